/**
 * Segment bodies in reused memory (src/volume/body-pool.ts): a body goes back to its pool only
 * when its put succeeded and the read cache wrote every block it kept of it; a failed put's
 * body is never reused (an abandoned attempt may still be sending it).
 */
import test from 'ava';
import { createHash } from 'node:crypto';
import { BlockCache, CACHE_BLOCK, type Slab } from '../../src/cache.js';
import { silentLogger } from '../../src/log.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import type { ByteRange, ListOptions, ObjectHead, ObjectInfo, ObjectStore, PutOptions } from '../../src/store/object-store.js';
import { BodyPool } from '../../src/volume/body-pool.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import type { Volume } from '../../src/volume/volume.js';

const MiB = 1024 * 1024;
const sha = (b: Buffer): string => createHash('sha256').update(b).digest('hex');
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

test('BodyPool: a buffer comes back once its last holder let go, at most maxKept are kept, none once idle; a long body is not pooled', (t) => {
  const pool = new BodyPool(1000, 2);
  const a = pool.take(600);
  t.is(a.body.length, 600);
  const lease = a.lease!;
  lease.acquire(); // e.g. a cache block
  lease.release(); // the taker
  t.is(pool.kept, 0, 'still held by the block');
  lease.release();
  t.is(pool.kept, 1);
  t.throws(() => lease.release(), { message: /let go once per hold/ });
  const b = pool.take(1000);
  t.is(pool.reused, 1, 'the same buffer again');
  t.is(b.body.buffer, a.body.buffer);
  const long = pool.take(1001);
  t.is(long.lease, null, 'longer than the pooled buffers: allocated on its own');
  const c = pool.take(10);
  const d = pool.take(10);
  b.lease!.release(); c.lease!.release(); d.lease!.release();
  t.is(pool.kept, 2, 'maxKept');
  pool.idle();
  t.is(pool.kept, 0);
  const e = pool.take(10);
  pool.idle();
  e.lease!.release();
  t.is(pool.kept, 0, 'given back while idle: dropped');
});

/** A slab whose writes wait while `holding`, and which copies a block's bytes only when its write goes ahead. */
class HeldSlab implements Slab {
  readonly slots = new Map<number, Buffer>();
  holding = false;
  private waiting: (() => void)[] = [];
  async write(slot: number, data: Buffer): Promise<void> {
    while (this.holding) await new Promise<void>((r) => this.waiting.push(r));
    this.slots.set(slot, Buffer.from(data));
  }
  release(): void { this.holding = false; for (const w of this.waiting.splice(0)) w(); }
  async read(slot: number, out: Buffer, outOff: number, from: number, length: number): Promise<void> { this.readSync(slot, out, outOff, from, length); }
  readSync(slot: number, out: Buffer, outOff: number, from: number, length: number): void { this.slots.get(slot)!.copy(out, outOff, from, from + length); }
  async close(): Promise<void> {}
}

/**
 * A store that keeps a reference to each segment put's body (no copy) and checks it is not
 * changed while the put is in flight; a put it fails keeps being "sent" (checked later).
 */
class WatchingStore implements ObjectStore {
  readonly description = 'watching';
  readonly failed: { body: Buffer; hash: string }[] = [];
  failNext = 0;
  changedInFlight = 0;
  segmentPuts = 0;
  constructor(readonly inner: ObjectStore) {}
  async put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    if (!key.includes('/seg/')) return this.inner.put(key, body, options);
    this.segmentPuts++;
    const hash = sha(body);
    await sleep(2);
    if (sha(body) !== hash) this.changedInFlight++;
    if (this.failNext > 0) {
      this.failNext--;
      this.failed.push({ body, hash }); // an abandoned attempt that may still be sending it
      throw Object.assign(new Error('injected: connection reset'), { code: 'ECONNRESET' });
    }
    await this.inner.put(key, body, options);
    if (sha(body) !== hash) this.changedInFlight++;
  }
  get(key: string, range?: ByteRange): Promise<Buffer> { return this.inner.get(key, range); }
  head(key: string): Promise<ObjectHead | null> { return this.inner.head(key); }
  list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> { return this.inner.list(prefix, options); }
  delete(key: string): Promise<void> { return this.inner.delete(key); }
  close(): Promise<void> { return this.inner.close(); }
}

test('a segment body is reused only after its put succeeded and the cache wrote its blocks; a failed put\'s body never', async (t) => {
  const mem = new MemoryObjectStore();
  const store = new WatchingStore(mem);
  const slab = new HeldSlab();
  const catalog = new StoreCatalog({
    store, log: silentLogger(),
    cache: () => BlockCache.open({ capacityBytes: 256 * MiB, slab }),
    volume: { segmentBytes: MiB, dirtySoftLimit: 4 * MiB, uploadConcurrency: 4 },
  });
  await catalog.create('v', 256 * MiB);
  const v = (await catalog.open('v', { readOnly: false })).backend as Volume;
  const pool = (v as unknown as { bodies: BodyPool }).bodies;
  let seed = 0;
  const round = async (offset: number): Promise<Buffer> => {
    const data = createHash('sha512').update(String(seed++)).digest();
    const big = Buffer.alloc(8 * MiB);
    for (let i = 0; i < big.length; i += data.length) data.copy(big, i); // compressible, but every round differs
    for (let i = 0; i < big.length; i += 4096) big.writeUInt32LE(seed * 1_000_003 + i, i);
    await v.write(offset, big, false);
    try {
      await v.flush();
    } catch (err) {
      t.regex(String(err), /connection reset/, 'the injected failure; the data stays buffered');
      await v.flush();
    }
    return big;
  };
  // Round 1: the cache's writes wait, so every body stays held by the blocks it fed.
  slab.holding = true;
  const r1 = await round(0);
  t.is(pool.kept, 0, 'nothing back while the cache holds them');
  // Round 2 (the cache still waits): new bodies; a failed put's body is dropped.
  store.failNext = 1;
  const r2 = await round(16 * MiB);
  t.is(store.failed.length, 1);
  t.is(pool.reused, 0, 'no body reused while their blocks wait for the cache');
  slab.release();
  await sleep(50);
  // Rounds 3-6: bodies come back and are reused.
  const later: [number, Buffer][] = [];
  for (let k = 0; k < 4; k++) later.push([(32 + 16 * k) * MiB, await round((32 + 16 * k) * MiB)]);
  await sleep(50);
  t.true(pool.reused > 0, `bodies reused (${pool.reused})`);
  t.is(store.changedInFlight, 0, 'no body changed while its put was in flight');
  t.is(sha(store.failed[0]!.body), store.failed[0]!.hash, 'the failed put\'s body was never reused');
  // Every cached block holds what the store holds: a body reused before its block was
  // written would have put other bytes in the slab.
  const cache = (v as unknown as { blockCache: BlockCache }).blockCache;
  const index = (cache as unknown as { index: Map<string, { slot: number; length: number; data: Buffer | null }> }).index;
  let checked = 0;
  for (const [id, e] of index) {
    if (!id.includes('/seg/') || e.data !== null) continue;
    const [key, block] = id.split('#') as [string, string];
    const want = await mem.get(key, { offset: Number(block) * CACHE_BLOCK, length: e.length });
    t.true(slab.slots.get(e.slot)!.subarray(0, e.length).equals(want), `${id} in the slab as in the store`);
    checked++;
  }
  t.true(checked >= 32, `${checked} cached segment blocks checked`);
  // And the volume reads back as written, from a fresh open (the store only).
  const fresh = new StoreCatalog({ store: mem, log: silentLogger(), cache: () => BlockCache.open({ capacityBytes: 64 * MiB }) });
  const w = (await fresh.open('v', { readOnly: true })).backend as Volume;
  t.true((await w.read(0, 8 * MiB)).equals(r1));
  t.true((await w.read(16 * MiB, 8 * MiB)).equals(r2));
  for (const [off, data] of later) t.true((await w.read(off, 8 * MiB)).equals(data), `round at ${off / MiB} MiB`);
  await w.close();
  await v.close();
});

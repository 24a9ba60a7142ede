/**
 * The read cache under cache-disk faults (17.10, 9 "full cache filesystem") and the rule that
 * a read never writes into the caller's buffer after it settled (9.1).
 */
import test from 'ava';
import { BlockCache, CACHE_BLOCK, MemorySlab, type CacheLogger, type Slab } from '../../src/cache.js';
import { InstrumentedObjectStore, seededRandom } from '../../src/store/decorators.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import type { ByteRange, ObjectStore } from '../../src/store/object-store.js';
import { CorruptError, StoreUnavailableError } from '../../src/errors.js';

function bytes(seed: number, n: number): Buffer {
  const r = seededRandom(seed);
  const b = Buffer.allocUnsafe(n);
  for (let i = 0; i < n; i++) b[i] = (r() * 256) | 0;
  return b;
}

interface Deferred { promise: Promise<void>; resolve: () => void }
function deferred(): Deferred {
  let resolve!: () => void;
  const promise = new Promise<void>((r) => { resolve = r; });
  return { promise, resolve };
}

function enospc(): Error {
  return Object.assign(new Error('ENOSPC: no space left on device, write'), { code: 'ENOSPC', errno: -28 });
}

/** A memory slab whose writes fail on demand (a full or failing cache disk), and whose reads can be held. */
class FaultySlab implements Slab {
  readonly inner = new MemorySlab();
  /** The next this many writes fail. */
  failNext = 0;
  /** Every write fails while set. */
  failing = false;
  writes = 0;
  failedWrites = 0;
  /** While set, reads wait for it; `readsWaiting` counts them. */
  readGate: Promise<void> | null = null;
  readsWaiting = 0;
  private waitFor: { n: number; d: Deferred } | null = null;

  async read(slot: number, out: Buffer, outOff: number, from: number, length: number): Promise<void> {
    if (this.readGate) {
      this.readsWaiting++;
      if (this.waitFor && this.readsWaiting >= this.waitFor.n) this.waitFor.d.resolve();
      await this.readGate;
      this.readsWaiting--;
    }
    await this.inner.read(slot, out, outOff, from, length);
  }

  /** Resolves once `n` reads are held at the gate. */
  readsHeld(n: number): Promise<void> {
    const d = deferred();
    this.waitFor = { n, d };
    if (this.readsWaiting >= n) d.resolve();
    return d.promise;
  }

  async write(slot: number, data: Buffer): Promise<void> {
    this.writes++;
    if (this.failing || this.failNext > 0) {
      if (this.failNext > 0) this.failNext--;
      this.failedWrites++;
      throw enospc();
    }
    await this.inner.write(slot, data);
  }

  async close(): Promise<void> { await this.inner.close(); }
}

class RecordingLogger implements CacheLogger {
  readonly warns: { obj: object; msg: string }[] = [];
  readonly infos: { obj: object; msg: string }[] = [];
  warn(obj: object, msg: string): void { this.warns.push({ obj, msg }); }
  info(obj: object, msg: string): void { this.infos.push({ obj, msg }); }
}

async function setup(capacityBlocks = 16, log?: CacheLogger) {
  const store = new InstrumentedObjectStore(new MemoryObjectStore());
  const slab = new FaultySlab();
  const cache = await BlockCache.open({ capacityBytes: capacityBlocks * CACHE_BLOCK, slab, ...(log ? { log } : {}) });
  return { store, slab, cache };
}

/** Read block `blk` of `key` (whole block) and check it against `obj`. */
async function readBlock(cache: BlockCache, store: ObjectStore, key: string, obj: Buffer, blk: number): Promise<boolean> {
  const from = blk * CACHE_BLOCK;
  const len = Math.min(CACHE_BLOCK, obj.length - from);
  const out = Buffer.alloc(len);
  await cache.read(store, key, obj.length, from, len, out, 0);
  return out.equals(obj.subarray(from, from + len));
}

test('17.10: a failed slab write gives its slot back; after the disk recovers, hot blocks are cached again', async (t) => {
  const { store, slab, cache } = await setup(16);
  t.teardown(() => cache.close());
  const cold = bytes(1, 16 * CACHE_BLOCK);
  const hot = bytes(2, 4 * CACHE_BLOCK);
  await store.put('cold', cold);
  await store.put('hot', hot);

  // The cache disk fails as many writes as the cache has slots.
  slab.failNext = 16;
  for (let b = 0; b < 16; b++) {
    t.true(await readBlock(cache, store, 'cold', cold, b), `cold block ${b} exact`);
    await cache.drain();
  }
  t.is(slab.failedWrites, 16);
  t.is(cache.stats.cachedBytes, 0, 'nothing counted as cached after failed writes');

  // The disk recovered: 12 reads of 4 hot blocks fetch each block once.
  store.reset();
  for (let round = 0; round < 3; round++) {
    for (let b = 0; b < 4; b++) {
      t.true(await readBlock(cache, store, 'hot', hot, b), `hot block ${b} exact (round ${round})`);
      await cache.drain();
    }
  }
  t.is(store.stats().get.requests, 4, 'each hot block fetched once, then served from the cache');
  t.is(cache.stats.cachedBytes, 4 * CACHE_BLOCK);

  // And the whole capacity is usable again: 16 distinct blocks all stay cached.
  store.reset();
  for (let b = 0; b < 16; b++) { await readBlock(cache, store, 'cold', cold, b); await cache.drain(); }
  t.is(cache.stats.cachedBytes, 16 * CACHE_BLOCK, 'no slot was lost');
});

test('17.10: a block whose slab write fails is fetched once, also for reads that waited for the fetch', async (t) => {
  const { store, slab, cache } = await setup(16);
  t.teardown(() => cache.close());
  const obj = bytes(3, 3 * CACHE_BLOCK);
  await store.put('o', obj);
  slab.failing = true;
  store.reset();
  t.true(await readBlock(cache, store, 'o', obj, 0));
  t.is(store.stats().get.requests, 1, 'one read of a missing block: one GET');

  // Three concurrent reads of the same missing block share one fetch and are served by it.
  store.reset();
  const results = await Promise.all([1, 1, 1].map((b) => readBlock(cache, store, 'o', obj, b)));
  t.deepEqual(results, [true, true, true]);
  t.is(store.stats().get.requests, 1, 'concurrent misses of one block: one GET');

  // A read spanning blocks: one coalesced GET, even though nothing can be cached.
  store.reset();
  const out = Buffer.alloc(CACHE_BLOCK + 10); // blocks 0, 1 and 2
  await cache.read(store, 'o', obj.length, CACHE_BLOCK - 5, out.length, out, 0);
  t.true(out.equals(obj.subarray(CACHE_BLOCK - 5, CACHE_BLOCK - 5 + out.length)));
  t.is(store.stats().get.requests, 1);
});

test('17.10: a block that cannot be inserted because everything is being read is fetched once', async (t) => {
  const { store, slab, cache } = await setup(16);
  t.teardown(() => cache.close());
  const full = bytes(4, 16 * CACHE_BLOCK);
  const other = bytes(5, CACHE_BLOCK);
  await store.put('full', full);
  await store.put('other', other);
  for (let b = 0; b < 16; b++) await readBlock(cache, store, 'full', full, b);
  await cache.drain();
  t.is(cache.stats.cachedBytes, 16 * CACHE_BLOCK);

  // Hold 16 reads, one on every cached block: nothing can be evicted.
  const gate = deferred();
  slab.readGate = gate.promise;
  const held = Array.from({ length: 16 }, (_, b) => readBlock(cache, store, 'full', full, b));
  await slab.readsHeld(16);

  store.reset();
  t.true(await readBlock(cache, store, 'other', other, 0), 'served from the fetched data');
  t.is(store.stats().get.requests, 1, 'one GET although the block could not be cached');

  slab.readGate = null;
  gate.resolve();
  t.deepEqual(await Promise.all(held), Array(16).fill(true));
  t.is(store.stats().get.requests, 1, 'the held reads were served from the cache');
});

test('9: a failing cache disk is reported once, reads keep working, and again only after it recovered', async (t) => {
  const log = new RecordingLogger();
  const { store, slab, cache } = await setup(16, log);
  t.teardown(() => cache.close());
  const obj = bytes(6, 12 * CACHE_BLOCK);
  await store.put('o', obj);

  slab.failing = true;
  for (let b = 0; b < 5; b++) { t.true(await readBlock(cache, store, 'o', obj, b)); await cache.drain(); }
  t.is(slab.failedWrites, 5);
  t.is(log.warns.length, 1, 'warned once for five failed writes');
  t.regex(log.warns[0]!.msg, /cache/i);
  t.regex(JSON.stringify(log.warns[0]!.obj), /ENOSPC/);

  slab.failing = false;
  for (let b = 5; b < 8; b++) { t.true(await readBlock(cache, store, 'o', obj, b)); await cache.drain(); }
  t.is(log.warns.length, 1, 'no warning while the disk works');
  t.is(cache.stats.cachedBytes, 3 * CACHE_BLOCK, 'caching resumed');

  slab.failing = true;
  for (let b = 8; b < 12; b++) { t.true(await readBlock(cache, store, 'o', obj, b)); await cache.drain(); }
  t.is(log.warns.length, 2, 'warned again after it recovered and failed again');

  // Cached blocks are still served from the cache while the disk fails.
  store.reset();
  for (let b = 5; b < 8; b++) t.true(await readBlock(cache, store, 'o', obj, b));
  t.is(store.stats().get.requests, 0);
});

/** A store whose ranged GETs can be held or failed per starting offset. */
class ControlledStore implements ObjectStore {
  readonly description = 'controlled';
  readonly inner = new MemoryObjectStore();
  readonly hold = new Map<number, Promise<void>>();
  readonly fail = new Set<number>();
  async get(key: string, range?: ByteRange): Promise<Buffer> {
    const off = range?.offset ?? 0;
    const h = this.hold.get(off);
    if (h) await h;
    if (this.fail.has(off)) throw new StoreUnavailableError(`injected failure of GET ${key} at ${off}`);
    return this.inner.get(key, range);
  }
  put(key: string, body: Buffer): Promise<void> { return this.inner.put(key, body); }
  head(key: string) { return this.inner.head(key); }
  list(prefix: string) { return this.inner.list(prefix); }
  delete(key: string): Promise<void> { return this.inner.delete(key); }
  close(): Promise<void> { return this.inner.close(); }
}

test('9.1: a read that failed never writes into its buffer afterwards, while a piece it waited for completes', async (t) => {
  const store = new ControlledStore();
  const obj = bytes(7, 2 * CACHE_BLOCK);
  await store.put('o', obj);
  const cache = await BlockCache.open({ capacityBytes: 16 * CACHE_BLOCK });
  t.teardown(() => cache.close());

  // Read A fetches block 0 and is held; read B needs blocks 0 (waits for A's fetch) and 1 (fails).
  const release = deferred();
  store.hold.set(0, release.promise);
  store.fail.add(CACHE_BLOCK);
  const a = Buffer.alloc(CACHE_BLOCK);
  const readA = cache.read(store, 'o', obj.length, 0, CACHE_BLOCK, a, 0);
  const b = Buffer.alloc(2 * CACHE_BLOCK, 0xee);
  let settled: Buffer | null = null;
  const readB = cache.read(store, 'o', obj.length, 0, 2 * CACHE_BLOCK, b, 0).then(
    () => { throw new Error('read B should have failed'); },
    (err: unknown) => { settled = Buffer.from(b); return err; },
  );
  const err = await readB;
  t.true(err instanceof StoreUnavailableError);
  // The buffer goes back to a pool here; nothing may write into it any more.
  b.fill(0x55);
  release.resolve();
  await readA;
  t.true(a.equals(obj.subarray(0, CACHE_BLOCK)));
  await cache.drain();
  t.not(settled, null);
  t.true(b.equals(Buffer.alloc(b.length, 0x55)), 'nothing was written into B after it rejected');
});

test('9: a failed cache-disk read is not a failed read: the block comes from the store and is no longer trusted', async (t) => {
  const { store, slab, cache } = await setup(16);
  t.teardown(() => cache.close());
  const obj = bytes(8, 2 * CACHE_BLOCK);
  await store.put('o', obj);
  for (let b = 0; b < 2; b++) await readBlock(cache, store, 'o', obj, b);
  await cache.drain();
  // The cache disk now fails reads.
  const failing = slab.read.bind(slab);
  let readFailures = 0;
  slab.read = async () => { readFailures++; throw Object.assign(new Error('EIO: i/o error, read'), { code: 'EIO' }); };
  store.reset();
  const out = Buffer.alloc(2 * CACHE_BLOCK);
  await cache.read(store, 'o', obj.length, 0, out.length, out, 0);
  t.true(out.equals(obj), 'served from the store');
  t.true(readFailures > 0);
  t.true(store.stats().get.requests > 0);
  // The failed blocks are no longer trusted: next time they are fetched (and cached) again.
  slab.read = failing;
  store.reset();
  t.true(await readBlock(cache, store, 'o', obj, 0));
  await cache.drain();
  t.is(store.stats().get.requests, 1);
  t.true(await readBlock(cache, store, 'o', obj, 0));
  t.is(store.stats().get.requests, 1, 'cached again');
});

test('a read past the end of its object never becomes blocks: refused, and a short GET too; another object\'s bytes in a reused slot are never served (reviewed finding)', async (t) => {
  // Blocks are cached under the object's key whatever their length. Before, a read of a range
  // past the object's end (damaged metadata naming a raw object) resolved with bytes left
  // unwritten and cached a 0-byte block, whose later reads copied a whole block from its
  // slot: what another object left there.
  const store = new MemoryObjectStore();
  const other = Buffer.alloc(16 * CACHE_BLOCK, 0x53);
  await store.put('vol/other/seg/1', other);
  await store.put('vol/mine/seg/1', Buffer.alloc(CACHE_BLOCK, 0x41));
  const cache = await BlockCache.open({ capacityBytes: 16 * CACHE_BLOCK });
  await cache.read(store, 'vol/other/seg/1', other.length, 0, other.length, Buffer.alloc(other.length), 0);
  await cache.drain();
  const out = Buffer.alloc(2 * CACHE_BLOCK, 0xee);
  await t.throwsAsync(cache.read(store, 'vol/mine/seg/1', CACHE_BLOCK, 0, 2 * CACHE_BLOCK, out, 0), { instanceOf: CorruptError }, 'a range past the size it was given');
  await t.throwsAsync(cache.read(store, 'vol/mine/seg/1', 2 * CACHE_BLOCK, 0, 2 * CACHE_BLOCK, out, 0), undefined, 'a size the object does not have: the store refuses the range (or a short body is refused)');
  await cache.drain();
  t.false(cache.readNow('vol/mine/seg/1', 0, 2 * CACHE_BLOCK, out, 0), 'nothing to answer on the spot');
  t.is(cache.missingBytes('vol/mine/seg/1', 2 * CACHE_BLOCK, CACHE_BLOCK, CACHE_BLOCK), CACHE_BLOCK, 'no block cached past the object\'s end');
  const first = Buffer.alloc(CACHE_BLOCK);
  await cache.read(store, 'vol/mine/seg/1', CACHE_BLOCK, 0, CACHE_BLOCK, first, 0);
  t.true(first.equals(Buffer.alloc(CACHE_BLOCK, 0x41)), 'the object itself still reads');
  // A store that answers a ranged GET short (no store of ours does; the cache does not trust it).
  const short: ObjectStore = Object.assign(Object.create(store) as ObjectStore, {
    get: async (key: string, range?: ByteRange) => (await store.get(key, range)).subarray(0, (range?.length ?? 1) - 1),
  });
  await store.put('vol/third/seg/1', Buffer.alloc(CACHE_BLOCK, 0x33));
  await t.throwsAsync(cache.read(short, 'vol/third/seg/1', CACHE_BLOCK, 1, 10, Buffer.alloc(10), 0), { instanceOf: CorruptError }, 'a short body is refused');
  t.is(cache.missingBytes('vol/third/seg/1', CACHE_BLOCK, 0, CACHE_BLOCK), CACHE_BLOCK, 'and never cached');
  await cache.close();
});

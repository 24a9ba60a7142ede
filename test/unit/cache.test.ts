/** The local read cache: bounded, correct under eviction, coalescing and readahead. */
import test from 'ava';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { BlockCache, CACHE_BLOCK, FileSlab, MAX_SLAB_WRITES } from '../../src/cache.js';
import { WRITE_CHUNK_BYTES } from '../../src/store/local-dir.js';
import { InstrumentedObjectStore, seededRandom } from '../../src/store/decorators.js';
import { MemoryObjectStore } from '../../src/store/memory.js';

function bytes(seed: number, n: number): Buffer {
  const r = seededRandom(seed);
  const b = Buffer.allocUnsafe(n);
  for (let i = 0; i < n; i++) b[i] = (r() * 256) | 0;
  return b;
}

for (const kind of ['memory', 'file'] as const) {
  test(`${kind}: reads are exact, misses coalesce, capacity is never exceeded`, async (t) => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-cache-'));
    t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }));
    const inner = new MemoryObjectStore();
    const store = new InstrumentedObjectStore(inner);
    const objs = [bytes(1, 3 * 1024 * 1024 + 77), bytes(2, 5 * 1024 * 1024)];
    await store.put('a', objs[0]!);
    await store.put('b', objs[1]!);
    const capacity = 16 * CACHE_BLOCK;
    const cache = await BlockCache.open({ ...(kind === 'file' ? { dir } : {}), capacityBytes: capacity });
    t.teardown(() => cache.close());
    store.reset();
    // One read spanning 6 blocks: one ranged GET.
    const out = Buffer.alloc(6 * CACHE_BLOCK - 100);
    await cache.read(store, 'a', objs[0]!.length, 50, out.length, out, 0);
    t.true(out.equals(objs[0]!.subarray(50, 50 + out.length)));
    t.is(store.stats().get.requests, 1, 'adjacent misses coalesced');
    // Random reads across both objects: always exact, the cache stays within capacity.
    const r = seededRandom(9);
    for (let i = 0; i < 400; i++) {
      const which = r() < 0.5 ? 0 : 1;
      const obj = objs[which]!;
      const off = Math.floor(r() * (obj.length - 1));
      const len = 1 + Math.floor(r() * Math.min(obj.length - off, 300_000));
      const b = Buffer.alloc(len);
      await cache.read(store, which ? 'b' : 'a', obj.length, off, len, b, 0, r() < 0.3 ? 1024 * 1024 : 0);
      if (!b.equals(obj.subarray(off, off + len))) { t.fail(`read ${i} at ${off}+${len} differs`); return; }
      t.true(cache.stats.cachedBytes <= capacity, 'within capacity');
    }
    // A hot block is served from the cache: no new request.
    const before = store.stats().get.requests;
    const hot = Buffer.alloc(4096);
    await cache.read(store, 'b', objs[1]!.length, 0, 4096, hot, 0);
    await cache.read(store, 'b', objs[1]!.length, 0, 4096, hot, 0);
    t.true(store.stats().get.requests - before <= 1);
  });
}

for (const kind of ['memory', 'file'] as const) {
  test(`${kind}: readNow answers from cached blocks only, before their write to the slab and after it; false (nothing counted) when any block is missing`, async (t) => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-cache-'));
    t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }));
    const store = new InstrumentedObjectStore(new MemoryObjectStore());
    const obj = bytes(4, 3 * CACHE_BLOCK + 1000);
    await store.put('o', obj);
    const cache = await BlockCache.open({ ...(kind === 'file' ? { dir } : {}), capacityBytes: 64 * CACHE_BLOCK });
    t.teardown(() => cache.close());
    const out = Buffer.alloc(2 * CACHE_BLOCK);
    t.false(cache.readNow('o', 100, 5000, out, 0), 'nothing cached');
    t.is(cache.stats.hits, 0);
    await cache.read(store, 'o', obj.length, 0, 10, out, 0); // caches block 0 (its slab write may still be running)
    t.true(cache.readNow('o', 100, 5000, out, 7), 'block 0, whether its bytes are still in memory or already in the slab');
    t.true(out.subarray(7, 5007).equals(obj.subarray(100, 5100)));
    t.false(cache.readNow('o', CACHE_BLOCK - 10, 20, out, 0), 'spans block 1, not cached');
    await cache.drain();
    const hits = cache.stats.hits;
    t.true(cache.readNow('o', 200, 4096, out, 0), 'from the slab');
    t.true(out.subarray(0, 4096).equals(obj.subarray(200, 4296)));
    t.is(cache.stats.hits, hits + 1);
    await cache.read(store, 'o', obj.length, CACHE_BLOCK, 3 * CACHE_BLOCK + 1000 - CACHE_BLOCK, Buffer.alloc(2 * CACHE_BLOCK + 1000), 0);
    const tail = obj.length - (CACHE_BLOCK - 10);
    const all = Buffer.alloc(tail);
    t.true(cache.readNow('o', CACHE_BLOCK - 10, tail, all, 0), 'across blocks, to the object\'s end');
    t.true(all.equals(obj.subarray(CACHE_BLOCK - 10)));
  });
}

test('readahead extends a sequential miss, never past the object end', async (t) => {
  const store = new InstrumentedObjectStore(new MemoryObjectStore());
  const obj = bytes(3, 2 * 1024 * 1024 + 5);
  await store.put('o', obj);
  const cache = await BlockCache.open({ capacityBytes: 64 * 1024 * 1024 });
  store.reset();
  const b = Buffer.alloc(4096);
  await cache.read(store, 'o', obj.length, 0, 4096, b, 0, 8 * 1024 * 1024);
  t.is(store.stats().get.bytes, obj.length, 'read ahead to the end of the object, and no further');
  const rest = Buffer.alloc(obj.length - 4096);
  await cache.read(store, 'o', obj.length, 4096, rest.length, rest, 0);
  t.is(store.stats().get.requests, 1, 'the rest came from the cache');
  t.true(rest.equals(obj.subarray(4096)));
});

test('every block goes to the cache file in a write of its own, never joined with its neighbours (large writes take large page-cache folios: local-dir.ts WRITE_CHUNK_BYTES)', async (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-slab-'));
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }));
  const slab = await FileSlab.open(dir);
  t.teardown(() => slab.close());
  // Slots 0..99 in order (the last block short), then 200..203, all asked for in one turn:
  // adjacent and waiting together, yet each is a write of its own, of at most WRITE_CHUNK_BYTES.
  const runA = Array.from({ length: 100 }, (_, i) => Buffer.alloc(i === 99 ? 1000 : CACHE_BLOCK, (i * 7) & 0xff));
  const runB = Array.from({ length: 4 }, (_, i) => Buffer.alloc(CACHE_BLOCK, 0x80 + i));
  await Promise.all([...runA.map((b, i) => slab.write(i, b)), ...runB.map((b, i) => slab.write(200 + i, b))]);
  t.is(slab.poolWrites, 104, `${slab.poolWrites} writes for 104 blocks`);
  t.true(CACHE_BLOCK <= WRITE_CHUNK_BYTES, 'a block fits in one write');
  t.true(slab.writes.maxInUse <= MAX_SLAB_WRITES);
  for (const [slot, want] of [...runA.map((b, i) => [i, b] as const), ...runB.map((b, i) => [200 + i, b] as const)]) {
    const out = Buffer.alloc(want.length);
    await slab.read(slot, out, 0, 0, want.length);
    t.true(out.equals(want), `slot ${slot}`);
  }
});

test('cache writes leave libuv\'s thread pool free: a lease file\'s operation queued behind 256 block writes waits for a few, not all', async (t) => {
  // Before the bound, every block write went into the pool's FIFO queue at once, and a lease
  // renewal's file operations waited behind all of them: under disk pressure a healthy host
  // lost its lease during a cold read (src/cache.ts MAX_SLAB_WRITES).
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-slab-'));
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }));
  const slab = await FileSlab.open(dir);
  t.teardown(() => slab.close());
  const N = 256;
  // Every other slot: no two waiting writes are adjacent, so each is a write of its own.
  const blocks = Array.from({ length: N }, (_, i) => Buffer.alloc(CACHE_BLOCK, i & 0xff));
  const writes = blocks.map((b, i) => slab.write(2 * i, b));
  // Queued in the pool after whatever the writes put there.
  const settledWhenStatDone = await fs.promises.stat(dir).then(() => slab.poolWritesSettled);
  await Promise.all(writes);
  t.is(slab.poolWrites, N);
  t.true(slab.writes.maxInUse <= MAX_SLAB_WRITES, `${slab.writes.maxInUse} writes in the pool at once`);
  t.true(settledWhenStatDone <= MAX_SLAB_WRITES + 2, `the stat waited for ${settledWhenStatDone} of ${N} block writes`);
  // And the bound loses nothing: every block reads back as written.
  const out = Buffer.alloc(CACHE_BLOCK);
  for (let i = 0; i < N; i += 17) {
    await slab.read(2 * i, out, 0, 0, CACHE_BLOCK);
    t.true(out.equals(blocks[i]!), `block ${i}`);
  }
});

/** GETs wait for their turn: each is held until `answer(i, ok)` lets the i-th one go (or fail). */
class GatedStore extends MemoryObjectStore {
  readonly gets: { offset: number; length: number; answer: (ok: boolean) => void }[] = [];
  override async get(key: string, range?: { offset: number; length: number }): Promise<Buffer> {
    let answer!: (ok: boolean) => void;
    const go = new Promise<boolean>((r) => { answer = r; });
    this.gets.push({ offset: range?.offset ?? 0, length: range?.length ?? -1, answer });
    if (!(await go)) throw new Error(`GET ${key} failed (test)`);
    return super.get(key, range);
  }
}

test('a read never waits for a background prefetch alone: its own GET races it, the first answer serves it, either may fail; a readahead prefetch is shared', async (t) => {
  const store = new GatedStore();
  const obj = bytes(7, 8 * CACHE_BLOCK);
  await store.put('o', obj);
  const cache = await BlockCache.open({ capacityBytes: 64 * CACHE_BLOCK });
  const turn = (): Promise<void> => new Promise((r) => setImmediate(r));
  const settled = <T>(p: Promise<T>): { done: boolean; p: Promise<T> } => {
    const s = { done: false, p };
    void p.then(() => { s.done = true; }, () => { s.done = true; });
    return s;
  };

  // Hydration's GET of blocks 0-3 hangs; a read of block 1 sends its own, of block 1 alone.
  const hydration = settled(cache.prefetch(store, 'o', obj.length, 0, 4 * CACHE_BLOCK, true));
  await turn();
  t.deepEqual(store.gets.map((g) => [g.offset, g.length]), [[0, 4 * CACHE_BLOCK]]);
  const out = Buffer.alloc(4096);
  const read = settled(cache.read(store, 'o', obj.length, CACHE_BLOCK + 100, 4096, out, 0));
  await turn();
  t.deepEqual(store.gets.map((g) => [g.offset, g.length]).slice(1), [[CACHE_BLOCK, CACHE_BLOCK]], 'its own GET, of its block');
  t.true(cache.wouldFetch('o', obj.length, 0, CACHE_BLOCK), 'block 0 is only in hydration\'s GET: a read would fetch it');
  t.false(cache.wouldFetch('o', obj.length, CACHE_BLOCK, 10), 'block 1 is in a read\'s GET: a read would share it');
  store.gets[1]!.answer(true);
  await read.p;
  t.true(out.equals(obj.subarray(CACHE_BLOCK + 100, CACHE_BLOCK + 4196)), 'served by its own GET while hydration\'s still hangs');
  t.false(hydration.done);
  t.is(cache.stats.raced, 1);
  store.gets[0]!.answer(true);
  t.is(await hydration.p, 4 * CACHE_BLOCK);
  const again = Buffer.alloc(4 * CACHE_BLOCK);
  await cache.read(store, 'o', obj.length, 0, again.length, again, 0);
  t.true(again.equals(obj.subarray(0, 4 * CACHE_BLOCK)), 'all four blocks cached, from whichever GET landed first');
  t.is(store.gets.length, 2);

  // The read's own GET fails, hydration's succeeds: the read is served by hydration's.
  store.gets.length = 0;
  const h2 = cache.prefetch(store, 'o', obj.length, 4 * CACHE_BLOCK, 2 * CACHE_BLOCK, true);
  await turn();
  const r2 = cache.read(store, 'o', obj.length, 4 * CACHE_BLOCK, 2 * CACHE_BLOCK, Buffer.alloc(2 * CACHE_BLOCK), 0);
  await turn();
  t.is(store.gets.length, 2, 'hydration\'s and the read\'s own, for both blocks');
  store.gets[1]!.answer(false);
  await turn();
  store.gets[0]!.answer(true);
  await t.notThrowsAsync(r2);
  await h2;

  // Both fail: the read fails with its own GET's error.
  store.gets.length = 0;
  const h3 = cache.prefetch(store, 'o', obj.length, 6 * CACHE_BLOCK, CACHE_BLOCK, true);
  await turn();
  const r3 = cache.read(store, 'o', obj.length, 6 * CACHE_BLOCK, 10, Buffer.alloc(10), 0);
  await turn();
  store.gets[0]!.answer(false);
  store.gets[1]!.answer(false);
  await t.throwsAsync(r3, { message: /failed \(test\)/ });
  t.is(await h3, 0, 'a failed prefetch fetched nothing, and never rejects');

  // A readahead (not background) prefetch is shared: the read waits for it, no second GET.
  store.gets.length = 0;
  const h4 = cache.prefetch(store, 'o', obj.length, 7 * CACHE_BLOCK, CACHE_BLOCK);
  await turn();
  const r4 = settled(cache.read(store, 'o', obj.length, 7 * CACHE_BLOCK, 10, Buffer.alloc(10), 0));
  await turn();
  t.is(store.gets.length, 1, 'shared');
  t.false(r4.done);
  store.gets[0]!.answer(true);
  await r4.p;
  await h4;
  await cache.close();
});

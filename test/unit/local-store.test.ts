/**
 * A store whose objects are local files (ObjectStore.local): reads in place through kept
 * open files, puts from pieces, and the volume engine using both (no block cache, no
 * assembled segment bodies), byte-exact and recoverable. Also: a write given as uneven
 * pieces (copied into the arena), and pack merging their extents again.
 */
import test, { type ExecutionContext } from 'ava';
import fs from 'node:fs';
import { syncBuiltinESMExports } from 'node:module';
import { mkdtemp, rm, readdir, stat } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { BlockCache } from '../../src/cache.js';
import { NotFoundError, OutOfRangeError } from '../../src/errors.js';
import { silentLogger } from '../../src/log.js';
import { FaultyObjectStore, InstrumentedObjectStore, seededRandom } from '../../src/store/decorators.js';
import { LocalDirObjectStore, WRITE_CHUNK_BYTES, keptFilesBudget } from '../../src/store/local-dir.js';
import { SettingsCheckedObjectStore } from '../../src/store/probe.js';
import { keysOf, listAll, type ObjectStore } from '../../src/store/object-store.js';
import { openStore } from '../../src/store/open.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import { decodeLogHeader } from '../../src/volume/format.js';
import type { Volume } from '../../src/volume/volume.js';

const MiB = 1024 * 1024;

async function tempStore(t: ExecutionContext, options: { maxOpenFiles?: number } = {}): Promise<LocalDirObjectStore> {
  const dir = await mkdtemp(join(tmpdir(), 'baton-local-'));
  const store = new LocalDirObjectStore(dir, options);
  t.teardown(async () => { await store.close(); await rm(dir, { recursive: true, force: true }); });
  return store;
}

function pattern(seed: number, len: number): Buffer {
  const r = seededRandom(seed);
  const b = Buffer.allocUnsafe(len);
  for (let i = 0; i < len; i++) b[i] = Math.floor(r() * 256);
  return b;
}

/**
 * Open file descriptors of this process that point into `dir`; without `temps`, not those in
 * its `.tmp/` (the temp a store makes ahead for its next put is no kept file).
 */
async function openFilesUnder(dir: string, temps = false): Promise<number> {
  const { readlink } = await import('node:fs/promises');
  let n = 0;
  for (const fd of await readdir('/proc/self/fd')) {
    try {
      const target = await readlink(`/proc/self/fd/${fd}`);
      if (target.startsWith(dir) && (temps || !target.startsWith(join(dir, '.tmp') + '/'))) n++;
    } catch { /* closed meanwhile */ }
  }
  return n;
}

test('local.read reads ranges in place; missing keys and ranges past the end fail like get', async (t) => {
  const store = await tempStore(t);
  const body = pattern(1, 300_000);
  await store.put('vol/a/seg/1', body);
  const out = Buffer.alloc(1000, 0xee);
  await store.local.read('vol/a/seg/1', 12_345, 500, out, 100);
  t.true(out.subarray(100, 600).equals(body.subarray(12_345, 12_845)));
  t.is(out[99], 0xee, 'nothing before outOff');
  t.is(out[600], 0xee, 'nothing after the range');
  await t.throwsAsync(store.local.read('vol/a/seg/2', 0, 10, out, 0), { instanceOf: NotFoundError });
  await t.throwsAsync(store.local.read('vol/a/seg/1', 299_995, 10, out, 0), { instanceOf: OutOfRangeError });
  // A failed open is not kept: the object appears, the next read finds it.
  await store.put('vol/a/seg/2', Buffer.from('late'));
  await store.local.read('vol/a/seg/2', 0, 4, out, 0);
  t.is(out.toString('latin1', 0, 4), 'late');
});

test('local.readNow reads in place without a wait only from a file open already; else false, with nothing read or counted', async (t) => {
  const store = await tempStore(t);
  const body = pattern(2, 100_000);
  await store.put('vol/a/seg/1', body);
  const reads = store.local.reads!;
  const out = Buffer.alloc(1000, 0xee);
  const before = { ...reads };
  t.false(store.local.readNow!('vol/a/seg/1', 10, 20, out, 0), 'not open yet (a put forgets its file)');
  t.false(store.local.readNow!('vol/a/seg/9', 0, 10, out, 0), 'no such object: not open either');
  t.deepEqual({ ...reads }, before, 'nothing counted');
  t.is(out[0], 0xee, 'nothing read');
  await store.local.read('vol/a/seg/1', 0, 1, out, 0); // opens and keeps the file
  const okBefore = reads.ok;
  t.true(store.local.readNow!('vol/a/seg/1', 54_321, 600, out, 200));
  t.true(out.subarray(200, 800).equals(body.subarray(54_321, 54_921)));
  t.is(out[199], 0xee, 'nothing before outOff');
  t.is(out[800], 0xee, 'nothing after the range');
  t.is(reads.ok, okBefore + 1, 'counted as a read');
  const errBefore = reads.error;
  t.throws(() => store.local.readNow!('vol/a/seg/1', 99_990, 20, out, 0), { instanceOf: OutOfRangeError });
  t.is(reads.error, errBefore + 1, 'a failed read is counted');
  await store.delete('vol/a/seg/1');
  t.false(store.local.readNow!('vol/a/seg/1', 0, 10, out, 0), 'a deleted object\'s file is forgotten');
  await t.throwsAsync(store.local.read('vol/a/seg/1', 0, 10, out, 0), { instanceOf: NotFoundError });
});

test('kept files beyond the budget: the one not read since the last sweep is closed, a file read since gets a second chance', async (t) => {
  const store = await tempStore(t, { maxOpenFiles: 2 });
  for (const k of ['a', 'b', 'c']) await store.put(k, Buffer.from(k));
  const out = Buffer.alloc(1);
  await store.local.read('a', 0, 1, out, 0);
  await store.local.read('b', 0, 1, out, 0);
  t.true(store.local.readNow!('a', 0, 1, out, 0), 'a is read again: marked');
  await store.local.read('c', 0, 1, out, 0); // the third open sweeps: over the budget of 2
  t.false(store.local.readNow!('b', 0, 1, out, 0), 'b, opened after a but not read since, was closed');
  t.true(store.local.readNow!('a', 0, 1, out, 0), 'a, the oldest but read since, stayed open');
  t.true(store.local.readNow!('c', 0, 1, out, 0));
  t.is(out.toString('latin1'), 'c');
  // The decorators the engine sees pass readNow on; the settings check only once it passed.
  t.true(new InstrumentedObjectStore(store).local!.readNow!('a', 0, 1, out, 0), 'counting passes it on');
  const checked = new SettingsCheckedObjectStore(store);
  t.false(checked.local!.readNow!('a', 0, 1, out, 0), 'not before the settings were checked (read() waits for that)');
  await checked.put('z', Buffer.from('z')); // checks (and records) the settings
  t.true(checked.local!.readNow!('a', 0, 1, out, 0), 'after');
  t.is(out.toString('latin1'), 'a');
});

test('local.view lends the bytes to a synchronous use: many views in flight at once each see their own, though they share one buffer', async (t) => {
  const store = await tempStore(t);
  const bodies = [pattern(11, 2 * MiB), pattern(12, 700_000)];
  await store.put('vol/a/seg/1', bodies[0]!);
  await store.put('vol/a/seg/2', bodies[1]!);
  const r = seededRandom(13);
  // Started in one turn, as a session dispatches a batch of READs: every view awaits its
  // file (the first ones open it), so their reads and uses interleave.
  const views = Array.from({ length: 64 }, (_, i) => {
    const which = i % 2;
    const body = bodies[which]!;
    const length = 1 + Math.floor(r() * Math.min(body.length, 1.5 * MiB));
    const offset = Math.floor(r() * (body.length - length));
    return store.local.view(`vol/a/seg/${which + 1}`, offset, length, (bytes) => {
      // A copy, as a decoder's output would be: the lent bytes are gone once use returns.
      return { offset, which, ok: bytes.length === length && bytes.equals(body.subarray(offset, offset + length)) };
    });
  });
  const results = await Promise.all(views);
  t.deepEqual(results.filter((x) => !x.ok), [], 'every use saw exactly its own range');
  // What use throws is passed on as it is, and the read itself counts as done.
  const before = { ...store.local.reads! };
  const err = await t.throwsAsync(store.local.view('vol/a/seg/2', 0, 10, () => { throw new RangeError('the decoder said no'); }));
  t.true(err instanceof RangeError && err.message === 'the decoder said no');
  t.is(store.local.reads!.ok, before.ok + 1);
  t.is(store.local.reads!.error, before.error);
  await t.throwsAsync(store.local.view('vol/a/seg/3', 0, 10, () => 1), { instanceOf: NotFoundError });
  await t.throwsAsync(store.local.view('vol/a/seg/2', 699_995, 10, () => 1), { instanceOf: OutOfRangeError });
});

test('local.readv fills its parts in order, also more parts than one preadv takes (IOV_MAX)', async (t) => {
  const store = await tempStore(t);
  const body = pattern(21, 3 * MiB);
  await store.put('vol/a/seg/1', body);
  const r = seededRandom(22);
  const parts: Buffer[] = [];
  let total = 0;
  while (total < 2 * MiB) { const n = 1 + Math.floor(r() * 1500); parts.push(Buffer.alloc(n, 0xee)); total += n; }
  t.true(parts.length > 1024, `${parts.length} parts`);
  await store.local.readv('vol/a/seg/1', 12_345, parts);
  t.true(Buffer.concat(parts).equals(body.subarray(12_345, 12_345 + total)));
  await t.throwsAsync(store.local.readv('vol/a/seg/1', 3 * MiB - 10, [Buffer.alloc(8), Buffer.alloc(8)]), { instanceOf: OutOfRangeError });
});

test('local.putParts stores exactly the concatenation (create-only included)', async (t) => {
  const store = await tempStore(t);
  const parts = [pattern(2, 70_000), Buffer.alloc(0), pattern(3, 5), pattern(4, 1_000_000)];
  await store.local.putParts('vol/a/log/1', parts, { ifNoneMatch: true, metadata: { 'put-id': 'x' } });
  t.true((await store.get('vol/a/log/1')).equals(Buffer.concat(parts)));
  t.is((await store.head('vol/a/log/1'))?.metadata['put-id'], 'x');
  await t.throwsAsync(store.local.putParts('vol/a/log/1', parts, { ifNoneMatch: true }), { code: 'BATON_ERR_PRECONDITION_FAILED' });
});

test.serial('an object\'s body goes to its file WRITE_CHUNK_BYTES per system call at most (large page-cache folios fault at the host of a microVM), and lands byte-exact', async (t) => {
  const store = await tempStore(t);
  // Uneven pieces, some larger than a chunk and some straddling a chunk's end.
  const sizes = [1, 4096, 300_000, 7, WRITE_CHUNK_BYTES, 5 * MiB + 3, 64 * 1024 - 1, 2 * WRITE_CHUNK_BYTES + 11];
  const parts = sizes.map((n, i) => pattern(100 + i, n));
  const whole = Buffer.concat(parts);
  // Every pwritev the store makes (fs.writev, or writevSync for a small body), by its size:
  // node:fs's functions wrapped, and its named exports (what the store imports) synced to them.
  const calls: number[] = [];
  const originals = { writev: fs.writev, writevSync: fs.writevSync };
  const count = (bufs: readonly NodeJS.ArrayBufferView[]): void => { calls.push(bufs.reduce((a, b) => a + b.byteLength, 0)); };
  fs.writev = ((fd: number, bufs: NodeJS.ArrayBufferView[], ...rest: unknown[]) => { count(bufs); return (originals.writev as (...a: unknown[]) => void)(fd, bufs, ...rest); }) as typeof fs.writev;
  fs.writevSync = ((fd: number, bufs: NodeJS.ArrayBufferView[], position?: number) => { count(bufs); return originals.writevSync(fd, bufs, position); }) as typeof fs.writevSync;
  syncBuiltinESMExports();
  try {
    await store.local!.putParts('big', parts);
  } finally {
    Object.assign(fs, originals);
    syncBuiltinESMExports();
  }
  t.true(calls.length >= Math.ceil(whole.length / WRITE_CHUNK_BYTES), `${calls.length} calls`);
  t.true(Math.max(...calls) <= WRITE_CHUNK_BYTES, `largest write ${Math.max(...calls)} bytes`);
  t.true((await store.get('big')).equals(whole));
});

test('a put or delete through the store forgets the kept file: a replaced object is read anew', async (t) => {
  const store = await tempStore(t);
  const out = Buffer.alloc(4);
  await store.put('k', Buffer.from('one!'));
  await store.local.read('k', 0, 4, out, 0);
  await store.put('k', Buffer.from('two!'));
  await store.local.read('k', 0, 4, out, 0);
  t.is(out.toString('latin1'), 'two!', 'not the file opened before the replacing put');
  await store.delete('k');
  await t.throwsAsync(store.local.read('k', 0, 4, out, 0), { instanceOf: NotFoundError });
});

test('kept files are bounded and closed by close()', async (t) => {
  const store = await tempStore(t, { maxOpenFiles: 128 });
  for (let i = 0; i < 200; i++) await store.put(`o/${i}`, Buffer.from([i]));
  const out = Buffer.alloc(1);
  for (let i = 0; i < 200; i++) await store.local.read(`o/${i}`, 0, 1, out, 0);
  const open = await openFilesUnder(store.root);
  t.true(open > 0 && open <= 128, `at most 128 files kept open (${open})`);
  await store.close();
  await new Promise((r) => setTimeout(r, 50)); // closes run in the background
  t.is(await openFilesUnder(store.root, true), 0, 'close() closes every kept file, and the temp made ahead');
});

test('a put writes into the temp made ahead of it and makes the next one; close() removes the last', async (t) => {
  const store = await tempStore(t);
  const tmp = join(store.root, '.tmp');
  await store.put('a/1', Buffer.from('one'));
  const [spare] = await readdir(tmp);
  t.truthy(spare, 'a temp made ahead for the next put');
  const inode = (await stat(join(tmp, spare!))).ino;
  await store.put('a/2', Buffer.from('two'), { ifNoneMatch: true });
  t.is((await stat(join(store.root, 'a', '2@'))).ino, inode, 'the object is that file');
  const after = await readdir(tmp);
  t.is(after.length, 1);
  t.not(after[0], spare, 'and the next put\'s is made');
  t.is((await store.get('a/2')).toString(), 'two');
  await store.close();
  t.deepEqual(await readdir(tmp), []);
  t.is(await openFilesUnder(store.root, true), 0);
});

test('decorators: the settings check passes local on, a fault layer hides it', async (t) => {
  const store = await tempStore(t);
  t.truthy(new SettingsCheckedObjectStore(store).local, 'a pure pass-through keeps it');
  t.is((new FaultyObjectStore(store, { latencyMs: 1 }) as ObjectStore).local, undefined, 'injected faults and latency must reach every read: the engine then caches as for a remote store');
});

async function localVolume(t: ExecutionContext, store: ObjectStore) {
  const cache = await BlockCache.open({ capacityBytes: 64 * MiB });
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: async () => cache });
  await catalog.create('v', 256 * MiB);
  const open = async (): Promise<Volume> => (await catalog.open('v', { readOnly: false })).backend as Volume;
  return { cache, open };
}

test('the engine on a local store: byte-exact through recovery, and the block cache is never used', async (t) => {
  const store = await tempStore(t);
  const { cache, open } = await localVolume(t, store);
  const v = await open();
  const big = pattern(5, 20 * MiB + 777);
  await v.write(MiB + 3, big, false);
  const small = pattern(6, 4096);
  await v.write(100 * MiB, small, false);
  await v.flush();
  const v2 = await open();
  t.true((await v2.read(MiB + 3, big.length)).equals(big));
  t.true((await v2.read(100 * MiB, 4096)).equals(small));
  t.deepEqual({ hits: cache.stats.hits, misses: cache.stats.misses, cachedBytes: cache.stats.cachedBytes }, { hits: 0, misses: 0, cachedBytes: 0 },
    'reads went to the store\'s files, and commits inserted nothing');
});

test('a large write given as uneven pieces lands byte-exact, merged into one extent per segment part', async (t) => {
  const store = await tempStore(t);
  const { open } = await localVolume(t, store);
  const v = await open();
  // 256 KiB writes as a socket delivers them: uneven pieces (as FrameReader.lend gives them).
  const want = pattern(7, 4 * MiB);
  const splits = [1, 4093, 65_536, 100, 65_536, 125_878];
  let pos = 0;
  while (pos < want.length) {
    const pieces: Buffer[] = [];
    let p = pos;
    for (const n of splits) { pieces.push(Buffer.from(want.subarray(p, p + n))); p += n; }
    await v.writeLent(pos, pieces, false);
    pos = p;
  }
  await v.flush();
  const reopened = await open();
  t.true((await reopened.read(0, want.length)).equals(want));
  const logs = (await (async () => { const o = []; for await (const x of store.list('vol/')) if (x.key.includes('/log/')) o.push(x); return o; })());
  const last = logs[logs.length - 1]!;
  const { header } = decodeLogHeader(await store.get(last.key), last.key);
  t.is(header.extents.length, 1, `4 MiB written in 96 uneven pieces is one extent in the record (${header.extents.length})`);
});

test('the kept-files budget is a quarter of the open-file limit, within 64..4096', (t) => {
  const limits = (soft: string): string => `Limit                     Soft Limit           Hard Limit           Units\nMax open files            ${soft}                 524288               files\n`;
  t.is(keptFilesBudget(limits('1024')), 256, 'the common default soft limit');
  t.is(keptFilesBudget(limits('20000')), 4096);
  t.is(keptFilesBudget(limits('100')), 64);
  t.is(keptFilesBudget(limits('unlimited')), 4096);
  t.is(keptFilesBudget(null), 256, 'no /proc: assume 1024');
});

test('puts into one directory share its fsyncs (each waits for one that started after its link), and all land', async (t) => {
  const store = await tempStore(t);
  await store.put('warm/x', Buffer.from('x')); // the directory chain and .tmp/ made once
  const before = store.dirSyncs;
  const bodies = Array.from({ length: 16 }, (_, i) => pattern(100 + i, 64 * 1024));
  await Promise.all(bodies.map((b, i) => store.put(`vol/v/seg/${i}`, b, { ifNoneMatch: true })));
  const syncs = store.dirSyncs - before;
  t.true(syncs >= 1 && syncs <= 8, `16 concurrent puts into one directory fsynced it ${syncs} times (16 before)`);
  for (let i = 0; i < 16; i++) t.true((await store.get(`vol/v/seg/${i}`)).equals(bodies[i]!));
  // One at a time, each put still has its own fsync (none is running when it links).
  const one = store.dirSyncs;
  await store.put('vol/v/seg/a', Buffer.from('a'));
  await store.put('vol/v/seg/b', Buffer.from('b'));
  t.is(store.dirSyncs - one, 2);
});

test('keysOf a file: store as openStore opens it (settings check, counting) lists keys without stats, counted as a listing', async (t) => {
  const dir = await mkdtemp(join(tmpdir(), 'baton-local-'));
  t.teardown(() => rm(dir, { recursive: true, force: true }));
  const store = openStore(`file:${dir}`, { instrument: true });
  t.teardown(() => store.close());
  const want = ['vol/x/log/1', 'vol/x/log/2', 'vol/x/log/3', 'vol/x/seg/1', 'vol/y/log/1'];
  for (const k of want) await store.put(k, Buffer.from(k));
  t.truthy(store.local?.keys, 'the local store\'s keys-only listing is passed on');
  const inst = store instanceof SettingsCheckedObjectStore ? store.next : null;
  if (!(inst instanceof InstrumentedObjectStore)) { t.fail('the counting decorator sits under the settings check'); return; }
  const got: string[] = [];
  const before = inst.stats().list.requests;
  for await (const k of keysOf(store, 'vol/x/log/', { startAfter: 'vol/x/log/1' })) got.push(k);
  t.deepEqual(got, ['vol/x/log/2', 'vol/x/log/3']);
  t.deepEqual(got, (await listAll(store, 'vol/x/log/', { startAfter: 'vol/x/log/1' })).map((o) => o.key));
  t.is(inst.stats().list.requests, before + 2, 'keysOf and list each counted once');
});

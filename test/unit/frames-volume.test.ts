/**
 * Framed data through the volume engine (issue 16): a store written by the code before frames
 * still reads byte for byte (and takes framed writes); a damaged object in the store or a
 * damaged cache block never reaches a reader (EIO after one re-fetch, or the right bytes when
 * the store's copy is good); random damage to random objects: every read is right or an error;
 * compaction, accounting and diff on framed data.
 */
import test, { type ExecutionContext } from 'ava';
import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as os from 'node:os';
import * as path from 'node:path';
import pino from 'pino';
import { BlockCache, MemorySlab } from '../../src/cache.js';
import { ChecksumError, CorruptError } from '../../src/errors.js';
import { silentLogger, type Logger } from '../../src/log.js';
import { seededRandom } from '../../src/store/decorators.js';
import { LocalDirObjectStore } from '../../src/store/local-dir.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { listAll, type ByteRange, type ObjectStore } from '../../src/store/object-store.js';
import { StoreCatalog, type CreateOptions } from '../../src/volume/catalog.js';
import { decodeCheckpoint, decodeVolumeRecord, keys } from '../../src/volume/format.js';
import { CODEC_BLOCKS } from '../../src/volume/frames.js';
import { masterKey } from '../../src/volume/keys.js';
import { collectGarbage } from '../../src/volume/gc.js';
import type { Volume, VolumeOptions } from '../../src/volume/volume.js';

const KiB = 1024;
const MiB = 1024 * KiB;
const OBJ_SUFFIX = '@'; // src/store/local-dir.ts: an object's file is its key's last segment + '@'
const FIXTURE = path.join(process.cwd(), 'test/fixtures/v0-store/store.json');

interface Fixture { size: number; expect: Record<string, string>; objects: { key: string; body: string }[] }
const fixture = JSON.parse(readFileSync(FIXTURE, 'utf8')) as Fixture;

const sha = (b: Buffer): string => createHash('sha256').update(b).digest('hex');
const text = (seed: number, n: number): Buffer => { const b = Buffer.allocUnsafe(n); const s = `module.exports = require("./lib/${seed}"); // seed ${seed}\n`; for (let i = 0; i < n; i++) b[i] = s.charCodeAt(i % s.length); return b; };
const rnd = (seed: number, n: number): Buffer => { const r = seededRandom(seed); const b = Buffer.allocUnsafe(n); for (let i = 0; i < n; i++) b[i] = Math.floor(r() * 256); return b; };
/** Half text, half random, in 16 KiB stripes: frames of both kinds. */
const mixed = (seed: number, n: number): Buffer => { const b = text(seed, n); rnd(seed, n).copy(b, 0, 0, 0); for (let o = 16 * KiB; o < n; o += 32 * KiB) rnd(seed + o, Math.min(16 * KiB, n - o)).copy(b, o); return b; };

interface LogLine { level: number; msg: string; key?: string; frame?: number }
function capturing(): { log: Logger; lines: LogLine[] } {
  const lines: LogLine[] = [];
  const log = pino({ level: 'debug' }, { write(s: string) { lines.push(JSON.parse(s) as LogLine); } });
  return { log, lines };
}

function host(store: ObjectStore, volume: Partial<VolumeOptions> = {}, log: Logger = silentLogger(), cache?: BlockCache) {
  const c = cache ?? BlockCache.open({ capacityBytes: 64 * MiB });
  const catalog = new StoreCatalog({ store, log, cache: async () => c, volume });
  const open = async (name: string, readOnly = false): Promise<Volume> => (await catalog.open(name, { readOnly })).volume!;
  return { catalog, open };
}

async function loadFixture(store: ObjectStore): Promise<void> {
  for (const o of fixture.objects) await store.put(o.key, Buffer.from(o.body, 'base64'));
}

async function tempDir(t: ExecutionContext): Promise<string> {
  const dir = await fsp.mkdtemp(path.join(os.tmpdir(), 'baton-frames-'));
  t.teardown(() => fsp.rm(dir, { recursive: true, force: true }));
  return dir;
}

/** Replace an object's bytes (a store that rotted, or someone who wrote the bucket). */
async function damage(store: ObjectStore, key: string, fn: (b: Buffer) => void): Promise<Buffer> {
  const before = await store.get(key);
  const after = Buffer.from(before);
  fn(after);
  await store.delete(key);
  await store.put(key, after);
  return before;
}

async function restore(store: ObjectStore, key: string, body: Buffer): Promise<void> {
  await store.delete(key);
  await store.put(key, body);
}

/** Counts GETs per key. */
class CountingStore implements ObjectStore {
  readonly gets = new Map<string, number>();
  constructor(readonly inner: ObjectStore) {}
  get description(): string { return this.inner.description; }
  get(key: string, range?: ByteRange): Promise<Buffer> { this.gets.set(key, (this.gets.get(key) ?? 0) + 1); return this.inner.get(key, range); }
  put(...a: Parameters<ObjectStore['put']>) { return this.inner.put(...a); }
  head(key: string) { return this.inner.head(key); }
  list(...a: Parameters<ObjectStore['list']>) { return this.inner.list(...a); }
  delete(key: string) { return this.inner.delete(key); }
  close() { return this.inner.close(); }
}

for (const kind of ['memory', 'file'] as const) {
  test(`a store written before framed data reads byte for byte: volume, fork, snapshot (${kind}: store)`, async (t) => {
    const store = kind === 'memory' ? new MemoryObjectStore() : new LocalDirObjectStore(await tempDir(t));
    await loadFixture(store);
    const { open } = host(store);
    for (const [name, want] of Object.entries(fixture.expect)) {
      const v = await open(name, true);
      t.is(sha(await v.read(0, fixture.size)), want!, name);
      // Pieces too: reads that start and end inside old objects.
      const r = seededRandom(name.length);
      const whole = await v.read(0, fixture.size);
      for (let k = 0; k < 30; k++) {
        const off = Math.floor(r() * fixture.size);
        const len = 1 + Math.floor(r() * Math.min(100_000, fixture.size - off));
        t.true((await v.read(off, len)).equals(whole.subarray(off, off + len)));
      }
      await v.close();
    }
  });
}

const V1_FIXTURE = path.join(process.cwd(), 'test/fixtures/v1-store/store.json');
interface V1Fixture extends Fixture { masterKey: string }

for (const kind of ['memory', 'file'] as const) {
  test(`a store written before frames in blocks and authenticated records (v1 fixture) reads byte for byte, plaintext and encrypted, and takes new writes (${kind}: store)`, async (t) => {
    const v1 = JSON.parse(readFileSync(V1_FIXTURE, 'utf8')) as V1Fixture;
    const store = kind === 'memory' ? new MemoryObjectStore() : new LocalDirObjectStore(await tempDir(t));
    for (const o of v1.objects) await store.put(o.key, Buffer.from(o.body, 'base64'));
    const master = masterKey(Buffer.from(v1.masterKey, 'hex'));
    const catalog = new StoreCatalog({ store, log: silentLogger(), cache: async () => BlockCache.open({ capacityBytes: 64 * MiB }), volume: { segmentBytes: 128 * KiB }, masterKey: () => master });
    const open = async (name: string, readOnly = false): Promise<Volume> => (await catalog.open(name, { readOnly })).volume!;
    const models = new Map<string, Buffer>();
    for (const [name, want] of Object.entries(v1.expect)) {
      const v = await open(name, true);
      const whole = await v.read(0, v1.size);
      t.is(sha(whole), want!, name);
      models.set(name, whole);
      // Reads that start and end inside old frames, raw (checked whole) and lz4: 4 KiB ones as a random reader's.
      const r = seededRandom(name.length + 1);
      for (let k = 0; k < 40; k++) {
        const len = k % 2 ? 4096 : 1 + Math.floor(r() * 100_000);
        const off = Math.floor(r() * (v1.size - len));
        t.true((await v.read(off, len)).equals(whole.subarray(off, off + len)), `${name} [${off}, +${len})`);
      }
      await v.close();
    }
    // Today's writes into the old volumes: plaintext frames now in blocks, the old encrypted volume's records still without a MAC.
    for (const name of ['plain', 'sec']) {
      const v = await open(name);
      const m = models.get(name)!;
      const fresh = rnd(name.length, 200 * KiB);
      await v.write(1 * MiB + 123, fresh, true);
      fresh.copy(m, 1 * MiB + 123);
      await v.close();
      const again = await open(name, true);
      t.true((await again.read(0, v1.size)).equals(m), `${name}: old and new data`);
      t.true((await again.read(1 * MiB + 4096, 4096)).equals(m.subarray(1 * MiB + 4096, 1 * MiB + 8192)), `${name}: a 4 KiB read of new data`);
    }
    const recs = async (name: string, dir: 'log' | 'seg'): Promise<Buffer[]> => {
      const id = decodeVolumeRecord(await store.get(keys.volumeRecord(name)), name).id;
      return Promise.all((await listAll(store, `${keys.volumePrefix(id)}${dir}/`)).map((o) => store.get(o.key)));
    };
    t.true((await recs('sec', 'log')).every((b) => b.subarray(0, 8).toString() === 'BATONLG3'), 'the old encrypted volume keeps writing records without a MAC (its key says so)');
    t.true((await recs('plain', 'seg')).some((b) => b[2] === CODEC_BLOCKS), 'new plaintext segments are in blocks');
    // A fork of the old encrypted volume made today authenticates its own records, and reads its parent's.
    await catalog.fork('sec', 'sec-new');
    const f = await open('sec-new');
    t.true((await f.read(0, v1.size)).equals(models.get('sec')!), 'the fork reads its parent (old records, old frames, and today\'s)');
    await f.write(0, rnd(9, 8 * KiB), true);
    await f.close();
    t.true((await recs('sec-new', 'log')).every((b) => b.subarray(0, 8).toString() === 'BATONLG4'));
  });
}

test('an old volume takes framed writes: old and new data read together, from a v5 checkpoint naming both kinds, on a fresh host, and GC keeps both', async (t) => {
  const store = new MemoryObjectStore();
  await loadFixture(store);
  const a = host(store, { segmentBytes: 64 * KiB });
  const v = await a.open('old');
  const model = await v.read(0, fixture.size);
  t.is(sha(model), fixture.expect.old!);
  for (const [i, off] of [5000, 1_000_000, 2_500_000].entries()) {
    const d = mixed(i, 20_000 + i * 70_000);
    await v.write(off, d, false);
    d.copy(model, off);
    await v.flush();
  }
  await v.close(); // a checkpoint of the mixed map
  const id = v.volumeId;
  const cps = await listAll(store, keys.checkpointPrefix(id));
  const c = decodeCheckpoint(await store.get(cps[cps.length - 1]!.key), 'cp');
  t.is(c.v, 5);
  t.true(c.objects.some((o) => o[2] === null) && c.objects.some((o) => o[2] !== null && o[2] !== undefined), 'raw and framed objects in one checkpoint');
  const w = await host(store).open('old', true);
  t.true((await w.read(0, fixture.size)).equals(model), 'a fresh host reads old and new bytes');
  const gc = await collectGarbage(a.catalog, { graceMs: 2000, maxOperationMs: 1000 });
  t.is(gc.deletedObjects, 0);
  t.true((await host(store).open('old-fork', true).then((f) => f.read(0, fixture.size)).then(sha)) === fixture.expect['old-fork']);
});

test('a flipped bit in a stored segment: the read fails (ChecksumError, EIO), the object is named in an error log, it was fetched again once; other ranges read', async (t) => {
  const mem = new MemoryObjectStore();
  const a = host(mem, { segmentBytes: 256 * KiB });
  await a.catalog.create('v', 16 * MiB);
  const v = await a.open('v');
  const data = mixed(1, 1 * MiB);
  await v.write(0, data, true);
  await v.close();
  const segs = (await listAll(mem, keys.volumePrefix(v.volumeId))).filter((o) => o.key.includes('/seg/'));
  t.is(segs.length, 4);
  const victim = segs[1]!.key; // volume bytes [256 KiB, 512 KiB)
  await damage(mem, victim, (b) => { b[b.length - 100]! ^= 0x10; }); // in its last frame
  const counting = new CountingStore(mem);
  const cap = capturing();
  const w = await host(counting, {}, cap.log).open('v', true);
  const err = await t.throwsAsync(w.read(0, 1 * MiB));
  t.true(err instanceof ChecksumError && err instanceof CorruptError, String(err));
  t.is((err as ChecksumError).objectKey, victim);
  const errors = cap.lines.filter((l) => l.level >= 50 && l.key === victim);
  t.is(errors.length, 2, 'one error for the first read, one for the re-fetch');
  t.is(counting.gets.get(victim), 2, 'through the cache, then once straight from the store');
  t.true((await w.read(0, 256 * KiB + 200 * KiB)).equals(data.subarray(0, 456 * KiB)), 'the frames before it read');
  t.true((await w.read(512 * KiB, 512 * KiB)).equals(data.subarray(512 * KiB)), 'other objects read');
  await t.throwsAsync(w.read(512 * KiB - 10, 5), { instanceOf: ChecksumError });
});

for (const kind of ['memory', 'file'] as const) {
  test(`4 KiB reads of random data read only their blocks: right bytes; a damaged block fails only its own reads (EIO after one re-read), a damaged cached one is fetched again (${kind}: store)`, async (t) => {
    const store = kind === 'memory' ? new MemoryObjectStore() : new LocalDirObjectStore(await tempDir(t));
    const slab = new MemorySlab();
    const cache = await BlockCache.open({ capacityBytes: 64 * MiB, slab });
    const a = host(store, { segmentBytes: 1 * MiB });
    await a.catalog.create('v', 16 * MiB);
    const v = await a.open('v');
    const data = rnd(5, 2 * MiB); // random: every frame in blocks
    await v.write(0, data, true);
    await v.close();
    const cap = capturing();
    const counting = new CountingStore(store);
    const w = await host(kind === 'memory' ? counting : store, {}, cap.log, cache).open('v', true);
    const r = seededRandom(11);
    const reads = store instanceof LocalDirObjectStore ? store.local.reads! : null;
    const readBefore = reads?.bytes ?? 0;
    let asked = 0;
    for (let k = 0; k < 300; k++) {
      const off = Math.floor(r() * (2 * MiB / 4096)) * 4096 + (k % 5 === 0 ? Math.floor(r() * 4000) : 0);
      const len = k % 7 === 0 ? 1 + Math.floor(r() * 9000) : 4096;
      if (off + len > 2 * MiB) continue;
      t.true((await w.read(off, len)).equals(data.subarray(off, off + len)), `[${off}, +${len})`);
      asked += len;
    }
    // In place (file:), a 4 KiB read reads its block and crc table entry, not its 32 KiB frame.
    if (reads) t.true(reads.bytes - readBefore < 2.5 * asked, `${reads.bytes - readBefore} bytes read for ${asked} asked`);
    // Damage one block of a segment in the store: the logical bytes [at, at+4096) of some frame.
    const seg = (await listAll(store, 'vol/')).find((o) => o.key.includes('/seg/'))!;
    const body = await store.get(seg.key);
    const frameLen = body.readUInt32LE(8) + 32;
    t.is(body[2], CODEC_BLOCKS);
    t.is(frameLen, 32 + 32 * KiB + 32, 'header, crc table, 32 KiB');
    // Block 3 of the segment's second frame (logical bytes 32 KiB + 12 KiB .. of the segment).
    const damagedAt = frameLen + 64 + 3 * 4096 + 100;
    const good = await damage(store, seg.key, (b) => { b[damagedAt]! ^= 1; });
    const w2 = await host(store, {}, cap.log, await BlockCache.open({ capacityBytes: 64 * MiB })).open('v', true);
    // Which volume offsets does that block hold? Find it by reading every 4 KiB: exactly one fails.
    const failed: number[] = [];
    for (let off = 0; off < 2 * MiB; off += 4096) {
      try { t.true((await w2.read(off, 4096)).equals(data.subarray(off, off + 4096))); } catch (err) { t.true(err instanceof ChecksumError, String(err)); failed.push(off); }
    }
    t.is(failed.length, 1, `one 4 KiB block fails: ${failed.join(', ')}`);
    t.true(cap.lines.some((l) => l.msg.startsWith('stored data failed its check again')), 'read once more, then EIO');
    await restore(store, seg.key, good);
    if (kind === 'memory') {
      // The read cache: rot every cached block; reads still give the right bytes (fetched again).
      await cache.drain();
      for (const b of (slab as unknown as { slots: Map<number, Buffer> }).slots.values()) b[2000]! ^= 1;
      const before = [...counting.gets.values()].reduce((x, y) => x + y, 0);
      for (let off = 0; off < 256 * KiB; off += 4096) t.true((await w.read(off, 4096)).equals(data.subarray(off, off + 4096)));
      t.true([...counting.gets.values()].reduce((x, y) => x + y, 0) > before, 'the store was asked again');
    }
  });
}

test('readNow (a READ answered on the spot) of a file: volume: the same bytes as read(), false where it would wait; a damaged block is never returned (false, then read() fails)', async (t) => {
  const store = new LocalDirObjectStore(await tempDir(t));
  const h = host(store, { segmentBytes: 1 * MiB });
  await h.catalog.create('v', 16 * MiB);
  const v = await h.open('v');
  const data = rnd(7, 2 * MiB); // random: every frame in blocks
  await v.write(0, data, true);
  const out = Buffer.alloc(64 * KiB);
  t.false(v.readNow(4096, 4096, out.subarray(0, 4096)), 'the segments\' files are not open yet: it would wait');
  t.true((await v.read(0, 4096)).equals(data.subarray(0, 4096)));
  t.true((await v.read(MiB, 4096)).equals(data.subarray(MiB, MiB + 4096)));
  const r = seededRandom(3);
  let now = 0;
  for (let k = 0; k < 400; k++) {
    const off = Math.floor(r() * (2 * MiB / 512)) * 512;
    const len = k % 3 === 0 ? 4096 : 512 * (1 + Math.floor(r() * 40));
    if (off + len > 2 * MiB) continue;
    const into = out.subarray(0, len).fill(0xee);
    if (v.readNow(off, len, into)) { now++; t.true(into.equals(data.subarray(off, off + len)), `readNow [${off}, +${len})`); }
    else t.true((await v.read(off, len)).equals(data.subarray(off, off + len)), `read [${off}, +${len})`);
  }
  t.true(now > 200, `most reads within one frame were answered on the spot (${now})`);
  // The crc entry a block passed its check against is remembered: the block's next read reads the block alone.
  const reads = store.local.reads!;
  t.true(v.readNow(8192, 4096, out.subarray(0, 4096)));
  const readBefore = reads.bytes;
  t.true(v.readNow(8192, 4096, out.subarray(0, 4096)) && out.subarray(0, 4096).equals(data.subarray(8192, 12_288)));
  t.is(reads.bytes - readBefore, 4096, 'the block alone');
  // Whole frames (a sequential reader's): read in place and checked, on the spot too.
  for (let off = 0; off + 96 * KiB <= 2 * MiB; off += 160 * KiB) {
    const into = out.subarray(0, 64 * KiB).fill(0xee);
    t.true(v.readNow(off + 32 * KiB, 64 * KiB, into), `whole frames [${off + 32 * KiB}, +64 KiB) on the spot`);
    t.true(into.equals(data.subarray(off + 32 * KiB, off + 96 * KiB)));
  }
  // Compressed (lz4) frames of a local file: read and decoded in a scratch buffer, on the spot.
  const txt = text(9, 1 * MiB);
  await v.write(12 * MiB, txt, true);
  t.true((await v.read(12 * MiB, 4096)).equals(txt.subarray(0, 4096))); // opens its file
  for (const [o, l] of [[0, 4096], [100, 40_000], [32 * KiB, 64 * KiB], [MiB - 5000, 5000]] as const) {
    const into = out.subarray(0, l).fill(0xee);
    t.true(v.readNow(12 * MiB + o, l, into), `lz4 frames [${o}, +${l}) on the spot`);
    t.true(into.equals(txt.subarray(o, o + l)));
  }
  // Bytes still in memory (written, not flushed) and holes: answered on the spot too.
  const fresh = rnd(8, 8192);
  await v.write(5 * MiB, fresh, false);
  t.true(v.readNow(5 * MiB, 8192, out.subarray(0, 8192)) && out.subarray(0, 8192).equals(fresh), 'buffered bytes');
  t.true(v.readNow(9 * MiB, 4096, out.subarray(0, 4096).fill(1)) && out.subarray(0, 4096).equals(Buffer.alloc(4096)), 'a hole');
  // Damage one block of the first segment: the file is put anew, so the next read() opens it.
  const victim = (await listAll(store, 'vol/')).find((o) => o.key.includes('/seg/'))!.key;
  const frameLen = 32 + 32 * KiB + 32; // header, crc table, 32 KiB
  const damagedAt = frameLen + 64 + 2 * 4096 + 10; // in block 2 of the segment's frame 1
  await damage(store, victim, (b) => { b[damagedAt]! ^= 1; });
  let bad = -1;
  for (let off = 0; off < 2 * MiB; off += 4096) {
    try { await v.read(off, 4096); } catch (err) { t.true(err instanceof ChecksumError, String(err)); bad = off; }
  }
  t.true(bad >= 0, 'one block fails read()');
  for (let off = 0; off < 2 * MiB; off += 4096) {
    const into = out.subarray(0, 4096).fill(0xee);
    if (off === bad) {
      t.false(v.readNow(off, 4096, into), 'the damaged block: not answered on the spot');
      await t.throwsAsync(v.read(off, 4096), { instanceOf: ChecksumError });
      const frame = Math.floor(off / (32 * KiB)) * 32 * KiB;
      t.false(v.readNow(frame, 32 * KiB, out.subarray(0, 32 * KiB)), 'nor its whole frame, read in place');
      await t.throwsAsync(v.read(frame, 32 * KiB), { instanceOf: ChecksumError });
    } else {
      t.true(v.readNow(off, 4096, into), `[${off}, +4096) on the spot`);
      t.true(into.equals(data.subarray(off, off + 4096)), `[${off}, +4096) right bytes`);
    }
  }
  await v.close();
});

test('a damaged block in the read cache (the store\'s copy is good): the reader gets the right bytes, after one re-fetch and an error log', async (t) => {
  const mem = new MemoryObjectStore();
  const slab = new MemorySlab();
  const cache = await BlockCache.open({ capacityBytes: 64 * MiB, slab });
  const cap = capturing();
  const a = host(mem, { segmentBytes: 256 * KiB });
  await a.catalog.create('v', 16 * MiB);
  const v = await a.open('v');
  const data = mixed(2, 1 * MiB);
  await v.write(0, data, true);
  await v.close();
  const counting = new CountingStore(mem);
  const w = await host(counting, {}, cap.log, cache).open('v', true);
  t.true((await w.read(0, 1 * MiB)).equals(data), 'first read fills the cache');
  await cache.drain();
  // Rot every cached block.
  const slots = (slab as unknown as { slots: Map<number, Buffer> }).slots;
  t.true(slots.size > 0);
  for (const b of slots.values()) b[1000]! ^= 1;
  const before = [...counting.gets.values()].reduce((x, y) => x + y, 0);
  t.true((await w.read(0, 1 * MiB)).equals(data), 'right bytes, from the store');
  const after = [...counting.gets.values()].reduce((x, y) => x + y, 0);
  t.true(after > before, 'the store was asked again');
  t.true(cap.lines.some((l) => l.level >= 50 && l.msg.startsWith('stored data failed its check')));
  t.false(cap.lines.some((l) => l.msg.startsWith('stored data failed its check again')), 'the re-fetch was good');
});

for (const encrypted of [false, true]) {
  test(`readNow from the read cache (a remote store's volume${encrypted ? ', encrypted' : ''}): the same bytes as read() once the blocks are cached, false before; a rotted cached block is never returned (false, then read() fetches it again)`, async (t) => {
    const mem = new MemoryObjectStore();
    const slab = new MemorySlab();
    const cache = await BlockCache.open({ capacityBytes: 64 * MiB, slab });
    const master = masterKey(Buffer.alloc(32, 7));
    const catalog = (store: ObjectStore, log: Logger, c: BlockCache): StoreCatalog =>
      new StoreCatalog({ store, log, cache: async () => c, volume: { segmentBytes: 256 * KiB }, ...(encrypted ? { masterKey: () => master } : {}) });
    const first = catalog(mem, silentLogger(), await BlockCache.open({ capacityBytes: 64 * MiB }));
    await first.create('v', 16 * MiB, encrypted ? { encrypt: true } : {});
    const v = (await first.open('v', { readOnly: false })).volume!;
    const data = mixed(4, 2 * MiB); // text frames (lz4) and random ones (in blocks)
    await v.write(0, data, true);
    await v.close();
    const counting = new CountingStore(mem);
    const cap = capturing();
    const w = (await catalog(counting, cap.log, cache).open('v', { readOnly: false })).volume!;
    const out = Buffer.alloc(600 * KiB);
    t.false(w.readNow(4096, 4096, out.subarray(0, 4096)), 'nothing cached yet: it would fetch');
    t.true((await w.read(0, 2 * MiB)).equals(data), 'the first read fills the cache');
    await cache.drain();
    const gets = (): number => [...counting.gets.values()].reduce((x, y) => x + y, 0);
    const getsBefore = gets();
    const r = seededRandom(encrypted ? 13 : 12);
    let now = 0;
    for (let k = 0; k < 300; k++) {
      const len = k % 4 === 0 ? 4096 : k % 4 === 1 ? 1 + Math.floor(r() * 9000) : 1 + Math.floor(r() * 500 * KiB);
      const off = Math.floor(r() * (2 * MiB - len));
      const into = out.subarray(0, len).fill(0xee);
      if (w.readNow(off, len, into)) { now++; t.true(into.equals(data.subarray(off, off + len)), `readNow [${off}, +${len})`); }
      else t.fail(`[${off}, +${len}) is cached but was not answered on the spot`);
    }
    t.is(now, 300);
    t.is(gets(), getsBefore, 'no request to the store');
    // Rot every cached block: readNow never returns the rotted bytes; read() fetches them again.
    for (const b of (slab as unknown as { slots: Map<number, Buffer> }).slots.values()) b[1000]! ^= 1;
    for (let off = 0; off < 2 * MiB; off += 64 * KiB) {
      const into = out.subarray(0, 8192).fill(0xee);
      if (w.readNow(off + 900, 8192, into)) t.true(into.equals(data.subarray(off + 900, off + 900 + 8192)), `readNow [${off + 900}, +8192) after the rot`);
      t.true((await w.read(off + 900, 8192)).equals(data.subarray(off + 900, off + 900 + 8192)), `read [${off + 900}, +8192) after the rot`);
    }
    t.true(gets() > getsBefore, 'the rotted blocks were fetched again');
    await w.close();
  });
}

for (const kind of ['mixed', 'random'] as const) {
  // random: every frame raw, so whole-frame reads go straight into the caller's buffer (planDirectRead).
  test(`file: store: a flipped bit in a segment file is EIO, never the bytes; the rest reads (${kind} data)`, async (t) => {
    const dir = await tempDir(t);
    const store = new LocalDirObjectStore(dir);
    t.truthy(store.local, 'reads in place');
    const a = host(store, { segmentBytes: 256 * KiB });
    await a.catalog.create('v', 16 * MiB);
    const v = await a.open('v');
    const data = kind === 'mixed' ? mixed(3, 1 * MiB) : rnd(3, 1 * MiB);
    await v.write(0, data, true);
    await v.close();
    const segs = (await listAll(store, keys.volumePrefix(v.volumeId))).filter((o) => o.key.includes('/seg/'));
    // Flip a bit in the file itself, near its end (the store's own header is at the start).
    const file = path.join(dir, ...segs[2]!.key.split('/')) + OBJ_SUFFIX;
    const st = await fsp.stat(file).catch(() => null);
    t.truthy(st, `the object is the file ${file}`);
    const fd = await fsp.open(file, 'r+');
    const b = Buffer.alloc(1);
    await fd.read(b, 0, 1, st!.size - 5000);
    b[0]! ^= 0x40;
    await fd.write(b, 0, 1, st!.size - 5000);
    await fd.close();
    const cap = capturing();
    const w = await host(new LocalDirObjectStore(dir), {}, cap.log).open('v', true);
    const out = Buffer.alloc(1 * MiB);
    await t.throwsAsync(w.read(0, 1 * MiB, out), { instanceOf: ChecksumError });
    t.true(cap.lines.some((l) => l.level >= 50 && l.msg.startsWith('stored data failed its check again')), 'the failure is logged');
    t.true((await w.read(0, 512 * KiB)).equals(data.subarray(0, 512 * KiB)));
    t.true((await w.read(768 * KiB, 256 * KiB)).equals(data.subarray(768 * KiB)));
    // Reads of every alignment around the damaged frame: the bytes or EIO, never other bytes.
    const r = seededRandom(kind === 'mixed' ? 5 : 6);
    for (let i = 0; i < 40; i++) {
      const len = 1 + Math.floor(r() * 300 * KiB);
      const off = 512 * KiB + Math.floor(r() * (512 * KiB - len));
      const got = await w.read(off, len).catch((err: unknown) => err);
      if (got instanceof ChecksumError) continue;
      t.true(Buffer.isBuffer(got) && got.equals(data.subarray(off, off + len)), `read [${off}, +${len})`);
    }
  });
}

test('0 wrong bytes: random damage to random objects of a volume (segments, inline data, headers), every read is the right bytes or an error', async (t) => {
  const mem = new MemoryObjectStore();
  const SIZE = 4 * MiB;
  const a = host(mem, { segmentBytes: 128 * KiB, checkpointEvery: 1000 });
  await a.catalog.create('v', SIZE);
  const v = await a.open('v');
  const model = Buffer.alloc(SIZE);
  const r = seededRandom(99);
  for (let i = 0; i < 25; i++) {
    const off = Math.floor(r() * (SIZE - 300 * KiB));
    const d = mixed(i, 1 + Math.floor(r() * 300 * KiB));
    await v.write(off, d, false);
    d.copy(model, off);
    if (i % 3 === 2) await v.flush();
  }
  await v.close();
  const objects = (await listAll(mem, keys.volumePrefix(v.volumeId))).filter((o) => o.key.includes('/seg/') || o.key.includes('/log/'));
  let wrong = 0;
  let failedReads = 0;
  let failedOpens = 0;
  let goodReads = 0;
  for (let round = 0; round < 40; round++) {
    const o = objects[Math.floor(r() * objects.length)]!;
    const flips = 1 + Math.floor(r() * 3);
    const body = await damage(mem, o.key, (b) => { for (let f = 0; f < flips; f++) b[Math.floor(r() * b.length)]! ^= 1 << Math.floor(r() * 8); });
    try {
      const w = await host(mem).open('v', true);
      for (let off = 0; off < SIZE; off += 256 * KiB) {
        try {
          const got = await w.read(off, 256 * KiB);
          if (got.equals(model.subarray(off, off + 256 * KiB))) goodReads++; else wrong++;
        } catch (err) {
          if (!(err instanceof CorruptError)) throw err;
          failedReads++;
        }
      }
    } catch (err) {
      if (!(err instanceof CorruptError)) throw err;
      failedOpens++; // a damaged log header: the volume is refused, never guessed
    }
    await restore(mem, o.key, body);
  }
  t.is(wrong, 0, `no wrong bytes (${goodReads} good reads, ${failedReads} failed reads, ${failedOpens} refused opens)`);
  t.true(failedReads + failedOpens >= 20, 'the damage was seen');
  t.true((await host(mem).open('v', true).then((w) => w.read(0, SIZE))).equals(model), 'restored: all reads again');
});

async function compressibleVolume(create: CreateOptions = {}) {
  const mem = new MemoryObjectStore();
  const a = host(mem, { segmentBytes: 1 * MiB });
  await a.catalog.create('v', 64 * MiB, create);
  const v = await a.open('v');
  const data = text(5, 4 * MiB);
  await v.write(0, data, true);
  return { mem, a, v, data };
}

test('compaction on framed data: live bytes against the object\'s logical size (not its compressed size), rewritten and read back', async (t) => {
  const { a, v, data } = await compressibleVolume();
  // Overwrite 3/4 of each 1 MiB segment: a quarter of each stays live.
  for (let s = 0; s < 4; s++) await v.write(s * MiB, text(50 + s, 768 * KiB), false);
  await v.flush();
  const model = Buffer.from(data);
  for (let s = 0; s < 4; s++) text(50 + s, 768 * KiB).copy(model, s * MiB);
  const c = await v.compactionCandidates(0.5);
  t.is(c.victims.size, 4, 'a quarter live: candidates (their compressed size is far below the live logical bytes)');
  t.is(c.liveBytes, 4 * 256 * KiB);
  const none = await v.compactionCandidates(0.2);
  t.is(none.victims.size, 0, 'a quarter live is above 0.2');
  const res = await v.compact({ below: 0.5 });
  t.is(res.rewrittenBytes, 1 * MiB);
  t.true((await v.read(0, 4 * MiB)).equals(model));
  await v.close();
  t.true((await a.open('v', true).then((w) => w.read(0, 4 * MiB))).equals(model));
});

test('accounting reports logical and stored bytes; diff is unchanged by compression', async (t) => {
  const { a, v } = await compressibleVolume();
  await v.write(8 * MiB, rnd(1, 1 * MiB), true);
  await v.close();
  await a.catalog.fork('v', 'f');
  const f = await a.open('f');
  await f.write(20 * MiB, text(9, 1 * MiB), true);
  await f.close();
  const acc = new Map((await a.catalog.listWithAccounting()).map((x) => [x.name, x]));
  const av = acc.get('v')!;
  t.is(av.writtenBytes, 5 * MiB);
  t.true(av.writtenStoredBytes! < 1.2 * MiB + 64 * KiB && av.writtenStoredBytes! > 1 * MiB, `stored ${av.writtenStoredBytes}: the random MiB and 4 MiB of text compressed`);
  t.is(av.sharedBytes, 5 * MiB);
  const af = acc.get('f')!;
  t.is(af.exclusiveBytes, 1 * MiB);
  t.true(af.exclusiveStoredBytes! < 256 * KiB, 'its text compressed');
  t.deepEqual(av.data, { format: 'framed', compression: 'lz4', encrypted: false });
  t.deepEqual(await a.catalog.diff('v', 'f'), [{ offset: 20 * MiB, length: 1 * MiB }]);
  const none = await compressibleVolume({ compression: 'none' });
  await none.v.close();
  const an = (await none.a.catalog.listWithAccounting())[0]!;
  t.true(an.writtenStoredBytes! >= 4 * MiB, 'compression none: stored = logical (+ frame headers)');
  t.deepEqual(an.data, { format: 'framed', compression: 'none', encrypted: false });
});

/** A store whose GETs answer after 0-4 ms at random: concurrent reads complete out of order. */
class JitterStore extends CountingStore {
  constructor(inner: ObjectStore, private readonly r: () => number) { super(inner); }
  override async get(key: string, range?: ByteRange): Promise<Buffer> {
    await new Promise((res) => setTimeout(res, Math.floor(this.r() * 5)));
    return super.get(key, range);
  }
}

for (const kind of ['memory', 'file'] as const) {
  test(`many concurrent framed reads completing out of order each get their own bytes (readObject's pooled buffers; ${kind}: store)`, async (t) => {
    const base = kind === 'memory' ? new MemoryObjectStore() : new LocalDirObjectStore(await tempDir(t));
    const a = host(base, { segmentBytes: 256 * KiB });
    await a.catalog.create('v', 16 * MiB);
    const v = await a.open('v');
    const data = mixed(11, 8 * MiB);
    await v.write(0, data, true);
    await v.close();
    const r = seededRandom(12);
    // memory: through a 1 MiB cache (most reads go to the jittery store); file: read in place.
    const store = kind === 'memory' ? new JitterStore(base, r) : base;
    const w = await host(store, {}, silentLogger(), await BlockCache.open({ capacityBytes: 1 * MiB })).open('v', true);
    let wrong = 0;
    for (let round = 0; round < 8; round++) {
      await Promise.all(Array.from({ length: 32 }, async () => {
        const off = Math.floor(r() * (data.length - 1));
        const len = 1 + Math.floor(r() * Math.min(300 * KiB, data.length - off - 1));
        if (!(await w.read(off, len)).equals(data.subarray(off, off + len))) wrong++;
      }));
    }
    t.is(wrong, 0);
  });
}

/**
 * Encryption at rest through the catalog and the engine (issue 16, src/volume/keys.ts): no
 * plaintext in the store or the read cache; a missing, wrong or damaged key is refused at
 * open (KeyError), never garbage; forks get a data key of their own and read their parent's
 * frames; snapshots read with their source's ring; a tampered or swapped frame is EIO; the
 * master key is loaded from a file or the environment and never printed.
 */
import test, { type ExecutionContext } from 'ava';
import { randomBytes } from 'node:crypto';
import * as fsp from 'node:fs/promises';
import * as os from 'node:os';
import * as path from 'node:path';
import { inspect } from 'node:util';
import { BlockCache, MemorySlab } from '../../src/cache.js';
import { ChecksumError, CorruptError, InvalidArgumentError, KeyError } from '../../src/errors.js';
import { silentLogger } from '../../src/log.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { listAll, type ObjectStore } from '../../src/store/object-store.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import { systemWorld } from '../../src/clock.js';
import {
  CHECKPOINT_MAGIC, CHECKPOINT_MAGIC_V6, LOG_MAGIC_V3, LOG_MAGIC_V4, decodeCheckpoint, decodeLogHeader, decodeVolumeRecord, encodeCheckpoint, encodeVolumeRecord, keys, type LogHeader,
} from '../../src/volume/format.js';
import { crc32 } from '../../src/volume/frames.js';
import { collectGarbage } from '../../src/volume/gc.js';
import { loadMasterKey, masterKey, unwrapDataKey, wrapDataKey, type MasterKey } from '../../src/volume/keys.js';
import type { Volume } from '../../src/volume/volume.js';

const KiB = 1024;
const MiB = 1024 * KiB;
const SECRET = 'AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\n';
/** Compressible text with a secret in it: what must never be found in the store or the cache. */
const secretText = (n: number, tag = 0): Buffer => {
  const line = `# .env ${tag}\n${SECRET}export PATH=/usr/local/bin:$PATH\n`;
  const b = Buffer.allocUnsafe(n);
  for (let i = 0; i < n; i++) b[i] = line.charCodeAt(i % line.length);
  return b;
};

function host(store: ObjectStore, master: MasterKey | null, cache?: BlockCache) {
  const c = cache ?? BlockCache.open({ capacityBytes: 64 * MiB });
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: async () => c, volume: { segmentBytes: 256 * KiB, maxOperationMs: 100 }, masterKey: () => master });
  const open = async (name: string, readOnly = false): Promise<Volume> => (await catalog.open(name, { readOnly })).volume!;
  return { catalog, open };
}

async function allStored(store: ObjectStore): Promise<Buffer> {
  const parts: Buffer[] = [];
  for (const o of await listAll(store, 'vol/')) parts.push(await store.get(o.key));
  return Buffer.concat(parts);
}

const K1 = masterKey(Buffer.alloc(32, 1));
const K2 = masterKey(Buffer.alloc(32, 2));

test('an encrypted volume: reads back, no plaintext in the store or in the read cache, raw bytes of another volume do hold it', async (t) => {
  const mem = new MemoryObjectStore();
  const slab = new MemorySlab();
  const cache = await BlockCache.open({ capacityBytes: 64 * MiB, slab });
  const a = host(mem, K1, cache);
  await a.catalog.create('sec', 16 * MiB, { encrypt: true });
  await a.catalog.create('plain', 16 * MiB);
  const data = secretText(1 * MiB + 12345);
  for (const name of ['sec', 'plain']) {
    const v = await a.open(name);
    await v.write(4096, data, true); // segments and inline data
    await v.write(8 * MiB, data.subarray(0, 3000), true); // a small commit: inline only
    await v.close();
  }
  const plainId = decodeVolumeRecord(await mem.get(keys.volumeRecord('plain')), 'plain').id;
  const secId = decodeVolumeRecord(await mem.get(keys.volumeRecord('sec')), 'sec').id;
  const storedOf = async (id: string): Promise<Buffer> => Buffer.concat(await Promise.all((await listAll(mem, keys.volumePrefix(id))).map((o) => mem.get(o.key))));
  t.true((await storedOf(plainId)).includes('wJalrXUtnFEMI'), 'the check can fail: a plain volume\'s lz4 frames hold the secret');
  t.false((await storedOf(secId)).includes('wJalrXUtnFEMI'), 'the encrypted volume\'s objects do not');
  const rec = (await mem.get(keys.volumeRecord('sec'))).toString();
  t.false(rec.includes(K1.key.toString('hex')) || rec.includes(K1.key.toString('base64')), 'the record holds no master key');
  // A fresh host reads it through the block cache; the cache holds only stored bytes.
  const slab2 = new MemorySlab();
  const cache2 = await BlockCache.open({ capacityBytes: 64 * MiB, slab: slab2 });
  const b = host(mem, K1, cache2);
  const w = await b.open('sec', true);
  t.true((await w.read(4096, data.length)).equals(data));
  t.true((await w.read(8 * MiB, 3000)).equals(data.subarray(0, 3000)));
  await cache2.drain();
  const slots = (slab2 as unknown as { slots: Map<number, Buffer> }).slots;
  t.true(slots.size > 0, 'the reads went through the cache');
  t.false(Buffer.concat([...slots.values()]).includes('wJalrXUtnFEMI'), 'no plaintext in the cache');
  const pw = await b.open('plain', true);
  t.true((await pw.read(4096, data.length)).equals(data));
  await cache2.drain();
  t.true(Buffer.concat([...slots.values()]).includes('wJalrXUtnFEMI'), 'the check can fail: a plain volume\'s cached frames hold it');
});

test('hydration of an encrypted volume on a new host fills the cache with stored (encrypted) bytes only; reads then need no GET', async (t) => {
  const mem = new MemoryObjectStore();
  const a = host(mem, K1);
  await a.catalog.create('sec', 16 * MiB, { encrypt: true });
  const v = await a.open('sec');
  const data = secretText(2 * MiB + 777);
  await v.write(0, data, true);
  await v.close(); // a checkpoint with the working set
  let gets = 0;
  const counting: ObjectStore = {
    get description() { return mem.description; },
    get: (...args) => { gets++; return mem.get(...args); },
    put: (...args) => mem.put(...args),
    head: (...args) => mem.head(...args),
    list: (...args) => mem.list(...args),
    delete: (key) => mem.delete(key),
    close: () => mem.close(),
  };
  const slab = new MemorySlab();
  const cache = await BlockCache.open({ capacityBytes: 64 * MiB, slab });
  const w = await host(counting, K1, cache).open('sec', true);
  const h = w.startHydration({ mode: 'all' });
  t.truthy(h, 'hydration runs (not a local store)');
  await h!.done;
  await cache.drain();
  const slots = (slab as unknown as { slots: Map<number, Buffer> }).slots;
  t.true(slots.size > 0, 'hydration filled the cache');
  t.false(Buffer.concat([...slots.values()]).includes('wJalrXUtnFEMI'), 'no plaintext in the cache');
  const before = gets;
  t.true((await w.read(0, data.length)).equals(data));
  t.is(gets, before, 'every read from the cache (decrypted and checked on the way out)');
});

test('attach of an encrypted volume: without a key, with another key, or with a damaged data key it is refused (KeyError naming the key id), before any read', async (t) => {
  const mem = new MemoryObjectStore();
  const a = host(mem, K1);
  await a.catalog.create('sec', 16 * MiB, { encrypt: true });
  const v = await a.open('sec');
  await v.write(0, secretText(300 * KiB), true);
  await v.close();
  const none = await t.throwsAsync(host(mem, null).open('sec', true), { instanceOf: KeyError });
  t.regex(none!.message, new RegExp(`master key id ${K1.id}.*--key-file`));
  const other = await t.throwsAsync(host(mem, K2).open('sec'), { instanceOf: KeyError });
  t.regex(other!.message, new RegExp(`${K1.id}.*${K2.id}`));
  t.is((other as KeyError).code, 'BATON_ERR_KEY');
  // A record whose wrapped data key was changed (or moved from another volume) does not unwrap.
  const recKey = keys.volumeRecord('sec');
  const rec = decodeVolumeRecord(await mem.get(recKey), recKey);
  const id = rec.id;
  const wrapped = Buffer.from(rec.data!.encryption!.keys[id]!, 'base64');
  wrapped[20]! ^= 1;
  rec.data!.encryption!.keys[id] = wrapped.toString('base64');
  await mem.delete(recKey);
  await mem.put(recKey, Buffer.from(JSON.stringify(rec)));
  await t.throwsAsync(host(mem, K1).open('sec', true), { instanceOf: KeyError, message: /does not unwrap/ });
  // Creating one needs a key too.
  await t.throwsAsync(host(mem, null).catalog.create('sec2', MiB, { encrypt: true }), { instanceOf: KeyError });
});

test('forks and snapshots of an encrypted volume: a fork gets a data key of its own and reads its parent\'s frames; snapshots read with their source\'s ring; forking needs the key', async (t) => {
  const mem = new MemoryObjectStore();
  const a = host(mem, K1);
  await a.catalog.create('sec', 16 * MiB, { encrypt: true });
  const v = await a.open('sec');
  const base = secretText(600 * KiB, 1);
  await v.write(0, base, true);
  await v.close();
  await a.catalog.snapshot('sec', 'before');
  await t.throwsAsync(host(mem, null).catalog.fork('sec', 'nokey'), { instanceOf: KeyError });
  await t.throwsAsync(host(mem, K2).catalog.fork('sec', 'otherkey'), { instanceOf: KeyError });
  await a.catalog.fork('sec', 'f');
  const f = await a.open('f');
  t.true((await f.read(0, base.length)).equals(base), 'the fork reads its parent\'s frames');
  const mine = secretText(200 * KiB, 2);
  await f.write(100 * KiB, mine, true);
  await f.close();
  const model = Buffer.from(base);
  mine.copy(model, 100 * KiB);
  const srec = decodeVolumeRecord(await mem.get(keys.volumeRecord('sec')), 's');
  const frec = decodeVolumeRecord(await mem.get(keys.volumeRecord('f')), 'f');
  t.deepEqual(Object.keys(frec.data!.encryption!.keys).sort(), [srec.id, frec.id].sort(), 'the fork\'s ring: its parent\'s key and its own');
  t.not(frec.data!.encryption!.keys[frec.id], srec.data!.encryption!.keys[srec.id]);
  // The fork's own objects are under its own key: the parent's key alone does not read them.
  const fObjs = (await listAll(mem, keys.volumePrefix(frec.id))).filter((o) => o.key.includes('/log/') || o.key.includes('/seg/'));
  t.true(fObjs.length > 0);
  t.false((await allStored(mem)).includes('wJalrXUtnFEMI'));
  // A fresh host: fork, snapshot, fork of the fork, all read.
  const b = host(mem, K1);
  t.true((await (await b.open('f', true)).read(0, base.length)).equals(model));
  t.true((await (await b.open('sec@before', true)).read(0, base.length)).equals(base));
  await b.catalog.fork('f', 'ff');
  t.true((await (await b.open('ff', true)).read(0, base.length)).equals(model));
  await b.catalog.fork('sec@before', 'fs');
  t.true((await (await b.open('fs', true)).read(0, base.length)).equals(base));
  // Without the key: the snapshot and the fork are refused like the volume.
  await t.throwsAsync(host(mem, null).open('sec@before', true), { instanceOf: KeyError });
  await t.throwsAsync(host(mem, K2).open('ff', true), { instanceOf: KeyError });
  // GC, ls and diff need no key (they read maps only) and keep what the forks need.
  const nokey = host(mem, null);
  t.deepEqual(await nokey.catalog.diff('sec', 'f'), [{ offset: 100 * KiB, length: 200 * KiB }]);
  t.true((await nokey.catalog.listWithAccounting()).length >= 5);
  const M = 100;
  const gcHost = new StoreCatalog({ store: mem, log: silentLogger(), cache: async () => BlockCache.open({ capacityBytes: MiB }), volume: { maxOperationMs: M } });
  const r1 = await collectGarbage(gcHost, { graceMs: 2 * M, maxOperationMs: M });
  await new Promise((r) => setTimeout(r, 3 * M));
  const r2 = await collectGarbage(gcHost, { graceMs: 2 * M, maxOperationMs: M });
  t.true(r1.records >= 5 && r2.records >= 5, 'GC read every record without a key');
  for (const [n, want] of [['ff', model], ['fs', base], ['sec@before', base], ['f', model], ['sec', base]] as const) {
    t.true((await (await host(mem, K1).open(n, true)).read(0, base.length)).equals(want), `${n} reads after GC`);
  }
});

test('a tampered, swapped or re-keyed encrypted frame is EIO (ChecksumError), never bytes', async (t) => {
  const mem = new MemoryObjectStore();
  const a = host(mem, K1);
  await a.catalog.create('x', 16 * MiB, { encrypt: true });
  await a.catalog.create('y', 16 * MiB, { encrypt: true });
  const data = secretText(512 * KiB);
  for (const n of ['x', 'y']) { const v = await a.open(n); await v.write(0, data, true); await v.close(); }
  const idOf = async (n: string): Promise<string> => decodeVolumeRecord(await mem.get(keys.volumeRecord(n)), n).id;
  const segsOf = async (n: string): Promise<string[]> => (await listAll(mem, keys.volumePrefix(await idOf(n)))).filter((o) => o.key.includes('/seg/')).map((o) => o.key).sort();
  const xs = await segsOf('x');
  const ys = await segsOf('y');
  t.is(xs.length, 2);
  // 1. One flipped bit in a ciphertext.
  const body = await mem.get(xs[0]!);
  const bad = Buffer.from(body);
  bad[body.length - 40]! ^= 4;
  await mem.delete(xs[0]!); await mem.put(xs[0]!, bad);
  const w = await host(mem, K1).open('x', true);
  await t.throwsAsync(w.read(0, 256 * KiB), { instanceOf: ChecksumError, message: /authentication failed/ });
  t.true((await w.read(256 * KiB, 256 * KiB)).equals(data.subarray(256 * KiB)), 'the other segment reads');
  // 2. y's segment (same data, same position, another volume's key) put in its place.
  await mem.delete(xs[0]!); await mem.put(xs[0]!, await mem.get(ys[0]!));
  await t.throwsAsync((await host(mem, K1).open('x', true)).read(0, 4096), { instanceOf: ChecksumError });
  // 3. x's own second segment put in place of its first (same key, another object).
  await mem.delete(xs[0]!); await mem.put(xs[0]!, await mem.get(xs[1]!));
  await t.throwsAsync((await host(mem, K1).open('x', true)).read(0, 4096), { instanceOf: ChecksumError });
  await mem.delete(xs[0]!); await mem.put(xs[0]!, body);
  t.true((await (await host(mem, K1).open('x', true)).read(0, data.length)).equals(data), 'restored: reads');
});

/**
 * Rewrite a log record's header as a bucket writer can: the JSON changed by `edit` (same
 * length), its crc made to fit, the MAC (a v4 record's) and the data left as they were.
 */
async function rewriteLogHeader(store: ObjectStore, key: string, edit: (h: LogHeader) => void): Promise<void> {
  const body = await store.get(key);
  const { header, dataStart } = decodeLogHeader(body, key);
  edit(header);
  const json = Buffer.from(JSON.stringify(header));
  const jsonAt = body.subarray(0, 8).equals(LOG_MAGIC_V4) ? 48 : 16;
  if (jsonAt + json.length !== dataStart) throw new Error('the edit changed the header\'s length');
  const out = Buffer.from(body);
  out.writeUInt32BE(crc32(json), 12);
  json.copy(out, jsonAt);
  await store.delete(key);
  await store.put(key, out);
}

/** An encrypted volume `x` with A at 0 and B at 1 MiB committed in one record, closed. Returns the objects' keys. */
async function twoBlocks(mem: MemoryObjectStore): Promise<{ A: Buffer; B: Buffer; logs: string[]; checkpoints: string[] }> {
  const a = host(mem, K1);
  await a.catalog.create('x', 16 * MiB, { encrypt: true });
  const A = secretText(64 * KiB, 1);
  const B = secretText(64 * KiB, 2);
  const v = await a.open('x');
  await v.write(0, A, false);
  await v.write(MiB, B, true);
  await v.close();
  const id = decodeVolumeRecord(await mem.get(keys.volumeRecord('x')), 'x').id;
  const listed = (await listAll(mem, keys.volumePrefix(id))).map((o) => o.key).sort();
  return { A, B, logs: listed.filter((k) => k.includes('/log/')), checkpoints: listed.filter((k) => k.includes('/checkpoint/')) };
}

test('an encrypted volume\'s log records are authenticated: one rewritten by a bucket writer to point its extents at other authentic frames (crc made to fit) refuses the open, never serves them', async (t) => {
  const mem = new MemoryObjectStore();
  const { A, B, logs, checkpoints } = await twoBlocks(mem);
  for (const k of checkpoints) await mem.delete(k); // recovery reads the log
  t.true((await (await host(mem, K1).open('x', true)).read(0, A.length)).equals(A), 'untouched: reads');
  let rewritten = 0;
  for (const k of logs) {
    const body = await mem.get(k);
    t.true(body.subarray(0, 8).equals(LOG_MAGIC_V4), `${k} is a v4 (authenticated) record`);
    const { header } = decodeLogHeader(body, k);
    const at0 = header.extents.find((e) => e[0] === 0);
    const at1 = header.extents.find((e) => e[0] === MiB);
    if (!at0 || !at1 || at0[2] !== at1[2]) continue;
    // Each extent pointed at the other's bytes: authentic frames of the same object, in the wrong place.
    await rewriteLogHeader(mem, k, (h) => {
      const e0 = h.extents.find((e) => e[0] === 0)!;
      const e1 = h.extents.find((e) => e[0] === MiB)!;
      [e0[3], e1[3]] = [e1[3], e0[3]];
    });
    rewritten++;
  }
  t.is(rewritten, 1, 'one record held both blocks');
  const opened = host(mem, K1).open('x', true);
  await t.throwsAsync(opened, { instanceOf: CorruptError, message: /authentication failed/ });
  const v = await opened.catch(() => null);
  if (v) t.false((await v.read(0, B.length)).equals(B), 'B\'s bytes at A\'s place');
  // Without keys (GC, accounting) the map still reads: they serve no data.
  t.true((await host(mem, null).catalog.listWithAccounting()).some((i) => i.name === 'x'));
});

test('an encrypted volume\'s checkpoints are authenticated: one rewritten by a bucket writer (crc made to fit) is skipped like a damaged one, and the log gives the right bytes', async (t) => {
  const mem = new MemoryObjectStore();
  const { A, B, checkpoints } = await twoBlocks(mem);
  t.true(checkpoints.length >= 1);
  const key = checkpoints[checkpoints.length - 1]!;
  const body = await mem.get(key);
  t.true(body.subarray(0, 8).equals(CHECKPOINT_MAGIC_V6), 'a v6 (authenticated) checkpoint');
  // Its extents at 0 and 1 MiB pointed at each other's bytes; written again as v6 with the crc made to fit and the old MAC.
  const c = decodeCheckpoint(body, key);
  const ext: [number, number, number, number][] = [];
  await c.forEachExtent(16 * MiB, (o, l, src, so) => { ext.push([o, l, src, so]); }, async () => {});
  const i0 = ext.findIndex((e) => e[0] === 0);
  const i1 = ext.findIndex((e) => e[0] === MiB);
  t.true(i0 >= 0 && i1 >= 0 && ext[i0]![2] === ext[i1]![2]);
  [ext[i0]![3], ext[i1]![3]] = [ext[i1]![3], ext[i0]![3]];
  const plain = await encodeCheckpoint({ volumeId: c.volumeId, seq: c.seq, token: c.token, ...(c.lastId !== undefined ? { lastId: c.lastId } : {}), time: new Date(0).toISOString() },
    async (fn) => { for (const [o, l, src, so] of ext) { const obj = src >= 0 ? c.objects[src]! : null; fn(o, l, obj ? obj[0] : null, src, so, obj ? obj[1] : 0, obj ? obj[2] ?? null : null); } },
    async () => {}, c.workingSet);
  const checked = Buffer.concat([CHECKPOINT_MAGIC_V6, plain.subarray(8, plain.length - 4)]);
  const crc = Buffer.alloc(4);
  crc.writeUInt32LE(crc32(checked), 0);
  await mem.delete(key);
  await mem.put(key, Buffer.concat([checked, crc, body.subarray(body.length - 32)]));
  // Without keys (accounting, GC) the checkpoint is read by its crc alone: they serve no data.
  t.true((await host(mem, null).catalog.listWithAccounting()).some((i) => i.name === 'x'));
  const v = await host(mem, K1).open('x', true);
  t.true((await v.read(0, A.length)).equals(A), 'A at 0 (from the log), not B');
  t.true((await v.read(MiB, B.length)).equals(B), 'B at 1 MiB');
});

test('an encrypted volume made before records were authenticated (its data key wrapped the old way) still reads and writes v3 records and v5 checkpoints; its fork authenticates its own', async (t) => {
  const mem = new MemoryObjectStore();
  const a = host(mem, K1);
  await a.catalog.create('old', 16 * MiB, { encrypt: true });
  // Its record as the code before wrote it: the data key wrapped without the "authenticated" mark.
  const rec = decodeVolumeRecord(await mem.get(keys.volumeRecord('old')), 'old');
  const enc = rec.data!.encryption!;
  const dek = unwrapDataKey(K1, rec.id, enc.keys[rec.id]!)!;
  t.true(dek.authenticated);
  enc.keys[rec.id] = wrapDataKey(K1, rec.id, dek.dek, systemWorld, true);
  t.false(unwrapDataKey(K1, rec.id, enc.keys[rec.id]!)!.authenticated);
  for (const k of [keys.volumeRecord('old'), keys.meta(rec.id)]) { await mem.delete(k); await mem.put(k, encodeVolumeRecord(rec)); }
  const data = secretText(300 * KiB, 3);
  const v = await a.open('old');
  await v.write(0, data, true);
  await v.close();
  const objs = (await listAll(mem, keys.volumePrefix(rec.id))).map((o) => o.key);
  for (const k of objs.filter((x) => x.includes('/log/'))) t.true((await mem.get(k)).subarray(0, 8).equals(LOG_MAGIC_V3), `${k}: v3`);
  for (const k of objs.filter((x) => x.includes('/checkpoint/'))) t.true((await mem.get(k)).subarray(0, 8).equals(CHECKPOINT_MAGIC), `${k}: v5`);
  t.true((await (await host(mem, K1).open('old', true)).read(0, data.length)).equals(data));
  await a.catalog.fork('old', 'new');
  const f = await host(mem, K1).open('new');
  t.true((await f.read(0, data.length)).equals(data), 'the fork reads its parent\'s unauthenticated records');
  await f.write(0, secretText(4 * KiB, 4), true);
  await f.close();
  const fid = decodeVolumeRecord(await mem.get(keys.volumeRecord('new')), 'new').id;
  const flogs = (await listAll(mem, keys.logPrefix(fid))).map((o) => o.key);
  t.true(flogs.length > 0);
  for (const k of flogs) t.true((await mem.get(k)).subarray(0, 8).equals(LOG_MAGIC_V4), `the fork's ${k}: v4`);
});

async function tempDir(t: ExecutionContext): Promise<string> {
  const dir = await fsp.mkdtemp(path.join(os.tmpdir(), 'baton-keys-'));
  t.teardown(() => fsp.rm(dir, { recursive: true, force: true }));
  return dir;
}

test('the master key: a file (raw, hex or base64), BATON_KEY_FILE or BATON_KEY; bad keys are clear errors; the key is never printed', async (t) => {
  const dir = await tempDir(t);
  const raw = randomBytes(32);
  const want = masterKey(raw).id;
  const f = (n: string, b: Buffer | string): Promise<string> => fsp.writeFile(path.join(dir, n), b).then(() => path.join(dir, n));
  t.is(loadMasterKey(await f('raw', raw), {})!.id, want);
  t.is(loadMasterKey(await f('hex', raw.toString('hex') + '\n'), {})!.id, want);
  t.is(loadMasterKey(await f('b64', raw.toString('base64')), {})!.id, want);
  t.is(loadMasterKey(undefined, { BATON_KEY_FILE: path.join(dir, 'hex') })!.id, want);
  t.is(loadMasterKey(undefined, { BATON_KEY: raw.toString('hex') })!.id, want);
  t.is(loadMasterKey(path.join(dir, 'raw'), { BATON_KEY: randomBytes(32).toString('hex') })!.id, want, '--key-file wins over the environment');
  t.is(loadMasterKey(undefined, {}), null);
  const short = await f('short', randomBytes(16).toString('hex'));
  t.throws(() => loadMasterKey(short, {}), { instanceOf: InvalidArgumentError, message: /not a key/ });
  t.throws(() => loadMasterKey(path.join(dir, 'missing'), {}), { instanceOf: InvalidArgumentError, message: /cannot read the key file/ });
  t.throws(() => loadMasterKey(undefined, { BATON_KEY: 'password' }), { instanceOf: InvalidArgumentError, message: /BATON_KEY: not a key/ });
  const mk = loadMasterKey(path.join(dir, 'raw'), {})!;
  const shown = JSON.stringify(mk) + inspect(mk) + String(mk);
  t.false(shown.includes(raw.toString('hex')) || shown.includes(raw.toString('base64')), shown);
});

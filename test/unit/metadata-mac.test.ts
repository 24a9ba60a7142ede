/**
 * The MAC of an encrypted volume's log records (v4 envelope) and checkpoints (v6) (format.ts,
 * keys.ts metaKeyOf): with the key, a record or checkpoint changed by a bucket writer (its crc
 * made to fit), moved to another key, written under another key, or written without a MAC is a
 * CorruptError; without a key (GC, accounting) both still read; a whole read and a ranged read
 * of a checkpoint agree.
 */
import test from 'ava';
import { CorruptError } from '../../src/errors.js';
import {
  LOG_MAGIC_V3, LOG_MAGIC_V4, SRC_INLINE, checkCheckpoint, decodeCheckpoint, decodeLogHeader, encodeCheckpoint, encodeLogRecord, readCheckpointInRanges,
  type CheckpointData, type LogHeader,
} from '../../src/volume/format.js';
import { crc32 } from '../../src/volume/frames.js';
import { metaKeyOf } from '../../src/volume/keys.js';

const KEY = metaKeyOf(Buffer.alloc(32, 7));
const OTHER = metaKeyOf(Buffer.alloc(32, 8));
const LOG = 'vol/vid/log/00000000000000000003';

function header(extents: LogHeader['extents']): LogHeader {
  return { v: 3, kind: 'commit', seq: 3, volumeId: 'vid', token: 1, time: new Date(0).toISOString(), segments: [], extents, inlineLength: 0, frameBytes: 32768, id: 'id3', prev: 'id2' };
}

/** The same record with its JSON changed and its crc made to fit, the MAC left as it was: what a bucket writer can do. */
function tamper(body: Buffer, edit: (h: LogHeader) => void): Buffer {
  const v4 = body.subarray(0, 8).equals(LOG_MAGIC_V4);
  const { header: h } = decodeLogHeader(body, LOG);
  edit(h);
  const re = encodeLogRecord(h, []).body; // v3: magic, length, crc, JSON
  return v4 ? Buffer.concat([LOG_MAGIC_V4, re.subarray(8, 16), body.subarray(16, 48), re.subarray(16)]) : re;
}

test('a v4 log record: read with its key, and without one; changed, moved, another key\'s, or v3 where a MAC is due: CorruptError', (t) => {
  const h = header([[0, 4096, SRC_INLINE, 0], [1 << 20, 4096, SRC_INLINE, 4096]]);
  const { body } = encodeLogRecord(h, [], { metaKey: KEY, objectKey: LOG });
  t.true(body.subarray(0, 8).equals(LOG_MAGIC_V4));
  t.deepEqual(decodeLogHeader(body, LOG, KEY).header, h);
  t.deepEqual(decodeLogHeader(body, LOG).header, h, 'a reader without keys still reads it (crc checked)');
  t.deepEqual(decodeLogHeader(body, LOG, null).header, h, 'a volume whose records carry no MAC: not checked');
  // Extents pointed at each other's data, crc fixed: the MAC does not fit.
  const swapped = tamper(body, (x) => { x.extents[0]![3] = 4096; x.extents[1]![3] = 0; });
  t.notThrows(() => decodeLogHeader(swapped, LOG), 'its crc fits');
  t.throws(() => decodeLogHeader(swapped, LOG, KEY), { instanceOf: CorruptError, message: /authentication failed/ });
  t.throws(() => decodeLogHeader(body, 'vol/vid/log/00000000000000000004', KEY), { instanceOf: CorruptError, message: /authentication failed/ }, 'moved to another position');
  t.throws(() => decodeLogHeader(body, LOG, OTHER), { instanceOf: CorruptError, message: /authentication failed/ }, 'checked with another volume\'s key');
  // The same change written as a v3 record (no MAC at all): refused where one is due.
  const downgraded = tamper(encodeLogRecord(h, []).body, (x) => { x.extents[0]![3] = 4096; });
  t.true(downgraded.subarray(0, 8).equals(LOG_MAGIC_V3));
  t.notThrows(() => decodeLogHeader(downgraded, LOG));
  t.throws(() => decodeLogHeader(downgraded, LOG, KEY), { instanceOf: CorruptError, message: /without its MAC/ });
  // Every single flipped byte of the header part is caught with the key.
  for (let i = 0; i < 48 + 40; i++) {
    const b = Buffer.from(body);
    b[i]! ^= 0x10;
    t.throws(() => decodeLogHeader(b, LOG, KEY), { instanceOf: CorruptError }, `byte ${i}`);
  }
});

const CP = 'vol/vid/checkpoint/00000000000000000009';
const cpHeader = { volumeId: 'vid', seq: 9, token: 1, lastId: 'id9', time: new Date(0).toISOString() };

/** A checkpoint of two extents pointing at `offs` of one object, authenticated with `metaKey` (or not). */
function checkpoint(offs: [number, number], metaKey: Buffer | null, objectKey = CP): Promise<Buffer> {
  return encodeCheckpoint(cpHeader, async (fn) => {
    fn(0, 4096, 'vol/vid/seg/a', 0, offs[0], 1 << 20, null);
    fn(1 << 20, 4096, 'vol/vid/seg/a', 0, offs[1], 1 << 20, null);
  }, async () => {}, { chunkBytes: 65536, chunks: [1, 0] }, 5, metaKey ? { metaKey, objectKey } : undefined);
}

async function extents(c: CheckpointData): Promise<number[][]> {
  const out: number[][] = [];
  await c.forEachExtent(1 << 30, (o, l, s, so) => { out.push([o, l, s, so]); }, async () => {});
  return out;
}

/** Whole (checkCheckpoint + decode), whole (decode alone) and ranged (16-byte ranges) reads of `b` as `key`: each one's extents, or its error. */
async function readAll(b: Buffer, metaKey: Buffer | null | undefined, key = CP): Promise<(number[][] | Error)[]> {
  const attempt = async (f: () => Promise<CheckpointData | null>): Promise<number[][] | Error> => {
    try { return await extents((await f())!); } catch (err) { return err as Error; }
  };
  return Promise.all([
    attempt(async () => { await checkCheckpoint(b, key, async () => {}, metaKey); return decodeCheckpoint(b, key, { checked: true }); }),
    attempt(async () => decodeCheckpoint(b, key, { metaKey })),
    attempt(() => readCheckpointInRanges({ size: b.length, read: async (o, l) => Buffer.from(b.subarray(o, o + l)) }, key, 16, metaKey)),
  ]);
}

test('a v6 checkpoint: read whole and in ranges with its key and without; changed with its crc fixed, moved, another key\'s, or v5 where a MAC is due: CorruptError', async (t) => {
  const good = await checkpoint([0, 4096], KEY);
  const want = [[0, 4096, 0, 0], [1 << 20, 4096, 0, 4096]];
  for (const k of [KEY, undefined, null]) t.deepEqual(await readAll(good, k), [want, want, want], `metaKey ${k === undefined ? 'none' : k === null ? 'null' : 'given'}`);
  // The extents swapped (each points at the other's data), the crc made to fit, the MAC kept.
  const swappedPlain = await checkpoint([4096, 0], null);
  const checked = Buffer.concat([Buffer.from('BATONCP6'), swappedPlain.subarray(8, swappedPlain.length - 4)]);
  const crc = Buffer.alloc(4);
  crc.writeUInt32LE(crc32(checked), 0);
  const forged = Buffer.concat([checked, crc, good.subarray(good.length - 32)]);
  t.deepEqual(await readAll(forged, undefined), [[[0, 4096, 0, 4096], [1 << 20, 4096, 0, 0]], [[0, 4096, 0, 4096], [1 << 20, 4096, 0, 0]], [[0, 4096, 0, 4096], [1 << 20, 4096, 0, 0]]], 'its crc fits: a reader without keys takes it');
  for (const r of await readAll(forged, KEY)) t.true(r instanceof CorruptError && /authentication failed/.test(r.message), String(r));
  for (const r of await readAll(good, KEY, 'vol/vid/checkpoint/00000000000000000010')) t.true(r instanceof CorruptError && /authentication failed/.test(r.message), `moved: ${String(r)}`);
  for (const r of await readAll(good, OTHER)) t.true(r instanceof CorruptError && /authentication failed/.test(r.message), `another key: ${String(r)}`);
  // Written as v5 (no MAC): refused where one is due, before any extent is used.
  for (const r of await readAll(swappedPlain, KEY)) t.true(r instanceof CorruptError && /without its MAC/.test(r.message), `v5: ${String(r)}`);
  // Every single flipped byte is caught with the key, in all three reads.
  for (let i = 0; i < good.length; i++) {
    const b = Buffer.from(good);
    b[i]! ^= 0x01;
    for (const r of await readAll(b, KEY)) t.true(r instanceof Error, `byte ${i}: ${String(r)}`);
  }
});

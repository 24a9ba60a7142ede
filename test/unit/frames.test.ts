/**
 * The frame format (src/volume/frames.ts, docs/rfc-frames.md): round trips of any size and
 * split, every single-bit flip of a stored frame detected (raw, compressed, encrypted), frames
 * bound to their object and position, truncation, the pure-TS LZ4 decoder against lz4-napi,
 * log record v3 and checkpoint v5 checksums.
 */
import test from 'ava';
import { randomBytes } from 'node:crypto';
import { crc32 as zlibCrc32 } from 'node:zlib';
import { ChecksumError, CorruptError } from '../../src/errors.js';
import { seededRandom } from '../../src/store/decorators.js';
import {
  checkCheckpoint, decodeCheckpoint, decodeLogHeader, encodeCheckpoint, encodeLogRecord, framedSegmentRef, inlineFrames, segmentFrames, type LogHeader,
} from '../../src/volume/format.js';
import {
  BLOCK_BYTES, CODEC_BLOCKS, CODEC_LZ4, CODEC_RAW, FRAME_BYTES, copyFromBlocks, planBlockRead, type DirectRead, FRAME_HEADER, FrameIndex, compressionAvailable, copyFromFrames, decodeFrame, decodeLz4Block, encodeFrame, encodeObject, encodeObjectSync, keySeed, frameSeed, crc32, rememberBlockCrcs, rememberedBlockCrcs, forgetBlockCrcs, nativeCrcAvailable, planDirectRead, finishDirectRead,
  lengthsFromString, lengthsToString, looksRandom, scanFrames, type EncodeOptions, type FrameKeys,
} from '../../src/volume/frames.js';

const KEY = 'vol/0123456789abcdef/seg/00000000000000000007-abcd1234-0';
const rnd = (seed: number, n: number): Buffer => { const r = seededRandom(seed); const b = Buffer.allocUnsafe(n); for (let i = 0; i < n; i++) b[i] = Math.floor(r() * 256); return b; };
const text = (n: number): Buffer => { const b = Buffer.allocUnsafe(n); const s = 'export function add(a, b) { return a + b; } // node_modules\n'; for (let i = 0; i < n; i++) b[i] = s.charCodeAt(i % s.length); return b; };
const plain = (compress: boolean): EncodeOptions => ({ compress, key: null, random: (n) => Buffer.alloc(n) });
const DEK = randomBytes(32);
const keysOf = (k: Buffer): FrameKeys => ({ writeKey: k, readKey: () => k, writeMetaKey: null, metaKey: () => null });
const enc = (compress: boolean): EncodeOptions => ({ compress, key: DEK, random: (n) => randomBytes(n) });

function indexOf(lengths: Uint32Array, logical: number, base = 0, frameBytes = FRAME_BYTES): FrameIndex {
  return FrameIndex.fromLengths(frameBytes, logical, base, lengths, 'test');
}

/** Read logical [off, off+len) back through copyFromFrames from the object's whole stored body. */
function readBack(body: Buffer, idx: FrameIndex, off: number, len: number, keys: FrameKeys | null = null, key = KEY): Buffer {
  const sp = idx.span(off, len);
  const out = Buffer.alloc(len);
  copyFromFrames(key, idx, body.subarray(sp.start, sp.end), off, len, out, 0, keys);
  return out;
}

test('round trip: any size, any split into parts, any sub-range; compressible frames are lz4, random ones in checked blocks', (t) => {
  for (const size of [1, 4095, FRAME_BYTES - 1, FRAME_BYTES, FRAME_BYTES + 1, 3 * FRAME_BYTES + 777, 300_000]) {
    for (const [name, data] of [['text', text(size)], ['random', rnd(size, size)]] as const) {
      // Parts cut at odd places: frames that span parts are gathered, others are views.
      const cut = [0, Math.floor(size / 3), Math.floor(size / 3) + 1, size].filter((x, i, a) => i === 0 || x > a[i - 1]!);
      const parts = cut.slice(1).map((end, i) => data.subarray(cut[i]!, end));
      for (const compress of [false, true]) {
        const e = encodeObjectSync(KEY, parts, size, plain(compress));
        const body = Buffer.concat(e.pieces);
        t.is(body.length, e.stored);
        const idx = indexOf(e.lengths, size);
        t.deepEqual(scanFrames(body), e.lengths, 'a segment walks without its index');
        t.true(readBack(body, idx, 0, size).equals(data), `${name} ${size} compress=${compress}: whole`);
        const r = seededRandom(size);
        for (let k = 0; k < 20; k++) {
          const off = Math.floor(r() * size);
          const len = 1 + Math.floor(r() * Math.min(size - off, 70_000));
          t.true(readBack(body, idx, off, len).equals(data.subarray(off, off + len)), `${name} ${size} [${off}, +${len})`);
        }
        const codec = body[2];
        if (compress && compressionAvailable && name === 'text' && size >= 4096) t.is(codec, CODEC_LZ4, 'text is compressed');
        if (name === 'random' || !compress) t.is(codec, CODEC_BLOCKS, 'random bytes and compression off: in checked blocks');
      }
    }
  }
});

test('compression: text frames shrink a lot; random ones are not even tried (looksRandom) and cost 32 bytes each and 4 per block', (t) => {
  const size = 1024 * 1024;
  const tx = encodeObjectSync(KEY, [text(size)], size, plain(true));
  if (compressionAvailable) t.true(tx.stored < size / 5, `text: ${tx.stored} of ${size}`);
  const rd = encodeObjectSync(KEY, [rnd(1, size)], size, plain(true));
  t.is(rd.stored, size + (size / FRAME_BYTES) * FRAME_HEADER + (size / BLOCK_BYTES) * 4, 'a header per frame and a crc per 4 KiB block');
  t.true(looksRandom(rnd(2, FRAME_BYTES)));
  t.false(looksRandom(text(FRAME_BYTES)));
  t.false(looksRandom(Buffer.from(rnd(3, 24 * 1024).toString('base64')).subarray(0, FRAME_BYTES)), 'base64 is 6 bits a byte: tried');
});

test('every single-bit flip of a stored frame is detected: raw, compressed and encrypted frames', (t) => {
  const cases: [string, Buffer, EncodeOptions, FrameKeys | null][] = [
    ['blocks', rnd(9, 9000), plain(false), null],
    ['raw (before blocks)', rnd(9, 2048), { ...plain(false), wholeRaw: true }, null],
    ['lz4', text(8192), plain(true), null],
    ['encrypted raw', rnd(10, 1024), enc(false), keysOf(DEK)],
    ['encrypted lz4', text(8192), enc(true), keysOf(DEK)],
  ];
  for (const [name, data, o, keys] of cases) {
    const frame = Buffer.concat(encodeFrame(KEY, keySeed(KEY), 3, data, o));
    if (name.includes('lz4') && compressionAvailable) t.is(frame[2], CODEC_LZ4);
    t.true(decodeFrame(KEY, keySeed(KEY), 3, frame, data.length, keys).equals(data), `${name}: intact`);
    let missed = 0;
    for (let bit = 0; bit < frame.length * 8; bit++) {
      const bad = Buffer.from(frame);
      bad[bit >> 3]! ^= 1 << (bit & 7);
      try {
        decodeFrame(KEY, keySeed(KEY), 3, bad, data.length, keys);
        missed++; // decoded despite a flipped bit
      } catch (err) {
        if (!(err instanceof ChecksumError)) throw err;
      }
    }
    t.is(missed, 0, `${name}: ${frame.length * 8} single-bit flips, all detected`);
  }
});

test('random multi-bit damage, truncation, another object\'s or position\'s frame, another key: all ChecksumError, never bytes', (t) => {
  const data = text(3 * FRAME_BYTES);
  for (const [o, keys] of [[plain(true), null], [plain(false), null], [{ ...plain(false), wholeRaw: true }, null], [enc(true), keysOf(DEK)]] as const) {
    const e = encodeObjectSync(KEY, [data], data.length, o);
    const body = Buffer.concat(e.pieces);
    const idx = indexOf(e.lengths, data.length);
    const r = seededRandom(42);
    for (let k = 0; k < 300; k++) {
      const bad = Buffer.from(body);
      const flips = 2 + Math.floor(r() * 30);
      for (let f = 0; f < flips; f++) bad[Math.floor(r() * bad.length)]! ^= 1 + Math.floor(r() * 255);
      if (bad.equals(body)) continue;
      const err = t.throws(() => readBack(bad, idx, 0, data.length, keys));
      t.true(err instanceof ChecksumError, String(err));
    }
    // Truncated: the last frame is short.
    t.throws(() => decodeFrame(KEY, keySeed(KEY), 2, body.subarray(idx.ends[2]!, idx.ends[3]! - 1), FRAME_BYTES, keys), { instanceOf: ChecksumError });
    // A frame of another object, or at another position of this one.
    const f0 = body.subarray(0, idx.ends[1]!);
    t.throws(() => decodeFrame('vol/0123456789abcdef/seg/other', keySeed('vol/0123456789abcdef/seg/other'), 0, f0, FRAME_BYTES, keys), { instanceOf: ChecksumError });
    t.throws(() => decodeFrame(KEY, keySeed(KEY), 1, f0, FRAME_BYTES, keys), { instanceOf: ChecksumError });
    // The index says another logical size.
    t.throws(() => decodeFrame(KEY, keySeed(KEY), 0, f0, FRAME_BYTES - 1, keys), { instanceOf: ChecksumError });
    if (keys) t.throws(() => readBack(body, idx, 0, 10, keysOf(randomBytes(32))), { instanceOf: ChecksumError }, 'another key');
    if (keys) t.throws(() => readBack(body, idx, 0, 10, null), { instanceOf: ChecksumError }, 'no key');
  }
});

test('an encrypted frame holds no plaintext: its payload is not the data and its crc field is zero', (t) => {
  const data = Buffer.alloc(8192, 0x61);
  const frame = Buffer.concat(encodeFrame(KEY, keySeed(KEY), 0, data, enc(true)));
  t.is(frame.readUInt32LE(12), 0);
  t.false(frame.includes(Buffer.alloc(64, 0x61)));
  const two = Buffer.concat(encodeFrame(KEY, keySeed(KEY), 0, data, enc(true)));
  t.false(two.subarray(16).equals(frame.subarray(16)), 'a new nonce for every frame');
});

test('the pure-TS LZ4 block decoder agrees with lz4-napi, and refuses damaged blocks', (t) => {
  if (!compressionAvailable) { t.pass('lz4-napi not loadable here'); return; }
  for (const data of [text(FRAME_BYTES), Buffer.concat([text(5000), rnd(4, 3000), Buffer.alloc(20000), text(4768)]), Buffer.alloc(FRAME_BYTES)]) {
    const frame = Buffer.concat(encodeFrame(KEY, keySeed(KEY), 0, data, plain(true)));
    t.is(frame[2], CODEC_LZ4);
    const payload = frame.subarray(FRAME_HEADER);
    t.true(decodeLz4Block(payload.subarray(4), data.length).equals(data));
    t.throws(() => decodeLz4Block(payload.subarray(4, payload.length - 3), data.length), { instanceOf: CorruptError });
    t.throws(() => decodeLz4Block(payload.subarray(4), data.length + 1), { instanceOf: CorruptError });
  }
});

test('FrameIndex: spans are O(1) lookups; an index that does not add up is corrupt', (t) => {
  const lengths = Uint32Array.from([100, 200, 50]);
  const idx = indexOf(lengths, 2 * FRAME_BYTES + 10, 1000);
  t.deepEqual(idx.span(0, 1), { first: 0, last: 0, start: 1000, end: 1100 });
  t.deepEqual(idx.span(FRAME_BYTES - 1, 2), { first: 0, last: 1, start: 1000, end: 1300 });
  t.deepEqual(idx.span(2 * FRAME_BYTES, 10), { first: 2, last: 2, start: 1300, end: 1350 });
  t.throws(() => idx.span(2 * FRAME_BYTES + 5, 10), { instanceOf: CorruptError });
  t.throws(() => indexOf(lengths, 3 * FRAME_BYTES + 1), { instanceOf: CorruptError }, 'four frames\' worth of logical bytes, three lengths');
  t.throws(() => indexOf(Uint32Array.from([10, 200, 50]), 2 * FRAME_BYTES + 10), { instanceOf: CorruptError }, 'a frame shorter than its header');
  t.deepEqual(lengthsFromString(lengthsToString(lengths), 'x'), lengths);
  t.throws(() => lengthsFromString('AAA', 'x'), { instanceOf: CorruptError });
});

test('encodeObject yields between slices and gives the same bytes as in one go', async (t) => {
  const data = text(3 * 1024 * 1024);
  let pauses = 0;
  const a = await encodeObject(KEY, [data], data.length, plain(true), async () => { pauses++; });
  t.true(pauses >= 2, `paused ${pauses} times`);
  t.true(Buffer.concat(a.pieces).equals(Buffer.concat(encodeObjectSync(KEY, [data], data.length, plain(true)).pieces)));
});

function v3Header(segments: LogHeader['segments'], inline?: LogHeader['inline'], inlineLength = 0): LogHeader {
  return {
    v: 3, kind: 'commit', seq: 7, volumeId: 'abc', token: 1, time: new Date(0).toISOString(), segments, extents: [[0, 10, -1, 0]], inlineLength, frameBytes: FRAME_BYTES,
    ...(inline ? { inline } : {}), id: 'id7', prev: 'id6',
  };
}

test('log record v3: inline frames after a checksummed header; a flipped bit in the header is refused; indexes must add up', (t) => {
  const data = text(50_000);
  const key = 'vol/abc/log/00000000000000000007';
  const e = encodeObjectSync(key, [data], data.length, plain(true));
  const seg = encodeObjectSync(KEY, [rnd(5, 40_000)], 40_000, plain(true));
  const h = v3Header([framedSegmentRef(KEY, 40_000, seg.lengths, seg.stored)], { logical: data.length, frames: lengthsToString(e.lengths) }, e.stored);
  const { body, dataStart } = encodeLogRecord(h, e.pieces);
  const d = decodeLogHeader(body, key);
  t.is(d.dataStart, dataStart);
  const inline = inlineFrames(d.header, d.dataStart, body.length, key)!;
  t.true(readBack(body, inline, 0, data.length, null, key).equals(data));
  t.is(segmentFrames(d.header, 0, key)!.stored, seg.stored);
  let refused = 0;
  for (let bit = 0; bit < dataStart * 8; bit++) {
    const bad = Buffer.from(body.subarray(0, dataStart));
    bad[bit >> 3]! ^= 1 << (bit & 7);
    try { decodeLogHeader(bad, key); } catch (err) { if (err instanceof CorruptError) refused++; else throw err; }
  }
  t.is(refused, dataStart * 8, 'every single-bit flip of the header (magic, lengths, crc, JSON) is refused');
  const wrong = v3Header([{ ...framedSegmentRef(KEY, 40_000, seg.lengths, seg.stored), size: seg.stored + 1 }]);
  t.throws(() => segmentFrames(decodeLogHeader(encodeLogRecord(wrong, []).body, key).header, 0, key), { instanceOf: CorruptError });
});

test('checkpoint v5: frame indexes round trip; a flipped bit anywhere is refused (crc), also by the sliced check', async (t) => {
  const seg = encodeObjectSync(KEY, [text(100_000)], 100_000, plain(true));
  const idx = indexOf(seg.lengths, 100_000);
  const header = { volumeId: 'abc', seq: 9, token: 2, lastId: 'x', time: new Date(0).toISOString() };
  const b = await encodeCheckpoint(header, async (fn) => {
    fn(0, 50_000, KEY, 0, 0, seg.stored, idx);
    fn(50_000, 4096, 'vol/abc/seg/raw-one', 0, 123, 8 * 1024 * 1024, null);
    fn(60_000, 8192, null, -2, 0, 0, null);
  }, async () => {});
  const c = decodeCheckpoint(b, 'cp');
  t.is(c.v, 5);
  t.deepEqual(c.objects[0]![2]!.lengths(), seg.lengths);
  t.is(c.objects[1]![2], null);
  await checkCheckpoint(b, 'cp', async () => {});
  const r = seededRandom(7);
  for (let k = 0; k < 200; k++) {
    const bad = Buffer.from(b);
    const bit = Math.floor(r() * bad.length * 8);
    bad[bit >> 3]! ^= 1 << (bit & 7);
    t.throws(() => decodeCheckpoint(bad, 'cp'), { instanceOf: CorruptError });
    if (bit >= 64) await t.throwsAsync(checkCheckpoint(bad, 'cp', async () => {}), { instanceOf: CorruptError });
  }
});

test('the frame checksum is zlib\'s crc32, whichever implementation computes it (sizes around the switch, seeds, continuation)', (t) => {
  // On linux-x64 (CI) the native one must load: else every framed read pays twice for its checks.
  if (process.platform === 'linux' && process.arch === 'x64') t.true(nativeCrcAvailable, '@node-rs/crc32 loads (npm ci installs its linux-x64-gnu binary)');
  const r = seededRandom(7);
  const data = randomBytes(70_000);
  for (const len of [0, 1, 27, 28, 1023, 1024, 1025, 4096, 32 * 1024, 32 * 1024 + 32, 70_000]) {
    for (let k = 0; k < 4; k++) {
      const seed = k === 0 ? 0 : Math.floor(r() * 2 ** 32);
      const off = Math.floor(r() * (data.length - len));
      const b = data.subarray(off, off + len);
      t.is(crc32(b, seed), zlibCrc32(b, seed), `length ${len}, seed ${seed}`);
    }
  }
  // A crc continued over two pieces is the crc of the whole (frames seed the next check with the last).
  const a = data.subarray(0, 5000);
  const b = data.subarray(5000, 40_000);
  t.is(crc32(b, crc32(a, 99)), zlibCrc32(data.subarray(0, 40_000), 99));
  // A frame's seed (its index as 4 bytes LE, from the key's seed) is computed in JS: the same numbers as zlib.
  for (let k = 0; k < 2000; k++) {
    const seed = k === 0 ? 0 : Math.floor(r() * 2 ** 32);
    const index = k < 10 ? [0, 1, 255, 256, 65_535, 65_536, 2 ** 24, 2 ** 31, 2 ** 32 - 1, 12345][k]! : Math.floor(r() * 2 ** 32);
    const le = Buffer.alloc(4);
    le.writeUInt32LE(index, 0);
    t.is(frameSeed(seed, index), zlibCrc32(le, seed), `index ${index}, seed ${seed}`);
  }
  // The key seeds are remembered: the same number from the memo as computed afresh, also past the memo's bound.
  for (let k = 0; k < 5000; k++) {
    const key = `vol/v/seg/${k % 4500}`;
    t.is(keySeed(key), zlibCrc32(Buffer.from(key, 'utf8')));
  }
});

test('remembered block crcs: only what was remembered is given back, a forgotten entry is asked for again, and the memo stays bounded', (t) => {
  const idx = () => FrameIndex.fromLengths(FRAME_BYTES, 8 * FRAME_BYTES, 0, new Uint32Array(8).fill(FRAME_HEADER + FRAME_BYTES + 32), 'test');
  const a = idx();
  const r = planBlockRead(a, 3 * FRAME_BYTES + 2 * BLOCK_BYTES + 100, 2 * BLOCK_BYTES, false)!; // blocks 2-4 of frame 3
  t.truthy(r);
  t.is(r.tableLength, 12);
  const table = Buffer.from([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0xff]);
  const got = Buffer.alloc(12);
  t.false(rememberedBlockCrcs(a, r, got), 'nothing remembered yet');
  rememberBlockCrcs(a, r, table);
  t.true(rememberedBlockCrcs(a, r, got));
  t.deepEqual(got, table);
  const wider = planBlockRead(a, 3 * FRAME_BYTES + BLOCK_BYTES, 4 * BLOCK_BYTES, false)!; // blocks 1-4: block 1 unknown
  t.false(rememberedBlockCrcs(a, wider, Buffer.alloc(wider.tableLength)));
  const other = planBlockRead(a, 4 * FRAME_BYTES + 2 * BLOCK_BYTES + 100, 2 * BLOCK_BYTES, false)!; // the same blocks of frame 4
  t.false(rememberedBlockCrcs(a, other, Buffer.alloc(12)), 'per frame');
  forgetBlockCrcs(a, r);
  t.false(rememberedBlockCrcs(a, r, got), 'forgotten');
  // Bounded: remembering for ever more objects forgets the old ones at some point (32 MiB of entries in all).
  rememberBlockCrcs(a, r, table);
  for (let i = 0; i < 200_000 && rememberedBlockCrcs(a, r, got); i++) rememberBlockCrcs(FrameIndex.fromLengths(FRAME_BYTES, 2048 * FRAME_BYTES, 0, new Uint32Array(2048).fill(FRAME_HEADER + FRAME_BYTES + 32), 'big'), r, table);
  t.false(rememberedBlockCrcs(a, r, got), 'the first object\'s entries were forgotten when the memo filled');
});

test('direct reads: only whole frames stored raw or in blocks are planned straight into the buffer; filled and finished, they are the logical bytes, and a damaged one is a ChecksumError', (t) => {
  const F = FRAME_BYTES;
  // Frames 0-3 random (raw), 4-5 text (lz4 when available), 6 random and short.
  const data = Buffer.concat([rnd(21, 4 * F), text(2 * F), rnd(22, F - 100)]);
  const e = encodeObjectSync(KEY, [data], data.length, plain(true));
  const body = Buffer.concat(e.pieces);
  const idx = indexOf(e.lengths, data.length);
  const read = (off: number, len: number, damage?: (d: DirectRead) => void): Buffer | null | Error => {
    const out = Buffer.alloc(len + 10, 0xaa);
    const d = planDirectRead(idx, off, len, out, 5);
    if (d === null) return null;
    const sp = idx.span(off, len);
    let at = sp.start;
    for (const p of d.parts) { body.copy(p, 0, at, at + p.length); at += p.length; }
    t.is(at, sp.end, 'the parts cover the span exactly');
    damage?.(d);
    try { finishDirectRead(KEY, d, null); } catch (err) { return err as Error; }
    t.is(out[4], 0xaa, 'nothing before outOff');
    t.is(out[5 + len], 0xaa, 'nothing after the range');
    return out.subarray(5, 5 + len);
  };
  t.deepEqual(read(0, 4 * F), data.subarray(0, 4 * F), 'whole raw frames');
  t.deepEqual(read(F, 2 * F), data.subarray(F, 3 * F));
  t.deepEqual(read(6 * F, F - 100), data.subarray(6 * F), 'the short last frame');
  t.is(read(0, 4 * F - 1), null, 'a frame not wholly inside');
  t.is(read(1, F), null, 'unaligned');
  if (compressionAvailable) t.is(read(4 * F, 2 * F), null, 'compressed frames are decoded elsewhere');
  t.is(planDirectRead(idx, 0, 2 * F, Buffer.alloc(2 * F), 0)!.parts.length, 4, 'two pieces per frame in blocks: header and crc table, logical bytes');
  t.true(read(0, 2 * F, (d) => { d.parts[1]![7]! ^= 1; }) instanceof ChecksumError, 'a damaged block');
  t.true(read(0, 2 * F, (d) => { d.parts[2]![FRAME_HEADER + 5]! ^= 1; }) instanceof ChecksumError, 'a damaged crc table entry');
  t.true(read(0, 2 * F, (d) => { d.parts[2]![7]! ^= 1; }) instanceof ChecksumError, 'a damaged header');
  t.true(read(0, 2 * F, (d) => {
    // Blocks 0 and 1 swapped, with their table entries.
    const p = d.parts[1]!; const x = Buffer.from(p.subarray(0, BLOCK_BYTES)); p.copy(p, 0, BLOCK_BYTES, 2 * BLOCK_BYTES); x.copy(p, BLOCK_BYTES);
    const h = d.parts[0]!; const y = Buffer.from(h.subarray(FRAME_HEADER, FRAME_HEADER + 4)); h.copy(h, FRAME_HEADER, FRAME_HEADER + 4, FRAME_HEADER + 8); y.copy(h, FRAME_HEADER + 4);
  }) instanceof ChecksumError, 'two blocks swapped with their crcs');
  // Frames written before blocks (raw-sized) are read in place the same way.
  const old = encodeObjectSync(KEY, [data], data.length, { ...plain(true), wholeRaw: true });
  const oldBody = Buffer.concat(old.pieces);
  const oldIdx = indexOf(old.lengths, data.length);
  const o = planDirectRead(oldIdx, 0, 4 * F, Buffer.alloc(4 * F), 0)!;
  t.is(o.parts.length, 8, 'a header and the payload per raw-sized frame');
  let at = 0;
  for (const p of o.parts) { oldBody.copy(p, 0, at, at + p.length); at += p.length; }
  finishDirectRead(KEY, o, null);
  t.true(Buffer.concat(o.parts.filter((_, i) => i % 2 === 1)).equals(data.subarray(0, 4 * F)));
});

test('block reads: part of a frame in blocks reads and checks only its blocks; a damaged or moved block is a ChecksumError; none for whole, spanning, compressed, old or encrypted frames', (t) => {
  const F = FRAME_BYTES;
  const data = Buffer.concat([rnd(31, 3 * F), text(F), rnd(32, F - 1000)]);
  const e = encodeObjectSync(KEY, [data], data.length, plain(true));
  const body = Buffer.concat(e.pieces);
  const idx = indexOf(e.lengths, data.length, 100);
  const stored = Buffer.concat([Buffer.alloc(100), body]); // the frames start at 100 (a log record's data)
  const r = seededRandom(3);
  for (let k = 0; k < 400; k++) {
    const frame = [0, 1, 2, 4][k % 4]!;
    const fl = frame === 4 ? F - 1000 : F;
    const from = Math.floor(r() * fl);
    const len = 1 + Math.floor(r() * Math.min(fl - from, k % 3 === 0 ? 100 : 9000));
    const off = frame * F + from;
    const plan = planBlockRead(idx, off, len, false);
    if (from === 0 && len === fl) { t.is(plan, null, 'a whole frame is not a block read'); continue; }
    t.truthy(plan);
    const blocks = Math.floor((from + len - 1) / BLOCK_BYTES) - Math.floor(from / BLOCK_BYTES) + 1;
    t.is(plan!.tableLength, blocks * 4, 'the table entries of the blocks it needs');
    t.true(plan!.dataLength <= blocks * BLOCK_BYTES, 'no more than the blocks it needs');
    const out = Buffer.alloc(len + 2, 0xee);
    copyFromBlocks(KEY, plan!, stored.subarray(plan!.tableStart, plan!.tableStart + plan!.tableLength), stored.subarray(plan!.dataStart, plan!.dataStart + plan!.dataLength), out, 1);
    t.true(out.subarray(1, 1 + len).equals(data.subarray(off, off + len)), `[${off}, +${len})`);
    t.is(out[0], 0xee); t.is(out[len + 1], 0xee);
  }
  t.is(planBlockRead(idx, F - 10, 20, false), null, 'spans two frames');
  if (compressionAvailable) t.is(planBlockRead(idx, 3 * F + 10, 20, false), null, 'a compressed frame');
  t.is(planBlockRead(idx, 10, 20, true), null, 'an object whose frames may be encrypted');
  const old = encodeObjectSync(KEY, [data], data.length, { ...plain(true), wholeRaw: true });
  t.is(planBlockRead(indexOf(old.lengths, data.length), 10, 20, false), null, 'a raw-sized frame (before blocks)');
  // Every flipped byte of what a block read reads fails it; another object's or frame's blocks too.
  const plan = planBlockRead(idx, F + 5000, 5000, false)!;
  const table = stored.subarray(plan.tableStart, plan.tableStart + plan.tableLength);
  const bytes = stored.subarray(plan.dataStart, plan.dataStart + plan.dataLength);
  for (const [which, b] of [['table', table], ['data', bytes]] as const) {
    for (let i = 0; i < b.length; i++) {
      const bad = Buffer.from(b);
      bad[i]! ^= 0x40;
      t.throws(() => copyFromBlocks(KEY, plan, which === 'table' ? bad : table, which === 'data' ? bad : bytes, Buffer.alloc(5000), 0), { instanceOf: ChecksumError }, `${which} byte ${i}`);
    }
  }
  t.throws(() => copyFromBlocks('vol/0123456789abcdef/seg/other', plan, table, bytes, Buffer.alloc(5000), 0), { instanceOf: ChecksumError });
  t.throws(() => copyFromBlocks(KEY, { ...plan, frame: 2 }, table, bytes, Buffer.alloc(5000), 0), { instanceOf: ChecksumError });
  t.throws(() => copyFromBlocks(KEY, plan, table, bytes.subarray(0, bytes.length - 1), Buffer.alloc(5000), 0), { instanceOf: ChecksumError }, 'short');
  // Block 1's bytes and crc read as block 2's (a plan shifted by one block): fails.
  const shifted = { ...plan, from: plan.from + BLOCK_BYTES, to: plan.to + BLOCK_BYTES };
  t.throws(() => copyFromBlocks(KEY, shifted, table, bytes, Buffer.alloc(5000), 0), { instanceOf: ChecksumError });
});

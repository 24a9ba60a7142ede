/**
 * Framed data (issue 16, docs/rfc-frames.md): the logical bytes of every data object (a
 * segment, the inline part of a log record) are cut at fixed logical offsets into frames of
 * `frameBytes` (FRAME_BYTES, the last one shorter), each stored as a 32-byte header and a
 * payload that decodes on its own, so a ranged GET still fetches only the frames a read needs.
 *
 *   0  u8  FRAME_MAGIC ('F')
 *   1  u8  FRAME_VERSION (1)
 *   2  u8  codec: CODEC_BLOCKS (payload = a u32 LE crc32 of each BLOCK_BYTES block of the
 *          logical bytes, seeded with the binding and the block's index, then the logical bytes:
 *          what plaintext frames that do not shrink are, since session 13), CODEC_LZ4 (LZ4 block, its u32 LE
 *          logical size first: lz4_flex's compress_prepend_size) or CODEC_RAW (payload = the
 *          logical bytes: plaintext frames written before, and the plaintext inside encrypted ones)
 *   3  u8  flags: FLAG_ENCRYPTED
 *   4  u32 LE logical length
 *   8  u32 LE payload length
 *   12 u32 LE crc32 of the logical bytes, seeded with the binding; 0 when encrypted (the crc
 *          is then the first 4 bytes of the plaintext: a plaintext crc in the clear would let
 *          anyone test guesses of the content) and for CODEC_BLOCKS (each block has its own)
 *   16 12 bytes: the AES-GCM nonce (encrypted frames), zero otherwise
 *   28 u32 LE crc32, seeded with the binding, of bytes 0..28 and, when the payload is
 *          compressed and not encrypted, of the payload
 *
 * The *binding* is the object's key and the frame's index in it: a frame copied to another
 * object or position fails its check, so a wrong object is caught like a flipped bit. Every
 * stored bit is under a check: a block of a CODEC_BLOCKS frame and its entry in the crc table
 * under that crc (its header under the header crc), a raw payload under the logical crc, a compressed payload under
 * the frame crc (checked before decompressing: the decoder never sees damaged input, and a
 * damaged size field cannot make it allocate), an encrypted payload (ciphertext + 16-byte tag)
 * under AES-256-GCM whose additional data is the binding and the header.
 *
 * An object's frame index (stored length of every frame) is carried by the metadata that names
 * the object (log record header, checkpoint object table: format.ts), so a read needs no
 * request to find it; in memory it is a FrameIndex: cumulative stored offsets, one lookup per
 * frame whatever the object's size.
 *
 * Why blocks: a 4 KiB read of a frame checked as a whole reads and checks the whole frame, 8x
 * the bytes it returns; a read of part of a CODEC_BLOCKS frame reads and checks only its blocks
 * and their table entries (planBlockRead: two small reads), and a read of whole frames still
 * lands in place, its logical bytes in one piece (planDirectRead; blocks each followed by its
 * crc made a sequential read of whole frames 20 % slower: 8x the pieces). In a plaintext
 * object the stored length alone says a frame is CODEC_BLOCKS (blocksStored): a raw one is
 * FRAME_HEADER + logical, an lz4 one shorter (it is kept only if it shrinks by 1/16), so a
 * block read need not read the header first. (Not so in an encrypted object, where a
 * frame's stored length can be anything from its header + tag up: block reads are for
 * plaintext objects only.)
 */

import { strict as assert } from 'node:assert';
import { createCipheriv, createDecipheriv } from 'node:crypto';
import { createRequire } from 'node:module';
import { crc32 as zlibCrc32 } from 'node:zlib';
import { ChecksumError, CorruptError } from '../errors.js';

export const FRAME_MAGIC = 0x46;
export const FRAME_VERSION = 1;
export const FRAME_HEADER = 32;
/** Logical bytes per frame: a cold random 4 KiB read fetches and checks at most this much (+ header). */
export const FRAME_BYTES = 32 * 1024;
export const CODEC_RAW = 0;
export const CODEC_LZ4 = 1;
export const CODEC_BLOCKS = 2;
/** Logical bytes per checked block of a CODEC_BLOCKS frame (a page: what a random reader asks for). */
export const BLOCK_BYTES = 4096;
const BLOCK_CRC = 4;

/** Stored length of a CODEC_BLOCKS frame of `logical` bytes (header, crc table, blocks). */
export function blocksStored(logical: number): number {
  return FRAME_HEADER + logical + BLOCK_CRC * Math.ceil(logical / BLOCK_BYTES);
}

/** The crc seed of block `k` of a frame whose seed is `fseed`: a block read at another index fails its check. */
function blockSeed(fseed: number, k: number): number {
  return (fseed ^ Math.imul(k + 1, 0x9e3779b1)) >>> 0;
}
export const FLAG_ENCRYPTED = 1;
const GCM_TAG = 16;
const NONCE = 12;

// ------------------------------------------------------------------ crc32

/**
 * @node-rs/crc32: zlib's CRC-32 (same polynomial, same seeding: a crc of a crc continues it),
 * computed with carry-less multiplication: 1 GiB in 32 KiB frames took 0.11 s against zlib's
 * 0.27 s here, and the checks of a framed read were its largest single cost. Prebuilt binaries
 * on the npm registry as optional dependencies, like lz4-napi; when it cannot be loaded, zlib's
 * crc32 computes the same numbers. Small inputs (the 28 header bytes, a 4-byte index) stay
 * with zlib, whose call costs less. test/unit/frames.test.ts holds the two to the same results.
 */
const nativeCrc32: ((b: Uint8Array, seed?: number) => number) | null = (() => {
  try { return (createRequire(import.meta.url)('@node-rs/crc32') as { crc32(b: Uint8Array, seed?: number): number }).crc32; } catch { return null; }
})();
const NATIVE_CRC_MIN = 1024;

export const nativeCrcAvailable = nativeCrc32 !== null;

/** zlib's crc32(b, seed), by whichever implementation is faster for b's length. */
export function crc32(b: Uint8Array, seed = 0): number {
  return nativeCrc32 !== null && b.length >= NATIVE_CRC_MIN ? nativeCrc32(b, seed) : zlibCrc32(b, seed);
}

// ------------------------------------------------------------------ lz4

interface Lz4 { compressSync(b: Buffer): Buffer; uncompressSync(b: Uint8Array): Buffer }

/**
 * lz4-napi: prebuilt binaries published on the npm registry as optional dependencies (no
 * install script, no node-gyp). If it cannot be loaded on a platform, new frames are stored
 * raw (compressionAvailable false) and lz4 frames are decoded by decodeLz4Block below.
 */
const native: Lz4 | null = (() => {
  try { return createRequire(import.meta.url)('lz4-napi') as Lz4; } catch { return null; }
})();

export const compressionAvailable = native !== null;

/**
 * An LZ4 block decoder (the format: lz4 block_format.md) in plain TypeScript: the fallback
 * when lz4-napi is not there, and the tests' independent decoder. Throws CorruptError on
 * anything that is not a well-formed block of exactly `size` bytes.
 */
export function decodeLz4Block(src: Uint8Array, size: number): Buffer {
  const out = Buffer.allocUnsafe(size);
  let i = 0;
  let o = 0;
  const bad = (why: string): never => { throw new CorruptError(`lz4 block: ${why}`); };
  while (i < src.length) {
    const token = src[i++]!;
    let lit = token >>> 4;
    if (lit === 15) { let b: number; do { if (i >= src.length) bad('truncated literal length'); b = src[i++]!; lit += b; } while (b === 255); }
    if (i + lit > src.length || o + lit > size) bad('literals past the end');
    out.set(src.subarray(i, i + lit), o);
    i += lit; o += lit;
    if (i === src.length) break; // the last sequence has literals only
    if (i + 2 > src.length) bad('truncated offset');
    const dist = src[i]! | (src[i + 1]! << 8);
    i += 2;
    if (dist === 0 || dist > o) bad('match offset out of range');
    let len = token & 15;
    if (len === 15) { let b: number; do { if (i >= src.length) bad('truncated match length'); b = src[i++]!; len += b; } while (b === 255); }
    len += 4;
    if (o + len > size) bad('match past the end');
    for (let k = 0; k < len; k++, o++) out[o] = out[o - dist]!; // may overlap: byte by byte
  }
  if (o !== size) bad(`decoded ${o} bytes, expected ${size}`);
  return out;
}

function lz4Decode(payload: Buffer, size: number): Buffer {
  if (payload.length < 4 || payload.readUInt32LE(0) !== size) throw new CorruptError(`lz4 payload names ${payload.length < 4 ? '?' : payload.readUInt32LE(0)} bytes, the frame ${size}`);
  if (native) {
    let out: Buffer;
    try { out = native.uncompressSync(payload); } catch (err) { throw new CorruptError(`lz4: ${err instanceof Error ? err.message : String(err)}`); }
    if (out.length !== size) throw new CorruptError(`lz4 decoded ${out.length} bytes, expected ${size}`);
    return out;
  }
  return decodeLz4Block(payload.subarray(4), size);
}

/** -p·log2(p) of a byte value seen c times in looksRandom's 2048-byte sample, for every c. */
const SAMPLE_ENTROPY = (() => {
  const t = new Float64Array(2049);
  for (let c = 1; c <= 2048; c++) { const p = c / 2048; t[c] = -p * Math.log2(p); }
  return t;
})();
/** looksRandom's histogram, reused (it runs synchronously, once per frame on the write path). */
const SAMPLE_HIST = new Uint16Array(256);

/**
 * Random-looking bytes (compressed, encrypted, media) do not shrink; lz4 takes 4x longer to
 * find that out than to compress text. An entropy estimate of a 2 KiB sample (8 spots of 256
 * bytes) costs about 2 µs (a table of -p·log2(p) instead of 256 log2 calls, and no histogram
 * allocated per call: 6 µs before): near 8 bits per byte, the frame is not even tried.
 * (Base64 of random bytes is about 6 bits, text 4-5, zeroes 0.)
 */
export function looksRandom(b: Buffer): boolean {
  if (b.length < 4096) return false;
  const hist = SAMPLE_HIST;
  hist.fill(0);
  const step = Math.floor((b.length - 256) / 7);
  for (let s = 0; s < 8; s++) {
    const at = s * step;
    for (let k = at; k < at + 256; k++) hist[b[k]!]!++;
  }
  let h = 0;
  for (let v = 0; v < 256; v++) h += SAMPLE_ENTROPY[hist[v]!]!;
  return h > 7.5;
}

// ------------------------------------------------------------------ keys and binding

/** Where frames get their keys (keys.ts builds one from a volume's keyring). */
export interface FrameKeys {
  /** Encrypts the frames this writer makes (null: it writes plaintext frames). */
  readonly writeKey: Buffer | null;
  /** The key that decrypts the frames of object `objectKey` (by the volume id in it); throws KeyError if there is none. */
  readKey(objectKey: string): Buffer;
  /**
   * The key that authenticates the log records and checkpoints this writer makes (keys.ts
   * metaKeyOf; null: it writes none, or its volume predates them).
   */
  readonly writeMetaKey: Buffer | null;
  /**
   * The key that must authenticate log record or checkpoint `objectKey` (by the volume id in
   * it): null when that volume's records carry no MAC (encrypted before records had one);
   * throws KeyError if the ring has no key for it.
   */
  metaKey(objectKey: string): Buffer | null;
}

/**
 * crc32 seed of an object key: every frame's checks start from it and the frame's index.
 * Remembered for the keys seen last (a random reader checks a block of one of a few hundred
 * objects per READ, and the seed cost an allocation and a call into zlib each time); the
 * memo is cleared whole when it fills, so it stays bounded and never holds a wrong seed.
 */
export function keySeed(objectKey: string): number {
  let seed = keySeeds.get(objectKey);
  if (seed === undefined) {
    seed = crc32(Buffer.from(objectKey, 'utf8'));
    if (keySeeds.size >= KEY_SEEDS_KEPT) keySeeds.clear();
    keySeeds.set(objectKey, seed);
  }
  return seed;
}
const keySeeds = new Map<string, number>();
const KEY_SEEDS_KEPT = 4096;

/** zlib's crc32 of the frame's index as 4 bytes LE, from `seed`: table-driven here, no Buffer and no call into zlib (frames.test.ts holds it to zlib's). */
export function frameSeed(seed: number, index: number): number {
  let c = ~seed;
  let x = index >>> 0;
  for (let i = 0; i < 4; i++) {
    c = CRC_TABLE[(c ^ x) & 0xff]! ^ (c >>> 8);
    x >>>= 8;
  }
  return ~c >>> 0;
}
const CRC_TABLE = (() => {
  const t = new Int32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    t[n] = c;
  }
  return t;
})();

function aad(objectKey: string, index: number, header: Buffer): Buffer {
  const k = Buffer.from(objectKey, 'utf8');
  const out = Buffer.allocUnsafe(k.length + 4 + 28);
  k.copy(out, 0);
  out.writeUInt32LE(index >>> 0, k.length);
  header.copy(out, k.length + 4, 0, 28);
  return out;
}

// ------------------------------------------------------------------ encoding

export interface EncodeOptions {
  /** Try lz4 (frames that do not shrink by 1/16 are stored raw anyway). */
  compress: boolean;
  /** AES-256-GCM key for this writer's frames (null: plaintext). */
  key: Buffer | null;
  /** Nonces (World.randomBytes, so a simulator's run replays). */
  random: (n: number) => Buffer;
  /** Write plaintext frames that do not shrink as CODEC_RAW, as before CODEC_BLOCKS (tests of old volumes). */
  wholeRaw?: boolean;
}

/**
 * One frame: returns its stored pieces (header, payload pieces), whose lengths add up to the
 * frame's stored length. A plaintext frame that is not compressed is CODEC_BLOCKS, its blocks
 * views of `logical` (no copy): the caller must not change those bytes until they are stored.
 */
export function encodeFrame(objectKey: string, seed: number, index: number, logical: Buffer, o: EncodeOptions): Buffer[] {
  const fseed = frameSeed(seed, index);
  let codec = CODEC_RAW;
  let payload = logical;
  if (o.compress && native && !looksRandom(logical)) {
    const c = native.compressSync(logical);
    if (c.length <= logical.length - (logical.length >>> 4)) { codec = CODEC_LZ4; payload = c; }
  }
  const h = Buffer.alloc(FRAME_HEADER);
  h[0] = FRAME_MAGIC; h[1] = FRAME_VERSION; h[2] = codec;
  h.writeUInt32LE(logical.length, 4);
  if (codec === CODEC_RAW && !o.key && !o.wholeRaw) {
    // In checked blocks: the header, the crc table, then `logical` itself (no copy).
    const n = Math.ceil(logical.length / BLOCK_BYTES);
    const table = Buffer.allocUnsafe(BLOCK_CRC * n);
    for (let k = 0; k < n; k++) {
      table.writeUInt32LE(crc32(logical.subarray(k * BLOCK_BYTES, Math.min((k + 1) * BLOCK_BYTES, logical.length)), blockSeed(fseed, k)), k * BLOCK_CRC);
    }
    h[2] = CODEC_BLOCKS;
    h.writeUInt32LE(logical.length + BLOCK_CRC * n, 8);
    h.writeUInt32LE(crc32(h.subarray(0, 28), fseed), 28);
    return [h, table, logical];
  }
  const crcL = crc32(logical, fseed);
  if (o.key) {
    h[3] = FLAG_ENCRYPTED;
    h.writeUInt32LE(4 + payload.length + GCM_TAG, 8);
    o.random(NONCE).copy(h, 16);
    h.writeUInt32LE(crc32(h.subarray(0, 28), fseed), 28);
    const c = createCipheriv('aes-256-gcm', o.key, h.subarray(16, 28));
    c.setAAD(aad(objectKey, index, h));
    const crcB = Buffer.allocUnsafe(4);
    crcB.writeUInt32LE(crcL, 0);
    const a = c.update(crcB);
    const b = c.update(payload);
    const f = c.final();
    return [h, a, b, f, c.getAuthTag()].filter((x) => x.length > 0);
  }
  h.writeUInt32LE(payload.length, 8);
  h.writeUInt32LE(crcL, 12);
  let crcF = crc32(h.subarray(0, 28), fseed);
  if (codec !== CODEC_RAW) crcF = crc32(payload, crcF);
  h.writeUInt32LE(crcF, 28);
  return [h, payload];
}

/** Bytes [from, from+n) of the concatenation of `parts` (a view when they lie in one part). */
function gather(parts: readonly Buffer[], cursor: { part: number; at: number }, n: number): Buffer {
  const first = parts[cursor.part]!;
  if (first.length - cursor.at >= n) {
    const out = first.subarray(cursor.at, cursor.at + n);
    cursor.at += n;
    if (cursor.at === first.length) { cursor.part++; cursor.at = 0; }
    return out;
  }
  const out = Buffer.allocUnsafe(n);
  let done = 0;
  while (done < n) {
    const p = parts[cursor.part]!;
    const k = Math.min(n - done, p.length - cursor.at);
    p.copy(out, done, cursor.at, cursor.at + k);
    done += k;
    cursor.at += k;
    if (cursor.at === p.length) { cursor.part++; cursor.at = 0; }
  }
  return out;
}

export interface EncodedObject {
  /** Stored pieces in order (frame headers and payloads). */
  pieces: Buffer[];
  /** Stored bytes (the sum of the pieces). */
  stored: number;
  /** Stored length of every frame (what the metadata carries). */
  lengths: Uint32Array;
}

/** Bytes of logical data encoded between two calls of `pause` (about a millisecond of lz4 and crc work each). */
export const ENCODE_SLICE = 1024 * 1024;

/** Encodes one object's frames a slice at a time (encodeObject); `step` is synchronous. */
class ObjectEncoder {
  private readonly n: number;
  private readonly lengths: Uint32Array;
  private readonly pieces: Buffer[] = [];
  private readonly seed: number;
  private readonly cursor = { part: 0, at: 0 };
  private i = 0;
  private stored = 0;
  constructor(private readonly objectKey: string, private readonly parts: readonly Buffer[], private readonly logical: number, private readonly o: EncodeOptions, private readonly frameBytes: number) {
    this.n = Math.ceil(logical / frameBytes);
    this.lengths = new Uint32Array(this.n);
    this.seed = keySeed(objectKey);
  }
  /** Encode frames until `budget` logical bytes were done or the object is; true when it is. */
  step(budget: number): boolean {
    let done = 0;
    while (this.i < this.n && done < budget) {
      const len = Math.min(this.frameBytes, this.logical - this.i * this.frameBytes);
      const f = encodeFrame(this.objectKey, this.seed, this.i, gather(this.parts, this.cursor, len), this.o);
      let s = 0;
      for (const p of f) { this.pieces.push(p); s += p.length; }
      this.lengths[this.i++] = s;
      this.stored += s;
      done += len;
    }
    return this.i === this.n;
  }
  result(): EncodedObject { return { pieces: this.pieces, stored: this.stored, lengths: this.lengths }; }
}

/**
 * Encode the logical bytes `parts` (`logical` of them) of object `objectKey` into frames,
 * awaiting `pause` after every ENCODE_SLICE bytes (an 8 MiB segment's work in one turn of
 * the event loop held it for ~30 ms). The same input and nonces give the same bytes.
 */
export async function encodeObject(objectKey: string, parts: readonly Buffer[], logical: number, o: EncodeOptions, pause: () => Promise<void>, frameBytes = FRAME_BYTES): Promise<EncodedObject> {
  const e = new ObjectEncoder(objectKey, parts, logical, o, frameBytes);
  while (!e.step(ENCODE_SLICE)) await pause();
  return e.result();
}

/**
 * Buffer.concat(pieces, size), copying at most ENCODE_SLICE bytes between two calls of
 * `pause`. An 8 MiB segment body assembled in one call held the event loop for 10-20 ms
 * (fresh memory, most of it first touches), and the commits of a sequential write made those
 * turns the longest the loop had: 2.1 s of the 6.2 s of busy stretches of 30 ms or more in a
 * profile of a 1 GiB `nbdcopy --flush` to radosgw (bench/volume.ts, the stall probe). The
 * pieces must not change until it returns (they are a sealed layer's arena views and encoded
 * frames, as for encodeObject). With `into` (exactly `size` bytes: a pooled body), the bytes go there.
 */
export async function concatInSlices(pieces: readonly Buffer[], size: number, pause: () => Promise<void>, into?: Buffer): Promise<Buffer> {
  assert(into === undefined || into.length === size, 'concatInSlices fills exactly `size` bytes');
  const out = into ?? Buffer.allocUnsafe(size);
  let at = 0;
  let sincePause = 0;
  for (const p of pieces) {
    for (let off = 0; off < p.length;) {
      const n = Math.min(p.length - off, ENCODE_SLICE - sincePause);
      p.copy(out, at, off, off + n);
      at += n;
      off += n;
      sincePause += n;
      if (sincePause >= ENCODE_SLICE && at < size) { await pause(); sincePause = 0; }
    }
  }
  if (at !== size) throw new RangeError(`concatInSlices: the pieces hold ${at} bytes, not ${size}`);
  return out;
}

/** encodeObject in one go (small objects; tests). */
export function encodeObjectSync(objectKey: string, parts: readonly Buffer[], logical: number, o: EncodeOptions, frameBytes = FRAME_BYTES): EncodedObject {
  const e = new ObjectEncoder(objectKey, parts, logical, o, frameBytes);
  e.step(Infinity);
  return e.result();
}

// ------------------------------------------------------------------ the index

/**
 * Where the frames of one object lie: logical bytes [i*frameBytes, ...) of frame i are stored
 * at [base + ends[i], base + ends[i+1]) of the object. Immutable; shared by every extent of
 * the object in a map.
 */
export class FrameIndex {
  readonly frames: number;
  constructor(
    readonly frameBytes: number,
    /** Logical bytes in the object. */
    readonly logical: number,
    /** Stored offset of frame 0 in the object (0 for a segment; a log record's data start). */
    readonly base: number,
    /** frames + 1 cumulative stored offsets from `base`; ends[0] = 0. */
    readonly ends: Uint32Array | Float64Array,
  ) {
    this.frames = ends.length - 1;
  }

  /** Block crcs remembered for this object (rememberBlockCrcs), and which of them are. */
  blockCrcs: Uint32Array | null = null;
  blockCrcKnown: Uint8Array | null = null;

  /** Stored bytes of all frames. */
  get stored(): number { return this.ends[this.frames]!; }

  /** An index from the stored length of every frame, checked against the logical size (CorruptError). */
  static fromLengths(frameBytes: number, logical: number, base: number, lengths: Uint32Array, what: string): FrameIndex {
    if (!(Number.isSafeInteger(frameBytes) && frameBytes >= 4096 && frameBytes <= 1 << 24)) throw new CorruptError(`${what}: frame size ${frameBytes}`);
    if (!(Number.isSafeInteger(logical) && logical >= 0) || lengths.length !== Math.ceil(logical / frameBytes)) {
      throw new CorruptError(`${what}: ${lengths.length} frames for ${logical} logical bytes of ${frameBytes}-byte frames`);
    }
    let total = 0;
    for (let i = 0; i < lengths.length; i++) total += lengths[i]!;
    const ends = total < 2 ** 32 ? new Uint32Array(lengths.length + 1) : new Float64Array(lengths.length + 1);
    let at = 0;
    for (let i = 0; i < lengths.length; i++) {
      if (lengths[i]! < FRAME_HEADER) throw new CorruptError(`${what}: frame ${i} is ${lengths[i]} bytes, shorter than its header`);
      at += lengths[i]!;
      ends[i + 1] = at;
    }
    return new FrameIndex(frameBytes, logical, base, ends);
  }

  /** The stored length of every frame (what metadata carries). */
  lengths(): Uint32Array {
    const out = new Uint32Array(this.frames);
    for (let i = 0; i < this.frames; i++) out[i] = this.ends[i + 1]! - this.ends[i]!;
    return out;
  }

  /**
   * The frames holding logical bytes [off, off+len) and the stored range [start, end) of the
   * object they occupy. O(1).
   */
  span(off: number, len: number): { first: number; last: number; start: number; end: number } {
    if (!(off >= 0 && len > 0 && off + len <= this.logical)) throw new CorruptError(`logical range [${off}, +${len}) outside an object of ${this.logical} bytes`);
    const first = Math.floor(off / this.frameBytes);
    const last = Math.floor((off + len - 1) / this.frameBytes);
    return { first, last, start: this.base + this.ends[first]!, end: this.base + this.ends[last + 1]! };
  }
}

/** Frame lengths as metadata carries them: base64 of u32 LE. */
export function lengthsToString(lengths: Uint32Array): string {
  const b = Buffer.allocUnsafe(lengths.length * 4);
  for (let i = 0; i < lengths.length; i++) b.writeUInt32LE(lengths[i]!, i * 4);
  return b.toString('base64');
}

export function lengthsFromString(s: unknown, what: string): Uint32Array {
  if (typeof s !== 'string') throw new CorruptError(`${what}: frame index missing`);
  const b = Buffer.from(s, 'base64');
  if (b.length % 4 !== 0) throw new CorruptError(`${what}: frame index is not whole u32s`);
  const out = new Uint32Array(b.length / 4);
  for (let i = 0; i < out.length; i++) out[i] = b.readUInt32LE(i * 4);
  return out;
}

// ------------------------------------------------------------------ decoding

/**
 * Decode frame `index` of object `objectKey` from its stored bytes `frame` (exactly its
 * stored length), checking everything: ChecksumError (a CorruptError) if anything is off.
 * A raw plaintext frame's result is a view of `frame`, as is one in blocks' (its logical bytes).
 */
export function decodeFrame(objectKey: string, seed: number, index: number, frame: Buffer, expectLogical: number, keys: FrameKeys | null): Buffer {
  if (frame.length < FRAME_HEADER) throw new ChecksumError(objectKey, index, `${frame.length} bytes, shorter than a frame header`);
  return decodeFrameParts(objectKey, seed, index, frame.subarray(0, FRAME_HEADER), frame.subarray(FRAME_HEADER), expectLogical, keys);
}

/**
 * decodeFrame of a frame whose header (FRAME_HEADER bytes) and payload lie apart: read
 * straight into where their logical bytes belong (Volume.readObject). A raw plaintext
 * frame's result is `payload` itself, one in blocks' a view of it.
 */
export function decodeFrameParts(objectKey: string, seed: number, index: number, header: Buffer, payload: Buffer, expectLogical: number, keys: FrameKeys | null): Buffer {
  const fail = (why: string): never => { throw new ChecksumError(objectKey, index, why); };
  if (header.length !== FRAME_HEADER) fail(`${header.length} header bytes`);
  if (header[0] !== FRAME_MAGIC || header[1] !== FRAME_VERSION) fail('not a frame header (magic/version)');
  const codec = header[2]!;
  const flags = header[3]!;
  const logical = header.readUInt32LE(4);
  const payloadLen = header.readUInt32LE(8);
  const fseed = frameSeed(seed, index);
  if (payloadLen !== payload.length) fail(`header says ${payloadLen} payload bytes, the index ${payload.length}`);
  if (logical !== expectLogical) fail(`header says ${logical} logical bytes, the index ${expectLogical}`);
  if ((codec !== CODEC_RAW && codec !== CODEC_LZ4 && codec !== CODEC_BLOCKS) || (flags & ~FLAG_ENCRYPTED) !== 0) fail(`unknown codec ${codec} or flags ${flags}`);
  let crcF = crc32(header.subarray(0, 28), fseed);
  if (codec === CODEC_BLOCKS) {
    if (flags !== 0) fail('an encrypted frame in blocks');
    if (crcF !== header.readUInt32LE(28)) fail('frame checksum mismatch');
    if (payloadLen !== blocksStored(logical) - FRAME_HEADER) fail(`${payloadLen} payload bytes for ${logical} logical bytes in blocks`);
    const tableLen = payloadLen - logical;
    const data = payload.subarray(tableLen);
    checkBlocks(objectKey, index, fseed, payload.subarray(0, tableLen), data, 0, logical, logical);
    return data;
  }
  if (flags & FLAG_ENCRYPTED) {
    if (crcF !== header.readUInt32LE(28)) fail('header checksum mismatch');
    if (payloadLen < 4 + GCM_TAG) fail('encrypted payload too short');
    if (!keys) fail('encrypted frame, and this volume has no key for it');
    const d = createDecipheriv('aes-256-gcm', keys!.readKey(objectKey), header.subarray(16, 28));
    d.setAAD(aad(objectKey, index, header));
    d.setAuthTag(payload.subarray(payload.length - GCM_TAG));
    let plain: Buffer;
    try {
      // GCM is a stream mode: update() returns every plaintext byte and final() only checks
      // the tag (it returns nothing, and throws on a mismatch): nothing is used before it passed.
      plain = d.update(payload.subarray(0, payload.length - GCM_TAG));
      d.final();
    } catch {
      return fail('authentication failed (tampered, damaged, or another key\'s frame)');
    }
    const out = codec === CODEC_LZ4 ? lz4OrFail(plain.subarray(4), logical, fail) : plain.subarray(4);
    if (out.length !== logical || crc32(out, fseed) !== plain.readUInt32LE(0)) fail('logical checksum mismatch');
    return out;
  }
  if (codec !== CODEC_RAW) crcF = crc32(payload, crcF);
  if (crcF !== header.readUInt32LE(28)) fail('frame checksum mismatch');
  const out = codec === CODEC_LZ4 ? lz4OrFail(payload, logical, fail) : payload;
  if (out.length !== logical || crc32(out, fseed) !== header.readUInt32LE(12)) fail('logical checksum mismatch');
  return out;
}

/**
 * Check blocks of a CODEC_BLOCKS frame (`frameLogical` bytes) that hold logical bytes
 * [from, to) of the frame: `data` holds those blocks' bytes (from the start of block
 * floor(from / BLOCK_BYTES) to the end of the last), `table` their crc table entries (from that
 * block's). ChecksumError if any block is not the one wanted.
 */
function checkBlocks(objectKey: string, index: number, fseed: number, table: Buffer, data: Buffer, from: number, to: number, frameLogical: number): void {
  const b0 = Math.floor(from / BLOCK_BYTES);
  const b1 = Math.floor((to - 1) / BLOCK_BYTES);
  const dataEnd = Math.min((b1 + 1) * BLOCK_BYTES, frameLogical) - b0 * BLOCK_BYTES;
  if (table.length < (b1 - b0 + 1) * BLOCK_CRC || data.length < dataEnd) throw new ChecksumError(objectKey, index, `blocks ${b0}-${b1}: ${table.length} table and ${data.length} data bytes read`);
  for (let k = b0; k <= b1; k++) {
    const at = (k - b0) * BLOCK_BYTES;
    const block = data.subarray(at, Math.min(at + BLOCK_BYTES, dataEnd));
    if (crc32(block, blockSeed(fseed, k)) !== table.readUInt32LE((k - b0) * BLOCK_CRC)) throw new ChecksumError(objectKey, index, `block ${k} checksum mismatch`);
  }
}

function lz4OrFail(payload: Buffer, logical: number, fail: (why: string) => never): Buffer {
  try { return lz4Decode(payload, logical); } catch (err) { return fail(err instanceof Error ? err.message : String(err)); }
}

/**
 * Copy logical bytes [off, off+len) of an object into out[outOff..] from `stored`, the object's
 * stored bytes [span.start, span.end) (FrameIndex.span): every frame of the span is decoded
 * and checked (decodeFrame) before anything is copied from it.
 */
export function copyFromFrames(objectKey: string, idx: FrameIndex, stored: Buffer, off: number, len: number, out: Buffer, outOff: number, keys: FrameKeys | null): void {
  const { first, last, start } = idx.span(off, len);
  const seed = keySeed(objectKey);
  const F = idx.frameBytes;
  for (let i = first; i <= last; i++) {
    const a = idx.base + idx.ends[i]! - start;
    const b = idx.base + idx.ends[i + 1]! - start;
    const frameStart = i * F;
    const frameLogical = Math.min(F, idx.logical - frameStart);
    const from = Math.max(off, frameStart);
    const to = Math.min(off + len, frameStart + frameLogical);
    const frame = stored.subarray(a, b);
    if (frame.length >= FRAME_HEADER && frame[2] === CODEC_BLOCKS) {
      // Only the blocks the range needs are checked (and the header, which says what the frame is).
      checkBlocksHeader(objectKey, i, seed, frame, frameLogical);
      const b0 = Math.floor((from - frameStart) / BLOCK_BYTES);
      const dataAt = frame.length - frameLogical;
      checkBlocks(objectKey, i, frameSeed(seed, i), frame.subarray(FRAME_HEADER + b0 * BLOCK_CRC, dataAt), frame.subarray(dataAt + b0 * BLOCK_BYTES), from - frameStart, to - frameStart, frameLogical);
      frame.copy(out, outOff + (from - off), dataAt + (from - frameStart), dataAt + (to - frameStart));
      continue;
    }
    const logical = decodeFrame(objectKey, seed, i, frame, frameLogical, keys);
    logical.copy(out, outOff + (from - off), from - frameStart, to - frameStart);
  }
}

/** The header of a frame whose codec byte says CODEC_BLOCKS: checked, and it must be one of `logical` bytes (ChecksumError). */
function checkBlocksHeader(objectKey: string, index: number, seed: number, frame: Buffer, logical: number, stored = frame.length): void {
  const fail = (why: string): never => { throw new ChecksumError(objectKey, index, why); };
  if (frame[0] !== FRAME_MAGIC || frame[1] !== FRAME_VERSION) fail('not a frame header (magic/version)');
  if (crc32(frame.subarray(0, 28), frameSeed(seed, index)) !== frame.readUInt32LE(28)) fail('frame checksum mismatch');
  if (frame[3] !== 0) fail('an encrypted frame in blocks');
  if (frame.readUInt32LE(4) !== logical) fail(`header says ${frame.readUInt32LE(4)} logical bytes, the index ${logical}`);
  if (stored !== blocksStored(logical) || frame.readUInt32LE(8) !== stored - FRAME_HEADER) fail(`a frame in blocks of ${stored} stored bytes for ${logical} logical bytes`);
}

/**
 * A read of part of one frame stored in blocks (CODEC_BLOCKS): the stored ranges of only the
 * crc table entries and the blocks it needs, [tableStart, +tableLength) and [dataStart,
 * +dataLength) of the object. null when it is not such a read (the range spans frames, covers
 * its frame whole, the frame is not blocks-sized) or the object's frames may be encrypted
 * (`encrypted`: then its stored length does not say what a frame is; see the top of the
 * file). The header is not read: the stored length (from metadata under its own check) says
 * the layout, and each block's crc, seeded with the object, frame and block, says the bytes
 * are the ones wanted (copyFromBlocks).
 */
export interface BlockRead {
  tableStart: number;
  tableLength: number;
  dataStart: number;
  dataLength: number;
  frame: number;
  /** The range in the frame's logical bytes. */
  from: number;
  to: number;
  frameLogical: number;
}

export function planBlockRead(idx: FrameIndex, off: number, len: number, encrypted: boolean): BlockRead | null {
  if (encrypted) return null;
  const { first, last } = idx.span(off, len);
  if (first !== last) return null;
  const F = idx.frameBytes;
  const frameStart = first * F;
  const frameLogical = Math.min(F, idx.logical - frameStart);
  const stored = idx.ends[first + 1]! - idx.ends[first]!;
  if (stored !== blocksStored(frameLogical)) return null;
  const from = off - frameStart;
  const to = from + len;
  if (from === 0 && to === frameLogical) return null;
  const b0 = Math.floor(from / BLOCK_BYTES);
  const b1 = Math.floor((to - 1) / BLOCK_BYTES);
  const at = idx.base + idx.ends[first]!;
  const data = at + stored - frameLogical;
  return {
    tableStart: at + FRAME_HEADER + b0 * BLOCK_CRC, tableLength: (b1 - b0 + 1) * BLOCK_CRC,
    dataStart: data + b0 * BLOCK_BYTES, dataLength: Math.min((b1 + 1) * BLOCK_BYTES, frameLogical) - b0 * BLOCK_BYTES,
    frame: first, from, to, frameLogical,
  };
}

/**
 * Block crcs remembered per object (on its FrameIndex), so a 4 KiB random read of a frame in
 * blocks reads only its block: one `pread` or cache lookup instead of two (the crc entries sit
 * at the frame's start, up to 32 KiB away). Only entries a block just passed its check against
 * are remembered (rememberBlockCrcs after copyFromBlocks), a failed check forgets them
 * (forgetBlockCrcs: the next read reads them again from where they are stored), and they only
 * ever check bytes read afresh, seeded with the object and frame: a remembered entry can make
 * a good block fail (then read() reads both again), never a bad one pass. Bounded for the
 * whole process: past BLOCK_CRC_MEMO_BYTES (entries and the indexes they keep alive) every
 * remembered entry is forgotten at once.
 */
const BLOCK_CRC_MEMO_BYTES = 32 * 1024 * 1024;
let blockCrcMemoBytes = 0;
const blockCrcHolders = new Set<FrameIndex>();

/** Where a block read's first block is in its object's remembered crcs (frame by frame, block by block). */
function firstBlockSlot(idx: FrameIndex, r: BlockRead): number {
  return r.frame * (idx.frameBytes / BLOCK_BYTES) + Math.floor(r.from / BLOCK_BYTES);
}

/** The crc entries of a block read, remembered: written into `table` (r.tableLength bytes) and true, or false when any is not. */
export function rememberedBlockCrcs(idx: FrameIndex, r: BlockRead, table: Buffer): boolean {
  const known = idx.blockCrcKnown;
  if (known === null) return false;
  const first = firstBlockSlot(idx, r);
  const n = r.tableLength / BLOCK_CRC;
  for (let k = 0; k < n; k++) if (known[first + k] !== 1) return false;
  const crcs = idx.blockCrcs!;
  for (let k = 0; k < n; k++) table.writeUInt32LE(crcs[first + k]!, k * BLOCK_CRC);
  return true;
}

/** Remember the crc entries of a block read whose blocks just passed their check against `table`. */
export function rememberBlockCrcs(idx: FrameIndex, r: BlockRead, table: Buffer): void {
  if (idx.frameBytes % BLOCK_BYTES !== 0) return; // frames of whole blocks only (all of today's)
  if (idx.blockCrcKnown === null) {
    const blocks = idx.frames * (idx.frameBytes / BLOCK_BYTES);
    // Counted with what holding the index costs (the Set keeps it alive until the next clear).
    const cost = blocks * 5 + idx.ends.byteLength + 256;
    if (blockCrcMemoBytes + cost > BLOCK_CRC_MEMO_BYTES) {
      for (const h of blockCrcHolders) { h.blockCrcs = null; h.blockCrcKnown = null; }
      blockCrcHolders.clear();
      blockCrcMemoBytes = 0;
    }
    idx.blockCrcs = new Uint32Array(blocks);
    idx.blockCrcKnown = new Uint8Array(blocks);
    blockCrcHolders.add(idx);
    blockCrcMemoBytes += cost;
  }
  const first = firstBlockSlot(idx, r);
  const n = r.tableLength / BLOCK_CRC;
  for (let k = 0; k < n; k++) {
    idx.blockCrcs![first + k] = table.readUInt32LE(k * BLOCK_CRC);
    idx.blockCrcKnown[first + k] = 1;
  }
}

/** Forget the remembered crc entries of a block read (a check against them failed). */
export function forgetBlockCrcs(idx: FrameIndex, r: BlockRead): void {
  const known = idx.blockCrcKnown;
  if (known === null) return;
  const first = firstBlockSlot(idx, r);
  known.fill(0, first, first + r.tableLength / BLOCK_CRC);
}

/** Check the blocks of a block read (`table`, `data`: its two ranges' bytes) and copy the range into out[outOff..] (ChecksumError). */
export function copyFromBlocks(objectKey: string, r: BlockRead, table: Buffer, data: Buffer, out: Buffer, outOff: number): void {
  if (table.length !== r.tableLength || data.length !== r.dataLength) throw new ChecksumError(objectKey, r.frame, `${table.length} + ${data.length} bytes read for a block read of ${r.tableLength} + ${r.dataLength}`);
  checkBlocks(objectKey, r.frame, frameSeed(keySeed(objectKey), r.frame), table, data, r.from, r.to, r.frameLogical);
  const at = r.from - Math.floor(r.from / BLOCK_BYTES) * BLOCK_BYTES;
  data.copy(out, outOff, at, at + (r.to - r.from));
}

/**
 * A read of logical bytes [off, off+len) whose frames can be read straight into `out`: every
 * frame of the span lies wholly inside the range and is stored raw-sized or blocks-sized (its
 * header, for a frame in blocks its crc table, and its logical bytes: what plaintext frames
 * that do not shrink are). `parts` is the scatter list for the span's stored bytes, each
 * frame's header (and table) into a buffer of its own and its logical bytes into their place
 * in `out`; null when the span is not like that (then the frames are read and decoded
 * elsewhere first).
 */
export interface DirectRead { parts: Buffer[]; first: number; last: number }

export function planDirectRead(idx: FrameIndex, off: number, len: number, out: Buffer, outOff: number): DirectRead | null {
  const { first, last } = idx.span(off, len);
  const F = idx.frameBytes;
  if (first * F < off || Math.min((last + 1) * F, idx.logical) > off + len) return null;
  let heads = 0;
  for (let i = first; i <= last; i++) {
    const logical = Math.min(F, idx.logical - i * F);
    const stored = idx.ends[i + 1]! - idx.ends[i]!;
    if (stored !== FRAME_HEADER + logical && stored !== blocksStored(logical)) return null;
    heads += stored - logical;
  }
  const headers = Buffer.allocUnsafe(heads);
  const parts: Buffer[] = [];
  let h = 0;
  for (let i = first; i <= last; i++) {
    const logical = Math.min(F, idx.logical - i * F);
    const head = idx.ends[i + 1]! - idx.ends[i]! - logical;
    const at = outOff + (i * F - off);
    parts.push(headers.subarray(h, h += head), out.subarray(at, at + logical));
  }
  return { parts, first, last };
}

/**
 * Check (and, for a frame that was not what its size suggests, decode in place) the frames of
 * a direct read once its parts are filled: ChecksumError as decodeFrame. Before it returns,
 * no byte in `out` may be used.
 */
export function finishDirectRead(objectKey: string, d: DirectRead, keys: FrameKeys | null): void {
  const seed = keySeed(objectKey);
  for (let i = d.first; i <= d.last; i++) {
    const k = 2 * (i - d.first);
    const head = d.parts[k]!;
    const logical = d.parts[k + 1]!;
    if (head.length > FRAME_HEADER && head[2] === CODEC_BLOCKS) {
      // In blocks: the logical bytes are in place, each block checked against its table entry.
      checkBlocksHeader(objectKey, i, seed, head, logical.length, head.length + logical.length);
      checkBlocks(objectKey, i, frameSeed(seed, i), head.subarray(FRAME_HEADER), logical, 0, logical.length, logical.length);
      continue;
    }
    // Raw-sized, or another kind of frame of either size (an encrypted one can be): decoded from
    // its stored bytes; a raw frame's logical bytes are its payload, in place.
    const payload = head.length === FRAME_HEADER ? logical : Buffer.concat([head.subarray(FRAME_HEADER), logical]);
    const decoded = decodeFrameParts(objectKey, seed, i, head.subarray(0, FRAME_HEADER), payload, logical.length, keys);
    if (decoded !== logical) decoded.copy(logical);
  }
}

/**
 * Walk a framed object's bytes without its index (each header gives the next frame's
 * position): the index of a segment found alone in the store (tools, tests).
 */
export function scanFrames(body: Buffer, base = 0): Uint32Array {
  const lengths: number[] = [];
  let at = base;
  while (at < body.length) {
    if (at + FRAME_HEADER > body.length || body[at] !== FRAME_MAGIC) throw new CorruptError(`no frame header at ${at}`);
    const len = FRAME_HEADER + body.readUInt32LE(at + 8);
    lengths.push(len);
    at += len;
  }
  if (at !== body.length) throw new CorruptError('the last frame runs past the end');
  return Uint32Array.from(lengths);
}

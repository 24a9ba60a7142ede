/**
 * Structure-aware input generation: a handshake (client flags, an option sequence) and a
 * transmission phase (bursts of pipelined requests), built from valid frames and then
 * mutated at the field level (magics, lengths that lie, flags, names, counts, limits) or at
 * the byte level (flips, inserts, deletes, truncation). What the server must answer is NOT
 * decided here: the oracle (oracle.ts) re-parses the final bytes as the spec frames them, so
 * a mutation that shifts every later frame is judged correctly.
 *
 * Frames are written with the spec-side writers of test/fixtures/nbd-vectors.ts (never
 * nbd/codec.ts).
 */

import { infoData, metaData, optionFrame, u16, u32, u64 } from '../fixtures/nbd-vectors.js';
import { CF, CMD, INFO, IHAVEOPT, KiB, MAX_PAYLOAD, MAX_STRING, MiB, OPT, REQUEST_MAGIC, allExportNames, laneVolume, type World } from './proto.js';
import { Rng } from './rng.js';

/** One write of the client: `bytes`, delivered in pieces cut at `cuts`; then maybe wait for the replies. */
export interface Send {
  bytes: Buffer;
  /** Offsets inside `bytes` where delivery is split (a turn of the event loop between pieces). */
  cuts: number[];
  /** After this send, wait until every reply the oracle expects for bytes sent so far has arrived. */
  waitAfter: boolean;
  /** After this send, stop reading the socket for this long (a client that does not read its replies). */
  pauseReadMs?: number;
}

/**
 * How the client leaves: 'end' half-closes (shutdown(SHUT_WR), as libnbd does after DISC);
 * 'destroy' closes abruptly (right away, or once the replies arrived); 'wait' does nothing
 * (after DISC or ABORT the server closes; in the handshake without them, its handshake timer
 * must).
 */
export type Ending = 'end' | 'destroy-now' | 'destroy-after' | 'wait';

export interface Input {
  index: number;
  lane: number;
  sends: Send[];
  /** All sends' bytes, back to back (each send's `bytes` is a slice of it). */
  stream: Buffer;
  ending: Ending;
  /** What the generator meant (for failure reports). */
  notes: string[];
}

export interface GenContext {
  world: World;
  index: number;
  lane: number;
}

interface OptionSpec {
  option: number;
  data: Buffer;
  length?: number;
  magic?: bigint;
  note: string;
}

/** 1 MiB of fixed pseudo-random bytes that payloads are cut from (generating every payload byte by byte costs more than the server's work). */
const POOL = new (class { b: Buffer | null = null })();
function pool(): Buffer {
  if (!POOL.b) {
    const r = new Rng(0x9e3779b9, 0x600d);
    POOL.b = r.bytes(MiB);
  }
  return POOL.b;
}

/**
 * Payload bytes: a slice of the pool at a random place, repeated as needed, with a random
 * 4-byte stamp every 512 bytes (so a shifted, misplaced or stale block reads back wrong).
 */
function payload(rng: Rng, n: number): Buffer {
  const src = pool();
  const b = Buffer.allocUnsafe(n);
  const start = rng.int(0, src.length - 1);
  for (let off = 0; off < n;) {
    const from = off === 0 ? start : 0;
    const k = Math.min(src.length - from, n - off);
    src.copy(b, off, from, from + k);
    off += k;
  }
  const stamp = rng.u32();
  for (let off = 0; off + 4 <= n; off += 512) b.writeUInt32LE((stamp ^ Math.imul(off, 0x9e3779b1)) >>> 0, off);
  if (n < 4 && n > 0) rng.bytes(n).copy(b);
  return b;
}

function badUtf8(rng: Rng): Buffer {
  return rng.pick([Buffer.from([0xc3]), Buffer.from([0xff, 0xfe]), Buffer.from([0x66, 0x7a, 0xed, 0xa0, 0x80]), Buffer.from([0xe2, 0x82])]);
}

/** Export names for INFO/GO/EXPORT_NAME/meta contexts. `attach`: the name may become the attached export. */
function genName(rng: Rng, ctx: GenContext, attach: boolean): Buffer {
  const own = laneVolume(ctx.lane);
  const w = ctx.world;
  const others = allExportNames(w).filter((n) => n !== own && n !== w.roName);
  return rng.weighted<() => Buffer>([
    [50, () => Buffer.from(own)],
    [15, () => Buffer.from(w.roName)],
    [5, () => Buffer.alloc(0)],
    [5, () => Buffer.from('nope')],
    [2, () => Buffer.from(own.toUpperCase())],
    [attach ? 0 : 6, () => Buffer.from(rng.pick(others))],
    [5, () => Buffer.from(rng.pick(['bad/x', 'a@', '@', '.x', 'x'.repeat(129), 'fz0@nope', ' fz0', 'ro@s@s']))],
    [2, () => Buffer.concat([Buffer.from(own), Buffer.from([0])])],
    [2, () => Buffer.concat([Buffer.from('fz'), badUtf8(rng)])],
    [1, () => Buffer.alloc(MAX_STRING, 0x61)],
    [1, () => Buffer.alloc(MAX_STRING + 1, 0x61)],
    [1, () => Buffer.from('é'.repeat(rng.int(1, 40)))],
  ])();
}

function genInfoTypes(rng: Rng): number[] {
  return rng.weighted<() => number[]>([
    [30, () => []],
    [25, () => [INFO.BLOCK_SIZE]],
    [15, () => [INFO.BLOCK_SIZE, INFO.NAME, INFO.DESCRIPTION]],
    [20, () => Array.from({ length: rng.int(1, 8) }, () => rng.pick([0, 1, 2, 3, 3, 4, 0x7fff, 0xffff, rng.int(0, 0xffff)]))],
    [2, () => Array.from({ length: rng.int(100, 4000) }, () => rng.int(0, 5))],
    [1, () => Array.from({ length: rng.pick([32765, 32766]) }, () => rng.int(0, 3))],
  ])();
}

function genQueries(rng: Rng): Buffer[] {
  const q = (): Buffer => rng.weighted<() => Buffer>([
    [40, () => Buffer.from('base:allocation')],
    [10, () => Buffer.from('base:')],
    [3, () => Buffer.from('base:allocationx')],
    [3, () => Buffer.from('BASE:allocation')],
    [10, () => Buffer.from(rng.pick(['qemu:dirty-bitmap:b', 'qemu:', 'qemu:allocation-depth']))],
    [5, () => Buffer.alloc(0)],
    [5, () => Buffer.from('x-fuzz:thing')],
    [1, () => Buffer.alloc(MAX_STRING, 0x62)],
    [1, () => Buffer.alloc(MAX_STRING + 1, 0x62)],
    [2, () => Buffer.concat([Buffer.from('base:'), badUtf8(rng)])],
    [1, () => Buffer.from('base:allocation\0')],
  ])();
  return rng.weighted<() => Buffer[]>([
    [20, () => []],
    [55, () => [q()]],
    [20, () => Array.from({ length: rng.int(2, 5) }, q)],
    [2, () => Array.from({ length: rng.int(50, 500) }, q)],
  ])();
}

/** Lie about one length field inside an option payload (the oracle decides what that means). */
function corruptField(rng: Rng, data: Buffer, fieldOffsets: number[], widths: number[]): Buffer {
  if (fieldOffsets.length === 0) return data;
  const i = rng.int(0, fieldOffsets.length - 1);
  const at = fieldOffsets[i]!;
  const w = widths[i]!;
  if (at + w > data.length) return data;
  const b = Buffer.from(data);
  const cur = w === 4 ? b.readUInt32BE(at) : b.readUInt16BE(at);
  const v = rng.pick([cur + 1, cur - 1, cur + rng.int(2, 100), 0, w === 4 ? 0xffffffff : 0xffff, w === 4 ? MAX_STRING + 1 : 0x8000, rng.u32()]);
  if (w === 4) b.writeUInt32BE(v >>> 0, at); else b.writeUInt16BE(v & 0xffff, at);
  return b;
}

/** INFO/GO data (§1.3) written in place (the fixture's writer concatenates one buffer per u16: slow for 32K of them). */
function infoDataFast(name: Buffer, infos: readonly number[]): Buffer {
  if (infos.length < 64) return infoData(name, infos);
  const b = Buffer.allocUnsafe(6 + name.length + 2 * infos.length);
  b.writeUInt32BE(name.length, 0);
  name.copy(b, 4);
  b.writeUInt16BE(infos.length & 0xffff, 4 + name.length);
  infos.forEach((t, i) => b.writeUInt16BE(t, 6 + name.length + 2 * i));
  return b;
}

function infoOption(rng: Rng, ctx: GenContext, option: number, attach: boolean): OptionSpec {
  const name = genName(rng, ctx, attach);
  const infos = genInfoTypes(rng);
  let data = infoDataFast(name, infos);
  let note = `${option === OPT.GO ? 'GO' : 'INFO'}(${name.length > 40 ? `${name.length}-byte name` : JSON.stringify(name.toString('latin1'))}, infos=${infos.length > 8 ? `${infos.length} types` : `[${infos.join(',')}]`})`;
  if (rng.chance(0.08)) {
    data = corruptField(rng, data, [0, 4 + name.length], [4, 2]);
    note += ' lying-length';
  } else if (rng.chance(0.04)) {
    data = Buffer.concat([data, rng.bytes(rng.int(1, 5))]);
    note += ' trailing-bytes';
  } else if (rng.chance(0.03)) {
    data = data.subarray(0, rng.int(0, Math.min(data.length - 1, 7)));
    note += ' short';
  }
  return { option, data, note };
}

function metaOption(rng: Rng, ctx: GenContext, option: number): OptionSpec {
  const name = genName(rng, ctx, false);
  const queries = genQueries(rng);
  let data = metaData(name, queries);
  let note = `${option === OPT.SET_META ? 'SET_META' : 'LIST_META'}(${JSON.stringify(name.length > 40 ? `${name.length}-byte name` : name.toString('latin1'))}, ${queries.length > 5 ? `${queries.length} queries` : JSON.stringify(queries.map((q) => (q.length > 40 ? `${q.length} bytes` : q.toString('latin1'))))})`;
  if (rng.chance(0.1)) {
    const offs = [0, 4 + name.length];
    const ws = [4, 4];
    let off = 8 + name.length;
    for (const q of queries) { offs.push(off); ws.push(4); off += 4 + q.length; }
    data = corruptField(rng, data, offs, ws);
    note += ' lying-length';
  } else if (rng.chance(0.04)) {
    data = Buffer.concat([data, rng.bytes(rng.int(1, 5))]);
    note += ' trailing-bytes';
  } else if (rng.chance(0.03)) {
    data = data.subarray(0, rng.int(0, Math.min(data.length - 1, 9)));
    note += ' short';
  }
  return { option, data, note };
}

function simpleOption(rng: Rng, option: number, name: string): OptionSpec {
  const data = rng.chance(0.07) ? rng.bytes(rng.int(1, 12)) : Buffer.alloc(0);
  return { option, data, note: `${name}${data.length ? `+${data.length}B` : ''}` };
}

function unknownOption(rng: Rng, limits: World['limits']): OptionSpec {
  const option = rng.pick([0, OPT.PEEK_EXPORT, OPT.STARTTLS, OPT.EXTENDED_HEADERS, 12, 13, 0x7654321, 0x80000000, 0xffffffff, rng.u32()]);
  const len = rng.weighted<() => number>([
    [80, () => rng.int(0, 64)],
    [10, () => rng.int(65, 4096)],
    [3, () => limits.maxOptionLength],
    [2, () => limits.maxOptionLength - 1],
  ])();
  return { option, data: rng.bytes(len), note: `opt${option >>> 0}(${len}B)` };
}

function randomOption(rng: Rng, ctx: GenContext, attach: boolean): OptionSpec {
  return rng.weighted<() => OptionSpec>([
    [14, () => simpleOption(rng, OPT.STRUCTURED_REPLY, 'STRUCTURED_REPLY')],
    [8, () => simpleOption(rng, OPT.LIST, 'LIST')],
    [16, () => infoOption(rng, ctx, OPT.INFO, false)],
    [attach ? 8 : 0, () => infoOption(rng, ctx, OPT.GO, true)],
    [14, () => metaOption(rng, ctx, OPT.SET_META)],
    [8, () => metaOption(rng, ctx, OPT.LIST_META)],
    [10, () => unknownOption(rng, ctx.world.limits)],
    [1, () => simpleOption(rng, OPT.ABORT, 'ABORT')],
  ])();
}

function frameOf(rng: Rng, o: OptionSpec, limits: World['limits']): { bytes: Buffer; note: string } {
  let note = o.note;
  let length = o.length ?? o.data.length;
  let magic: bigint | undefined = o.magic;
  let data = o.data;
  const r = rng.float();
  if (r < 0.015) { magic = IHAVEOPT ^ (1n << BigInt(rng.int(0, 63))); note += ' bad-magic'; }
  else if (r < 0.03) { length = Math.max(0, length + rng.pick([-1, 1, 2, -3, 7])); note += ` header-length=${length}`; }
  else if (r < 0.04) {
    length = rng.pick([limits.maxOptionLength + 1, limits.maxOptionLength + 1000, 0x7fffffff, 0xffffffff]);
    data = data.subarray(0, Math.min(data.length, 64));
    note += ` header-length=${length}(over the limit)`;
  }
  const frame = optionFrame(o.option, data, length);
  if (magic !== undefined) frame.writeBigUInt64BE(magic, 0);
  return { bytes: frame, note };
}

// ------------------------------------------------------------------ transmission

interface ReqCtx {
  size: number;
  cookie: number;
  cookieHigh: number;
}

function genLength(rng: Rng, type: number, size: number): number {
  const rw = type === CMD.READ || type === CMD.WRITE;
  if (rw) {
    return rng.weighted<() => number>([
      [14, () => rng.int(1, 16)],
      [45, () => 512 * rng.int(1, 32)],
      [24, () => rng.int(1, 32 * KiB)],
      [6, () => rng.int(32 * KiB, MiB)],
      [0.8, () => rng.int(MiB, 4 * MiB)],
      [3, () => 0],
      // At the payload limit: costly, so rare; past it: cheap (refused, or the connection ends).
      [type === CMD.READ ? 0.15 : 0.04, () => rng.pick([MAX_PAYLOAD - 1, MAX_PAYLOAD, MAX_PAYLOAD - 512])],
      [type === CMD.READ ? 1 : 0.3, () => rng.pick([MAX_PAYLOAD + 1, MAX_PAYLOAD + 512, 0xffffffff, 0x80000000])],
    ])();
  }
  return rng.weighted<() => number>([
    [40, () => rng.pick([512 * rng.int(1, 256), rng.int(1, 128 * KiB)])],
    [25, () => rng.int(1, size)],
    [10, () => rng.pick([0xffffffff, 0x80000000, rng.int(size, 0xffffffff)])],
    [5, () => 0],
    [5, () => size],
    [3, () => rng.pick([MAX_PAYLOAD, MAX_PAYLOAD + 1])],
  ])();
}

function genOffset(rng: Rng, size: number, length: number): bigint {
  const fit = Math.max(0, size - Math.min(length, size));
  return rng.weighted<() => bigint>([
    [45, () => BigInt(512 * rng.int(0, Math.floor(fit / 512)))],
    [20, () => BigInt(rng.int(0, fit))],
    [12, () => BigInt(Math.max(0, size - length + rng.pick([0, 0, 1, -1, 512, -512])))],
    [7, () => 0n],
    [3, () => BigInt(size)],
    [5, () => rng.pick([BigInt(size + 512), 1n << 32n, (1n << 32n) - 512n, 1n << 63n, (1n << 64n) - 1n, (1n << 64n) - BigInt(Math.max(1, length)), BigInt(Number.MAX_SAFE_INTEGER) + 1n])],
  ])();
}

function genFlags(rng: Rng, type: number): number {
  let f = 0;
  if (rng.chance(0.3)) f |= CF.FUA;
  if (type === CMD.READ && rng.chance(0.15)) f |= CF.DF;
  if (type === CMD.WRITE_ZEROES) { if (rng.chance(0.4)) f |= CF.NO_HOLE; if (rng.chance(0.3)) f |= CF.FAST_ZERO; }
  if (type === CMD.BLOCK_STATUS && rng.chance(0.5)) f |= CF.REQ_ONE;
  const r = rng.float();
  if (r < 0.05) f |= rng.pick([CF.NO_HOLE, CF.DF, CF.REQ_ONE, CF.FAST_ZERO, CF.PAYLOAD_LEN, 0x40, 0x8000]);
  else if (r < 0.07) f = rng.int(0, 0xffff);
  return f;
}

export interface GenRequest { bytes: Buffer[]; note: string; oversizeWrite: boolean }

function genRequest(rng: Rng, rc: ReqCtx, blockStatusLikely: boolean): GenRequest {
  const type = rng.weighted<() => number>([
    [28, () => CMD.READ],
    [26, () => CMD.WRITE],
    [7, () => CMD.FLUSH],
    [7, () => CMD.TRIM],
    [9, () => CMD.WRITE_ZEROES],
    [5, () => CMD.CACHE],
    [blockStatusLikely ? 16 : 4, () => CMD.BLOCK_STATUS],
    [3, () => rng.pick([CMD.RESIZE, 9, 0x100, 0xffff, rng.int(9, 0xffff)])],
  ])();
  let length = type === CMD.FLUSH ? (rng.chance(0.05) ? rng.int(1, 4096) : 0) : genLength(rng, type, rc.size);
  let offset = type === CMD.FLUSH ? (rng.chance(0.05) ? BigInt(rng.int(1, rc.size)) : 0n) : genOffset(rng, rc.size, length);
  if (type >= 8 && rng.chance(0.5)) { length = 0; offset = 0n; }
  const flags = genFlags(rng, type);
  const cookie = Buffer.alloc(8);
  cookie.writeUInt32BE(rc.cookieHigh, 0);
  cookie.writeUInt32BE(rc.cookie++, 4);
  const hdr = Buffer.concat([u32(REQUEST_MAGIC), u16(flags), u16(type), cookie, u64(offset), u32(length)]);
  const name = ({ 0: 'READ', 1: 'WRITE', 3: 'FLUSH', 4: 'TRIM', 5: 'CACHE', 6: 'WZ', 7: 'BS' } as Record<number, string>)[type] ?? `cmd${type}`;
  const note = `${name}(flags=0x${flags.toString(16)}, off=${offset}, len=${length})`;
  if (type === CMD.WRITE) {
    if (length > MAX_PAYLOAD) return { bytes: [hdr, rng.bytes(rng.int(0, 512))], note, oversizeWrite: true };
    return { bytes: [hdr, payload(rng, length)], note, oversizeWrite: false };
  }
  return { bytes: [hdr], note, oversizeWrite: false };
}

function discFrame(rng: Rng, rc: ReqCtx, clean = false): Buffer {
  const odd = !clean && rng.chance(0.1);
  const cookie = Buffer.alloc(8);
  cookie.writeUInt32BE(rc.cookieHigh, 0);
  cookie.writeUInt32BE(rc.cookie++, 4);
  return Buffer.concat([u32(REQUEST_MAGIC), u16(odd ? rng.int(0, 0xffff) : 0), u16(CMD.DISC), cookie, u64(odd ? rng.u64() : 0n), u32(odd ? rng.u32() : 0)]);
}

// ------------------------------------------------------------------ whole inputs

function cutsFor(rng: Rng, n: number): number[] {
  if (n <= 1) return [];
  const r = rng.float();
  if (r < 0.72) return [];
  if (r < 0.95 || n > 4096) {
    const k = rng.int(1, 6);
    const cuts = new Set<number>();
    for (let i = 0; i < k; i++) cuts.add(rng.int(1, n - 1));
    return [...cuts].sort((a, b) => a - b);
  }
  const cuts: number[] = [];
  for (let at = rng.int(1, 7); at < n; at += rng.int(1, 7)) cuts.push(at);
  return cuts;
}

interface Script { sends: Send[]; notes: string[]; parts: Buffer[][] }

/** A send made of `parts` (concatenated once, with every other send, by finish()). */
function push(s: Script, rng: Rng, parts: Buffer[], waitAfter: boolean): void {
  const n = parts.reduce((k, b) => k + b.length, 0);
  if (n === 0) return;
  s.sends.push({ bytes: Buffer.alloc(0), cuts: cutsFor(rng, n), waitAfter });
  s.parts.push(parts);
}

/** One copy of all bytes; sends become slices of it. */
function finish(s: Script): Buffer {
  const stream = Buffer.concat(s.parts.flat());
  let pos = 0;
  s.sends.forEach((x, i) => {
    const n = s.parts[i]!.reduce((k, b) => k + b.length, 0);
    x.bytes = stream.subarray(pos, pos + n);
    pos += n;
  });
  s.parts = [];
  return stream;
}

/** Client flags: mostly what real clients send; sometimes no FIXED_NEWSTYLE, unknown bits, or garbage. */
function genClientFlags(rng: Rng): number {
  return rng.weighted<() => number>([
    [78, () => 0x3],
    [10, () => 0x1],
    [4, () => 0x0],
    [3, () => 0x2],
    [3, () => rng.pick([0x4, 0x7, 0x80000003, 0x100])],
    [2, () => rng.u32()],
  ])();
}

/** Option sequences real clients send (notes §2.6), then random ones. */
function genOptions(rng: Rng, ctx: GenContext): OptionSpec[] {
  const own = Buffer.from(laneVolume(ctx.lane));
  const target = rng.chance(0.8) ? own : Buffer.from(ctx.world.roName);
  const sr: OptionSpec = { option: OPT.STRUCTURED_REPLY, data: Buffer.alloc(0), note: 'STRUCTURED_REPLY' };
  const setMeta = (n: Buffer): OptionSpec => ({ option: OPT.SET_META, data: metaData(n, ['base:allocation']), note: `SET_META(${n}, [base:allocation])` });
  const go = (n: Buffer, infos: number[]): OptionSpec => ({ option: OPT.GO, data: infoData(n, infos), note: `GO(${n}, [${infos}])` });
  return rng.weighted<() => OptionSpec[]>([
    // qemu 7.2
    [14, () => [sr, setMeta(target), go(target, [INFO.BLOCK_SIZE])]],
    // nbdinfo
    [5, () => [sr, { option: OPT.INFO, data: infoData(target, [3, 1, 2]), note: 'INFO(target,[3,1,2])' }, { option: OPT.LIST_META, data: metaData(target, []), note: 'LIST_META(target,[])' }, go(target, [3, 1, 2])]],
    // kernel nbd-client
    [8, () => [go(target, [])]],
    // libnbd tools, fio
    [6, () => [sr, go(target, [INFO.BLOCK_SIZE])]],
    // old clients
    [5, () => [{ option: OPT.EXPORT_NAME, data: target, note: `EXPORT_NAME(${target})` }]],
    [3, () => [sr, { option: OPT.EXPORT_NAME, data: target, note: `EXPORT_NAME(${target})` }]],
    // random prefix, then one of the above endings
    [45, () => {
      const n = rng.weighted<() => number>([[30, () => 0], [50, () => rng.int(1, 4)], [15, () => rng.int(5, 12)], [5, () => rng.int(13, 40)]])();
      const opts = Array.from({ length: n }, () => randomOption(rng, ctx, true));
      const end = rng.weighted<() => OptionSpec[]>([
        [50, () => [infoOption(rng, ctx, OPT.GO, true)]],
        [20, () => (rng.chance(0.5) ? [sr, setMeta(target), go(target, [3])] : [setMeta(target), go(target, [])])],
        [8, () => [{ option: OPT.EXPORT_NAME, data: rng.chance(0.8) ? target : genName(rng, ctx, true), note: 'EXPORT_NAME' }]],
        [8, () => [simpleOption(rng, OPT.ABORT, 'ABORT')]],
        [14, () => []],
      ])();
      return [...opts, ...end];
    }],
    // the option-count limit: maxOptions-1, maxOptions, maxOptions+1 options before GO
    [3, () => {
      const n = ctx.world.limits.maxOptions + rng.pick([-2, -1, 0, 1]);
      const filler = (): OptionSpec => (rng.chance(0.5) ? { option: OPT.LIST, data: Buffer.alloc(0), note: 'LIST' } : { option: 0x7654321, data: Buffer.alloc(0), note: 'unknown' });
      return [...Array.from({ length: n - 1 }, filler), go(target, [])];
    }],
    // repeats
    [4, () => [sr, sr, setMeta(target), setMeta(target), go(target, [3])]],
    [3, () => [setMeta(target), sr, go(target, [])]],
    [3, () => [sr, setMeta(target), { option: OPT.SET_META, data: metaData(target, []), note: 'SET_META(target,[])' }, go(target, [])]],
    [3, () => [sr, setMeta(Buffer.from(ctx.world.roName)), go(own, [])]],
  ])();
}

export function generate(rng: Rng, ctx: GenContext): Input {
  const s: Script = { sends: [], notes: [], parts: [] };
  const limits = ctx.world.limits;
  const flags = genClientFlags(rng);
  s.notes.push(`client flags 0x${(flags >>> 0).toString(16)}`);
  const options = genOptions(rng, ctx);
  // Long sequences go out pipelined (a round trip per option would outlast the handshake timer on a loaded machine).
  const pipelineOptions = rng.chance(0.5) || options.length > 16;
  const hs: Buffer[] = [u32(flags)];
  for (const o of options) {
    const f = frameOf(rng, o, limits);
    hs.push(f.bytes);
    s.notes.push(f.note);
  }
  if (pipelineOptions) push(s, rng, hs, true);
  else for (const b of hs) push(s, rng, [b], true);

  // Transmission: bursts of pipelined requests (harmless if the handshake did not end in GO:
  // then the oracle reads them as options, as the server must).
  const size = ctx.world.laneSize;
  const rc: ReqCtx = { size, cookie: 1, cookieHigh: rng.u32() };
  const withTransmission = rng.chance(0.85);
  let ending: Ending;
  if (withTransmission) {
    const bursts = rng.weighted<() => number>([[40, () => 1], [35, () => 2], [20, () => 3], [5, () => rng.int(4, 8)]])();
    const bsLikely = options.some((o) => o.option === OPT.SET_META);
    let stop = false;
    for (let b = 0; b < bursts && !stop; b++) {
      const n = rng.weighted<() => number>([
        // Past maxInflight now and then: the server must stop reading, not fail.
        [35, () => 1], [50, () => rng.int(2, 6)], [12, () => rng.int(7, 20)], [3, () => rng.int(limits.maxInflight - 2, limits.maxInflight * 4)],
      ])();
      const parts: Buffer[] = [];
      let bytes = 0;
      if (rng.chance(0.004)) {
        // Past the in-flight byte bound: several large WRITEs and READs pipelined at once.
        const k = rng.int(2, 5);
        for (let i = 0; i < k; i++) {
          const len = rng.int(4 * MiB, 12 * MiB) & ~511;
          const off = BigInt(rng.int(0, Math.floor((size - len) / 512)) * 512);
          const type = rng.chance(0.5) ? CMD.WRITE : CMD.READ;
          const cookie = Buffer.alloc(8);
          cookie.writeUInt32BE(rc.cookieHigh, 0);
          cookie.writeUInt32BE(rc.cookie++, 4);
          parts.push(Buffer.concat([u32(REQUEST_MAGIC), u16(0), u16(type), cookie, u64(off), u32(len)]));
          if (type === CMD.WRITE) parts.push(payload(rng, len));
          bytes += len;
          s.notes.push(`  [burst ${b}] big ${type === CMD.WRITE ? 'WRITE' : 'READ'}(off=${off}, len=${len})`);
        }
      }
      for (let i = 0; i < n; i++) {
        const r = genRequest(rng, rc, bsLikely);
        // Keep one input's payload bounded (a 32 MiB WRITE is allowed, a burst of them rarely).
        const rl = r.bytes.reduce((k, x) => k + x.length, 0);
        if (bytes + rl > 80 * MiB) break;
        parts.push(...r.bytes);
        bytes += rl;
        s.notes.push(`  [burst ${b}] ${r.note}`);
        if (r.oversizeWrite) { stop = true; break; }
        if (rng.chance(0.004)) {
          parts.push(Buffer.concat([u32(REQUEST_MAGIC ^ (1 << rng.int(0, 31))), rng.bytes(24)]));
          s.notes.push(`  [burst ${b}] bad request magic`);
          stop = true;
          break;
        }
      }
      const last = b === bursts - 1 || stop;
      if (last && !stop && rng.chance(0.6)) {
        parts.push(discFrame(rng, rc));
        s.notes.push('  DISC');
        if (rng.chance(0.1)) { parts.push(rng.bytes(rng.int(1, 64))); s.notes.push('  garbage after DISC'); }
      }
      push(s, rng, parts, !last);
      if (!last && rng.chance(0.03)) s.sends[s.sends.length - 1]!.pauseReadMs = rng.int(20, 200);
    }
    if (rng.chance(0.02)) {
      // A client that does not read its replies for a while (the server must stop reading, not buffer).
      const last = s.sends[s.sends.length - 1];
      if (last) last.pauseReadMs = rng.int(50, 300);
    }
    ending = rng.weighted<() => Ending>([[55, () => 'end'], [20, () => 'wait'], [12, () => 'destroy-now'], [13, () => 'destroy-after']])();
  } else {
    ending = rng.weighted<() => Ending>([[40, () => 'end'], [35, () => 'wait'], [12, () => 'destroy-now'], [13, () => 'destroy-after']])();
  }

  // Stream-level mutations: truncation at any point, byte flips and splices.
  let stream = finish(s);
  const r = rng.float();
  if (r < 0.06) stream = truncate(rng, s, stream);
  else if (r < 0.13) stream = mutateBytes(rng, s, stream);
  s.notes.push(`ending: ${ending}`);
  return { index: ctx.index, lane: ctx.lane, sends: s.sends, stream, ending, notes: s.notes };
}

/** Cut the stream at a random byte (truncation at every point, over many inputs). */
function truncate(rng: Rng, s: Script, stream: Buffer): Buffer {
  const n = stream.length;
  if (n === 0) return stream;
  const at = rng.int(0, n - 1);
  let pos = 0;
  const out: Send[] = [];
  for (const x of s.sends) {
    if (pos + x.bytes.length <= at) { out.push(x); pos += x.bytes.length; continue; }
    const keep = at - pos;
    if (keep > 0) out.push({ bytes: x.bytes.subarray(0, keep), cuts: x.cuts.filter((c) => c < keep), waitAfter: false });
    break;
  }
  s.sends = out;
  s.notes.push(`truncated at byte ${at} of ${n}`);
  return stream.subarray(0, at);
}

/** A few byte-level mutations anywhere in the stream; the result goes out as one pipelined send. */
function mutateBytes(rng: Rng, s: Script, stream: Buffer): Buffer {
  let b = stream;
  if (b.length === 0) return b;
  const k = rng.int(1, 4);
  for (let i = 0; i < k && b.length > 0; i++) {
    const at = rng.int(0, b.length - 1);
    const op = rng.int(0, 5);
    if (op <= 1) { b = Buffer.from(b); b[at] = b[at]! ^ (1 << rng.int(0, 7)); s.notes.push(`bit flip at ${at}`); }
    else if (op === 2) { b = Buffer.from(b); b[at] = rng.pick([0, 0xff, 0x7f, 0x80, 1]); s.notes.push(`byte set at ${at}`); }
    else if (op === 3) { const ins = rng.bytes(rng.int(1, 8)); b = Buffer.concat([b.subarray(0, at), ins, b.subarray(at)]); s.notes.push(`${ins.length} bytes inserted at ${at}`); }
    else if (op === 4) { const n = rng.int(1, Math.min(16, b.length - at)); b = Buffer.concat([b.subarray(0, at), b.subarray(at + n)]); s.notes.push(`${n} bytes deleted at ${at}`); }
    else { const n = rng.int(1, Math.min(28, b.length - at)); b = Buffer.concat([b.subarray(0, at + n), b.subarray(at, at + n), b.subarray(at + n)]); s.notes.push(`${n} bytes duplicated at ${at}`); }
  }
  s.sends = [{ bytes: b, cuts: cutsFor(rng, b.length), waitAfter: false }];
  return b;
}

// ------------------------------------------------------------------ the well-behaved client

/**
 * A session of a client that follows every rule: a qemu- or kernel-like handshake on the
 * victim export, then bursts of valid, non-overlapping requests (waiting for each burst's
 * replies), then DISC. Every request must succeed and every read must verify.
 */
export function generateWellBehaved(rng: Rng, world: World, index: number): Input {
  const name = Buffer.from(world.victimName);
  const size = world.victimSize;
  const notes: string[] = [];
  const sc: Script = { sends: [], notes, parts: [] };
  const structured = rng.chance(0.5);
  const hs: Buffer[] = [u32(0x3)];
  if (structured) {
    hs.push(optionFrame(OPT.STRUCTURED_REPLY));
    hs.push(optionFrame(OPT.SET_META, metaData(name, ['base:allocation'])));
    hs.push(optionFrame(OPT.GO, infoData(name, [INFO.BLOCK_SIZE])));
  } else {
    hs.push(optionFrame(OPT.GO, infoData(name, [])));
  }
  notes.push(structured ? 'structured (qemu-like)' : 'simple (kernel-like)');
  for (const b of hs) push(sc, rng, [b], true);
  const rc: ReqCtx = { size, cookie: 1, cookieHigh: rng.u32() };
  const bursts = rng.int(3, 8);
  const slot = 64 * KiB;
  const slots = Math.floor(size / slot);
  for (let b = 0; b < bursts; b++) {
    const n = rng.int(1, 4);
    const used = new Set<number>();
    const parts: Buffer[] = [];
    for (let i = 0; i < n; i++) {
      let s = rng.int(0, slots - 1);
      while (used.has(s)) s = (s + 1) % slots;
      used.add(s);
      const type = rng.weighted<() => number>([
        [40, () => CMD.WRITE], [35, () => CMD.READ], [8, () => CMD.WRITE_ZEROES], [7, () => CMD.FLUSH], [3, () => CMD.TRIM], [structured ? 7 : 0, () => CMD.BLOCK_STATUS],
      ])();
      const length = type === CMD.FLUSH ? 0 : rng.chance(0.6) ? 512 * rng.int(1, slot / 512) : rng.int(1, slot);
      const offset = type === CMD.FLUSH ? 0n : BigInt(s * slot + (rng.chance(0.7) ? 0 : rng.int(0, slot - length)));
      let flags = 0;
      if (type !== CMD.FLUSH && type !== CMD.READ && type !== CMD.BLOCK_STATUS && rng.chance(0.3)) flags |= CF.FUA;
      if (type === CMD.WRITE_ZEROES && rng.chance(0.5)) flags |= CF.NO_HOLE;
      if (type === CMD.BLOCK_STATUS && rng.chance(0.5)) flags |= CF.REQ_ONE;
      const cookie = Buffer.alloc(8);
      cookie.writeUInt32BE(rc.cookieHigh, 0);
      cookie.writeUInt32BE(rc.cookie++, 4);
      const hdr = Buffer.concat([u32(REQUEST_MAGIC), u16(flags), u16(type), cookie, u64(offset), u32(length)]);
      parts.push(hdr);
      if (type === CMD.WRITE) parts.push(payload(rng, length));
      notes.push(`  [burst ${b}] cmd ${type} off=${offset} len=${length} flags=${flags}`);
    }
    push(sc, rng, parts, true);
  }
  push(sc, rng, [discFrame(rng, rc, true)], false);
  const stream = finish(sc);
  return { index, lane: -1, sends: sc.sends, stream, ending: rng.chance(0.5) ? 'end' : 'wait', notes };
}

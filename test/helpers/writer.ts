/**
 * A crash-test writer over the hand-written RawClient (test/helpers/nbd-raw.ts): it writes
 * self-describing blocks, flushes every k writes, and keeps, for every block, exactly what a
 * correct server may return after a crash (notes/nbd-protocol.md §3).
 *
 * Block format (BLOCK = 4 KiB, every write is block-aligned):
 *
 *   0..8     "BTNCRSH1"
 *   8..12    u32 BE block index          (a misdirected write is caught)
 *   12..16   u32 BE generation           (which write produced these bytes)
 *   16..20   u32 BE salt                 (which model/volume wrote it)
 *   20..4092 fill derived from (index, generation, salt)
 *   4092..   u32 BE crc32 of bytes 0..4092 (a torn or garbled block is caught)
 *
 * A block that reads as all zeroes is "zero": the fresh volume, or a WRITE_ZEROES.
 *
 * The model (BlockModel), per block:
 * - `acked`: the newest generation known durable: covered by an acknowledged FLUSH (every
 *   write REPLIED TO before that FLUSH was sent) or acknowledged with FUA.
 * - `pending`: every generation SENT after `acked` (replied to or not, its flush failed or
 *   never came): each may or may not have reached the store.
 * After a crash a block must read as `acked` or one of `pending`: never older than acked
 * (a false acknowledgement), never anything else (garbage, a foreign block).
 *
 * The writer keeps at most one write in flight per block, so a block's generations are
 * applied in the order they were sent and the allowed set is exact. A failed FLUSH (EIO) drops
 * no coverage: its writes stay pending, and the next successful FLUSH covers them (it covers
 * every write replied to before it was sent), which is the "fsyncgate" check: a FLUSH that
 * succeeds after an EIO one must still make the earlier data durable.
 */

import { crc32 } from 'node:zlib';
import { NBD_EIO as EIO } from '../../nbd/constants.js';
import { seededRandom } from '../../src/store/decorators.js';
import {
  ClosedError, CMD, CMD_FLAG_FUA, RawClient, ReadTimeoutError, SIMPLE_REPLY_MAGIC, TFLAG, requestFrame,
} from './nbd-raw.js';

export const BLOCK = 4096;
const MAGIC = Buffer.from('BTNCRSH1', 'latin1');
const HDR = 20;
const CRC_AT = BLOCK - 4;
const FILL_WORDS = (CRC_AT - HDR) / 4;
const ZERO_BLOCK = Buffer.alloc(BLOCK);

// ------------------------------------------------------------------ seeded randomness

export const rngFrom = seededRandom;

export const randInt = (rng: () => number, lo: number, hi: number): number => lo + Math.floor(rng() * (hi - lo + 1));

// ------------------------------------------------------------------ block stamps

/** A buffer for `blocks` blocks whose memory is 4-byte aligned (stampBlock fills through a Uint32Array). */
export function allocBlocks(blocks: number): Buffer {
  return Buffer.from(new ArrayBuffer(blocks * BLOCK));
}

/** Write block `index` at generation `gen` into `out` (from allocBlocks) at `at`. */
export function stampBlock(out: Buffer, at: number, index: number, gen: number, salt: number): void {
  MAGIC.copy(out, at);
  out.writeUInt32BE(index >>> 0, at + 8);
  out.writeUInt32BE(gen >>> 0, at + 12);
  out.writeUInt32BE(salt >>> 0, at + 16);
  // xorshift32 seeded from the stamp: cheap, and differs for every (index, gen, salt). The
  // fill is only ever checked through the crc, so its byte order does not matter.
  const words = new Uint32Array(out.buffer, out.byteOffset + at + HDR, FILL_WORDS);
  let x = (Math.imul(index + 1, 0x9e3779b1) ^ Math.imul(gen + 1, 0x85ebca6b) ^ salt ^ 0x2545f491) >>> 0 || 1;
  for (let i = 0; i < FILL_WORDS; i++) {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    words[i] = x;
  }
  out.writeUInt32BE(crc32(out.subarray(at, at + CRC_AT)) >>> 0, at + CRC_AT);
}

export type Decoded =
  | { kind: 'zero' }
  | { kind: 'block'; index: number; gen: number; salt: number }
  | { kind: 'garbage'; why: string };

/** Decode one block read back, independently of any model. */
export function decodeBlock(b: Buffer): Decoded {
  if (b.length !== BLOCK) return { kind: 'garbage', why: `length ${b.length}` };
  if (b.equals(ZERO_BLOCK)) return { kind: 'zero' };
  if (!b.subarray(0, 8).equals(MAGIC)) return { kind: 'garbage', why: `no stamp (starts ${b.subarray(0, 16).toString('hex')})` };
  const crc = crc32(b.subarray(0, CRC_AT)) >>> 0;
  if (crc !== b.readUInt32BE(CRC_AT)) {
    return { kind: 'garbage', why: `crc mismatch (stamp says block ${b.readUInt32BE(8)} gen ${b.readUInt32BE(12)}): torn or corrupted` };
  }
  return { kind: 'block', index: b.readUInt32BE(8), gen: b.readUInt32BE(12), salt: b.readUInt32BE(16) };
}

// ------------------------------------------------------------------ the model

export interface Problem {
  block: number;
  kind: 'garbage' | 'stale' | 'unexpected' | 'wrong-block' | 'foreign' | 'read-error';
  detail: string;
  /** Generations allowed (0 and zero-writes read as zeroes). */
  allowed: number[];
}

export class BlockModel {
  readonly acked: Uint32Array;
  readonly pending: (number[] | undefined)[];
  /** Generations that were WRITE_ZEROES (gen 0, the fresh volume, reads as zeroes too). */
  readonly zeroGens = new Set<number>([0]);
  nextGen = 1;

  constructor(readonly blocks: number, readonly salt: number) {
    this.acked = new Uint32Array(blocks);
    this.pending = new Array(blocks).fill(undefined);
  }

  allowed(b: number): number[] {
    return [this.acked[b]!, ...(this.pending[b] ?? [])];
  }

  /** A write of `gen` to block b was sent. */
  sent(b: number, gen: number): void {
    const p = this.pending[b];
    if (p) p.push(gen);
    else this.pending[b] = [gen];
  }

  /** Block b is durable at least at `gen`. */
  durable(b: number, gen: number): void {
    if (gen <= this.acked[b]!) return;
    this.acked[b] = gen;
    const p = this.pending[b];
    if (p) {
      const rest = p.filter((g) => g > gen);
      this.pending[b] = rest.length > 0 ? rest : undefined;
    }
  }

  /** Blocks that still have generations whose durability is unknown. */
  pendingBlocks(): number {
    let n = 0;
    for (const p of this.pending) if (p) n++;
    return n;
  }

  /**
   * Check one block read back. Returns the generation it holds (for a zero block: the newest
   * allowed zero generation) or a Problem.
   */
  check(b: number, data: Buffer): { gen: number } | Problem {
    const allowed = this.allowed(b);
    const d = decodeBlock(data);
    if (d.kind === 'garbage') return { block: b, kind: 'garbage', detail: d.why, allowed };
    if (d.kind === 'zero') {
      const z = allowed.filter((g) => this.zeroGens.has(g));
      if (z.length > 0) return { gen: Math.max(...z) };
      return { block: b, kind: 'stale', detail: `reads as zeroes; acknowledged generation ${this.acked[b]} is lost`, allowed };
    }
    if (d.salt !== this.salt) return { block: b, kind: 'foreign', detail: `salt ${d.salt.toString(16)} is not this writer's ${this.salt.toString(16)}`, allowed };
    if (d.index !== b) return { block: b, kind: 'wrong-block', detail: `holds block ${d.index} gen ${d.gen} (misdirected)`, allowed };
    if (allowed.includes(d.gen)) return { gen: d.gen };
    if (d.gen < this.acked[b]!) {
      return { block: b, kind: 'stale', detail: `holds generation ${d.gen}, older than the acknowledged ${this.acked[b]}: an acknowledged flush was lost`, allowed };
    }
    return { block: b, kind: 'unexpected', detail: `holds generation ${d.gen}, never written to this block after its acknowledged ${this.acked[b]}`, allowed };
  }

  // Flush coverage lives in the model, not in one connection: a FLUSH covers the writes
  // replied to on every connection of the export (CAN_MULTI_CONN), so a later session on the
  // same server may acknowledge what an earlier one wrote (or what an earlier failed FLUSH
  // should have persisted).

  /** Writes replied to since the last FLUSH was sent: block -> newest replied generation. */
  replied = new Map<number, number>();
  /** Coverage of each FLUSH sent and not yet acknowledged (failed ones stay), oldest first. */
  snapshots: { id: number; blocks: Map<number, number>; failed: boolean }[] = [];
  /** block -> generation that a failed FLUSH should have persisted (cleared when rewritten). */
  failedCover = new Map<number, number>();
  /** Blocks whose data a FLUSH failed to persist (EIO) and a LATER flush acknowledged, not rewritten in between. */
  rescued = new Set<number>();
  private flushIds = 0;

  /** A write was sent: generation `gen` may land on these blocks from now on. */
  writeSent(start: number, count: number, gen: number): void {
    for (let b = start; b < start + count; b++) {
      this.sent(b, gen);
      this.failedCover.delete(b);
    }
  }

  writeReplied(start: number, count: number, gen: number, fua: boolean): void {
    for (let b = start; b < start + count; b++) {
      this.replied.set(b, gen);
      if (fua) this.durable(b, gen);
    }
  }

  /** A FLUSH is being sent: it must cover everything replied to so far. Returns its id. */
  flushSent(): number {
    const id = ++this.flushIds;
    this.snapshots.push({ id, blocks: this.replied, failed: false });
    this.replied = new Map();
    return id;
  }

  flushAcked(id: number): void {
    // Covers its own snapshot and every earlier one (failed flushes included).
    while (this.snapshots.length > 0 && this.snapshots[0]!.id <= id) {
      const s = this.snapshots.shift()!;
      for (const [b, gen] of s.blocks) {
        if (s.failed && this.failedCover.get(b) === gen) this.rescued.add(b);
        this.durable(b, gen);
      }
    }
  }

  flushFailed(id: number): void {
    for (const s of this.snapshots) {
      if (s.id > id) break;
      s.failed = true;
      for (const [b, gen] of s.blocks) this.failedCover.set(b, gen);
    }
  }

  /** True when every write replied to is covered by an acknowledged FLUSH. */
  get allRepliedCovered(): boolean {
    return this.replied.size === 0 && this.snapshots.length === 0;
  }

  /**
   * The server died: nothing it held can be acknowledged any more (a new server never
   * acknowledges an old server's writes). What may have landed stays in `pending`.
   */
  serverLost(): void {
    this.replied = new Map();
    this.snapshots = [];
    this.failedCover.clear();
  }

  /** After a verified read-back: what was read is now the durable state (nothing is pending). */
  rebase(observed: Uint32Array): void {
    this.acked.set(observed);
    this.pending.fill(undefined);
    this.serverLost();
  }
}

// ------------------------------------------------------------------ connecting

/**
 * Connect and GO, retrying a refused GO (an error reply, e.g. the volume failed to open
 * because injected store faults broke its recovery or its takeover record) up to `retries`
 * times. A server that refuses every time is reported with its last answer.
 */
export async function connectGo(socket: string, exportName: string, retries = 0): Promise<{ client: RawClient; size: bigint; eflags: number }> {
  for (let attempt = 0; ; attempt++) {
    const client = await RawClient.connect(socket);
    try {
      const { size, eflags } = await client.handshakeGo(exportName);
      return { client, size, eflags };
    } catch (err) {
      client.destroy();
      if (attempt >= retries || !(err instanceof Error && err.message.startsWith('GO '))) throw err;
      await new Promise((r) => setTimeout(r, 100 + 100 * attempt));
    }
  }
}

// ------------------------------------------------------------------ the writer

export type WriterEvent =
  | { type: 'ready' }
  | { type: 'write-sent'; n: number; gen: number }
  | { type: 'write-done'; n: number; ok: boolean }
  | { type: 'flush-sent'; n: number }
  | { type: 'flush-done'; n: number; ok: boolean; errno: number };

export interface WriterStatus {
  writesInFlight: number;
  flushInFlight: boolean;
  flushesOk: number;
  flushesFailed: number;
  writesSent: number;
}

export interface WriterOptions {
  exportName: string;
  rng: () => number;
  /** Send a FLUSH after every k writes (at most one FLUSH in flight). */
  flushEvery: number;
  /** Writes in flight at once (default 4). */
  depth?: number;
  /**
   * Connections to the export (default 1). Writes go to a random one, FLUSH too: the export
   * advertises CAN_MULTI_CONN, so a FLUSH on one connection must cover the writes replied to
   * on all of them (nbdfuse writes on 4 connections and flushes on one).
   */
  connections?: number;
  /** Largest ordinary write, in blocks (default 16). */
  maxRunBlocks?: number;
  /** Probability of a big write (default 0.03). */
  bigWriteRate?: number;
  /** Size range of a big write in blocks (default [128, 512]: 0.5..2 MiB). */
  bigRunBlocks?: [number, number];
  fuaRate?: number;
  zeroRate?: number;
  /** Half of the ordinary writes go to the first `hotBlocks` blocks (many generations per block). 0: uniform. */
  hotBlocks?: number;
  /** Stop issuing after this many write commands. */
  maxWrites?: number;
  /** Stop issuing after this long. */
  durationMs?: number;
  /** Stop issuing when this returns true (checked before each command). */
  stopWhen?: (s: WriterStats) => boolean;
  /** After stopping normally: FLUSH until one succeeds (at most this many tries). 0: no final flush. */
  finalFlushTries?: number;
  replyTimeoutMs?: number;
  /** Retry a refused GO this many times (store faults can make a volume open fail). */
  goRetries?: number;
  /** Called synchronously: a crash test may SIGKILL the server from here. */
  onEvent?: (e: WriterEvent, s: WriterStatus) => void;
}

export interface WriterStats {
  writesSent: number;
  writesOk: number;
  writesFailed: number;
  fuaOk: number;
  zeroWrites: number;
  bytesSent: number;
  flushesSent: number;
  flushesOk: number;
  flushesFailed: number;
  /** errno -> count, for failed flushes and writes. */
  errnos: Record<number, number>;
  endedBy: 'done' | 'closed';
  /** What was outstanding when the connection died (or ended). */
  atEnd: { writesInFlight: number; flushInFlight: boolean };
  elapsedMs: number;
}

interface WriteOp { kind: 'write'; n: number; start: number; count: number; gen: number; fua: boolean; conn: number }
interface FlushOp { kind: 'flush'; n: number; id: number; conn: number }
type Op = WriteOp | FlushOp;

/**
 * Connect to `socket`, write and flush as configured, updating `model`, until the limits are
 * reached (then finish in-flight commands and optionally flush) or the connection dies.
 * Never throws for a dead connection: that is the expected end of a crash round.
 */
export async function runWriter(socket: string, model: BlockModel, o: WriterOptions): Promise<WriterStats> {
  const t0 = Date.now();
  const rng = o.rng;
  const depth = o.depth ?? 4;
  const maxRun = o.maxRunBlocks ?? 16;
  const bigRate = o.bigWriteRate ?? 0.03;
  const [bigMin, bigMax] = o.bigRunBlocks ?? [128, 512];
  const fuaRate = o.fuaRate ?? 0;
  const zeroRate = o.zeroRate ?? 0;
  const hot = Math.min(o.hotBlocks ?? 0, model.blocks);
  const replyTimeout = o.replyTimeoutMs ?? 120_000;
  const stats: WriterStats = {
    writesSent: 0, writesOk: 0, writesFailed: 0, fuaOk: 0, zeroWrites: 0, bytesSent: 0,
    flushesSent: 0, flushesOk: 0, flushesFailed: 0, errnos: {},
    endedBy: 'done', atEnd: { writesInFlight: 0, flushInFlight: false }, elapsedMs: 0,
  };

  let writesInFlight = 0;
  let flushInFlight = false;
  const clients: RawClient[] = [];
  /** Replies (or the connection's end) from every connection, in arrival order. */
  const replies: ({ conn: number; h: Buffer } | { conn: number; err: unknown })[] = [];
  let wakeup: (() => void) | null = null;
  let finished = false;
  const pump = async (conn: number, c: RawClient): Promise<void> => {
    for (;;) {
      let item: (typeof replies)[number];
      try {
        item = { conn, h: await c.read(16, 24 * 3600_000) };
      } catch (err) {
        item = { conn, err };
      }
      if (finished) return;
      replies.push(item);
      const w = wakeup;
      wakeup = null;
      w?.();
      if ('err' in item) return;
    }
  };
  const nextReply = async (): Promise<{ conn: number; h: Buffer }> => {
    const deadline = Date.now() + replyTimeout;
    while (replies.length === 0) {
      const left = deadline - Date.now();
      if (left <= 0) throw new ReadTimeoutError(`no reply within ${replyTimeout} ms`);
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, left);
        wakeup = () => { clearTimeout(timer); resolve(); };
      });
    }
    const r = replies.shift()!;
    if ('err' in r) throw r.err;
    return r;
  };
  try {
    const nconn = Math.max(1, o.connections ?? 1);
    let eflags = 0;
    for (let i = 0; i < nconn; i++) {
      const { client: c, ...hs } = await connectGo(socket, o.exportName, o.goRetries ?? 0);
      clients.push(c);
      if (hs.size < BigInt(model.blocks * BLOCK)) throw new Error(`export ${o.exportName} has ${hs.size} bytes, the model needs ${model.blocks * BLOCK}`);
      eflags = hs.eflags;
    }
    if (!(eflags & TFLAG.SEND_FLUSH)) throw new Error('the server does not advertise SEND_FLUSH: nothing to test');
    if (nconn > 1 && !(eflags & TFLAG.CAN_MULTI_CONN)) throw new Error('the server does not advertise CAN_MULTI_CONN: one connection only');
    const canFua = (eflags & TFLAG.SEND_FUA) !== 0;
    const canZero = (eflags & TFLAG.SEND_WRITE_ZEROES) !== 0;
    clients.forEach((c, i) => void pump(i, c));
    const pickConn = (): number => (nconn === 1 ? 0 : randInt(rng, 0, nconn - 1));

    const inflight = new Map<bigint, Op>();
    const busy = new Uint8Array(model.blocks);
    let writesSinceFlush = 0;
    let cookie = 1n;

    const status = (): WriterStatus => ({ writesInFlight, flushInFlight, flushesOk: stats.flushesOk, flushesFailed: stats.flushesFailed, writesSent: stats.writesSent });
    const emit = (e: WriterEvent): void => o.onEvent?.(e, status());
    const countErrno = (e: number): void => { stats.errnos[e] = (stats.errnos[e] ?? 0) + 1; };

    const pickExtent = (): { start: number; count: number } | null => {
      for (let tries = 0; tries < 16; tries++) {
        let count: number;
        let start: number;
        if (rng() < bigRate) {
          count = Math.min(randInt(rng, bigMin, bigMax), model.blocks);
          start = randInt(rng, 0, model.blocks - count);
        } else {
          count = Math.min(randInt(rng, 1, maxRun), model.blocks);
          const region = hot > 0 && rng() < 0.5 ? Math.max(hot, count) : model.blocks;
          start = randInt(rng, 0, region - count);
        }
        let free = true;
        for (let b = start; b < start + count; b++) if (busy[b]) { free = false; break; }
        if (free) return { start, count };
      }
      return null;
    };

    const sendFlush = async (): Promise<void> => {
      const op: FlushOp = { kind: 'flush', n: ++stats.flushesSent, id: model.flushSent(), conn: pickConn() };
      writesSinceFlush = 0;
      flushInFlight = true;
      const c = cookie++;
      inflight.set(c, op);
      await clients[op.conn]!.write(requestFrame({ type: CMD.FLUSH, cookie: c, offset: 0n, length: 0 }));
      emit({ type: 'flush-sent', n: op.n });
    };

    const sendWrite = async (start: number, count: number): Promise<void> => {
      const gen = model.nextGen++;
      const zero = canZero && rng() < zeroRate;
      const fua = canFua && rng() < fuaRate;
      const op: WriteOp = { kind: 'write', n: ++stats.writesSent, start, count, gen, fua, conn: pickConn() };
      const client = clients[op.conn]!;
      for (let b = start; b < start + count; b++) busy[b] = 1;
      model.writeSent(start, count, gen);
      if (zero) model.zeroGens.add(gen);
      writesInFlight++;
      writesSinceFlush++;
      const c = cookie++;
      inflight.set(c, op);
      const flags = fua ? CMD_FLAG_FUA : 0;
      if (zero) {
        stats.zeroWrites++;
        await client.write(requestFrame({ type: CMD.WRITE_ZEROES, flags, cookie: c, offset: BigInt(start * BLOCK), length: count * BLOCK }));
      } else {
        const payload = allocBlocks(count);
        for (let i = 0; i < count; i++) stampBlock(payload, i * BLOCK, start + i, gen, model.salt);
        stats.bytesSent += payload.length;
        await client.write(requestFrame({ type: CMD.WRITE, flags, cookie: c, offset: BigInt(start * BLOCK), length: payload.length }, payload));
      }
      emit({ type: 'write-sent', n: op.n, gen });
    };

    const onReply = (conn: number, c: bigint, errno: number): void => {
      const op = inflight.get(c);
      if (!op) throw new ProtocolError(`reply for unknown cookie ${c}`);
      if (op.conn !== conn) throw new ProtocolError(`reply for cookie ${c} came on connection ${conn}, sent on ${op.conn}`);
      inflight.delete(c);
      if (op.kind === 'write') {
        writesInFlight--;
        for (let b = op.start; b < op.start + op.count; b++) busy[b] = 0;
        if (errno === 0) {
          stats.writesOk++;
          if (op.fua) stats.fuaOk++;
          model.writeReplied(op.start, op.count, op.gen, op.fua);
        } else {
          // Unknown whether it landed: it stays pending, and is covered by no flush.
          stats.writesFailed++;
          countErrno(errno);
        }
        emit({ type: 'write-done', n: op.n, ok: errno === 0 });
        return;
      }
      flushInFlight = false;
      if (errno === 0) {
        stats.flushesOk++;
        model.flushAcked(op.id);
      } else {
        stats.flushesFailed++;
        countErrno(errno);
        model.flushFailed(op.id);
      }
      emit({ type: 'flush-done', n: op.n, ok: errno === 0, errno });
    };

    emit({ type: 'ready' });
    let stopping = false;
    let finalTries = 0;
    for (;;) {
      if (!stopping) {
        if ((o.maxWrites !== undefined && stats.writesSent >= o.maxWrites)
          || (o.durationMs !== undefined && Date.now() - t0 >= o.durationMs)
          || (o.stopWhen?.(stats) ?? false)) stopping = true;
      }
      if (!stopping) {
        if (writesSinceFlush >= o.flushEvery && !flushInFlight) await sendFlush();
        while (!stopping && writesInFlight < depth) {
          const e = pickExtent();
          if (!e) break;
          await sendWrite(e.start, e.count);
          if (writesSinceFlush >= o.flushEvery && !flushInFlight) await sendFlush();
        }
      } else if (inflight.size === 0) {
        // Drained. Flush until one succeeds with every write replied to (on any session) covered.
        if (finalTries >= (o.finalFlushTries ?? 0) || (finalTries > 0 && model.allRepliedCovered)) break;
        finalTries++;
        await sendFlush();
      }
      if (inflight.size === 0) continue;
      const { conn, h } = await nextReply();
      if (h.readUInt32BE(0) !== SIMPLE_REPLY_MAGIC) throw new ProtocolError(`bad reply magic 0x${h.readUInt32BE(0).toString(16)}`);
      onReply(conn, h.readBigUInt64BE(8), h.readUInt32BE(4));
    }
    finished = true;
    for (const c of clients) await c.disconnect().catch(() => {});
  } catch (err) {
    if (!isConnectionLoss(err, clients)) {
      if (err instanceof ReadTimeoutError) throw new Error(`writer: no reply within ${replyTimeout} ms (server hung?)`);
      throw err;
    }
    stats.endedBy = 'closed';
  } finally {
    finished = true;
    for (const c of clients) c.destroy();
    stats.atEnd = { writesInFlight, flushInFlight };
    stats.elapsedMs = Date.now() - t0;
  }
  return stats;
}

/** The server went away (the normal end of a crash round), as opposed to a protocol or test bug. */
function isConnectionLoss(err: unknown, clients: RawClient[]): boolean {
  if (err instanceof ClosedError) return true;
  if (err instanceof ProtocolError || err instanceof ReadTimeoutError) return false;
  const code = typeof err === 'object' && err !== null && 'code' in err ? String(err.code) : '';
  if (['EPIPE', 'ECONNRESET', 'ERR_STREAM_DESTROYED', 'ERR_STREAM_WRITE_AFTER_END'].includes(code)) return true;
  return (err instanceof Error && /socket destroyed/.test(err.message)) || clients.some((c) => c.closed);
}

/** The server answered something a correct server never would. */
export class ProtocolError extends Error {}

// ------------------------------------------------------------------ verification

export interface VerifyResult {
  blocks: number;
  zeroBlocks: number;
  /** Blocks that read as their acknowledged generation. */
  atAcked: number;
  /** Blocks that read as a generation written after the acknowledged one. */
  newer: number;
  /** READs that failed with EIO and succeeded when repeated (opts.eioRetries). */
  eioRetried: number;
  problems: Problem[];
  problemCount: number;
  /** Generation read back per block (valid where there is no problem). */
  observed: Uint32Array;
  elapsedMs: number;
}

/**
 * Read every block of the model through a fresh connection and check each against the model.
 * `eioRetries`: a READ that fails with EIO is repeated up to this many times (default 0) —
 * only for a server whose store injects read faults, where an EIO is an honest answer (a GET
 * that failed on each of its attempts) and says nothing about what the store holds; damage
 * in the store (a missing or corrupt object) fails every repetition and is still a problem.
 */
export async function verifyVolume(socket: string, exportName: string, model: BlockModel, opts: { chunkBlocks?: number; maxProblems?: number; goRetries?: number; eioRetries?: number } = {}): Promise<VerifyResult> {
  const t0 = Date.now();
  const chunk = opts.chunkBlocks ?? 256;
  const maxProblems = opts.maxProblems ?? 20;
  const res: VerifyResult = { blocks: model.blocks, zeroBlocks: 0, atAcked: 0, newer: 0, eioRetried: 0, problems: [], problemCount: 0, observed: new Uint32Array(model.blocks), elapsedMs: 0 };
  const problem = (p: Problem): void => {
    res.problemCount++;
    if (res.problems.length < maxProblems) res.problems.push(p);
  };
  const { client, size } = await connectGo(socket, exportName, opts.goRetries ?? 0);
  try {
    if (size < BigInt(model.blocks * BLOCK)) throw new Error(`export ${exportName} has ${size} bytes, the model needs ${model.blocks * BLOCK}`);
    let cookie = 1n;
    for (let start = 0; start < model.blocks; start += chunk) {
      const count = Math.min(chunk, model.blocks - start);
      let { reply, data } = await client.readAt(cookie++, BigInt(start * BLOCK), count * BLOCK);
      for (let retry = 0; !data && reply.error === EIO && retry < (opts.eioRetries ?? 0); retry++) {
        ({ reply, data } = await client.readAt(cookie++, BigInt(start * BLOCK), count * BLOCK));
        if (data) res.eioRetried++;
      }
      if (reply.magic !== SIMPLE_REPLY_MAGIC) throw new Error(`bad reply magic 0x${reply.magic.toString(16)}`);
      if (!data) {
        for (let b = start; b < start + count; b++) problem({ block: b, kind: 'read-error', detail: `READ failed with errno ${reply.error}`, allowed: model.allowed(b) });
        continue;
      }
      for (let i = 0; i < count; i++) {
        const b = start + i;
        const r = model.check(b, data.subarray(i * BLOCK, (i + 1) * BLOCK));
        if ('kind' in r) { problem(r); continue; }
        res.observed[b] = r.gen;
        if (model.zeroGens.has(r.gen)) res.zeroBlocks++;
        if (r.gen === model.acked[b]) res.atAcked++;
        else res.newer++;
      }
    }
    await client.disconnect().catch(() => {});
  } finally {
    client.destroy();
    res.elapsedMs = Date.now() - t0;
  }
  return res;
}

export function describeProblems(v: VerifyResult): string {
  if (v.problemCount === 0) return 'no problems';
  const lines = v.problems.map((p) => `  block ${p.block} (offset ${p.block * BLOCK}): ${p.kind}: ${p.detail}; allowed generations [${p.allowed.join(', ')}]`);
  return `${v.problemCount} bad blocks of ${v.blocks}:\n${lines.join('\n')}${v.problemCount > v.problems.length ? `\n  ... and ${v.problemCount - v.problems.length} more` : ''}`;
}

/**
 * The object-store volume engine: a BlockBackend whose truth is in the object store.
 *
 * Design (log-structured, as LSVD and ZeroFS do it):
 * - Writes are copied into an in-memory write buffer (the `dirty` overlay) shared by every
 *   connection of the export; reads see them at once.
 * - FLUSH (and FUA) seals the dirty overlay and commits it: full segments are uploaded in
 *   parallel, then ONE create-only put of the next log record (which carries the last
 *   segment's data inline) is the commit point. Only after the store acknowledged that put
 *   does the flush resolve. A small flush is therefore a single store round trip.
 * - Flushes that arrive while a commit is running share the next commit (group commit).
 * - A failed commit keeps every sealed overlay; the next commit includes them, so dirty data
 *   is never dropped and a later flush can never succeed without it ("fsyncgate").
 * - The committed extent map (cow/) says which object and offset holds each byte. Reads
 *   resolve, synchronously and newest first, dirty -> sealed -> committed, then fetch
 *   committed pieces through the local block cache.
 * - Memory is bounded: past `dirtySoftLimit` a background commit starts; past
 *   `dirtyHardLimit` writes wait (in arrival order) until a commit frees memory.
 * - TRIM and WRITE_ZEROES are map operations: no zero bytes are uploaded.
 * - Nothing runs on a timer: an idle volume makes no store requests.
 * - Fencing: a create-only put that finds its log position taken by someone else means
 *   another writer committed there. This engine then refuses every later write and flush
 *   (FencedError -> EIO); it can never land data after that point. See src/lease.ts for
 *   the takeover protocol that relies on this.
 */

import { randomBytes } from 'node:crypto';
import type { BlockBackend, Extent, ZeroOptions } from '../../nbd/backend.js';
import { NBD_STATE_HOLE, NBD_STATE_ZERO } from '../../nbd/constants.js';
import { ExtentMap, type Piece } from '../../cow/extent-map.js';
import type { BlockCache } from '../cache.js';
import { BatonError, CorruptError, FencedError, LeaseLostError, NotFoundError, PreconditionFailedError, ReadOnlyError, ShutdownError, errorMessage } from '../errors.js';
import type { Logger } from '../log.js';
import { listAll, type ObjectStore } from '../store/object-store.js';
import {
  SRC_HOLE, SRC_INLINE, SRC_ZERO, decodeCheckpoint, decodeLogHeader, decodeVolumeRecord, keys, logHeaderLength, maxOperationMs, seqFromKey, encodeLogRecord,
  type Checkpoint, type LogHeader, type RecordExtent, type VolumeRecord,
} from './format.js';

/** The lease token is not above the highest one in the log: re-acquire with `minToken`. */
export class StaleTokenError extends BatonError {
  constructor(readonly minToken: number, message: string) { super('BATON_ERR_LEASE_LOST', message); }
}

// ------------------------------------------------------------------ map values

/** Where committed bytes live: object `key` at `off`, or zeroes. */
export type Loc = { key: string; off: number } | ZeroLoc;
export interface ZeroLoc { zero: true; hole: boolean }
const HOLE: ZeroLoc = { zero: true, hole: true };
const ZERO: ZeroLoc = { zero: true, hole: false };

function isZero(v: Loc | Dirty): v is ZeroLoc { return (v as ZeroLoc).zero === true; }

const sliceLoc = (v: Loc, d: number): Loc => (isZero(v) ? v : { key: v.key, off: v.off + d });

/** A buffered write: bytes in memory, or zeroes. */
type Dirty = { buf: Buffer } | ZeroLoc;
const sliceDirty = (v: Dirty, d: number): Dirty => (isZero(v) ? v : { buf: v.buf.subarray(d) });

interface Sealed {
  map: ExtentMap<Dirty>;
  bytes: number;
}

export interface VolumeOptions {
  store: ObjectStore;
  cache: BlockCache;
  log: Logger;
  readOnly: boolean;
  /** Fencing token written into every log record (0 without a lease). */
  token?: number;
  /** Size of an uploaded data segment; a flush with less data is a single put. */
  segmentBytes?: number;
  dirtySoftLimit?: number;
  dirtyHardLimit?: number;
  /** Write a checkpoint of the map after this many log records. */
  checkpointEvery?: number;
  /** Parallel segment uploads per commit. */
  uploadConcurrency?: number;
  /** See maxOperationMs() in format.ts (GC's safety margin); defaults to it. */
  maxOperationMs?: number;
}

export interface VolumeStats {
  dirtyBytes: number;
  sealedBytes: number;
  commits: number;
  lastCommitSeq: number;
  lastFlushAt: string | null;
  extents: number;
  fenced: boolean;
}

export interface CompactionResult {
  /** Objects whose live bytes were rewritten (they are garbage once GC's grace passed). */
  objects: number;
  /** Their total size. */
  objectBytes: number;
  /** Live bytes copied into new objects. */
  rewrittenBytes: number;
}

interface Deferred { promise: Promise<void>; resolve: () => void; reject: (e: unknown) => void }
function deferred(): Deferred {
  let resolve!: () => void;
  let reject!: (e: unknown) => void;
  const promise = new Promise<void>((res, rej) => { resolve = res; reject = rej; });
  promise.catch(() => {}); // a commit nobody waits for must not become an unhandled rejection
  return { promise, resolve, reject };
}

const ARENA_CHUNK = 1024 * 1024;

export class Volume implements BlockBackend {
  readonly size: number;
  readonly readOnly: boolean;
  private readonly store: ObjectStore;
  private readonly blockCache: BlockCache;
  private readonly log: Logger;
  private readonly id: string;
  private token: number;

  private committed = new ExtentMap<Loc>(sliceLoc);
  private readonly objectSizes = new Map<string, number>();
  private dirty = new ExtentMap<Dirty>(sliceDirty);
  private dirtyBytes = 0;
  private readonly sealed: Sealed[] = [];
  private arena: Buffer = Buffer.alloc(0);
  private arenaUsed = 0;

  private nextSeq = 1;
  private lastCheckpointSeq = 0;
  /** The checkpoint upload in progress, if any (one at a time). */
  private checkpointing: Promise<void> | null = null;
  private commitRunning: Promise<void> | null = null;
  private nextCommit: Deferred | null = null;
  /** The last commit attempt whose outcome is unknown (its put failed without an answer). */
  private ambiguous: { seq: number; putId: string; batchLength: number; apply: () => void } | null = null;
  private fencedError: FencedError | null = null;
  private closed = false;
  private readonly writeWaiters: (() => void)[] = [];
  private lastReadEnd = -1;
  private sequentialStreak = 0;
  private commits = 0;
  private lastFlushAt: string | null = null;

  private readonly segmentBytes: number;
  private readonly softLimit: number;
  private readonly hardLimit: number;
  private readonly checkpointEvery: number;
  private readonly uploadConcurrency: number;
  private readonly maxOpMs: number;
  /** When the committed map was last brought up to date with the log (read-only views of live volumes). */
  private mapLoadedAt = 0;
  private refreshing: Promise<void> | null = null;

  private constructor(private readonly record: VolumeRecord, private readonly opts: VolumeOptions) {
    this.size = record.size;
    this.id = record.id;
    this.readOnly = opts.readOnly;
    this.store = opts.store;
    this.blockCache = opts.cache;
    this.log = opts.log.child({ volume: record.name });
    this.token = opts.token ?? 0;
    this.segmentBytes = opts.segmentBytes ?? 8 * 1024 * 1024;
    this.softLimit = opts.dirtySoftLimit ?? 64 * 1024 * 1024;
    this.hardLimit = Math.max(opts.dirtyHardLimit ?? 256 * 1024 * 1024, this.softLimit + 32 * 1024 * 1024);
    this.checkpointEvery = opts.checkpointEvery ?? 64;
    this.uploadConcurrency = opts.uploadConcurrency ?? 16;
    this.maxOpMs = opts.maxOperationMs ?? maxOperationMs();
  }

  get name(): string { return this.record.name; }

  /** Open a volume: latest checkpoint, then replay the log after it. */
  static async open(record: VolumeRecord, opts: VolumeOptions): Promise<Volume> {
    const v = new Volume(record, opts);
    await v.recover();
    return v;
  }

  private async recover(): Promise<void> {
    const t0 = Date.now();
    this.mapLoadedAt = performance.now();
    const fromSeq = await this.loadLatestCheckpoint(this.id, Infinity, true);
    let base = 'checkpoint';
    if (fromSeq === 0 && this.record.parent) {
      // A fork that has not written its own checkpoint yet: start from the parent's state.
      await this.loadAncestor(this.record.parent.id, this.record.parent.seq, 1);
      base = `parent ${this.record.parent.id}@${this.record.parent.seq}`;
    }
    this.lastCheckpointSeq = fromSeq;
    this.nextSeq = fromSeq + 1;
    const replayed = await this.replayLog();
    this.log.info({ seq: this.nextSeq - 1, checkpoint: fromSeq, base, replayed, extents: this.committed.size, ms: Date.now() - t0 }, 'volume recovered');
  }

  /**
   * Load the newest readable checkpoint of volume `id` at or below `maxSeq` into the map.
   * Returns its seq, or 0 if there is none.
   */
  private async loadLatestCheckpoint(id: string, maxSeq: number, own: boolean): Promise<number> {
    const cps = (await listAll(this.store, keys.checkpointPrefix(id))).filter((o) => seqFromKey(o.key) <= maxSeq);
    // Newest first; a checkpoint that fails to load is skipped, not trusted.
    for (const cp of cps.reverse()) {
      try {
        const c = decodeCheckpoint(await this.store.get(cp.key), cp.key);
        this.loadCheckpoint(c);
        if (own) this.highestTokenSeen = c.token;
        return c.seq;
      } catch (err) {
        this.log.warn({ key: cp.key, err: errorMessage(err) }, 'skipping unreadable checkpoint');
      }
    }
    return 0;
  }

  /** The map of ancestor `id` as of its log record `seq`: its checkpoint (or its own parent) plus its log. */
  private async loadAncestor(id: string, seq: number, depth: number): Promise<void> {
    if (depth > 10_000) throw new CorruptError(`volume ${this.name}: ancestry deeper than 10000 (a cycle?)`);
    const from = await this.loadLatestCheckpoint(id, seq, false);
    if (from === 0) {
      const meta = await this.readMeta(id);
      if (meta.parent) await this.loadAncestor(meta.parent.id, meta.parent.seq, depth + 1);
    }
    if (seq > from) await this.replayRange(id, from, seq);
  }

  private async readMeta(id: string): Promise<VolumeRecord> {
    const key = keys.meta(id);
    try {
      return decodeVolumeRecord(await this.store.get(key), key);
    } catch (err) {
      if (err instanceof NotFoundError) throw new CorruptError(`volume ${this.name}: its ancestor ${id} is gone from the store (${key})`);
      throw err;
    }
  }

  /** Apply an ancestor's log records (after, upTo] to the map (data only: tokens are the ancestor's business). */
  private async replayRange(id: string, after: number, upTo: number): Promise<void> {
    const logs = (await listAll(this.store, keys.logPrefix(id), after > 0 ? { startAfter: keys.log(id, after) } : {}))
      .filter((o) => seqFromKey(o.key) <= upTo);
    if (logs.length !== upTo - after) throw new CorruptError(`volume ${this.name}: ancestor ${id} is missing log records in (${after}, ${upTo}]`);
    const headers = await mapLimit(logs, 16, (o) => this.readLogHeader(o.key, o.size));
    let fence = 0;
    for (let i = 0; i < logs.length; i++) {
      const { header, dataStart } = headers[i]!;
      if (header.kind === 'takeover') fence = Math.max(fence, header.token);
      if (header.kind === 'commit' && header.token < fence) continue;
      this.applyRecord(logs[i]!.key, header, dataStart, logs[i]!.size);
    }
  }

  /**
   * Apply every log record after the ones already applied. Used by recovery and when a
   * create-only put finds its position taken (to learn what the other writer committed).
   *
   * Token rule (belt and braces; by construction it cannot trigger, see takeover()): once a
   * takeover record with token T is in the log, a later record with a token below T comes
   * from a fenced writer and is ignored.
   */
  private async replayLog(): Promise<number> {
    const after = this.nextSeq - 1;
    const logs = await listAll(this.store, keys.logPrefix(this.id), after > 0 ? { startAfter: keys.log(this.id, after) } : {});
    let expect = this.nextSeq;
    // Fetch headers with bounded parallelism, apply strictly in order.
    const headers = await mapLimit(logs, 16, (o) => this.readLogHeader(o.key, o.size));
    for (let i = 0; i < logs.length; i++) {
      const o = logs[i]!;
      const seq = seqFromKey(o.key);
      if (seq !== expect) throw new CorruptError(`volume ${this.name}: log record ${expect} is missing (found ${seq}); refusing to guess`);
      const { header, dataStart } = headers[i]!;
      if (header.seq !== seq || header.volumeId !== this.id) throw new CorruptError(`${o.key}: header says seq ${header.seq} of volume ${header.volumeId}`);
      if (header.token < this.highestTokenSeen && header.kind === 'commit') {
        this.log.error({ seq, token: header.token, fence: this.highestTokenSeen }, 'ignoring a log record from a fenced writer');
        this.objectSizes.set(o.key, o.size);
      } else {
        this.applyRecord(o.key, header, dataStart, o.size);
        if (header.kind === 'takeover') this.highestTokenSeen = Math.max(this.highestTokenSeen, header.token);
      }
      expect++;
    }
    this.nextSeq = expect;
    return logs.length;
  }

  /**
   * Highest fencing token of a takeover record in the log. A writer must hold a larger one:
   * the lease layer refuses (and re-acquires with a larger token) otherwise, which is what
   * keeps tokens growing even if Redis lost its data.
   */
  highestTokenSeen = 0;

  /**
   * The new holder's first act: commit a takeover record with its token at the next log
   * position (create-only). From then on any commit by an older holder fails, because the
   * position it would write is taken (it can only ever write at the position after its own
   * last commit, and this record sits at or before it). If the position is taken, another
   * writer committed there first: learn its records and try the next position.
   *
   * Why this fences, case by case (the lease decides who should write; this decides who can):
   * - Paused holder (SIGSTOP, GC pause): when it resumes, its next commit targets a position
   *   at or before our takeover record: the create-only put fails, it fences itself.
   * - Partitioned holder (cannot reach Redis): its renewals fail, it stops acknowledging at
   *   validUntil (before the TTL can expire), and any commit it still sends loses as above.
   * - Redis restart or data loss: two hosts may both get "the lease", maybe with a repeated
   *   token. Tokens below the log's highest are refused (re-acquired higher); two hosts with
   *   leases still serialize on log positions: whichever commits second at a position is
   *   fenced, and it never acknowledged that commit.
   * - Two hosts racing to acquire: Redis lets one win; if both believed they won, the
   *   create-only takeover puts still order them, and the earlier one is fenced by the later.
   */
  async takeover(token: number): Promise<void> {
    for (let attempt = 0; attempt < 20; attempt++) {
      if (token <= this.highestTokenSeen) {
        throw new StaleTokenError(this.highestTokenSeen, `token ${token} is not above the log's ${this.highestTokenSeen}`);
      }
      const seq = this.nextSeq;
      const header: LogHeader = {
        v: 1, kind: 'takeover', seq, volumeId: this.id, token, time: new Date().toISOString(), segments: [], extents: [], inlineLength: 0,
      };
      const { body, dataStart } = encodeLogRecord(header, []);
      const key = keys.log(this.id, seq);
      try {
        await this.store.put(key, body, { ifNoneMatch: true, metadata: { 'baton-put-id': randomBytes(8).toString('hex') } });
      } catch (err) {
        if (!(err instanceof PreconditionFailedError)) throw err;
        await this.replayLog();
        continue;
      }
      this.applyRecord(key, header, dataStart, body.length);
      this.nextSeq = seq + 1;
      this.highestTokenSeen = token;
      this.token = token;
      this.log.info({ seq, token }, 'takeover record committed');
      // A fork's first checkpoint flattens its ancestry: later opens need no parent at all.
      if (this.record.parent && this.lastCheckpointSeq === 0) this.maybeCheckpoint(true);
      return;
    }
    throw new FencedError(`volume ${this.name}: could not commit a takeover record (the log keeps moving: is another host writing?)`);
  }

  /** The lease's local deadline: past it this host acknowledges no write and no flush. */
  setWriteDeadline(deadline: () => number): void {
    this.writeDeadline = deadline;
  }

  private writeDeadline: (() => number) | null = null;

  private checkDeadline(): void {
    if (this.writeDeadline && performance.now() >= this.writeDeadline()) {
      this.fence('the lease could not be renewed in time');
      throw new LeaseLostError(`volume ${this.name}: this host's lease expired; writes are refused (reattach to serve it again)`);
    }
  }

  private async readLogHeader(key: string, size: number): Promise<{ header: LogHeader; dataStart: number }> {
    const first = Math.min(size, 64 * 1024);
    let b = await this.store.get(key, { offset: 0, length: first });
    const need = 12 + logHeaderLength(b, key);
    if (need > b.length) {
      if (need > size) throw new CorruptError(`${key}: header length past the end of the object`);
      b = await this.store.get(key, { offset: 0, length: need });
    }
    return decodeLogHeader(b, key);
  }

  private applyRecord(key: string, h: LogHeader, dataStart: number, recordSize: number): void {
    this.objectSizes.set(key, recordSize);
    for (const s of h.segments) this.objectSizes.set(s.key, s.size);
    for (const [off, len, src, srcOff] of h.extents) {
      if (off < 0 || len <= 0 || off + len > this.size) throw new CorruptError(`${key}: extent out of range`);
      let loc: Loc;
      if (src === SRC_HOLE) loc = HOLE;
      else if (src === SRC_ZERO) loc = ZERO;
      else if (src === SRC_INLINE) loc = { key, off: dataStart + srcOff };
      else {
        const seg = h.segments[src];
        if (!seg) throw new CorruptError(`${key}: extent refers to missing segment ${src}`);
        loc = { key: seg.key, off: srcOff };
      }
      this.committed.set(off, len, loc);
    }
  }

  private loadCheckpoint(c: Checkpoint): void {
    const m = new ExtentMap<Loc>(sliceLoc);
    for (const [key, size] of c.objects) this.objectSizes.set(key, size);
    for (const [off, len, src, srcOff] of c.extents) {
      if (src === SRC_HOLE) m.set(off, len, HOLE);
      else if (src === SRC_ZERO) m.set(off, len, ZERO);
      else {
        const o = c.objects[src];
        if (!o) throw new CorruptError(`checkpoint ${c.seq}: bad object index`);
        m.set(off, len, { key: o[0], off: srcOff });
      }
    }
    this.committed = m;
  }

  // ------------------------------------------------------------------ reads

  /**
   * Resolve [offset, offset+length) to the newest source of each piece, in volume order.
   * Synchronous: a consistent snapshot. `visit` may return false to stop early (work
   * bounded by what the caller needs, e.g. a BLOCK_STATUS reply).
   */
  private resolve(offset: number, length: number, visit: (p: Piece<Dirty | Loc>) => boolean | void): void {
    // Every byte of the range is visited exactly once (gaps too), newest source first.
    const layers: ExtentMap<Dirty>[] = [this.dirty];
    for (let i = this.sealed.length - 1; i >= 0; i--) layers.push(this.sealed[i]!.map);
    const walk = (layer: number, off: number, len: number): boolean => {
      if (layer === layers.length) {
        for (const p of this.committed.lookup(off, len)) if (visit(p) === false) return false;
        return true;
      }
      for (const p of layers[layer]!.lookup(off, len)) {
        if (p.value !== undefined) { if (visit(p) === false) return false; }
        else if (!walk(layer + 1, p.offset, p.length)) return false;
      }
      return true;
    };
    walk(0, offset, length);
  }

  /**
   * A read-only view of a volume another host may be writing follows its log: its map must
   * never be older than maxOperationMs when it reads, because garbage collection may delete
   * what a map older than its grace period (>= 2x that) names. Snapshots never change.
   */
  private get followsLog(): boolean { return this.readOnly && !this.record.snapshot; }

  private async refreshIfStale(): Promise<void> {
    // A read that arrives during a refresh waits for it: the map in use is the stale one.
    if (this.refreshing) { await this.refreshing; return; }
    if (performance.now() - this.mapLoadedAt <= this.maxOpMs / 2) return;
    this.refreshing = this.refresh().finally(() => { this.refreshing = null; });
    await this.refreshing;
  }

  /**
   * Catch up with the log. If GC collected records after our position (a gap in the listing,
   * or a record gone between listing and reading it), reload from the newest checkpoint:
   * the new map is built beside the one in use and swapped in whole, so no read ever sees a
   * half-loaded map.
   */
  async refresh(): Promise<void> {
    const t0 = performance.now();
    try {
      await this.replayLog();
      this.mapLoadedAt = t0;
      return;
    } catch (err) {
      if (!(err instanceof CorruptError) && !(err instanceof NotFoundError)) throw err;
      this.log.info({ err: errorMessage(err) }, 'log moved past this view; reloading from the newest checkpoint');
    }
    const fresh = await Volume.open(this.record, this.opts);
    this.committed = fresh.committed;
    for (const [k, v] of fresh.objectSizes) this.objectSizes.set(k, v);
    this.nextSeq = fresh.nextSeq;
    this.highestTokenSeen = fresh.highestTokenSeen;
    this.lastCheckpointSeq = fresh.lastCheckpointSeq;
    this.mapLoadedAt = fresh.mapLoadedAt;
  }

  async read(offset: number, length: number, into?: Buffer): Promise<Buffer> {
    if (this.followsLog) await this.refreshIfStale();
    const out = into ?? Buffer.allocUnsafe(length);
    const fetches: { key: string; off: number; len: number; outOff: number }[] = [];
    this.resolve(offset, length, (p) => {
      const v = p.value;
      if (v === undefined || isZero(v)) out.fill(0, p.offset - offset, p.offset - offset + p.length);
      else if ('buf' in v) v.buf.copy(out, p.offset - offset, 0, p.length);
      else fetches.push({ key: v.key, off: v.off, len: p.length, outOff: p.offset - offset });
    });
    if (fetches.length > 0) {
      // Sequential readers get a growing readahead window.
      if (offset === this.lastReadEnd) this.sequentialStreak = Math.min(this.sequentialStreak + 1, 6);
      else this.sequentialStreak = 0;
      const readahead = this.sequentialStreak > 0 ? (128 * 1024) << this.sequentialStreak : 0;
      await Promise.all(fetches.map((f) => this.blockCache.read(this.store, f.key, this.objectSize(f.key), f.off, f.len, out, f.outOff, readahead)));
    }
    this.lastReadEnd = offset + length;
    return out;
  }

  private objectSize(key: string): number {
    const s = this.objectSizes.get(key);
    if (s === undefined) throw new CorruptError(`map refers to object ${key} of unknown size`);
    return s;
  }

  async blockStatus(offset: number, length: number, maxExtents: number): Promise<Extent[]> {
    // Work bounded by what the reply can carry (BlockBackend.blockStatus), not by the
    // range (up to 4 GiB) or its fragmentation: stop at maxExtents extents or after
    // `budget` map pieces (many same-flag pieces merge into one extent, so the extent count
    // alone bounds nothing), and reply with what was seen. The range is resolved one
    // map region at a time, because each resolve() builds the whole piece list of its range
    // before the visitor can stop it: a window bounds that to one region's pieces per layer
    // (ExtentMap's REGION_SIZE, below). All of it is synchronous, so the extents are one
    // consistent snapshot.
    const window = 4 * 1024 * 1024; // REGION_SIZE in cow/extent-map.ts: a window spans one region
    const limit = maxExtents >= 1 ? Math.floor(maxExtents) : 1; // also when a wrapper forgot to pass it
    const budget = Math.max(4096, 4 * limit);
    const out: Extent[] = [];
    let visited = 0;
    let stop = false;
    const visit = (p: Piece<Dirty | Loc>): boolean => {
      const v = p.value;
      const flags = v === undefined ? NBD_STATE_HOLE | NBD_STATE_ZERO : isZero(v) ? (v.hole ? NBD_STATE_HOLE | NBD_STATE_ZERO : NBD_STATE_ZERO) : 0;
      const last = out[out.length - 1];
      if (last && last.flags === flags) last.length += p.length;
      else if (out.length >= limit) { stop = true; return false; }
      else out.push({ length: p.length, flags });
      if (++visited >= budget) { stop = true; return false; }
      return true;
    };
    const end = offset + length;
    for (let pos = offset; pos < end && !stop;) {
      const wEnd = Math.min(end, (Math.floor(pos / window) + 1) * window);
      this.resolve(pos, wEnd - pos, visit);
      pos = wEnd;
    }
    return out;
  }

  async cache(offset: number, length: number): Promise<void> {
    // Read-ahead hint: warm the block cache through this.read, one piece after the other,
    // so a CACHE holds at most one piece however long it is (up to 4 GiB); the session
    // counts exactly that against the connection's in-flight bound. The bytes are not
    // needed, so one buffer serves every piece. A failed piece ends the warm-up (a hint
    // changes nothing a read returns; nothing is retried against a failing store), so the
    // buffer is never reused after a failure, while a late fetch may still write into it.
    const piece = 1024 * 1024; // CACHE_PIECE_BYTES in nbd/backend.ts (test/unit/session-bounds.test.ts holds them equal)
    const end = offset + length;
    const buf = Buffer.allocUnsafe(Math.min(length, piece));
    try {
      for (let pos = offset; pos < end; pos += buf.length) {
        const n = Math.min(buf.length, end - pos);
        await this.read(pos, n, n === buf.length ? buf : buf.subarray(0, n));
      }
    } catch { /* see above */ }
  }

  // ------------------------------------------------------------------ writes

  private checkWritable(): void {
    if (this.fencedError) throw this.fencedError;
    if (this.draining) throw new ShutdownError(`volume ${this.name} is being handed to another host`);
    this.checkDeadline();
    if (this.readOnly) throw new ReadOnlyError(`volume ${this.name} is open read-only`);
    if (this.closed) throw new ShutdownError(`volume ${this.name} is closed`);
  }

  private get heldBytes(): number {
    let n = this.dirtyBytes;
    for (const s of this.sealed) n += s.bytes;
    return n;
  }

  /** Writes wait here, in arrival order, while buffered data is over the hard limit. */
  private async admit(): Promise<void> {
    if (this.writeWaiters.length === 0 && this.heldBytes < this.hardLimit) return;
    await new Promise<void>((resolve) => {
      this.writeWaiters.push(resolve);
      this.kickCommit();
    });
    this.checkWritable();
  }

  private wakeWriters(): void {
    while (this.writeWaiters.length > 0 && (this.heldBytes < this.hardLimit || this.fencedError || this.closed)) this.writeWaiters.shift()!();
  }

  async write(offset: number, data: Buffer, fua: boolean): Promise<void> {
    this.checkWritable();
    await this.admit();
    this.dirty.set(offset, data.length, { buf: this.copyIn(data) });
    this.dirtyBytes += data.length;
    this.afterMutation();
    if (fua) await this.flush();
  }

  /** Copy a write into the arena (small writes) or an own buffer (large), so the caller's buffer is not retained. */
  private copyIn(data: Buffer): Buffer {
    if (data.length >= 64 * 1024) {
      // A large payload that owns its whole ArrayBuffer can be kept as it is: no copy.
      if (data.byteOffset === 0 && data.byteLength === data.buffer.byteLength) return data;
      return Buffer.from(data);
    }
    if (this.arenaUsed + data.length > this.arena.length) {
      this.arena = Buffer.allocUnsafe(ARENA_CHUNK);
      this.arenaUsed = 0;
    }
    const out = this.arena.subarray(this.arenaUsed, this.arenaUsed + data.length);
    data.copy(out);
    this.arenaUsed += data.length;
    return out;
  }

  async trim(offset: number, length: number, fua: boolean): Promise<void> {
    this.checkWritable();
    await this.admit();
    this.dirty.set(offset, length, HOLE);
    this.afterMutation();
    if (fua) await this.flush();
  }

  async zero(offset: number, length: number, o: ZeroOptions): Promise<void> {
    this.checkWritable();
    // Zeroing is a map operation, always faster than writing: FAST_ZERO never has to refuse.
    await this.admit();
    this.dirty.set(offset, length, o.mayTrim ? HOLE : ZERO);
    this.afterMutation();
    if (o.fua) await this.flush();
  }

  private afterMutation(): void {
    if (this.heldBytes >= this.softLimit) this.kickCommit();
  }

  /** Start a background commit if none is running, or make sure one follows the running one. */
  private kickCommit(): void {
    if (this.fencedError || this.closed) return;
    if (!this.commitRunning) void this.startCommit().catch((err) => this.log.warn({ err: errorMessage(err) }, 'background commit failed; data stays dirty'));
    else if (!this.nextCommit) this.nextCommit = deferred();
  }

  // ------------------------------------------------------------------ flush / commit

  async flush(): Promise<void> {
    if (this.fencedError) throw this.fencedError;
    if (this.readOnly) return;
    if (!this.commitRunning) {
      if (this.dirty.isEmpty() && this.sealed.length === 0) return;
      return this.startCommit();
    }
    // The running commit sealed before this call: this flush needs the next commit.
    if (!this.nextCommit) this.nextCommit = deferred();
    return this.nextCommit.promise;
  }

  /**
   * A failed commit leaves its data buffered. If writers are parked over the hard limit (or
   * the buffer is over the soft limit), nothing else would start the next attempt until a
   * client writes or flushes again, so retry with backoff (500 ms doubling to 30 s) while that
   * is so. An idle volume with nothing buffered never has a timer.
   */
  private retryTimer: NodeJS.Timeout | null = null;
  private retryDelayMs = 0;

  private scheduleRetry(): void {
    if (this.retryTimer || this.closed || this.fencedError || this.commitRunning) return;
    if (this.writeWaiters.length === 0 && this.heldBytes < this.softLimit) return;
    this.retryDelayMs = Math.min(Math.max(this.retryDelayMs * 2, 500), 30_000);
    // Not unref'd: buffered data that must still land keeps the process alive.
    this.retryTimer = setTimeout(() => { this.retryTimer = null; this.kickCommit(); }, this.retryDelayMs);
  }

  private startCommit(): Promise<void> {
    const p = this.commit().then(
      () => { this.retryDelayMs = 0; },
      (err: unknown) => { setImmediate(() => this.scheduleRetry()); throw err; },
    ).finally(() => {
      this.commitRunning = null;
      this.wakeWriters();
      const next = this.nextCommit;
      this.nextCommit = null;
      if (!next) return;
      if (this.fencedError) next.reject(this.fencedError);
      else if (this.dirty.isEmpty() && this.sealed.length === 0) next.resolve();
      else this.startCommit().then(next.resolve, next.reject);
    });
    this.commitRunning = p;
    return p;
  }

  private async commit(): Promise<void> {
    if (!this.dirty.isEmpty()) {
      this.sealed.push({ map: this.dirty, bytes: this.dirtyBytes });
      this.dirty = new ExtentMap<Dirty>(sliceDirty);
      this.dirtyBytes = 0;
      this.arena = Buffer.alloc(0); // sealed buffers keep their chunks alive; new writes start a new one
      this.arenaUsed = 0;
    }
    if (this.sealed.length === 0) return;
    this.checkDeadline();
    if (this.ambiguous) await this.resolveAmbiguous();
    if (this.sealed.length === 0) return;

    const batchLength = this.sealed.length;
    let merged = this.sealed[0]!.map;
    if (batchLength > 1) {
      merged = merged.clone();
      for (let i = 1; i < batchLength; i++) for (const e of this.sealed[i]!.map.entries()) merged.set(e.offset, e.length, e.value);
    }
    const seq = this.nextSeq;
    const nonce = randomBytes(4).toString('hex');

    // Pack the data in volume order: full segments are uploaded separately, the rest rides
    // inline in the log record.
    const extents: RecordExtent[] = [];
    const segments: { key: string; size: number; parts: Buffer[] }[] = [];
    let parts: Buffer[] = [];
    let partBytes = 0;
    const sealSegment = (): void => {
      segments.push({ key: keys.segment(this.id, seq, nonce, segments.length), size: partBytes, parts });
      parts = [];
      partBytes = 0;
    };
    // Extents pointing at the not-yet-sealed tail use SRC_INLINE; fixed up when the tail becomes a segment.
    let tailExtents: RecordExtent[] = [];
    for (const e of merged.entries()) {
      const v = e.value;
      if (isZero(v)) { extents.push([e.offset, e.length, v.hole ? SRC_HOLE : SRC_ZERO, 0]); continue; }
      let done = 0;
      while (done < e.length) {
        const n = Math.min(e.length - done, this.segmentBytes - partBytes);
        const x: RecordExtent = [e.offset + done, n, SRC_INLINE, partBytes];
        extents.push(x);
        tailExtents.push(x);
        parts.push(v.buf.subarray(done, done + n));
        partBytes += n;
        done += n;
        if (partBytes >= this.segmentBytes) {
          for (const t of tailExtents) t[2] = segments.length;
          tailExtents = [];
          sealSegment();
        }
      }
    }
    const inlineParts = parts;
    const inlineLength = partBytes;

    // Each segment is assembled just before its upload, not all at once: a big commit
    // would otherwise hold the event loop for the whole copy.
    const segBodies: Buffer[] = new Array(segments.length);
    await mapLimit(segments, this.uploadConcurrency, async (s, i) => {
      await new Promise((r) => setImmediate(r));
      const body = Buffer.concat(s.parts, s.size);
      segBodies[i] = body;
      await this.store.put(s.key, body);
    });

    const header: LogHeader = {
      v: 1, kind: 'commit', seq, volumeId: this.id, token: this.token, time: new Date().toISOString(),
      segments: segments.map((s) => ({ key: s.key, size: s.size })), extents, inlineLength,
    };
    const { body, dataStart } = encodeLogRecord(header, inlineParts);
    const key = keys.log(this.id, seq);
    const putId = randomBytes(8).toString('hex');
    const apply = (): void => {
      this.applyRecord(key, header, dataStart, body.length);
      this.blockCache.insertObject(key, body);
      segments.forEach((s, i) => this.blockCache.insertObject(s.key, segBodies[i]!));
      this.sealed.splice(0, batchLength);
      this.nextSeq = seq + 1;
      this.commits++;
      this.lastFlushAt = header.time;
      this.maybeCheckpoint();
    };
    try {
      await this.store.put(key, body, { ifNoneMatch: true, metadata: { 'baton-put-id': putId } });
    } catch (err) {
      if (err instanceof PreconditionFailedError) {
        this.fence(`log position ${seq} of volume ${this.name} was taken by another writer`);
        throw this.fencedError!;
      }
      // Unknown outcome: it may have landed. Remember how to recognise it.
      this.ambiguous = { seq, putId, batchLength, apply };
      throw err;
    }
    this.ambiguous = null;
    apply();
    // It landed, and is in the log for everyone; but if our lease ran out meanwhile, we do
    // not vouch for it to the client (EIO never claims the data is absent).
    this.checkDeadline();
    this.log.debug({ seq, segments: segments.length, inline: inlineLength, extents: extents.length }, 'committed');
  }

  /** A previous commit's put failed without an answer: find out whether it landed before going on. */
  private async resolveAmbiguous(): Promise<void> {
    const a = this.ambiguous!;
    const head = await this.store.head(keys.log(this.id, a.seq));
    if (!head) { this.ambiguous = null; return; } // it did not land; commit again at the same position
    if (head.metadata['baton-put-id'] === a.putId) {
      this.ambiguous = null;
      a.apply();
      this.log.info({ seq: a.seq }, 'an earlier commit whose reply was lost did land');
      return;
    }
    this.fence(`log position ${a.seq} of volume ${this.name} was taken by another writer`);
    throw this.fencedError!;
  }

  private fence(reason: string): void {
    if (this.fencedError) return;
    this.fencedError = new FencedError(`${reason}; this host no longer writes it (reattach to serve it again)`);
    this.log.error({ reason }, 'volume fenced: refusing further writes');
    this.wakeWriters();
    for (const cb of this.fencedListeners.splice(0)) cb(this.fencedError);
  }

  private readonly fencedListeners: ((err: FencedError) => void)[] = [];

  /** Called once when the volume fences itself (a terminal state: it never writes again). */
  onFenced(cb: (err: FencedError) => void): void {
    if (this.fencedError) queueMicrotask(() => cb(this.fencedError!));
    else this.fencedListeners.push(cb);
  }

  /** The volume's identity in the store (a new volume of the same name has another). */
  get volumeId(): string { return this.id; }

  private draining = false;

  /** Graceful handoff: refuse new writes (ESHUTDOWN) from now on; flush still works. */
  drain(): void { this.draining = true; }

  /** A handoff that could not complete: take writes again. */
  undrain(): void { this.draining = false; }

  /** For the lease layer: stop writing now (lease lost or handed over). */
  fenceLocally(reason: string): void { this.fence(reason); }

  get isFenced(): boolean { return this.fencedError !== null; }

  /**
   * A checkpoint costs time proportional to the map; replaying costs time proportional to
   * the records since the last one. Checkpoint when the replay would cost about as much:
   * at least every `checkpointEvery` records, and for a big map only every size/256.
   */
  private maybeCheckpoint(force = false): void {
    const since = this.nextSeq - 1 - this.lastCheckpointSeq;
    if (this.checkpointing || (!force && since < Math.max(this.checkpointEvery, Math.floor(this.committed.size / 256)))) return;
    const seq = this.nextSeq - 1;
    // Serialize now (a consistent snapshot at `seq`), upload in the background.
    const objects = new Map<string, number>();
    const ext: RecordExtent[] = [];
    for (const e of this.committed.entries()) {
      const v = e.value;
      if (isZero(v)) { ext.push([e.offset, e.length, v.hole ? SRC_HOLE : SRC_ZERO, 0]); continue; }
      let idx = objects.get(v.key);
      if (idx === undefined) { idx = objects.size; objects.set(v.key, idx); }
      ext.push([e.offset, e.length, idx, v.off]);
    }
    const cp: Checkpoint = {
      v: 1, volumeId: this.id, seq, token: this.highestTokenSeen, time: new Date().toISOString(),
      objects: [...objects.keys()].map((k) => [k, this.objectSizes.get(k) ?? 0]), extents: ext,
    };
    this.checkpointing = this.store.put(keys.checkpoint(this.id, seq), Buffer.from(JSON.stringify(cp)))
      .then(() => { this.lastCheckpointSeq = Math.max(this.lastCheckpointSeq, seq); this.log.debug({ seq }, 'checkpoint written'); })
      .catch((err) => this.log.warn({ seq, err: errorMessage(err) }, 'checkpoint failed; recovery replays more log'))
      .finally(() => { this.checkpointing = null; });
  }

  /**
   * Compaction: rewrite the live bytes of this volume's own objects that are mostly dead
   * (live / size below `below`), through the normal write and commit path: the data goes
   * into the write buffer and a flush commits it under this writer's token, fenced like any
   * write. The old objects become unreferenced and garbage collection deletes them later.
   *
   * Only objects under this volume's id are rewritten: an inherited object is shared with
   * the parent (rewriting it would add bytes, not free them). A snapshot of this volume
   * may still need a compacted object; GC keeps it until that snapshot is removed.
   *
   * A client write that lands while a piece is being read wins: a piece is copied into the
   * buffer only if, after the read, the map still points at the same object bytes (checked
   * and copied in one synchronous step).
   */
  async compact(opts: { below: number; maxBytes?: number }): Promise<CompactionResult> {
    this.checkWritable();
    const { victims, objectBytes: victimBytes } = this.compactionCandidates(opts.below);
    const pieces: { offset: number; length: number; key: string; off: number }[] = [];
    let planned = 0;
    const maxBytes = opts.maxBytes ?? Infinity;
    for (const e of this.committed.entries()) {
      const v = e.value;
      if (isZero(v) || !victims.has(v.key)) continue;
      if (planned >= maxBytes) break;
      for (let d = 0; d < e.length; d += 1024 * 1024) {
        pieces.push({ offset: e.offset + d, length: Math.min(1024 * 1024, e.length - d), key: v.key, off: v.off + d });
      }
      planned += e.length;
    }
    let rewritten = 0;
    await mapLimit(pieces, 8, async (p) => {
      await this.admit();
      this.checkWritable();
      const buf = Buffer.allocUnsafe(p.length);
      await this.blockCache.read(this.store, p.key, this.objectSize(p.key), p.off, p.length, buf, 0, 0);
      this.checkWritable();
      this.resolve(p.offset, p.length, (q) => {
        const v = q.value;
        if (v === undefined || isZero(v) || !('key' in v) || v.key !== p.key || v.off !== p.off + (q.offset - p.offset)) return;
        this.dirty.set(q.offset, q.length, { buf: buf.subarray(q.offset - p.offset, q.offset - p.offset + q.length) });
        this.dirtyBytes += q.length;
        rewritten += q.length;
      });
      this.afterMutation();
    });
    await this.flush();
    this.log.info({ objects: victims.size, objectBytes: victimBytes, rewritten }, 'compacted');
    return { objects: victims.size, objectBytes: victimBytes, rewrittenBytes: rewritten };
  }

  /** This volume's own objects whose live fraction is below `below` (what compact() would rewrite). */
  compactionCandidates(below: number): { victims: Set<string>; objectBytes: number; liveBytes: number } {
    const prefix = keys.volumePrefix(this.id);
    const live = new Map<string, number>();
    for (const e of this.committed.entries()) {
      const v = e.value;
      if (!isZero(v) && v.key.startsWith(prefix)) live.set(v.key, (live.get(v.key) ?? 0) + e.length);
    }
    const victims = new Set<string>();
    let objectBytes = 0;
    let liveBytes = 0;
    for (const [key, n] of live) {
      const size = this.objectSizes.get(key) ?? 0;
      if (size > 0 && n < below * size) { victims.add(key); objectBytes += size; liveBytes += n; }
    }
    return { victims, objectBytes, liveBytes };
  }

  /** The committed map (for diff and space accounting): [offset, length, key|null for zeroes, objectOffset]. */
  *committedExtents(): IterableIterator<{ offset: number; length: number; key: string | null; off: number }> {
    for (const e of this.committed.entries()) {
      const v = e.value;
      if (isZero(v)) yield { offset: e.offset, length: e.length, key: null, off: 0 };
      else yield { offset: e.offset, length: e.length, key: v.key, off: v.off };
    }
  }

  /** The last committed log position (what a fork of this volume, made now, would start from). */
  get lastCommittedSeq(): number { return this.nextSeq - 1; }

  stats(): VolumeStats {
    return {
      dirtyBytes: this.dirtyBytes, sealedBytes: this.heldBytes - this.dirtyBytes, commits: this.commits,
      lastCommitSeq: this.nextSeq - 1, lastFlushAt: this.lastFlushAt, extents: this.committed.size, fenced: this.isFenced,
    };
  }

  /**
   * Flush what is dirty (unless fenced) and stop. A writer leaves a checkpoint behind, so
   * the next host (a handoff, a later attach) recovers with one read instead of replaying
   * the log since the last one.
   */
  async close(): Promise<void> {
    if (!this.readOnly && !this.fencedError) {
      await this.flush();
      await this.checkpointing;
      if (this.nextSeq - 1 > this.lastCheckpointSeq && !this.fencedError) {
        this.maybeCheckpoint(true);
        await this.checkpointing;
      }
    }
    this.closed = true;
    if (this.retryTimer) { clearTimeout(this.retryTimer); this.retryTimer = null; }
    this.wakeWriters();
    await this.checkpointing;
  }
}

/** Run `fn` over `items` with at most `limit` in flight; results in input order. */
export async function mapLimit<T, R>(items: readonly T[], limit: number, fn: (item: T, index: number) => Promise<R>): Promise<R[]> {
  const out: R[] = new Array(items.length);
  let next = 0;
  const worker = async (): Promise<void> => {
    while (next < items.length) {
      const i = next++;
      out[i] = await fn(items[i]!, i);
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  return out;
}

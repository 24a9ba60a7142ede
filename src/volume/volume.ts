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
 *   Commits are pipelined: while one publishes its record (or finishes its last uploads),
 *   the next may seal and upload (see "Pipelined commits" at commit()).
 * - A failed commit keeps every sealed overlay; the next commit includes them, so dirty data
 *   is never dropped and a later flush can never succeed without it ("fsyncgate").
 * - The committed extent map (cow/) says which object and offset holds each byte. Reads
 *   resolve, synchronously and newest first, dirty -> sealed -> committed, then fetch
 *   committed pieces through the local block cache.
 * - Memory is bounded: past `dirtySoftLimit` a background commit starts; past
 *   `dirtyHardLimit` writes wait (in arrival order) until a commit frees memory.
 * - Guest mutations (write, trim, zero) take effect in the order they were called, waiting or
 *   not (see admitThen): overlapping writes of one burst end as the last one sent.
 * - TRIM and WRITE_ZEROES are map operations: no zero bytes are uploaded.
 * - No store request runs on a timer: an idle volume makes none. (The one timer a volume may
 *   have once idle lets go of its free segment bodies, 2-4 s after the last upload: BodyPool.)
 * - Fencing: a create-only put that finds its log position taken by a record with another
 *   id means another writer committed there. This engine then refuses every later write and
 *   flush (FencedError -> EIO) for good: a fenced volume is terminal (onFenced tells the
 *   serving layer, which disconnects its clients and drops it; the next attach recovers
 *   from the store). See takeover() for the protocol that relies on this, and "The log is a
 *   chain" for why a stale writer cannot make a record visible even at a position garbage
 *   collection freed.
 */

import { strict as assert } from 'node:assert';
import { CACHE_PIECE_BYTES, type BlockBackend, type Extent, type ZeroOptions } from '../../nbd/backend.js';
import { NBD_STATE_HOLE, NBD_STATE_ZERO } from '../../nbd/constants.js';
import { ExtentMap, REGION_SIZE, type FrozenExtentMap, type Piece } from '../../cow/extent-map.js';
import { PackedExtentMap, type LocationCodec } from '../../cow/packed-map.js';
import type { BlockCache } from '../cache.js';
import { BatonError, ChecksumError, CorruptError, KeyError, FencedError, LeaseLostError, NotFoundError, OutOfRangeError, PreconditionFailedError, ReadOnlyError, ShutdownError, errorMessage } from '../errors.js';
import { randomId, systemWorld, turnBudget, type TimerHandle, type World } from '../clock.js';
import type { Logger } from '../log.js';
import { Hydration, type HydrateOptions, type HydrationStatus, type ObjectPiece } from './hydrate.js';
import { WorkingSet } from './working-set.js';
import { BodyPool, type BodyLease } from '../body-pool.js';
import { DurationHistogram } from '../histogram.js';
import { Slots } from '../slots.js';
import { PUT_ID_META } from '../store/decorators.js';
import { listAll, type LocalObjects, type ObjectStore } from '../store/object-store.js';
import {
  CHECKPOINT_CHUNK, CHECKPOINT_RANGE_BYTES, CHUNK_MS, SRC_HOLE, type MetaKey, SRC_INLINE, SRC_ZERO, checkCheckpoint, dataSettings, decodeCheckpoint, decodeLogHeader, decodeVolumeRecord, encodeCheckpoint, encodeLogRecord, fenceAfter, readCheckpointInRanges,
  followsChain, framedSegmentRef, inlineFrames, keys, logHeaderEnd, maxOperationMs, recordCounts, segmentFrames, seqFromKey, timeBounds,
  type CheckpointData, type DataSettings, type LogHeader, type RecordExtent, type VolumeRecord, type WorkingSetData,
} from './format.js';
import { ENCODE_SLICE, FRAME_BYTES, compressionAvailable, concatInSlices, copyFromBlocks, copyFromFrames, encodeObject, finishDirectRead, forgetBlockCrcs, planBlockRead, planDirectRead, rememberBlockCrcs, rememberedBlockCrcs, lengthsToString, type BlockRead, type EncodeOptions, type FrameIndex, type FrameKeys } from './frames.js';

/** A guest mutation waiting for room in the write buffer (Volume.admitThen). */
interface WriteWaiter {
  apply(): void;
  resolve(): void;
  reject(err: unknown): void;
}

/** The lease token is not above the highest one in the log: re-acquire with `minToken`. */
export class StaleTokenError extends BatonError {
  constructor(readonly minToken: number, message: string) { super('BATON_ERR_LEASE_LOST', message); }
}

// ------------------------------------------------------------------ map values

/**
 * Where committed bytes live: object `key` (of `size` stored bytes) at `off`, or zeroes. The
 * size travels with the map entry, so the volume keeps no table of objects: its memory follows
 * its live map, not its history. A framed object (issue 16) carries its frame index `fr`, and
 * `off` is then a logical offset into it (frames.ts); for a raw one (written before) `fr` is
 * null and `off` a stored offset.
 */
export type Loc = { key: string; off: number; size: number; fr: FrameIndex | null } | ZeroLoc;
export interface ZeroLoc { zero: true; hole: boolean }
const HOLE: ZeroLoc = { zero: true, hole: true };
const ZERO: ZeroLoc = { zero: true, hole: false };

function isZero(v: Loc | Dirty): v is ZeroLoc { return (v as ZeroLoc).zero === true; }

/**
 * A piece of a read that needs no store: a hole or zeroes (zero-filled) or buffered bytes
 * (copied), into out[at, at + len); false, with nothing done, for a piece in an object.
 */
function copyHeld(v: Loc | Dirty | undefined, out: Buffer, at: number, len: number): v is ZeroLoc | { buf: Buffer } | undefined {
  if (v === undefined || isZero(v)) out.fill(0, at, at + len);
  else if ('buf' in v) v.buf.copy(out, at, 0, len);
  else return false;
  return true;
}

type ObjectLoc = Exclude<Loc, ZeroLoc>;

/**
 * The committed map is packed (cow/packed-map.ts: no object per extent, so a map of 10M
 * extents is not 20M objects for V8's GC to mark): zeroes are its constants (-1 hole,
 * -2 allocated zeroes), an object location is "offset `off` of source `key`", the key
 * interned once per map. Slicing and merging are the packed map's location arithmetic:
 * zeroes of one kind, or the next bytes of the same object, merge. An object has one size
 * and one frame index, so they travel with the interned key (the first value seen for it).
 */
const LOC_CODEC: LocationCodec<Loc> = {
  constant: (v) => (isZero(v) ? (v.hole ? -1 : -2) : 0),
  ofConstant: (c) => (c === -1 ? HOLE : ZERO),
  source: (v) => (v as ObjectLoc).key,
  at: (v) => (v as ObjectLoc).off,
  locate: (first, off) => ({ key: (first as ObjectLoc).key, off, size: (first as ObjectLoc).size, fr: (first as ObjectLoc).fr }),
};
const newCommittedMap = (): PackedExtentMap<Loc> => new PackedExtentMap<Loc>(LOC_CODEC);

/** A buffered write: bytes in memory, or zeroes. */
type Dirty = { buf: Buffer } | ZeroLoc;
const sliceDirty = (v: Dirty, d: number): Dirty => (isZero(v) ? v : { buf: v.buf.subarray(d) });
/**
 * Buffered writes merge when their bytes lie one after the other in one buffer (small
 * sequential writes copied into the arena): the merged view spans both.
 */
const joinDirty = (a: Dirty, n: number, b: Dirty): Dirty | undefined => {
  if (isZero(a) || isZero(b)) return isZero(a) && isZero(b) && a.hole === b.hole ? a : undefined;
  if (a.buf.buffer !== b.buf.buffer || a.buf.byteOffset + n !== b.buf.byteOffset) return undefined;
  return { buf: Buffer.from(a.buf.buffer, a.buf.byteOffset, n + b.buf.length) };
};
const DIRTY_MAP = { join: joinDirty };

/**
 * A piece of memory the data of buffered writes is copied into (Volume.copyPieces), reused
 * once nothing can read it any more. `holds` counts what may still read it: the allocator
 * while it fills it, each write whose bytes were copied in and that has not yet reached a
 * layer (it may wait at the hard limit, admit), and each layer (the dirty overlay or a sealed
 * one) whose map may name bytes in it. At zero it goes back to the free list.
 *
 * Why a layer's hold may end when the layer lands (publish): the bytes of buffered writes are
 * only ever read by (1) reads, which copy them out synchronously (Volume.read), (2) pack, whose
 * segment parts are views of them, used by upload to assemble a body (a copy: concatInSlices,
 * or the frames of encodeObject, whose raw frames are views again) and, for a local store, by
 * putParts, whose writes have all completed when the attempt's upload resolved, before its
 * record is put. A landed layer is out of every map and its attempt's uploads are done. An
 * attempt that was dropped may still be encoding or writing its segments after the layer's
 * next attempt landed: it then reads reused memory, but nothing will ever name what it
 * writes (a dropped attempt is never published), so that is harmless. A remote store may go
 * on sending a body after its put gave up (RetryingObjectStore abandons an attempt): those
 * bodies are always copies (concatInSlices), never views of the arena.
 */
interface ArenaChunk { buf: Buffer; holds: number }

/** Buffered writes no longer open for new writes: being committed, or left by a failed commit. */
interface Sealed {
  map: ExtentMap<Dirty>;
  bytes: number;
  /** Arena chunks its map may name bytes in (one hold each: ArenaChunk). */
  chunks: Set<ArenaChunk>;
  /**
   * The attempt committing this layer, if any. Attempts are made for the oldest layer that
   * has none, and an attempt that does not land takes every later one with it (dropAfter),
   * so the layers with attempts are always a prefix of `sealed`, in log order.
   */
  attempt?: CommitAttempt | undefined;
}

/** One run of commit() (startCommit): the attempts it publishes, and its outcome for flushes. */
interface CommitRun {
  done: Promise<void> | null;
}

/**
 * One attempt to commit the oldest sealed layer at log position `seq`, as explicit steps:
 * pack (synchronous: the layer becomes segments + a log record), upload (segments), publish
 * (the create-only put of the record: the commit point). Its outcome is one of
 * - landed: the put succeeded, or the record at `seq` carries this attempt's id;
 * - taken: the record at `seq` has another id: another writer committed there (fenced);
 * - ambiguous: the put failed without an answer. The attempt is kept whole (same bytes,
 *   same id) and published again before anything else is committed, so a retry is always
 *   recognisable as the same commit: re-putting it either lands, or finds the position
 *   holding its own id (landed) or another's (fenced). A new body is never put at a
 *   position an earlier attempt may have taken.
 */
interface CommitAttempt {
  seq: number;
  /** The record's id (also its put-id metadata). */
  id: string;
  header: LogHeader;
  /** The record's bytes; for a framed attempt built once its frames are encoded (upload), then never again. */
  body: Buffer;
  dataStart: number;
  /**
   * Its segments: `logical` bytes in `parts` until upload encodes them (framed: `parts`
   * become the frames, `size` their stored bytes; raw: `size` = `logical`).
   */
  segments: { key: string; size: number; logical: number; body?: Buffer; bodyLease?: BodyLease | null; parts: Buffer[]; frames?: Uint32Array }[];
  /** Framed attempts: the inline data's logical parts (encoded in upload into the record). */
  inlineParts: Buffer[] | null;
  /** The sealed layer it commits (its `attempt` while this attempt lives; sealed[0] when it publishes). */
  layer: Sealed;
  state: 'packed' | 'uploaded' | 'ambiguous';
  /** The attempt at seq - 1 still in flight when this one was packed (it must land first), if any. */
  after: CommitAttempt | null;
  /** Resolves when this attempt's record landed; rejects when it will not (the attempts after it are dropped). */
  landed: Deferred;
  /** The run publishing it; null for an ambiguous attempt whose run ended (the next run takes it over). */
  owner: CommitRun | null;
  /** Dropped from its layer before it could publish (an earlier attempt did not land, or its upload failed). */
  dropped: boolean;
  /** Why: the error of the attempt that did not land (its run's flushes fail with it). */
  droppedBy?: unknown;
  /** World time when it was packed: its commit latency runs from here to landing, retries included. */
  startedAt: number;
}

const EMPTY = Buffer.alloc(0);
/** Framed reads of up to this many stored bytes use pooled buffers (readObject's scratch), at most SCRATCH_POOL of them per volume. */
const SCRATCH_BYTES = 1024 * 1024 + 64 * 1024;
const SCRATCH_POOL = 8;

/** Commits in flight at once: one publishing its record while the next seals and uploads. */
const PIPELINE_DEPTH = 2;
/** The most data a commit with segments carries inline in its record (pack). */
const INLINE_TAIL_MAX = 256 * 1024;

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
  /** A checkpoint bigger than this is read in ranges of this size (readCheckpointInRanges); tests make it small. */
  checkpointRangeBytes?: number;
  /** Parallel segment uploads per commit. */
  uploadConcurrency?: number;
  /** See maxOperationMs() in format.ts (GC's safety margin); defaults to it. */
  maxOperationMs?: number;
  /** Time and randomness (src/clock.ts); the real ones by default, a simulated one in the simulator. */
  world?: World;
  /** false: new frames are stored uncompressed whatever the record says (serve --compression off). */
  compress?: boolean;
  /** The keys of an encrypted volume (keys.ts), given by the catalog after checking the master key. */
  frameKeys?: FrameKeys | null;
}

export interface VolumeStats {
  dirtyBytes: number;
  sealedBytes: number;
  commits: number;
  /** Bytes the landed commits put into the store: segments and log records. */
  committedBytes: number;
  lastCommitSeq: number;
  lastFlushAt: string | null;
  extents: number;
  /** Extents in the write buffer (dirty and sealed layers). */
  bufferedExtents: number;
  fenced: boolean;
  /** Chunks in the working set (working-set.ts). */
  workingSetChunks: number;
  /** Memory of the write arena (ArenaChunk): chunks being filled, holding buffered writes, or free for reuse. */
  arenaBytes: number;
  /** Guest writes, trims and zeroes that waited for room at the hard limit since the volume opened (admitThen). */
  parkedWrites: number;
  /** The background hydration started at open (hydrate.ts), if any. */
  hydration: HydrationStatus | null;
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
/** Volume.maxConcurrentReads on a local store. */
const LOCAL_READS_AT_ONCE = 16;
/**
 * Arena chunks kept while nothing is buffered (more are kept while data flows: up to the hard
 * limit's worth). One: a volume whose writes all landed keeps 1 MiB for its next write, not
 * the chunk it was filling plus a burst's free ones (5 MiB per open idle volume before).
 */
const ARENA_IDLE_KEEP = 1;

/**
 * Free segment bodies a volume keeps while it writes (65 MiB at the default 8 MiB segments).
 * Bodies come back a few at a time, as the cache writes their blocks two at a time, so a few
 * cover most takes: on radosgw a 1 GiB `nbdcopy --flush` cost 3.0-3.2 CPU-s per GiB with 8
 * kept, 2.9-3.1 with 16, 3.1-4.1 with 4, 5.4-11.4 with none (bench/README.md, issue 11,
 * session 20).
 */
const BODIES_KEPT = 8;
/** How many recent read ends the sequential-reader detection keeps (Volume.readEnds). */
const READ_ENDS_KEPT = 256;
/** Sequential prefetch (Volume.prefetchAhead): from this streak on, this far ahead, this much at a time. */
const PREFETCH_STREAK = 3;
const PREFETCH_WINDOW = 128 * 1024 * 1024;
const PREFETCH_STEP = 8 * 1024 * 1024;
const PREFETCH_IN_FLIGHT = 16;
const PREFETCH_STREAMS = 8;
/**
 * A checkpoint also follows this many new working-set chunks (64 MiB of volume) once at least
 * WS_CHECKPOINT_RECORDS records were committed since the last one (instead of checkpointEvery;
 * maybeCheckpoint): the working set a host that crashes leaves to the next is then at most
 * about that much behind. (The log after the checkpoint adds what was written since; what was
 * only read since is what a crash loses.) In the background, like every checkpoint: a flush
 * never waits for it.
 */
const WS_CHECKPOINT_CHUNKS = 256;
const WS_CHECKPOINT_RECORDS = 8;
/** Hydration of a whole volume (`all`) walks it this much at a time, after the working set. */
const HYDRATE_ALL_WINDOW = 16 * 1024 * 1024;

export class Volume implements BlockBackend {
  /** The size clients see; only grows while open (grow()). */
  private sizeNow: number;
  get size(): number { return this.sizeNow; }
  /**
   * What log records and checkpoints are validated against: the largest size this volume (and,
   * for a fork, its ancestors up to the fork point) ever had (format.ts VolumeRecord.recoverySize).
   * A volume shrunk with --shrink had no data past its new end, but its older records may
   * still name extents there (later trimmed): they stay readable, and name no data.
   */
  private recoverySize: number;
  readonly readOnly: boolean;
  private readonly store: ObjectStore;
  /**
   * The store's objects are local files (ObjectStore.local): reads go to them in place and
   * never through the block cache, which would only copy them to the same disk; segments are
   * put as the pieces the writes brought. Undefined for a remote store.
   */
  private readonly local: LocalObjects | undefined;
  /**
   * A local store's reads are a pread and a check on this thread: 16 at a time per
   * connection keep it busy (nbdkit's default thread count), where 64 (nbdcopy's queue) held
   * 64 reply buffers each (BlockBackend.maxConcurrentReads).
   */
  get maxConcurrentReads(): number | undefined { return this.local ? LOCAL_READS_AT_ONCE : undefined; }
  private readonly world: World;
  private readonly blockCache: BlockCache;
  private readonly log: Logger;
  private readonly id: string;
  private token: number;

  private committed = newCommittedMap();
  private dirty = new ExtentMap<Dirty>(sliceDirty, DIRTY_MAP);
  /**
   * Uncommitted work in the dirty overlay, in bytes: written bytes, and the length of every
   * trim and zeroed range. Trims and zeroes hold no data, but they are changes a crash would
   * lose and map entries in memory; counting them like writes makes them start commits (soft
   * limit) and wait for them (hard limit): 400k trims once made no commit and no backpressure.
   */
  private dirtyBytes = 0;
  private readonly sealed: Sealed[] = [];
  /** The arena chunk being filled (held by the allocator), and how much of it is used. */
  private arena: ArenaChunk | null = null;
  private arenaUsed = 0;
  /** Chunks the dirty overlay holds (Sealed.chunks once sealed). */
  private dirtyChunks = new Set<ArenaChunk>();
  /** Arena chunks nothing holds, ready for reuse (bounded: releaseChunk). */
  private readonly arenaFree: ArenaChunk[] = [];
  /** Arena chunks in existence (being filled, held, or free): VolumeStats.arenaBytes. */
  private arenaChunks = 0;

  private nextSeq = 1;
  private lastCheckpointSeq = 0;
  /** The checkpoint upload in progress, if any (one at a time). */
  private checkpointing: Promise<void> | null = null;
  /** Runs of commit() in flight (at most PIPELINE_DEPTH). */
  private readonly runs = new Set<Promise<void>>();
  /** Flushes (and background kicks) waiting for a commit to start once a run ends. */
  private nextCommit: Deferred | null = null;
  /** Segment uploads in flight over all attempts (at most uploadConcurrency), and the ones waiting, oldest attempt first. */
  private readonly uploadSlots: Slots;
  /** Segment bodies in reused memory (src/body-pool.ts says when a body may be reused). */
  private readonly bodies: BodyPool;
  /**
   * The id of the log record at nextSeq - 1 as this volume applied it ('' before a volume's
   * first record; undefined when unknown: v1 records and checkpoints). See "The log is a chain".
   */
  private lastRecordId: string | undefined = '';
  private fencedError: FencedError | null = null;
  private closed = false;
  private readonly writeWaiters: WriteWaiter[] = [];
  /** VolumeStats.parkedWrites. */
  private parkedWrites = 0;
  /**
   * Where recent reads ended, and how long a sequential run each ended: a read starting at
   * one of them continues a sequential reader, however its requests interleave with others
   * (nbdcopy keeps 64 reads in flight per connection over several connections, so "the
   * previous read" was rarely the one this continues, and a cold sequential read made one
   * GET per request). Recorded when a read starts, not when it ends, for the same reason.
   * Bounded: the oldest entry goes first.
   */
  private readonly readEnds = new Map<number, number>();
  private commits = 0;
  /** Bytes landed commits put (their segments and records), for serve --metrics. */
  private committedBytes = 0;
  /** Seal to landing of each landed commit (serve --metrics reads it at scrape time). */
  readonly commitSeconds = new DurationHistogram();
  private lastFlushAt: string | null = null;
  /**
   * What this volume's clients read and wrote lately (working-set.ts): loaded from the
   * checkpoint recovery started from (an ancestor's for a fork that has none), plus the data
   * the log after it wrote; written into every checkpoint; what the next host hydrates.
   */
  private workingSet = new WorkingSet();
  /** The background fetch of the working set started at open (startHydration), if any. */
  private hydration: Hydration | null = null;

  private readonly segmentBytes: number;
  private readonly softLimit: number;
  private readonly hardLimit: number;
  private readonly checkpointEvery: number;
  private readonly checkpointRangeBytes: number;
  /** GC's time bounds (format.ts timeBounds): a view never reads through a map older than viewMaxAgeMs. */
  private readonly viewMaxAgeMs: number;
  /** How this volume stores data (its record's settings: format.ts DataSettings). */
  private readonly data: DataSettings;
  /** How new frames are encoded (compression, this writer's data key, nonces). */
  private readonly encodeOptions: EncodeOptions;
  /** The keys that decrypt an encrypted volume's frames (null: not encrypted, or not given: then no data is read). */
  private readonly frameKeys: FrameKeys | null;
  /** When the committed map was last brought up to date with the log (read-only views of live volumes). */
  private mapLoadedAt = 0;
  private refreshing: Promise<void> | null = null;

  private constructor(private readonly record: VolumeRecord, private readonly opts: VolumeOptions) {
    this.sizeNow = record.size;
    this.recoverySize = Math.max(record.size, record.recoverySize ?? 0);
    this.id = record.id;
    this.readOnly = opts.readOnly;
    this.store = opts.store;
    this.local = opts.store.local;
    this.blockCache = opts.cache;
    this.log = opts.log.child({ volume: record.name });
    this.token = opts.token ?? 0;
    this.world = opts.world ?? systemWorld;
    this.segmentBytes = opts.segmentBytes ?? 8 * 1024 * 1024;
    this.softLimit = opts.dirtySoftLimit ?? 64 * 1024 * 1024;
    this.hardLimit = Math.max(opts.dirtyHardLimit ?? 256 * 1024 * 1024, this.softLimit + 32 * 1024 * 1024);
    this.checkpointEvery = opts.checkpointEvery ?? 64;
    this.checkpointRangeBytes = opts.checkpointRangeBytes ?? CHECKPOINT_RANGE_BYTES;
    this.uploadSlots = new Slots(opts.uploadConcurrency ?? 16);
    // A segment's stored bytes exceed its logical ones by its frames' headers and checks (well
    // under 1 %); a longer body is allocated on its own. BODIES_KEPT free ones at most.
    this.bodies = new BodyPool(this.segmentBytes + Math.ceil(this.segmentBytes / 64) + 4096, BODIES_KEPT, 2000, this.world);
    this.viewMaxAgeMs = timeBounds(opts.maxOperationMs ?? maxOperationMs()).viewMaxAgeMs;
    this.data = dataSettings(record);
    this.frameKeys = opts.frameKeys ?? null;
    const encrypted = this.data.encryption !== undefined;
    // Never a plaintext frame in an encrypted volume: a writer must have its data key (the
    // catalog refuses the attach before this, with the reason: KeyError). Read-only views
    // without keys (GC, accounting, diff) read maps, never data.
    assert(!encrypted || this.readOnly || this.frameKeys?.writeKey, `volume ${record.name} is encrypted: a writer needs its data key`);
    assert(encrypted || !this.frameKeys?.writeKey, `volume ${record.name} is not encrypted: no data key`);
    this.encodeOptions = {
      compress: this.data.compression === 'lz4' && opts.compress !== false && compressionAvailable,
      key: this.frameKeys?.writeKey ?? null,
      random: (n) => this.world.randomBytes(n),
    };
  }

  get name(): string { return this.record.name; }

  /** Open a volume: latest checkpoint, then replay the log after it. */
  static async open(record: VolumeRecord, opts: VolumeOptions): Promise<Volume> {
    const v = new Volume(record, opts);
    await v.recover();
    // From here on the guest's reads and writes are this session's (its boot set: working-set.ts).
    v.workingSet.beginSession();
    // A writer without a lease commits under the fence it recovered: it fences nobody, and
    // its acknowledged records must count at the next recovery (token 0 would be ignored
    // below an earlier lease holder's takeover). A lease holder's takeover() replaces it.
    if (opts.token === undefined) v.token = v.highestTokenSeen;
    return v;
  }

  /**
   * ## The log is a chain
   * Every record (v2) carries a random id and the id of the record before it as its writer
   * applied it (`prev`). Recovery and every replay accept a record only if it follows the
   * one before it (format.ts followsChain), and a checkpoint only if the first record after
   * it names the checkpoint's last record. Why this is needed: garbage collection deletes
   * log records a checkpoint covers, which frees their positions. A stale writer (paused
   * after its last deadline check, its put stretched by retries) may then re-create such a
   * position with a create-only put that succeeds. Its record names as `prev` the record it
   * had applied, while the true successor of that position names the record the live
   * writers saw there; so the stale record never joins a chain: a replay from before it
   * (a read-only view catching up) breaks at the successor and reloads from the newest
   * checkpoint, and recovery from the newest checkpoint never reads positions at or below
   * it. The top position is never freed (GC keeps every live id's newest record), so a
   * stale record always has a successor. Checkpoints are written create-only, so a stale
   * writer cannot replace one either; and a freed position is at or below a checkpoint that
   * stays the newest or is superseded by a newer one, so a stale checkpoint is never the
   * newest (and the chain rejects it if an older one is ever tried).
   */
  private async recover(): Promise<void> {
    const t0 = this.world.now();
    this.mapLoadedAt = t0;
    let base = 'empty';
    let fromSeq = 0;
    // Newest checkpoint first. Only a definitely unusable one (corrupt, gone, or not followed
    // by the log) sends us to an older one; any other error (the store unreachable) fails
    // the open: falling back on a transient error ends in a misleading "record missing".
    const cps = (await listAll(this.store, keys.checkpointPrefix(this.id))).reverse();
    for (const cp of cps) {
      const c = await this.readCheckpoint(cp.key, cp.size);
      if (!c || !(await this.resetTo(c, cp.key))) continue;
      try {
        const replayed = await this.replayLog();
        this.lastCheckpointSeq = c.seq;
        this.log.info({ seq: this.nextSeq - 1, checkpoint: c.seq, replayed, extents: this.committed.size, ms: Math.round(this.world.now() - t0) }, 'volume recovered');
        return;
      } catch (err) {
        if (!(err instanceof ChainBrokenError) || err.seq !== c.seq + 1) throw err;
        this.log.error({ key: cp.key, err: errorMessage(err) }, 'checkpoint is not followed by the log (a stale writer\'s?); trying an older one');
      }
    }
    this.committed = newCommittedMap();
    this.highestTokenSeen = 0;
    this.lastRecordId = '';
    this.workingSet = new WorkingSet();
    if (this.record.parent) {
      // A fork that has not written its own checkpoint yet: start from the parent's state,
      // and from the parent's working set at the fork point (a fork's first attach hydrates
      // what the parent was working on).
      ({ map: this.committed, ws: this.workingSet } = await this.ancestorMap(this.record.parent.id, this.record.parent.seq, 1));
      base = `parent ${this.record.parent.id}@${this.record.parent.seq}`;
    }
    this.lastCheckpointSeq = fromSeq;
    this.nextSeq = fromSeq + 1;
    const replayed = await this.replayLog();
    this.log.info({ seq: this.nextSeq - 1, checkpoint: 0, base, replayed, extents: this.committed.size, ms: Math.round(this.world.now() - t0) }, 'volume recovered');
  }

  /**
   * A checkpoint (`size` bytes, as listed), or null if it is corrupt or gone (then an older
   * one may be tried). A big one is read in ranges as its extents are walked: then its crc is
   * checked, and a read may find it gone, only during the walk (mapOf says so).
   */
  private readCheckpoint(key: string, size: number): Promise<CheckpointData | null> {
    return this.unlessUnusable(key, async () => {
      if (size > this.checkpointRangeBytes) {
        // A range past the object's end: it is not the object listed (gone and made again since): unusable, as if gone.
        const read = (offset: number, length: number): Promise<Buffer> => this.store.get(key, { offset, length }).catch((err: unknown) => {
          throw err instanceof OutOfRangeError ? new CorruptError(`${key}: not the ${size} bytes listed (${errorMessage(err)})`) : err;
        });
        const ranged = await readCheckpointInRanges({ size, read }, key, this.checkpointRangeBytes, this.metaKeyFor(key));
        if (ranged) return ranged;
      }
      const body = await this.store.get(key);
      await checkCheckpoint(body, key, () => this.world.yield(), this.metaKeyFor(key));
      return decodeCheckpoint(body, key, { checked: true });
    });
  }

  /**
   * The map checkpoint `c` holds, or null if the walk found it unusable (a checkpoint read in
   * ranges is checked as it is walked: its crc at the end, and it may be found gone; the map
   * built so far is then dropped, and an older checkpoint may be tried).
   */
  private mapOf(c: CheckpointData, key: string): Promise<PackedExtentMap<Loc> | null> {
    return this.unlessUnusable(key, () => mapOfCheckpoint(c, this.recoverySize, this.world));
  }

  /**
   * What `step` on checkpoint `key` gives, or null (logged) if it found the checkpoint
   * unusable: corrupt or gone, so that an older one may be tried. Any other error (the store
   * unreachable) fails the open: falling back on it would end in a misleading "record missing".
   */
  private async unlessUnusable<T>(key: string, step: () => Promise<T>): Promise<T | null> {
    try {
      return await step();
    } catch (err) {
      if (!(err instanceof CorruptError || err instanceof NotFoundError)) throw err;
      this.log.warn({ key, err: errorMessage(err) }, 'skipping unreadable checkpoint');
      return null;
    }
  }

  /** Start from checkpoint `c` of this volume; false (nothing changed) if it turned out unusable. */
  private async resetTo(c: CheckpointData, key: string): Promise<boolean> {
    const map = await this.mapOf(c, key);
    if (!map) return false;
    this.committed = map;
    this.highestTokenSeen = c.token;
    this.lastRecordId = c.lastId;
    this.nextSeq = c.seq + 1;
    this.workingSet = await workingSetOf(c, this.size, this.world);
    return true;
  }

  /**
   * The map of ancestor `id` as of its log record `seq`: its newest usable checkpoint at or
   * below `seq` (or its own parent's state) plus its log up to `seq`, under the same token
   * and chain rules as our own log, starting from the ancestor checkpoint's fence. With it the
   * working set as of `seq`: that checkpoint's, plus what the log up to `seq` wrote.
   */
  private async ancestorMap(id: string, seq: number, depth: number): Promise<{ map: PackedExtentMap<Loc>; ws: WorkingSet }> {
    if (depth > 10_000) throw new CorruptError(`volume ${this.name}: ancestry deeper than 10000 (a cycle?)`);
    // endAt: an ancestor's later checkpoints and records are not wanted (GC's record of what
    // this recovery read then does not change when the ancestor is written: gc.ts).
    const cps = (await listAll(this.store, keys.checkpointPrefix(id), { endAt: keys.checkpoint(id, seq) })).filter((o) => seqFromKey(o.key) <= seq).reverse();
    for (const cp of cps) {
      const c = await this.readCheckpoint(cp.key, cp.size);
      if (!c) continue;
      const map = await this.mapOf(c, cp.key);
      if (!map) continue;
      const ws = await workingSetOf(c, this.size, this.world);
      try {
        await this.replayInto(map, id, c.seq, seq, { fence: c.token, lastId: c.lastId, ws });
        return { map, ws };
      } catch (err) {
        if (!(err instanceof ChainBrokenError) || err.seq !== c.seq + 1) throw err;
        this.log.error({ key: cp.key, err: errorMessage(err) }, 'ancestor checkpoint is not followed by its log; trying an older one');
      }
    }
    const meta = await this.readMeta(id);
    const { map, ws } = meta.parent ? await this.ancestorMap(meta.parent.id, meta.parent.seq, depth + 1) : { map: newCommittedMap(), ws: new WorkingSet() };
    await this.replayInto(map, id, 0, seq, { fence: 0, lastId: '', ws });
    return { map, ws };
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

  /**
   * Read the records of volume `id` after position `after` (up to `upTo`), check them, then
   * apply the ones that count to `map`. Nothing is applied unless every record checked:
   * contiguous positions, headers that say where they are, and an unbroken chain. Returns
   * the state after the last record. With `ws`, the data each applied record wrote is touched
   * in it, in log order (the newest writes are the most recent part of the working set).
   */
  private async replayInto(map: PackedExtentMap<Loc>, id: string, after: number, upTo: number, state: { fence: number; lastId: string | undefined; ws?: WorkingSet }):
    Promise<{ seq: number; fence: number; lastId: string | undefined; records: number }> {
    const listed = await listAll(this.store, keys.logPrefix(id), {
      ...(after > 0 ? { startAfter: keys.log(id, after) } : {}),
      ...(upTo !== Infinity ? { endAt: keys.log(id, upTo) } : {}),
    });
    const logs = listed.filter((o) => seqFromKey(o.key) <= upTo);
    // Fetch headers with bounded parallelism, check and apply strictly in order.
    const headers = await mapLimit(logs, 16, (o) => this.readLogHeader(o.key, o.size));
    let expect = after + 1;
    let lastId = state.lastId;
    for (let i = 0; i < logs.length; i++) {
      const seq = seqFromKey(logs[i]!.key);
      if (seq !== expect) throw new CorruptError(`volume ${this.name}: log record ${expect} of ${id} is missing (found ${seq}); refusing to guess`);
      const { header } = headers[i]!;
      if (header.seq !== seq || header.volumeId !== id) throw new CorruptError(`${logs[i]!.key}: header says seq ${header.seq} of volume ${header.volumeId}`);
      if (!followsChain(header, lastId)) throw new ChainBrokenError(seq, `${logs[i]!.key} does not follow the record before it (it names ${header.prev}, the log holds ${lastId}): a stale writer's record or checkpoint at a position garbage collection freed`);
      lastId = header.id;
      expect++;
    }
    if (upTo !== Infinity && expect - 1 !== upTo) throw new CorruptError(`volume ${this.name}: ancestor ${id} is missing log records in (${after}, ${upTo}]`);
    let fence = state.fence;
    for (let i = 0; i < logs.length; i++) {
      const { header, dataStart } = headers[i]!;
      if (recordCounts(header, fence)) {
        applyRecord(map, this.recoverySize, logs[i]!.key, header, dataStart, logs[i]!.size);
        if (state.ws) for (const [off, len, src] of header.extents) if (src !== SRC_HOLE && src !== SRC_ZERO) state.ws.touch(off, len);
        fence = fenceAfter(header, fence);
      } else {
        this.log.error({ key: logs[i]!.key, token: header.token, fence }, 'ignoring a log record from a fenced writer');
      }
    }
    return { seq: expect - 1, fence, lastId, records: logs.length };
  }

  /**
   * Apply every record of our own log after the ones already applied. Used by recovery, by
   * read-only views catching up, and when a create-only put finds its position taken (to
   * learn what the other writer committed).
   */
  private async replayLog(): Promise<number> {
    const r = await this.replayInto(this.committed, this.id, this.nextSeq - 1, Infinity, { fence: this.highestTokenSeen, lastId: this.lastRecordId, ws: this.workingSet });
    this.nextSeq = r.seq + 1;
    this.highestTokenSeen = r.fence;
    this.lastRecordId = r.lastId;
    return r.records;
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
   * - Our own map is old (found by the simulator, seed 93471): its next position may be one
   *   GC freed, below the real end. The create-only put then succeeds in a hole; landing is
   *   confirmed only once no record sits above it (below), else we reload and go again.
   */
  async takeover(token: number): Promise<void> {
    assert(this.runs.size === 0 && this.sealed.length === 0, 'a takeover is the first write of a writer: no commit in flight');
    for (let attempt = 0; attempt < 20; attempt++) {
      if (token <= this.highestTokenSeen) {
        throw new StaleTokenError(this.highestTokenSeen, `token ${token} is not above the log's ${this.highestTokenSeen}`);
      }
      const seq = this.nextSeq;
      const header = this.newHeader('takeover', seq, token, [], [], 0);
      const key = keys.log(this.id, seq);
      const { body, dataStart } = encodeLogRecord(header, [], this.authFor(key));
      try {
        await this.store.put(key, body, { ifNoneMatch: true, metadata: { [PUT_ID_META]: header.id! } });
      } catch (err) {
        if (!(err instanceof PreconditionFailedError)) throw err;
        // Another writer's record (or our own earlier attempt, whose token then counts as
        // seen and makes the lease layer re-acquire higher): learn it, try the next position.
        await this.replayLog();
        continue;
      }
      this.landRecord(key, header, dataStart, body.length);
      // A free position is not always the end of the log: GC frees positions below the
      // newest checkpoint, so a map loaded long ago (an open that waited through an outage
      // or a re-acquire) may name one of those as its next. A takeover landed there is in
      // no chain (recovery starts above it, "The log is a chain"), so nobody would ever
      // see it or the commits after it: acknowledging those would lose them. GC never
      // frees the top record of a live log, so the position was the end if and only if
      // no record sits above it. Otherwise: reload from the newest checkpoint, try again
      // at the real end (the orphan record stays in its hole; GC collects it).
      if (await this.logContinuesAfter(seq)) {
        this.log.warn({ seq, token }, 'takeover landed at a log position garbage collection had freed (this map was older than the log); reloading and trying again at the end of the log');
        await this.reload();
        continue;
      }
      this.token = token;
      this.log.info({ seq, token }, 'takeover record committed');
      // A fork's first checkpoint flattens its ancestry: later opens need no parent at all.
      if (this.record.parent && this.lastCheckpointSeq === 0) this.maybeCheckpoint(true);
      return;
    }
    throw new FencedError(`volume ${this.name}: could not commit a takeover record (the log keeps moving: is another host writing?)`);
  }

  /**
   * A header at `seq`, chained to the record this volume applied before it: v3 (framed data)
   * unless the volume stores raw data (then v2, the layout before issue 16).
   */
  private newHeader(kind: LogHeader['kind'], seq: number, token: number, segments: LogHeader['segments'], extents: RecordExtent[], inlineLength: number, after: CommitAttempt | null = null,
    v: 2 | 3 = this.data.format === 'raw' ? 2 : 3): LogHeader {
    assert(seq === (after ? after.seq + 1 : this.nextSeq), `header for position ${seq} while the log is at ${this.nextSeq}${after ? ` and an attempt for ${after.seq} is in flight` : ''}`);
    return {
      v, kind, seq, volumeId: this.id, token, time: this.world.wallTime().toISOString(), segments, extents, inlineLength,
      ...(v === 3 ? { frameBytes: FRAME_BYTES } : {}),
      id: randomId(this.world, 12), prev: after ? after.id : this.lastRecordId ?? '',
    };
  }

  /** Our own record landed at the next position: it is in the log for everyone. */
  private landRecord(key: string, h: LogHeader, dataStart: number, recordSize: number): void {
    assert(h.seq === this.nextSeq, `landing position ${h.seq} while the log is at ${this.nextSeq}`);
    applyRecord(this.committed, this.recoverySize, key, h, dataStart, recordSize);
    this.highestTokenSeen = fenceAfter(h, this.highestTokenSeen);
    this.lastRecordId = h.id;
    this.nextSeq = h.seq + 1;
  }

  /**
   * The lease's local deadline: past it this host acknowledges no write and no flush, and
   * answers no read. Why reads too: once the deadline passed, another host may have taken
   * the lease over and acknowledged writes this map has never seen, so an answer from it
   * could be older than an acknowledged flush (a client that moved on to the new host, or
   * a second client, would see time go backwards). A read that started before the deadline
   * is answered as of its start, which is still inside our lease: the lease service only
   * lets another host in after our deadline (it is measured from when the renewal was sent).
   */
  setWriteDeadline(deadline: () => number): void {
    this.writeDeadline = deadline;
  }

  private writeDeadline: (() => number) | null = null;

  private checkDeadline(): void {
    if (this.writeDeadline && this.world.now() >= this.writeDeadline()) {
      this.fence('the lease could not be renewed in time');
      throw new LeaseLostError(`volume ${this.name}: this host's lease expired; reads and writes are refused (reattach to serve it again)`);
    }
  }

  private async readLogHeader(key: string, size: number): Promise<{ header: LogHeader; dataStart: number }> {
    const first = Math.min(size, 64 * 1024);
    let b = await this.store.get(key, { offset: 0, length: first });
    const need = logHeaderEnd(b, key);
    if (need > b.length) {
      if (need > size) throw new CorruptError(`${key}: header length past the end of the object`);
      b = await this.store.get(key, { offset: 0, length: need });
    }
    return decodeLogHeader(b, key, this.metaKeyFor(key));
  }

  /**
   * How this writer authenticates its log record or checkpoint at `objectKey`: an encrypted
   * volume's are (format.ts MAC), so a bucket writer cannot change where its extents point.
   */
  private authFor(objectKey: string): { metaKey: Buffer; objectKey: string } | undefined {
    const k = this.frameKeys?.writeMetaKey;
    return k ? { metaKey: k, objectKey } : undefined;
  }

  /**
   * What a read of log record or checkpoint `objectKey` checks (MetaKey): with keys, the MAC
   * its volume's records must carry. A view without keys (GC, accounting, diff) checks crcs
   * only: it reads maps to keep or count objects and never serves data (reads need the keys).
   */
  private metaKeyFor(objectKey: string): MetaKey {
    return this.frameKeys ? this.frameKeys.metaKey(objectKey) : undefined;
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
    if (this.world.now() - this.mapLoadedAt <= this.viewMaxAgeMs) return;
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
    const t0 = this.world.now();
    try {
      await this.replayLog();
      this.mapLoadedAt = t0;
      return;
    } catch (err) {
      if (!(err instanceof CorruptError) && !(err instanceof NotFoundError)) throw err;
      this.log.info({ err: errorMessage(err) }, 'log moved past this view; reloading from the newest checkpoint');
    }
    await this.reload();
  }

  /** Replace the committed map by a fresh recovery (newest checkpoint + log), swapped in whole. */
  private async reload(): Promise<void> {
    const fresh = await Volume.open(this.record, this.opts);
    this.committed = fresh.committed;
    this.nextSeq = fresh.nextSeq;
    this.lastRecordId = fresh.lastRecordId;
    this.highestTokenSeen = fresh.highestTokenSeen;
    this.lastCheckpointSeq = fresh.lastCheckpointSeq;
    this.mapLoadedAt = fresh.mapLoadedAt;
  }

  /** Whether any log record sits above position `seq` (one LIST, stopped at the first key). */
  private async logContinuesAfter(seq: number): Promise<boolean> {
    for await (const o of this.store.list(keys.logPrefix(this.id), { startAfter: keys.log(this.id, seq) })) {
      void o;
      return true;
    }
    return false;
  }

  /** A writer's map is the truth only while it holds the lease (setWriteDeadline) and is not fenced. */
  private checkReadable(): void {
    if (this.fencedError) throw this.fencedError;
    this.checkDeadline();
  }

  async read(offset: number, length: number, into?: Buffer): Promise<Buffer> {
    this.checkReadable();
    if (this.followsLog) await this.refreshIfStale();
    const out = into ?? Buffer.allocUnsafe(length);
    this.workingSet.touch(offset, length, true);
    // Streaks feed the block cache's readahead and prefetch; a local store has neither.
    const streak = this.local ? 0 : this.sequentialStreak(offset, length);
    if (streak >= PREFETCH_STREAK) this.prefetchAhead(offset + length);
    const fetches: { key: string; size: number; off: number; len: number; outOff: number; fr: FrameIndex | null }[] = [];
    this.resolve(offset, length, (p) => {
      const v = p.value;
      if (!copyHeld(v, out, p.offset - offset, p.length)) fetches.push({ key: v.key, size: v.size, off: v.off, len: p.length, outOff: p.offset - offset, fr: v.fr });
    });
    if (fetches.length > 0) {
      // While hydration runs, what this read needs goes to the front of its queue (the read
      // itself does not wait for it: its misses are fetched below, at once), and a miss makes
      // hydration step back for a moment (hydrate.ts).
      const h = this.hydration;
      if (h?.isRunning && !this.local) {
        for (const f of fetches) {
          const st = storedRange(f);
          if (this.blockCache.wouldFetch(f.key, f.size, st.off, st.len)) h.guestMissed();
          h.promote(f.key, st.off, st.len);
        }
      }
      // A local store's objects are read where they lie; others through the block cache,
      // sequential readers with a growing readahead window (readObject).
      const readahead = streak > 0 ? (128 * 1024) << streak : 0;
      const fetch = (f: typeof fetches[number]): Promise<void> => this.readObject(f.key, f.size, f.fr, f.off, f.len, out, f.outOff, readahead);
      // Settle every fetch before answering, also when one fails: each writes into `out`,
      // and the caller may hand `out` to another request (a pooled buffer) once this
      // settles. Nothing may write into it after that.
      const results = await Promise.allSettled(fetches.map(fetch));
      for (const r of results) if (r.status === 'rejected') throw r.reason;
    }
    return out;
  }

  /**
   * BlockBackend.readNow: read() answered before returning, when no piece of the range needs
   * a wait: holes, bytes in memory, and stored pieces readStoredNow can read now (a local
   * store's files open already, or blocks in the read cache). Same checks, same bytes as
   * read(); what is not like that (a read-only view that follows a log, a running hydration,
   * an unopened file, a block not cached, a failed check) returns false before the read is
   * recorded (the working set and the sequential streaks are touched only on success), and
   * read() does it all again, so every failure is handled, logged and retried in one place
   * (readChecked). While hydration runs, read() also tells it what the guest wants.
   */
  readNow(offset: number, length: number, into: Buffer): boolean {
    if (this.followsLog || (this.local ? !this.local.readNow : this.hydration?.isRunning)) return false;
    this.checkReadable();
    let done = true;
    this.resolve(offset, length, (p) => {
      const v = p.value;
      const at = p.offset - offset;
      if (copyHeld(v, into, at, p.length) || this.readObjectNow(v.key, v.fr, v.off, p.length, into, at)) return true;
      return (done = false);
    });
    if (!done) return false;
    this.workingSet.touch(offset, length, true);
    // As read(): streaks feed the block cache's prefetch; a local store has none.
    if (!this.local && this.sequentialStreak(offset, length) >= PREFETCH_STREAK) this.prefetchAhead(offset + length);
    return true;
  }

  /** Stored bytes [off, off+len) of `key` into out[outOff..] now (LocalObjects.readNow or BlockCache.readNow), or false. */
  private readStoredNow(key: string, off: number, len: number, out: Buffer, outOff: number): boolean {
    return this.local ? this.local.readNow!(key, off, len, out, outOff) : this.blockCache.readNow(key, off, len, out, outOff);
  }

  /**
   * readObject's reads that need no wait (readStoredNow), checked as readObject checks them:
   * a raw object's range; part of one frame in blocks (planBlockRead), its crc entries (or
   * the ones remembered after an earlier check: rememberBlockCrcs) and blocks read into
   * nowScratch and checked there (copyFromBlocks) before a byte reaches `out`; whole frames
   * too: a local file's raw ones read straight into `out` and checked
   * there (planDirectRead, as readObject does), others read into a scratch buffer and decoded
   * (copyFromFrames). False when it would wait, when the volume is encrypted and its keys are
   * not here, or when a check failed (read() reads it again and reports it; `out` may hold
   * unchecked bytes until then, which read() overwrites). nowScratch and the scratch buffer
   * are used only within one synchronous run.
   */
  private readObjectNow(key: string, fr: FrameIndex | null, off: number, len: number, out: Buffer, outOff: number): boolean {
    if (fr === null) return this.readStoredNow(key, off, len, out, outOff);
    if (this.data.encryption && !this.frameKeys) return false;
    try {
      const r = planBlockRead(fr, off, len, this.data.encryption !== undefined);
      if (r === null) {
        const sp = fr.span(off, len);
        // Whole raw frames in a local file (a sequential reader's): straight into `out`, checked there.
        const direct = this.local?.readvNow ? planDirectRead(fr, off, len, out, outOff) : null;
        if (direct) {
          if (!this.local!.readvNow!(key, sp.start, direct.parts)) return false;
          finishDirectRead(key, direct, this.frameKeys);
          return true;
        }
        const stored = this.takeScratch(sp.end - sp.start);
        const got = this.readStoredNow(key, sp.start, sp.end - sp.start, stored, 0);
        if (got) copyFromFrames(key, fr, stored, off, len, out, outOff, this.frameKeys);
        this.returnScratch(stored);
        return got;
      }
      const need = r.tableLength + r.dataLength;
      if (this.nowScratch.length < need) this.nowScratch = Buffer.allocUnsafe(Math.max(need, FRAME_BYTES + 1024));
      const table = this.nowScratch.subarray(0, r.tableLength);
      const data = this.nowScratch.subarray(r.tableLength, need);
      const remembered = rememberedBlockCrcs(fr, r, table);
      if (!remembered && !this.readStoredNow(key, r.tableStart, r.tableLength, table, 0)) return false;
      if (!this.readStoredNow(key, r.dataStart, r.dataLength, data, 0)) return false;
      try {
        copyFromBlocks(key, r, table, data, out, outOff);
      } catch (err) {
        if (remembered) forgetBlockCrcs(fr, r);
        throw err;
      }
      if (!remembered) rememberBlockCrcs(fr, r, table);
      return true;
    } catch (err) {
      if (err instanceof ChecksumError) return false;
      throw err;
    }
  }

  private nowScratch = Buffer.alloc(0);

  /**
   * Bytes [off, off+len) of object `key` (`size` stored bytes) into out[outOff..]: in place for
   * a local store, else through the block cache (`readahead`: stored bytes to fetch beyond).
   * A framed object (`fr`) is read as the stored range of the frames that hold those logical
   * bytes, or for part of one frame stored in blocks as the range of those blocks
   * (planBlockRead), and every frame or block is checked before a byte of it is copied (frames.ts). One
   * whose check fails is never returned: the error is logged with the object and frame, its
   * cached blocks are dropped, and the range is read once more straight from the store; a
   * second failure is a ChecksumError (EIO to the client). A raw object (written before issue
   * 16) has nothing to check and is read as before. On a local store, whole raw frames (what a
   * sequential reader of incompressible data asks for) are read straight into `out` and checked
   * there (planDirectRead): `out` holds unchecked bytes until then, which is why nothing may
   * use it before this settles (Volume.read) and a failure leaves it to the caller's error path.
   */
  private async readObject(key: string, size: number, fr: FrameIndex | null, off: number, len: number, out: Buffer, outOff: number, readahead: number): Promise<void> {
    const local = this.local;
    if (fr === null) {
      if (local) await local.read(key, off, len, out, outOff);
      else await this.blockCache.read(this.store, key, size, off, len, out, outOff, readahead);
      return;
    }
    if (this.data.encryption && !this.frameKeys) throw new KeyError(`volume ${this.name} is encrypted and was opened without its key: its data cannot be read`);
    // Part of one frame stored in blocks (a random reader's 4 KiB): only its blocks are read
    // and checked (readBlocks). Else whole frames, each checked before a byte of it is copied.
    const blocks = planBlockRead(fr, off, len, this.data.encryption !== undefined);
    if (blocks !== null) return this.readBlocks(key, size, blocks, out, outOff, readahead);
    const sp = fr.span(off, len);
    const n = sp.end - sp.start;
    const decode = (stored: Buffer): void => copyFromFrames(key, fr, stored, off, len, out, outOff, this.frameKeys);
    const where = { key, start: sp.start, end: sp.end };
    if (local) {
      // Checked and decoded in the store's own buffer, lent for as long as that takes.
      const view = (): Promise<void> => local.view(key, sp.start, n, decode);
      // Raw frames wholly inside the range (a sequential reader's): read straight into `out`,
      // each payload where its bytes belong, and checked there before the read returns.
      const direct = planDirectRead(fr, off, len, out, outOff);
      const inPlace = direct && (async (): Promise<void> => {
        await local.readv(key, sp.start, direct.parts);
        finishDirectRead(key, direct, this.frameKeys);
      });
      return this.readChecked(where, inPlace ? [inPlace, view, view] : [view, view]);
    }
    return this.readChecked(where, [
      async () => {
        const stored = this.takeScratch(n);
        await this.blockCache.read(this.store, key, size, sp.start, n, stored, 0, readahead);
        decode(stored);
        // Only here: the read into it has settled and every byte taken from it was copied out.
        this.returnScratch(stored);
      },
      async () => {
        this.blockCache.forget(key, sp.start, n);
        decode(await this.store.get(key, { offset: sp.start, length: n }));
      },
    ]);
  }

  /**
   * The reads of stored bytes that readObject tries in turn, each checking what it read
   * (frames.ts): the next one runs only if the one before failed its check (ChecksumError),
   * which is logged with the object and frame; the last one's failure is the read's (EIO to
   * the client), logged as such. Any other error ends it at once.
   */
  private async readChecked(where: Record<string, unknown>, attempts: (() => Promise<void>)[]): Promise<void> {
    for (let i = 0; ; i++) {
      try {
        await attempts[i]!();
        return;
      } catch (err) {
        if (!(err instanceof ChecksumError)) throw err;
        const last = i === attempts.length - 1;
        this.log.error({ ...where, frame: err.frame, reason: err.reason }, last
          ? 'stored data failed its check again: the read fails (EIO), no bytes of it are returned'
          : 'stored data failed its check; reading it again from the store');
        if (last) throw err;
      }
    }
  }

  /**
   * readObject of part of one frame stored in blocks (planBlockRead): its crc table entries and
   * its blocks, two small reads, checked as copyFromBlocks says; a failed check is handled as
   * readObject's (readChecked: the cached blocks dropped, read once more from the store, then EIO).
   */
  private async readBlocks(key: string, size: number, r: BlockRead, out: Buffer, outOff: number, readahead: number): Promise<void> {
    const local = this.local;
    const attempt = async (fromStore: boolean): Promise<void> => {
      if (fromStore) {
        const [t, d] = await Promise.all([this.store.get(key, { offset: r.tableStart, length: r.tableLength }), this.store.get(key, { offset: r.dataStart, length: r.dataLength })]);
        copyFromBlocks(key, r, t, d, out, outOff);
        return;
      }
      const table = Buffer.allocUnsafe(r.tableLength);
      if (local) {
        await local.read(key, r.tableStart, r.tableLength, table, 0);
        await local.view(key, r.dataStart, r.dataLength, (data) => copyFromBlocks(key, r, table, data, out, outOff));
        return;
      }
      // Dropped, not pooled, if anything fails: a read still in flight may land in it.
      const data = this.takeScratch(r.dataLength);
      await Promise.all([
        this.blockCache.read(this.store, key, size, r.tableStart, r.tableLength, table, 0),
        this.blockCache.read(this.store, key, size, r.dataStart, r.dataLength, data, 0, readahead),
      ]);
      copyFromBlocks(key, r, table, data, out, outOff);
      this.returnScratch(data);
    };
    return this.readChecked({ key, table: r.tableStart, data: r.dataStart }, [
      () => attempt(false),
      () => {
        if (local) return attempt(false); // the store is the file: read it once more
        this.blockCache.forget(key, r.tableStart, r.dataStart + r.dataLength - r.tableStart);
        return attempt(true);
      },
    ]);
  }

  /**
   * Buffers for the stored bytes of framed reads (a new 256 KiB buffer per read was 18 % of a
   * framed read's CPU in allocation and GC). A buffer is in the pool only while no read uses
   * it: readObject takes one before its read into it and gives it back only after the read
   * settled and the decoded bytes were copied out (copyFromFrames is synchronous and returns
   * views of it that are copied before it returns); on any failure the buffer is dropped, so
   * a read that may still land in it can never reach another request's bytes.
   */
  private readonly scratch: Buffer[] = [];

  private takeScratch(n: number): Buffer {
    if (n > SCRATCH_BYTES) return Buffer.allocUnsafe(n);
    return (this.scratch.pop() ?? Buffer.allocUnsafe(SCRATCH_BYTES)).subarray(0, n);
  }

  private returnScratch(b: Buffer): void {
    if (b.buffer.byteLength === SCRATCH_BYTES && b.byteOffset === 0 && this.scratch.length < SCRATCH_POOL) this.scratch.push(Buffer.from(b.buffer, 0, SCRATCH_BYTES));
  }

  /**
   * Keep the store busy ahead of sequential readers: the per-read readahead extends a miss
   * only to the end of its object, so a cold sequential read had as many GETs in flight as
   * objects its requests' window spans (a few), where the store gives its bandwidth at 16
   * (volume bench, `stream`). Each sequential stream has a frontier: how far past its reads
   * the committed pieces are being (or were) read into the block cache, PREFETCH_STEP at a
   * time, up to PREFETCH_WINDOW ahead and PREFETCH_IN_FLIGHT steps in flight over all streams
   * (nbdcopy reads four regions at once, one per connection: a single frontier jumped between
   * them and re-planned a window each time). A read ending within a window behind a frontier
   * (or a step past it) is that stream's; another starts a new one, the least recently used
   * of PREFETCH_STREAMS giving way. Within a quarter of the cache, so prefetched blocks are
   * not evicted before they are read. Only committed pieces are fetched (buffered ones are in
   * memory), and a failed prefetch costs nothing but the reads that then miss.
   */
  private readonly prefetchFrontiers: number[] = []; // least recently used first
  private prefetchSteps = 0;

  private prefetchAhead(end: number): void {
    const window = Math.min(PREFETCH_WINDOW, Math.floor(this.blockCache.capacityBytes / 4));
    if (window < PREFETCH_STEP || this.closed) return;
    const fronts = this.prefetchFrontiers;
    const i = fronts.findIndex((f) => f >= end - PREFETCH_STEP && f <= end + window);
    let frontier = i < 0 ? end : Math.max(fronts[i]!, end);
    if (i >= 0) fronts.splice(i, 1);
    else if (fronts.length >= PREFETCH_STREAMS) fronts.shift();
    const stop = Math.min(end + window, this.size);
    while (this.prefetchSteps < PREFETCH_IN_FLIGHT && frontier < stop && (frontier + PREFETCH_STEP <= stop || stop === this.size)) {
      const from = frontier;
      const len = Math.min(PREFETCH_STEP, this.size - from);
      frontier = from + len;
      const pieces: ObjectPiece[] = [];
      this.committedPieces(from, len, pieces);
      if (pieces.length === 0) continue;
      // Each piece extended to a step's worth of its object: steps are cut at volume offsets,
      // objects are not, and a piece per step made two GETs of most objects (and smaller ones
      // where they crossed the reads' own misses). Blocks cached or in flight are skipped.
      this.prefetchSteps++;
      void Promise.all(pieces.map((q) => this.blockCache.prefetch(this.store, q.key, q.size, q.off, Math.max(q.len, PREFETCH_STEP))))
        .finally(() => { this.prefetchSteps--; });
    }
    fronts.push(frontier);
  }

  /** 0 for a read that continues none of the recent ones, else 1 + the run it continues (at most 6). */
  private sequentialStreak(offset: number, length: number): number {
    const before = this.readEnds.get(offset);
    const streak = before === undefined ? 0 : Math.min(before + 1, 6);
    if (before !== undefined) this.readEnds.delete(offset);
    this.readEnds.set(offset + length, streak);
    if (this.readEnds.size > READ_ENDS_KEPT) this.readEnds.delete(this.readEnds.keys().next().value!);
    return streak;
  }

  async blockStatus(offset: number, length: number, maxExtents: number): Promise<Extent[]> {
    this.checkReadable();
    // Work bounded by what the reply can carry (BlockBackend.blockStatus), not by the
    // range (up to 4 GiB) or its fragmentation: stop at maxExtents extents or after
    // `budget` map pieces (many same-flag pieces merge into one extent, so the extent count
    // alone bounds nothing), and reply with what was seen. The range is resolved one
    // map region at a time, because each resolve() builds the whole piece list of its range
    // before the visitor can stop it: a window bounds that to one region's pieces per layer
    // (ExtentMap's REGION_SIZE, below). All of it is synchronous, so the extents are one
    // consistent snapshot.
    const window = REGION_SIZE; // a window spans one map region
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
    // changes nothing a read returns; nothing is retried against a failing store).
    // `baton prefetch` sends these; through read() they also count in the working set.
    const piece = CACHE_PIECE_BYTES;
    const end = offset + length;
    const buf = Buffer.allocUnsafe(Math.min(length, piece));
    try {
      for (let pos = offset; pos < end; pos += buf.length) {
        const n = Math.min(buf.length, end - pos);
        await this.read(pos, n, n === buf.length ? buf : buf.subarray(0, n));
      }
    } catch { /* see above */ }
  }

  /**
   * The committed object pieces of a range that buffered writes do not cover (zeroes need
   * nothing), as stored ranges (for a framed object: its frames that hold them), which is what
   * the block cache holds: prefetch and hydration fetch these.
   */
  private committedPieces(offset: number, length: number, out: ObjectPiece[]): void {
    this.resolve(offset, length, (p) => {
      const v = p.value;
      if (v !== undefined && !isZero(v) && !('buf' in v)) {
        const st = storedRange({ fr: v.fr, off: v.off, len: p.length });
        out.push({ key: v.key, size: v.size, off: st.off, len: st.len });
      }
    });
  }

  /**
   * Start fetching the working set (and with `all`, then the rest) into the block cache in the
   * background (hydrate.ts). The serving layer calls it once the volume is recovered; a
   * running hydration is replaced. Nothing to do for a local store (its objects are read in
   * place) or with mode `off`.
   */
  startHydration(opts: HydrateOptions): Hydration | null {
    this.hydration?.stop();
    this.hydration = null;
    if (opts.mode === 'off' || this.local || this.closed || this.fencedError) return null;
    const ws = this.workingSet;
    const size = this.size;
    const all = opts.mode === 'all';
    const workingSetChunks = ws.size;
    const source = {
      workingSetChunks,
      *ranges(): IterableIterator<{ offset: number; length: number }> {
        yield* ws.ranges(size);
        if (all) for (let off = 0; off < size; off += HYDRATE_ALL_WINDOW) yield { offset: off, length: Math.min(HYDRATE_ALL_WINDOW, size - off) };
      },
      pieces: (offset: number, length: number, out: ObjectPiece[]): void => this.committedPieces(offset, length, out),
    };
    // Said at info only when there is something to hydrate (a new volume's first open has nothing).
    const log = workingSetChunks > 0 || all ? this.log : this.log.child({}, { level: 'warn' });
    log.info({ mode: opts.mode, workingSetChunks, workingSetBytes: workingSetChunks * ws.chunkBytes }, 'hydration started');
    this.hydration = new Hydration(source, this.blockCache, this.store, opts, this.world, log);
    return this.hydration;
  }

  /**
   * The ranges of the volume that hold data, in hydration order: the working set's chunks most
   * recently used first, then with `all` every other chunk in volume order; neighbours merged.
   * What `baton prefetch` asks a server to warm (NBD CACHE), from a read-only view of the map.
   */
  hydrationPlan(mode: 'working-set' | 'all'): { offset: number; length: number }[] {
    const out: { offset: number; length: number }[] = [];
    const push = (offset: number, length: number): void => {
      const last = out[out.length - 1];
      if (last && last.offset + last.length === offset) last.length += length;
      else out.push({ offset, length });
    };
    const cb = this.workingSet.chunkBytes;
    const seen = new Set<number>();
    for (const r of this.workingSet.ranges(this.size)) {
      seen.add(r.offset / cb);
      this.resolve(r.offset, r.length, (p) => { if (p.value !== undefined && !isZero(p.value)) push(p.offset, p.length); });
    }
    if (mode === 'all') {
      for (const e of this.committed.entries()) {
        if (isZero(e.value)) continue;
        for (let off = e.offset, end = e.offset + e.length; off < end;) {
          const next = Math.min(end, (Math.floor(off / cb) + 1) * cb);
          if (!seen.has(Math.floor(off / cb))) push(off, next - off);
          off = next;
        }
      }
    }
    return out;
  }

  /** The working set as a checkpoint would record it now (diagnostics, tests). */
  workingSetSnapshot(): WorkingSetData { return this.workingSet.snapshot(); }

  /** The running or finished hydration (null: none was started). */
  get hydrationStatus(): HydrationStatus | null { return this.hydration?.status() ?? null; }

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

  /** A mutation may take effect now: no earlier one waits, and buffered data is under the hard limit. */
  private admitsNow(): boolean {
    return this.writeWaiters.length === 0 && this.heldBytes < this.hardLimit;
  }

  /**
   * Admission of a guest mutation, and the order mutations take effect in. `apply` (the
   * mutation itself: synchronous, throws nothing) runs before this returns when admitsNow();
   * the result is then null. Otherwise it waits in writeWaiters and wakeWriters runs it, after
   * every earlier waiter's, before anything called later can apply (a later call finds the
   * queue non-empty and queues behind it): the promise settles once it ran, or rejects without
   * running it if the volume was fenced, closed or handed over meanwhile.
   *
   * Why apply is run here, not by the caller after an await: a mutation applied a microtask
   * after its admission could land after one called later that did not wait (writeNow, or
   * writeLent under the limit), and overlapping writes of one burst would end as the earlier
   * one (the protocol fuzzer found exactly that once the session's request loop stopped
   * awaiting between requests).
   */
  private admitThen(apply: () => void): Promise<void> | null {
    if (this.admitsNow()) { apply(); return null; }
    this.parkedWrites++;
    return new Promise<void>((resolve, reject) => {
      this.writeWaiters.push({ apply, resolve, reject });
      this.kickCommit();
    });
  }

  /** Run waiting mutations in arrival order while there is room (or refuse them all once the volume can no longer write). */
  private wakeWriters(): void {
    while (this.writeWaiters.length > 0 && (this.heldBytes < this.hardLimit || this.fencedError || this.closed)) {
      const w = this.writeWaiters.shift()!;
      try {
        this.checkWritable();
      } catch (err) {
        w.reject(err);
        continue;
      }
      w.apply(); // grows heldBytes: the loop stops again at the hard limit
      w.resolve();
    }
  }

  /** `data` is copied (as writeLent's pieces are): the caller may reuse it. */
  write(offset: number, data: Buffer, fua: boolean): Promise<void> {
    return this.writeLent(offset, [data], fua);
  }

  /**
   * A write whose pieces are lent (BlockBackend.writeLent): they are copied into the arena
   * before the first await, so the session reads its socket into buffers it reuses, and the
   * arena's chunks are reused once their layer landed (ArenaChunk). Before, each socket read
   * was a fresh 64 KiB buffer kept until its commit landed: a page fault per 4 KiB touched
   * (1 GiB `nbdcopy --flush` into `file:`: ~140k faults and 1.9 s of system time on the
   * event loop, on a VM whose host backs guest memory on first touch) and a major GC per
   * 64 MiB of external memory. The copy is done before admit() may wait: the pieces are the
   * socket's, reused as soon as this returns.
   */
  async writeLent(offset: number, chunks: readonly Buffer[], fua: boolean): Promise<void> {
    this.checkWritable();
    let length = 0;
    for (const c of chunks) length += c.length;
    const { pieces, pinned } = this.copyPieces(chunks, length);
    const waiting = this.admitThen(() => this.absorb(offset, length, pieces, pinned));
    if (waiting) {
      try {
        await waiting;
      } catch (err) {
        for (const c of pinned) this.releaseChunk(c);
        throw err;
      }
    }
    if (fua) await this.flush();
  }

  /**
   * BlockBackend.writeNow: writeLent of a write without FUA, done before returning when
   * admit() would not wait (no writer waits and buffered data is under the hard limit), so
   * the write costs no promise; false, having done nothing, when it would (then writeLent
   * waits its turn). The same copy and the same dirty overlay as writeLent: acknowledged
   * means buffered, as ever; only a FLUSH (or FUA) makes it durable.
   */
  writeNow(offset: number, chunks: readonly Buffer[]): boolean {
    if (!this.admitsNow()) return false;
    this.checkWritable();
    let length = 0;
    for (const c of chunks) length += c.length;
    const { pieces, pinned } = this.copyPieces(chunks, length);
    this.absorb(offset, length, pieces, pinned);
    return true;
  }

  /** A copied write (copyPieces) enters the dirty overlay: its holds pass to it (one per chunk: a second one is let go). */
  private absorb(offset: number, length: number, pieces: readonly Buffer[], pinned: readonly ArenaChunk[]): void {
    for (const c of pinned) {
      if (this.dirtyChunks.has(c)) this.releaseChunk(c);
      else this.dirtyChunks.add(c);
    }
    let pos = offset;
    for (const c of pieces) {
      this.dirty.set(pos, c.length, { buf: c });
      pos += c.length;
    }
    this.dirtyBytes += length;
    this.workingSet.touch(offset, length);
    this.afterMutation();
  }

  /**
   * Copy `chunks` (`length` bytes) into the arena: the pieces they land in (one per arena
   * chunk touched) and the chunks, each held once for this write (`pinned`) until it reaches
   * a layer. Synchronous.
   */
  private copyPieces(chunks: readonly Buffer[], length: number): { pieces: Buffer[]; pinned: ArenaChunk[] } {
    const pieces: Buffer[] = [];
    const pinned: ArenaChunk[] = [];
    let ci = 0;
    let at = 0; // in chunks[ci]
    let left = length;
    while (left > 0) {
      if (this.arena === null || this.arenaUsed === this.arena.buf.length) this.nextArenaChunk();
      const a = this.arena!;
      if (pinned[pinned.length - 1] !== a) { a.holds++; pinned.push(a); }
      const start = this.arenaUsed;
      const room = Math.min(left, a.buf.length - start);
      let done = 0;
      while (done < room) {
        const src = chunks[ci]!;
        const k = Math.min(room - done, src.length - at);
        src.copy(a.buf, start + done, at, at + k);
        done += k;
        at += k;
        if (at === src.length) { ci++; at = 0; }
      }
      this.arenaUsed += room;
      left -= room;
      pieces.push(a.buf.subarray(start, start + room));
    }
    return { pieces, pinned };
  }

  /** Let go of the full (or no) chunk being filled and take a free one, or a new one. */
  private nextArenaChunk(): void {
    if (this.arena !== null) this.releaseChunk(this.arena);
    let c = this.arenaFree.pop();
    if (c === undefined) {
      c = { buf: Buffer.allocUnsafe(ARENA_CHUNK), holds: 0 };
      this.arenaChunks++;
    }
    assert(c.holds === 0, 'a free arena chunk is held by nothing');
    c.holds = 1; // the allocator's, until it is full
    this.arena = c;
    this.arenaUsed = 0;
  }

  /**
   * One hold of `c` ends; with the last it is free again. The free list keeps at most the
   * hard limit's worth while data is buffered, and ARENA_IDLE_KEEP chunks once nothing is
   * (releaseIdleArena): an idle volume does not keep a burst's memory.
   */
  private releaseChunk(c: ArenaChunk): void {
    assert(c.holds > 0, 'an arena chunk is released once per hold');
    if (--c.holds > 0) return;
    if (this.arenaFree.length * ARENA_CHUNK < this.hardLimit) this.arenaFree.push(c);
    else this.arenaChunks--; // left to the collector
  }

  /**
   * Nothing buffered any more (every layer landed): the allocator lets go of the chunk it was
   * filling too (the next write takes a free one, maybe this one, from its start: the hold
   * counts say nothing else can read it once it is free), and ARENA_IDLE_KEEP free ones stay.
   */
  private releaseIdleArena(): void {
    if (this.heldBytes !== 0) return;
    if (this.arena !== null) {
      const a = this.arena;
      this.arena = null;
      this.arenaUsed = 0;
      this.releaseChunk(a);
    }
    if (this.arenaFree.length > ARENA_IDLE_KEEP) {
      this.arenaChunks -= this.arenaFree.length - ARENA_IDLE_KEEP;
      this.arenaFree.length = ARENA_IDLE_KEEP;
    }
  }

  async trim(offset: number, length: number, fua: boolean): Promise<void> {
    this.checkWritable();
    await this.admitThen(() => {
      this.dirty.set(offset, length, HOLE);
      this.dirtyBytes += length; // uncommitted work like written bytes (see dirtyBytes)
      this.afterMutation();
    });
    if (fua) await this.flush();
  }

  async zero(offset: number, length: number, o: ZeroOptions): Promise<void> {
    this.checkWritable();
    // Zeroing is a map operation, always faster than writing: FAST_ZERO never has to refuse.
    await this.admitThen(() => {
      this.dirty.set(offset, length, o.mayTrim ? HOLE : ZERO);
      this.dirtyBytes += length;
      this.afterMutation();
    });
    if (o.fua) await this.flush();
  }

  private afterMutation(): void {
    if (this.heldBytes >= this.softLimit) this.kickCommit();
  }

  /**
   * Start a background commit, or make sure one follows the running ones. While a run is in
   * flight, a second one starts only once the soft limit is dirty again (or writers wait
   * at the hard limit): a commit per write would make records of a few KiB.
   */
  private kickCommit(): void {
    if (this.fencedError || this.closed) return;
    const start = this.runs.size === 0
      || (this.runs.size < PIPELINE_DEPTH && (this.dirtyBytes >= this.softLimit || this.writeWaiters.length > 0));
    if (start) void this.startCommit().catch((err) => this.log.warn({ err: errorMessage(err) }, 'background commit failed; data stays dirty'));
    else if (!this.nextCommit) this.nextCommit = deferred();
  }

  // ------------------------------------------------------------------ flush / commit

  /**
   * Resolves once everything written before the call is in the log (and vouched for). If
   * nothing was written since the last commit started, that is the newest attempt in flight
   * (attempts land in log order, and one that does not land fails the ones after it);
   * otherwise a commit that seals now, started at once or as soon as a run ends.
   */
  async flush(): Promise<void> {
    if (this.fencedError) throw this.fencedError;
    if (this.readOnly) return;
    if (this.dirty.isEmpty()) {
      const newest = this.sealed[this.sealed.length - 1];
      if (newest === undefined) return;
      const run = newest.attempt?.owner;
      if (run?.done) return run.done;
    }
    if (this.runs.size < PIPELINE_DEPTH) return this.startCommit();
    if (!this.nextCommit) this.nextCommit = deferred();
    return this.nextCommit.promise;
  }

  /**
   * A failed commit leaves its data buffered. If writers are parked over the hard limit (or
   * the buffer is over the soft limit), nothing else would start the next attempt until a
   * client writes or flushes again, so retry with backoff (500 ms doubling to 30 s) while that
   * is so. An idle volume with nothing buffered never has a timer.
   */
  private retryTimer: TimerHandle | null = null;
  private retryDelayMs = 0;

  private scheduleRetry(): void {
    if (this.retryTimer || this.closed || this.fencedError || this.runs.size > 0) return;
    if (this.writeWaiters.length === 0 && this.heldBytes < this.softLimit) return;
    this.retryDelayMs = Math.min(Math.max(this.retryDelayMs * 2, 500), 30_000);
    // Not unref'd: buffered data that must still land keeps the process alive.
    this.retryTimer = this.world.setTimeout(() => { this.retryTimer = null; this.kickCommit(); }, this.retryDelayMs);
  }

  private startCommit(): Promise<void> {
    const run: CommitRun = { done: null };
    const p = this.commit(run).then(
      () => { this.retryDelayMs = 0; },
      (err: unknown) => { void this.world.yield().then(() => this.scheduleRetry()); throw err; },
    ).finally(() => {
      this.runs.delete(p);
      // An ambiguous attempt this run leaves behind is taken over by the next run.
      for (const l of this.sealed) if (l.attempt?.owner === run) l.attempt.owner = null;
      this.wakeWriters();
      const next = this.nextCommit;
      if (!next) return;
      this.nextCommit = null;
      // Whatever the waiters wrote is dirty or in a layer: flush() commits or waits for it.
      this.flush().then(next.resolve, next.reject);
    });
    run.done = p;
    this.runs.add(p);
    return p;
  }

  /**
   * One run: seal, then publish (in log order) an ambiguous earlier attempt nobody is
   * publishing, and an attempt for the newest layer if it has none.
   *
   * ## Pipelined commits
   * Up to PIPELINE_DEPTH runs are in flight. A run's attempt is packed for the position after
   * the newest attempt in flight (`after`), chained to its record id, and uploads at once
   * (segment uploads of all attempts share uploadConcurrency, oldest attempt first); it
   * publishes only once `after` landed. So records still land one position at a time, each
   * naming the one before it, exactly as without pipelining: recovery, fencing and the chain
   * ("The log is a chain") see no difference. What an attempt in flight may do:
   * - land: its layer leaves `sealed`, and the next attempt publishes;
   * - not land (upload failed, fenced): it and every attempt after it are dropped from their
   *   layers (dropAfter), which merge again at the next seal; those runs fail (EIO to their
   *   flushes) and the data stays buffered for the next commit;
   * - become ambiguous: it stays on its layer (the oldest) to be published again byte for
   *   byte before anything else, and the attempts after it are dropped: they were chained
   *   to it, and a new body is never put at a position an earlier attempt may have taken.
   * A dropped attempt's segments are named for a position no record of it will take: the
   * log passes it by, and GC collects them like those of any failed commit (gc.ts case 3).
   */
  private async commit(run: CommitRun): Promise<void> {
    this.seal();
    if (this.sealed.length === 0) return;
    this.checkDeadline();
    const work: CommitAttempt[] = [];
    const oldest = this.sealed[0]!.attempt;
    if (oldest?.state === 'ambiguous' && oldest.owner === null) {
      oldest.owner = run;
      oldest.landed = deferred();
      oldest.after = null;
      work.push(oldest);
    }
    const newest = this.sealed[this.sealed.length - 1]!;
    if (newest.attempt === undefined) {
      const ahead = this.sealed.length > 1 ? this.sealed[this.sealed.length - 2]!.attempt ?? null : null;
      const a = this.pack(newest, ahead, run);
      newest.attempt = a;
      work.push(a);
    }
    let i = 0;
    try {
      for (; i < work.length; i++) {
        const a = work[i]!;
        if (a.state === 'packed') await this.upload(a);
        // Dropped while it uploaded, or its predecessor will not land (which drops `a` too).
        if (a.dropped) throw a.droppedBy;
        if (a.after) await a.after.landed.promise;
        if (a.dropped) throw a.droppedBy;
        if (this.fencedError) throw this.fencedError;
        await this.publish(a);
        a.landed.resolve();
        this.vouch();
      }
    } catch (err) {
      // The first attempt of this run that has not landed (or we do not know) leaves its
      // layer with every attempt after it, or only those if it is ambiguous (kept whole for
      // its next try). Also when the run ends early (vouch): never leave one hanging, an
      // attempt of the next run waits for it to land.
      const a = work.slice(i).find((x) => x.layer.attempt === x && !x.dropped);
      if (a) this.dropAfter(a, a.state === 'ambiguous', err);
      throw err;
    }
    if (work.length > 0) this.log.debug({ seq: work[work.length - 1]!.seq, attempts: work.length }, 'committed');
  }

  /**
   * Attempt `a` did not land: drop it (unless `keep`: an ambiguous one stays on its layer)
   * and every attempt after it, which were chained to it; their runs fail at their wait.
   */
  private dropAfter(a: CommitAttempt, keep: boolean, err: unknown): void {
    const i = this.sealed.indexOf(a.layer);
    assert(i >= 0, 'an attempt in flight is on a sealed layer');
    for (let k = keep ? i + 1 : i; k < this.sealed.length; k++) {
      const x = this.sealed[k]!.attempt;
      if (x === undefined) continue;
      x.dropped = true;
      x.droppedBy = err;
      this.sealed[k]!.attempt = undefined;
      if (x !== a) x.landed.reject(err);
    }
    a.landed.reject(err);
  }

  /**
   * Close the dirty overlay for writing. Layers without an attempt (a new one, and those
   * whose attempts were dropped) are a suffix of `sealed`: merge them into the oldest of them,
   * newer writes over older ones. So at most PIPELINE_DEPTH + 1 layers carry attempts (the
   * runs' and an ambiguous one waiting for the next run) and one more has none, whatever
   * number of commits failed: reads recurse through a bounded number of layers.
   */
  private seal(): void {
    if (!this.dirty.isEmpty()) {
      this.sealed.push({ map: this.dirty, bytes: this.dirtyBytes, chunks: this.dirtyChunks });
      this.dirty = new ExtentMap<Dirty>(sliceDirty, DIRTY_MAP);
      this.dirtyBytes = 0;
      this.dirtyChunks = new Set(); // the chunk being filled goes on: each layer holds it for its own bytes
    }
    const free = this.sealed.findIndex((l) => l.attempt === undefined);
    if (free >= 0 && this.sealed.length - free > 1) {
      // No attempt references these layers, so the oldest of them can absorb the newer ones in place.
      const into = this.sealed[free]!;
      for (const layer of this.sealed.splice(free + 1)) {
        assert(layer.attempt === undefined, 'layers with attempts are a prefix of sealed');
        for (const e of layer.map.entries()) into.map.set(e.offset, e.length, e.value);
        into.bytes += layer.bytes;
        for (const c of layer.chunks) {
          if (into.chunks.has(c)) this.releaseChunk(c);
          else into.chunks.add(c);
        }
      }
    }
    assert(this.sealed.length <= PIPELINE_DEPTH + 2, 'a bounded number of sealed layers');
  }

  /**
   * Pack a sealed layer in volume order for the position after `after` (or the log's next):
   * full segments are uploaded separately, the rest rides inline in the log record.
   * Synchronous, and the layer is not changed.
   */
  private pack(layer: Sealed, after: CommitAttempt | null, owner: CommitRun): CommitAttempt {
    const seq = after ? after.seq + 1 : this.nextSeq;
    const nonce = randomId(this.world, 4);
    const extents: RecordExtent[] = [];
    const segments: CommitAttempt['segments'] = [];
    let parts: Buffer[] = [];
    let partBytes = 0;
    const sealSegment = (): void => {
      segments.push({ key: keys.segment(this.id, seq, nonce, segments.length), size: partBytes, logical: partBytes, parts });
      parts = [];
      partBytes = 0;
    };
    // Extents pointing at the not-yet-sealed tail use SRC_INLINE; fixed up when the tail becomes a segment.
    let tailExtents: RecordExtent[] = [];
    for (const e of layer.map.entries()) {
      const v = e.value;
      if (isZero(v)) { extents.push([e.offset, e.length, v.hole ? SRC_HOLE : SRC_ZERO, 0]); continue; }
      let done = 0;
      while (done < e.length) {
        const n = Math.min(e.length - done, this.segmentBytes - partBytes);
        // Adjacent in the volume and in the same part of the record: one extent (a write
        // copied across arena chunks, or sequential writes, make many such neighbours).
        const prev = tailExtents[tailExtents.length - 1];
        if (prev && prev === extents[extents.length - 1] && prev[0] + prev[1] === e.offset + done && prev[3] + prev[1] === partBytes) {
          prev[1] += n;
        } else {
          const x: RecordExtent = [e.offset + done, n, SRC_INLINE, partBytes];
          extents.push(x);
          tailExtents.push(x);
        }
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
    // A big tail rides as a segment of its own: the record is the one put of a commit that
    // others wait for (records land one position at a time), so it stays small whenever the
    // commit has segments anyway; only a commit without any keeps its data inline (one put).
    if (segments.length > 0 && partBytes >= INLINE_TAIL_MAX) {
      for (const t of tailExtents) t[2] = segments.length;
      tailExtents = [];
      sealSegment();
    }
    if (this.data.format === 'raw') {
      // The layout before issue 16 (v2 record, raw data): built now, as it always was.
      const header = this.newHeader('commit', seq, this.token, segments.map((s) => ({ key: s.key, size: s.size })), extents, partBytes, after, 2);
      const { body, dataStart } = encodeLogRecord(header, parts);
      return { seq, id: header.id!, header, body, dataStart, segments, inlineParts: null, layer, state: 'packed', after, landed: deferred(), owner, dropped: false, startedAt: this.world.now() };
    }
    // Framed: the frames are encoded in upload (a slice per turn of the event loop), and the
    // record, whose header carries every object's frame index, is built once they all are.
    const header = this.newHeader('commit', seq, this.token, [], extents, 0, after, 3);
    return { seq, id: header.id!, header, body: EMPTY, dataStart: 0, segments, inlineParts: parts, layer, state: 'packed', after, landed: deferred(), owner, dropped: false, startedAt: this.world.now() };
  }

  /**
   * Upload the attempt's segments in parallel, each assembled just before its upload (a big
   * commit would otherwise hold the event loop for the whole copy). All attempts share
   * uploadConcurrency, in the order they asked: the older attempt's segments go first.
   */
  private async upload(a: CommitAttempt): Promise<void> {
    assert(a.state === 'packed');
    const local = this.local;
    // Each segment's work (encoding its frames, assembling its body, writing it into a
    // socket) goes a slice at a time, and the slices of every upload in this process share
    // each turn of the event loop (TurnBudget): started together, 16 uploads held the loop
    // for 300-450 ms, and later 16 slices a turn still held it for 10-30 ms; another client's
    // 4 KiB read waited that long, and a lease renewal would as well.
    const turns = turnBudget(this.world);
    await Promise.all(a.segments.map(async (s) => {
      await this.uploadSlots.acquire();
      // The oldest upload's slices first (TurnBudget.ticket): segments finish in the order they started.
      const ticket = turns.ticket();
      const slice = (): Promise<void> => turns.take(ENCODE_SLICE, ticket);
      try {
        if (a.dropped) return; // an earlier attempt failed meanwhile: nothing will name it
        await slice();
        if (a.inlineParts !== null) {
          // Framed: the segment's logical parts become its frames (each frame checksummed,
          // maybe compressed and encrypted), a slice at a time.
          const enc = await encodeObject(s.key, s.parts, s.logical, this.encodeOptions, slice);
          s.parts = enc.pieces;
          s.size = enc.stored;
          s.frames = enc.lengths;
          if (a.dropped) return;
        }
        if (local) {
          // Written from its pieces; nothing goes to the block cache (see `local`).
          await local.putParts(s.key, s.parts);
          return;
        }
        // A private copy (an abandoned put may still be sending it after the arena was reused:
        // ArenaChunk), in a pooled buffer: its lease is let go only once the put succeeded and
        // the body reached the cache (publish); on any other path it is left to the collector.
        // "Succeeded" means at the first try: a put that needed a retry gave up on an attempt
        // that may still be reading the body (a transport or decorator that abandons an
        // attempt without stopping it: BATON_FAULTS' injected timeouts do), and reusing the
        // body would let that attempt land the next segment's bytes under this key (reviewed
        // finding: a flushed write read back wrong). So its lease is dropped, never let go.
        const { body, lease } = this.bodies.take(s.size);
        s.body = await concatInSlices(s.parts, s.size, slice, body);
        s.bodyLease = lease;
        if (a.dropped) return;
        await this.store.put(s.key, s.body, { onRetry: () => { s.bodyLease = null; } });
      } finally {
        this.uploadSlots.release();
      }
    }));
    if (a.inlineParts !== null && !a.dropped) await this.buildFramedRecord(a);
    a.state = 'uploaded';
  }

  /**
   * A framed attempt's record, once its segments are encoded: the inline data's frames, and
   * the v3 header with every object's frame index. Built once: an ambiguous attempt is put
   * again with these very bytes.
   */
  private async buildFramedRecord(a: CommitAttempt): Promise<void> {
    assert(a.body === EMPTY && a.inlineParts !== null && a.header.v === 3, 'a framed record is built once');
    const h = a.header;
    const logical = a.inlineParts.reduce((n, b) => n + b.length, 0);
    const enc = await encodeObject(keys.log(this.id, a.seq), a.inlineParts, logical, this.encodeOptions, () => this.world.yield());
    h.segments = a.segments.map((s) => {
      assert(s.frames !== undefined, 'every segment is encoded before its record');
      return framedSegmentRef(s.key, s.logical, s.frames, s.size);
    });
    h.inlineLength = enc.stored;
    if (logical > 0) h.inline = { logical, frames: lengthsToString(enc.lengths) };
    const { body, dataStart } = encodeLogRecord(h, enc.pieces, this.authFor(keys.log(this.id, a.seq)));
    a.body = body;
    a.dataStart = dataStart;
    a.inlineParts = [];
  }

  /**
   * The commit point: the create-only put of the attempt's record. Resolves once it is in
   * the log (now, or by an earlier try of the same attempt); throws FencedError if another
   * writer holds the position, and leaves the attempt ambiguous if nobody answered.
   */
  private async publish(a: CommitAttempt): Promise<void> {
    assert(a.state === 'uploaded' || a.state === 'ambiguous');
    assert(a.seq === this.nextSeq && a.layer === this.sealed[0] && a.layer.attempt === a, 'an attempt publishes the next position and the oldest layer');
    const key = keys.log(this.id, a.seq);
    let landed = false;
    try {
      await this.store.put(key, a.body, { ifNoneMatch: true, metadata: { [PUT_ID_META]: a.id } });
      landed = true;
    } catch (err) {
      if (!(err instanceof PreconditionFailedError)) {
        // Unknown outcome: it may have landed, or may land later. Keep the attempt whole.
        a.state = 'ambiguous';
        throw err;
      }
    }
    if (!landed) {
      // The position is taken: by this very attempt (an earlier try, or the retry layer's)
      // or by another writer. The record's id tells which.
      let there: LogHeader | null | 'gone';
      try {
        const head = await this.store.head(key);
        // Taken, then gone: only garbage collection (or rm) deletes a log record, and GC
        // never frees the newest position of a log (gc.ts), so records after this one exist:
        // another writer moved the log past it (or the volume was removed). Whoever's record
        // it was (an earlier try of ours included), this writer's map is behind the log, and
        // re-putting the position would re-create a freed one. Fenced, never ambiguous.
        there = head ? (await this.readLogHeader(key, head.size)).header : 'gone';
      } catch (err) {
        if (err instanceof CorruptError) there = null; // not a record we could have written
        else if (err instanceof NotFoundError) there = 'gone'; // deleted between the head and the read
        else { a.state = 'ambiguous'; throw err; }
      }
      if (there === 'gone' || there?.id !== a.id) {
        a.state = 'uploaded'; // not ambiguous any more: it did not land, and never will
        this.fence(there === 'gone'
          ? `log position ${a.seq} of volume ${this.name} was taken and has since been garbage-collected: the log moved past it (another writer, or the volume was removed)`
          : `log position ${a.seq} of volume ${this.name} was taken by another writer`);
        throw this.fencedError!;
      }
    }
    this.landRecord(key, a.header, a.dataStart, a.body.length);
    if (!this.local) {
      this.blockCache.insertObject(key, a.body);
      for (const s of a.segments) {
        if (!s.body) continue;
        // Every put of this attempt succeeded (it published): the cache holds the body now
        // (once per block it keeps), and this attempt lets go of it for good.
        this.blockCache.insertObject(s.key, s.body, s.bodyLease ?? undefined);
        s.bodyLease?.release();
        s.bodyLease = null;
        delete s.body;
      }
    }
    this.sealed.shift();
    a.layer.attempt = undefined;
    // Landed: nothing reads the layer's bytes any more (ArenaChunk says why).
    for (const c of a.layer.chunks) this.releaseChunk(c);
    a.layer.chunks.clear();
    this.releaseIdleArena();
    this.commits++;
    this.lastFlushAt = a.header.time;
    let bytes = a.body.length;
    for (const seg of a.segments) bytes += seg.size;
    this.committedBytes += bytes;
    this.commitSeconds.observe((this.world.now() - a.startedAt) / 1000);
    this.maybeCheckpoint();
    // Told after the record is applied: what it made durable is in the store (the API's
    // `flushed` event). A listener's failure is not the commit's.
    for (const cb of this.committedListeners) {
      try { cb({ seq: a.seq, bytes }); } catch { /* a listener's own bug */ }
    }
  }

  /**
   * The volume was grown in the store (`baton resize`): serve the new size from now on. Only
   * ever grows: bytes past the old end read as zeroes (nothing is mapped there), and
   * connections attached before keep validating against the size they negotiated.
   */
  grow(size: number): void {
    if (size <= this.sizeNow) return;
    this.sizeNow = size;
    this.recoverySize = Math.max(this.recoverySize, size);
  }

  private readonly committedListeners: ((c: { seq: number; bytes: number }) => void)[] = [];

  /** Called after each commit landed (log position `seq`, `bytes` put for it). */
  onCommitted(cb: (c: { seq: number; bytes: number }) => void): void {
    this.committedListeners.push(cb);
  }

  /**
   * After a commit point, before the flush it serves succeeds: the record is in the log, but
   * if this writer lost its lease or fenced itself while the put was on its way, it does not
   * vouch for it to the client (EIO never claims the data is absent). A put that waited out
   * a stall may have landed at a position GC freed after another writer moved the log on:
   * recovery then ignores it ("The log is a chain"), so acknowledging it would lose the data.
   */
  private vouch(): void {
    if (this.fencedError) throw this.fencedError;
    this.checkDeadline();
  }

  private fence(reason: string): void {
    if (this.fencedError) return;
    this.fencedError = new FencedError(`${reason}; this host no longer writes it (reattach to serve it again)`);
    this.log.error({ reason }, 'volume fenced: refusing further writes');
    this.hydration?.stop();
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
    // Also once the working set grew by WS_CHECKPOINT_CHUNKS (see there): that lowers only the
    // floor of checkpointEvery records, never the bound for big maps (a checkpoint of a map of
    // millions of extents is tens of MiB). A checkpoint goes at a new log position only
    // (create-only, one per position): hence at least one record.
    const bigMap = Math.floor(this.committed.size / 256);
    const wsDue = since >= Math.max(WS_CHECKPOINT_RECORDS, bigMap) && this.workingSet.addedSinceSaved >= WS_CHECKPOINT_CHUNKS;
    if (this.checkpointing || (!force && !wsDue && since < Math.max(this.checkpointEvery, bigMap))) return;
    const seq = this.nextSeq - 1;
    // The map as of `seq`, frozen now (synchronously, right after the record at `seq` was
    // applied) and encoded a chunk at a time while commits go on changing the live map: a
    // map of millions of extents once held the event loop for seconds here, past lease
    // renewals. The view copies a region only when a commit changes it.
    const view = this.committed.freeze();
    // The working set as of now, with the map (both taken in this synchronous step).
    const workingSet = this.workingSet.snapshot();
    this.workingSet.markSaved();
    const header = {
      volumeId: this.id, seq, token: this.highestTokenSeen, time: this.world.wallTime().toISOString(),
      ...(this.lastRecordId !== undefined ? { lastId: this.lastRecordId } : {}),
    };
    const t0 = this.world.now();
    const { pause, due } = slices(this.world);
    // Create-only, like log records: a stale writer can never replace a checkpoint (see
    // "The log is a chain"). A position's checkpoint is only ever written once by its writer.
    this.checkpointing = encodeCheckpoint(header, (fn, p) => walkCheckpoint(view, fn, p, due), pause, workingSet, 5, this.authFor(keys.checkpoint(this.id, seq)))
      .finally(() => view.close())
      .then((body) => this.store.put(keys.checkpoint(this.id, seq), body, { ifNoneMatch: true }).then(() => body.length))
      .then((bytes) => { this.lastCheckpointSeq = Math.max(this.lastCheckpointSeq, seq); this.log.debug({ seq, bytes, extents: view.size, workingSetChunks: workingSet.chunks.length, ms: Math.round(this.world.now() - t0) }, 'checkpoint written'); })
      .catch((err) => {
        if (err instanceof PreconditionFailedError) this.log.error({ seq }, 'a checkpoint for this position already exists (another writer\'s?); not replacing it');
        else this.log.warn({ seq, err: errorMessage(err) }, 'checkpoint failed; recovery replays more log');
      })
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
    const { victims, objectBytes: victimBytes } = await this.compactionCandidates(opts.below);
    const pieces: { offset: number; length: number; key: string; size: number; off: number; fr: FrameIndex | null }[] = [];
    let planned = 0;
    const maxBytes = opts.maxBytes ?? Infinity;
    await this.forEachCommitted((e) => {
      if (e.key === null || !victims.has(e.key)) return;
      if (planned >= maxBytes) return false;
      for (let d = 0; d < e.length; d += 1024 * 1024) {
        pieces.push({ offset: e.offset + d, length: Math.min(1024 * 1024, e.length - d), key: e.key, size: e.size, off: e.off + d, fr: e.fr });
      }
      planned += e.length;
    });
    let rewritten = 0;
    await mapLimit(pieces, 8, async (p) => {
      // Waits its turn with the guest's writes (memory stays bounded); what it rewrites is
      // checked against the map when its bytes are back, so its own order does not matter.
      await this.admitThen(() => {});
      this.checkWritable();
      const buf = Buffer.allocUnsafe(p.length);
      await this.readObject(p.key, p.size, p.fr, p.off, p.length, buf, 0, 0);
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
  async compactionCandidates(below: number): Promise<{ victims: Set<string>; objectBytes: number; liveBytes: number }> {
    const prefix = keys.volumePrefix(this.id);
    // Live bytes against the object's logical size (a framed object's size in the store is
    // its compressed size, which live logical bytes would outgrow); objectBytes are stored bytes.
    const live = new Map<string, { live: number; size: number; stored: number }>();
    await this.forEachCommitted((e) => {
      if (e.key === null || !e.key.startsWith(prefix)) return;
      const l = live.get(e.key);
      if (l) l.live += e.length; else live.set(e.key, { live: e.length, size: e.fr ? e.fr.logical : e.size, stored: e.size });
    });
    const victims = new Set<string>();
    let objectBytes = 0;
    let liveBytes = 0;
    for (const [key, { live: n, size, stored }] of live) {
      if (size > 0 && n < below * size) { victims.add(key); objectBytes += stored; liveBytes += n; }
    }
    return { victims, objectBytes, liveBytes };
  }

  /**
   * Every extent of the committed map as it is now, in volume order, a chunk at a time with
   * the event loop free in between (compaction planning, GC's references and accounting walk
   * maps of any size this way): the walk reads a frozen view, so commits may go on meanwhile
   * and it still sees one consistent map. `fn` returning false ends the walk.
   */
  async forEachCommitted(fn: (e: { offset: number; length: number; key: string | null; off: number; size: number; fr: FrameIndex | null }) => void | false): Promise<void> {
    const view = this.committed.freeze();
    const { pause, due } = slices(this.world);
    try {
      await walkFrozen(view, (offset, length, v) => (isZero(v)
        ? fn({ offset, length, key: null, off: 0, size: 0, fr: null })
        : fn({ offset, length, key: v.key, off: v.off, size: v.size, fr: v.fr })), pause, due);
    } finally {
      view.close();
    }
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
      dirtyBytes: this.dirtyBytes, sealedBytes: this.heldBytes - this.dirtyBytes, commits: this.commits, committedBytes: this.committedBytes,
      lastCommitSeq: this.nextSeq - 1, lastFlushAt: this.lastFlushAt, extents: this.committed.size,
      bufferedExtents: this.sealed.reduce((n, l) => n + l.map.size, this.dirty.size), fenced: this.isFenced,
      workingSetChunks: this.workingSet.size, arenaBytes: this.arenaChunks * ARENA_CHUNK, parkedWrites: this.parkedWrites, hydration: this.hydrationStatus,
    };
  }

  /**
   * Flush what is dirty (unless fenced) and stop. A writer leaves a checkpoint behind, so
   * the next host (a handoff, a later attach) recovers with one read instead of replaying
   * the log since the last one, and finds the working set to hydrate in it. A writer under a
   * lease always has a record of its own (its takeover record), so there is a position for
   * it, unless a checkpoint was written at the newest position already (a fork's flattening
   * checkpoint, then no commit): that one stays, with the working set as of then.
   */
  async close(): Promise<void> {
    // Hydration is for this host's next reads: none will come (its GETs in flight only fill the cache).
    this.hydration?.stop();
    try {
      if (!this.readOnly && !this.fencedError) {
        await this.flush();
        await this.checkpointing;
        if (this.nextSeq - 1 > this.lastCheckpointSeq && !this.fencedError) {
          this.maybeCheckpoint(true);
          await this.checkpointing;
        }
      }
    } finally {
      // Also when the final flush failed: no retry timer may outlive a closed volume.
      this.closed = true;
      this.bodies.close();
      if (this.retryTimer) { this.world.clearTimeout(this.retryTimer); this.retryTimer = null; }
      this.wakeWriters();
      await this.checkpointing;
    }
  }
}

/** A record does not follow the one before it (see "The log is a chain" in Volume). */
export class ChainBrokenError extends CorruptError {
  constructor(readonly seq: number, message: string) { super(message); }
}

/**
 * Apply one log record's extents to a map. A v3 record's objects are framed: extents name
 * logical offsets into them, and their frame indexes (checked against the sizes the header
 * gives) travel with the locations. Older records' objects are raw: stored offsets.
 */
function applyRecord(map: PackedExtentMap<Loc>, volumeSize: number, key: string, h: LogHeader, dataStart: number, recordSize: number): void {
  const segFrames = h.segments.map((_s, i) => segmentFrames(h, i, key));
  const inline = inlineFrames(h, dataStart, recordSize, key);
  for (const [off, len, src, srcOff] of h.extents) {
    // Whole bytes too: the committed map refuses fractions (RangeError), which is corruption here.
    if (!Number.isSafeInteger(off) || !Number.isSafeInteger(len) || off < 0 || len <= 0 || off + len > volumeSize) throw new CorruptError(`${key}: extent out of range`);
    let loc: Loc;
    if (src === SRC_HOLE) loc = HOLE;
    else if (src === SRC_ZERO) loc = ZERO;
    else if (src === SRC_INLINE) {
      if (h.v === 3 && (!inline || !(srcOff >= 0 && srcOff + len <= inline.logical))) throw new CorruptError(`${key}: extent outside the inline data`);
      loc = h.v === 3 ? { key, off: srcOff, size: recordSize, fr: inline } : { key, off: dataStart + srcOff, size: recordSize, fr: null };
    } else {
      const seg = h.segments[src];
      if (!seg) throw new CorruptError(`${key}: extent refers to missing segment ${src}`);
      const fr = segFrames[src]!;
      if (fr && !(srcOff >= 0 && srcOff + len <= fr.logical)) throw new CorruptError(`${key}: extent outside segment ${seg.key}`);
      loc = { key: seg.key, off: srcOff, size: seg.size, fr };
    }
    map.set(off, len, loc);
  }
}

/** The stored range of an object holding logical bytes [off, off+len) (a framed object's covering frames; a raw one's same range). */
function storedRange(p: { fr: FrameIndex | null; off: number; len: number }): { off: number; len: number } {
  if (!p.fr) return { off: p.off, len: p.len };
  const sp = p.fr.span(p.off, p.len);
  return { off: sp.start, len: sp.end - sp.start };
}

/** The working set a checkpoint carries (v4), or an empty one (older versions), taken over a slice at a time. */
async function workingSetOf(c: CheckpointData, volumeSize: number, world: World): Promise<WorkingSet> {
  const ws = new WorkingSet();
  if (c.workingSet) await ws.load(c.workingSet, volumeSize, () => world.yield());
  return ws;
}

/**
 * The map a checkpoint holds, built a chunk of extents at a time with the event loop free in
 * between (other volumes of this host are served while a big one recovers). Its extents are
 * in volume order, so they are appended (no search per extent).
 */
async function mapOfCheckpoint(c: CheckpointData, volumeSize: number, world: World): Promise<PackedExtentMap<Loc>> {
  const m = newCommittedMap();
  const { pause, due } = slices(world);
  try {
    await c.forEachExtent(volumeSize, (off, len, src, srcOff) => {
      if (src === SRC_HOLE) m.append(off, len, HOLE);
      else if (src === SRC_ZERO) m.append(off, len, ZERO);
      else {
        const o = c.objects[src]!;
        const fr = o[2] ?? null;
        if (fr && !(srcOff >= 0 && srcOff + len <= fr.logical)) throw new CorruptError(`checkpoint ${c.seq} of volume ${c.volumeId}: extent outside object ${o[0]}`);
        m.append(off, len, { key: o[0], off: srcOff, size: o[1], fr });
      }
    }, pause, CHECKPOINT_CHUNK, due);
  } catch (err) {
    // append refuses extents out of order or overlapping: a checkpoint no writer wrote.
    if (err instanceof RangeError) throw new CorruptError(`checkpoint ${c.seq} of volume ${c.volumeId}: ${err.message}`);
    throw err;
  }
  return m;
}

/**
 * How a long synchronous walk lets the event loop turn: `pause` after a chunk, and `due` once
 * the current chunk has taken CHUNK_MS of the world's time (the walks pause after
 * CHECKPOINT_CHUNK items or when due, whichever comes first).
 */
function slices(world: World): { pause: () => Promise<void>; due: () => boolean } {
  let since = world.now();
  return {
    pause: async () => { await world.yield(); since = world.now(); },
    due: () => world.now() - since >= CHUNK_MS,
  };
}

/**
 * Every extent of a frozen map in volume order, the event loop free every CHECKPOINT_CHUNK
 * extents or when `due` (`pause`); `fn` returning false ends the walk. The one walk of whole
 * maps: the checkpoint encoder, compaction planning, GC and accounting all go through it.
 */
function walkFrozen(view: FrozenExtentMap<Loc>, fn: (offset: number, length: number, value: Loc) => void | false, pause: () => Promise<void>, due?: () => boolean): Promise<void> {
  return view.walk(fn, pause, CHECKPOINT_CHUNK, due);
}

/** A frozen committed map as the checkpoint encoder walks it (format.ts encodeCheckpoint). */
function walkCheckpoint(view: FrozenExtentMap<Loc>, fn: (offset: number, length: number, key: string | null, src: number, srcOff: number, objectSize: number, frames: FrameIndex | null) => void, pause: () => Promise<void>, due?: () => boolean): Promise<void> {
  return walkFrozen(view, (offset, length, v) => {
    if (isZero(v)) fn(offset, length, null, v.hole ? SRC_HOLE : SRC_ZERO, 0, 0, null);
    else fn(offset, length, v.key, 0, v.off, v.size, v.fr);
  }, pause, due);
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

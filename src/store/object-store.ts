/**
 * The narrow object-store interface every byte of a volume goes through (SlateDB style):
 * get (with a byte range), put (optionally create-only), head, list by prefix, delete.
 *
 * Invariants every implementation keeps, and the conformance tests check:
 * - Keys are relative to the store's root ("vol/abc/log/00000001"); the implementation
 *   adds its own prefix.
 * - `put(..., { ifNoneMatch: true })` is atomic create-only: exactly one of any number of
 *   racing puts of the same key succeeds; the others throw PreconditionFailedError. This is
 *   the fencing primitive; a store that cannot do it is refused by `probeStore`.
 * - A put that resolved is durable and visible to every later get/head/list (read-after-write).
 * - `get` of a missing key throws NotFoundError; a ranged get returns exactly `length` bytes
 *   or throws (a short answer is never returned as success).
 * - Transient failures (network, 5xx, throttling, timeouts) throw StoreUnavailableError, so
 *   decorators know what may be retried.
 * - `delete` of a missing key succeeds (idempotent, as S3).
 */

export interface ObjectInfo {
  key: string;
  size: number;
  lastModified: Date;
  /**
   * Names the version of the object, as S3's ETag: a new put of the key (even of the same
   * bytes, on every store but S3, whose ETag of a plain put is the MD5 of its bytes) gets
   * another. Listings carry it where it costs nothing (S3, memory) or when asked
   * (ListOptions.etags); absent otherwise.
   */
  etag?: string;
}

export interface ObjectHead extends ObjectInfo {
  metadata: Record<string, string>;
}

export interface PutOptions {
  /** Create-only: fail with PreconditionFailedError if the key exists (If-None-Match: *). */
  ifNoneMatch?: boolean;
  /** Small string metadata (S3 x-amz-meta-*). Keys lower-case [a-z0-9-]. */
  metadata?: Record<string, string>;
  /**
   * Told when a retrying layer sends this put again after a try that may still be on its way
   * (timed out, reply lost): that try may land later, up to M after it was sent. A caller
   * whose correctness depends on nothing of the put landing after it returned waits that out.
   */
  onRetry?: () => void;
}

export interface DeleteOptions {
  /**
   * Told when a retrying layer sends this delete again after a try that may still be on its
   * way (timed out, reply lost): that try may land later, up to M after it was sent. A caller
   * that lets the key be written again right after the delete returned (a volume name: rm,
   * then create) waits that out, or the late try deletes the new object.
   */
  onRetry?: () => void;
}

export interface ByteRange {
  offset: number;
  length: number;
}

export interface ListOptions {
  /** Only keys strictly after this one (S3 StartAfter). */
  startAfter?: string;
  /**
   * Keys after this one are not wanted: a store stops there when it can (S3 has no end
   * bound, so its listing stops at the page that passes it). A store may return more;
   * callers filter what they use.
   */
  endAt?: string;
  /** Report each object's etag: S3 and memory stores always do; a `file:` store reads each object's header for it. */
  etags?: boolean;
}

/**
 * What a store whose objects are files on this machine offers beyond the interface. The
 * engine then reads objects where they lie, without its read cache (a second copy on the
 * same disk would cost a write and a read the store already did), and puts a body as the
 * pieces it holds (no copy to assemble them). Only a store whose reads cost what a local
 * disk's do has it. A decorator passes it on only if it changes nothing about reads and
 * puts: one that injects faults or latency hides it, so that the engine then uses its cache
 * as it would for a remote store.
 */
export interface LocalObjects {
  /**
   * Fill out[outOff, outOff + length) with bytes [offset, offset + length) of object `key`:
   * NotFoundError if it does not exist, OutOfRangeError past its end (as a ranged get).
   * For objects that are never replaced (every data object of a volume): an object read
   * before may be read through a file opened then, also after it was deleted.
   */
  read(key: string, offset: number, length: number, out: Buffer, outOff: number): Promise<void>;
  /**
   * read(), done before returning when it needs no wait (the object's file is open already,
   * as a recently read object's is): true once `out` is filled; false when it would need one,
   * and then nothing was read (call read()). Throws what read() rejects with. For reads that
   * can be answered on the spot (Volume.readNow): a promise and a turn of the event loop per
   * read were most of what a 4 KiB random read of a `file:` volume cost.
   */
  readNow?(key: string, offset: number, length: number, out: Buffer, outOff: number): boolean;
  /** readv(), done before returning when it needs no wait, as readNow. */
  readvNow?(key: string, offset: number, parts: readonly Buffer[]): boolean;
  /**
   * The same bytes, lent: `use` is called with them and must be done with them when it
   * returns (it is synchronous; the store reuses their memory for the next view); resolves to
   * what `use` returned, or rejects with what it threw. For a reader that checks or decodes
   * the stored bytes into a buffer of its own (framed data): no buffer of its own for them.
   */
  view<T>(key: string, offset: number, length: number, use: (bytes: Buffer) => T): Promise<T>;
  /** Fill `parts` in order with bytes from `offset` on (a scatter read: read() into each in turn). */
  readv(key: string, offset: number, parts: readonly Buffer[]): Promise<void>;
  /** Exactly put(key, concatenation of parts, options), without concatenating them. */
  putParts(key: string, parts: readonly Buffer[], options?: PutOptions): Promise<void>;
  /**
   * The keys list(prefix, options) gives, without what each file would cost list() to learn
   * (its size and time: a stat per key). For callers that need only keys (keysOf).
   */
  keys?(prefix: string, options?: ListOptions): AsyncIterable<string>;
  /**
   * Counts of read() calls, kept by the store that does them and passed on unchanged by every
   * decorator that passes `local` on (serve --metrics reads them at scrape time). Kept there
   * because read() is on the path of every NBD READ of a file: store: counting in place costs
   * a few increments, where a decorator wrapping each call cost a promise and half a
   * microsecond per read (bench/metrics-cost.ts). Not timed, for the same reason.
   */
  readonly reads?: LocalReadCounts;
}

/** How in-place reads ended, and the bytes the successful ones read. Only ever grow. */
export interface LocalReadCounts {
  ok: number;
  notFound: number;
  /** Any other failure (out of range, I/O error, corrupt file). */
  error: number;
  bytes: number;
}

export interface ObjectStore {
  /** For logs and errors: "s3://bucket/prefix", "file:/var/lib/baton". */
  readonly description: string;
  /** Present when objects are local files (see LocalObjects). */
  readonly local?: LocalObjects;
  /**
   * `into` (exactly `range.length` bytes, a reused buffer: src/cache.ts): the store MAY read
   * the body into it and return it instead of a buffer of its own; the caller uses what is
   * returned. Once the call resolved WITH `into` (returned it), nothing writes into it any
   * more. Otherwise an attempt given up on may still be receiving into it (RetryingObjectStore
   * gives up on attempts without stopping them, and reads the retry into memory of its own),
   * so a caller reuses `into` only after a get that returned it: never after a rejection, nor
   * after a get that returned another buffer.
   */
  get(key: string, range?: ByteRange, into?: Buffer): Promise<Buffer>;
  put(key: string, body: Buffer, options?: PutOptions): Promise<void>;
  /** Null when the key does not exist. */
  head(key: string): Promise<ObjectHead | null>;
  /** Keys starting with `prefix`, in lexicographic (UTF-8 byte) order. */
  list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo>;
  delete(key: string, options?: DeleteOptions): Promise<void>;
  /** Release sockets, file handles. */
  close(): Promise<void>;
}

/** The keys of store.list(prefix, options), through LocalObjects.keys where the store has it. */
export async function* keysOf(store: ObjectStore, prefix: string, options?: ListOptions): AsyncIterable<string> {
  const local = store.local?.keys;
  if (local) {
    yield* local(prefix, options);
    return;
  }
  for await (const o of store.list(prefix, options)) yield o.key;
}

export async function listAll(store: ObjectStore, prefix: string, options?: ListOptions): Promise<ObjectInfo[]> {
  const out: ObjectInfo[] = [];
  for await (const o of store.list(prefix, options)) out.push(o);
  return out;
}

/**
 * The one interface between the protocol and storage (nbdkit's `struct backend`).
 *
 * The session validates every request once (range, flags, read-only, alignment) before it
 * calls a backend, so backends may assume: 0 <= offset, offset + length <= size, length > 0,
 * and write-type calls only on writable backends. Backends take byte-granular requests
 * (sub-block writes are read-modify-write inside them).
 *
 * Ordering contract, which CAN_MULTI_CONN relies on: one backend object serves every
 * connection of an export; a `flush()` that resolves has made durable every write, trim and
 * zero whose promise resolved before the flush was called, from any connection. Writes are
 * applied in call order, so a replayed stale write issued earlier can never overwrite a
 * newer one issued later (kernel timeouts re-queue requests on another connection).
 */

import type { Extent } from './codec.js';
import type { RequestStats } from './stats.js';

export type { Extent };

export interface ZeroOptions {
  fua: boolean;
  /** Without NO_HOLE the backend may deallocate (punch a hole) instead of writing zeroes. */
  mayTrim: boolean;
  /** FAST_ZERO: fail quickly with NotSupportedError unless zeroing is faster than writing. */
  fastZero: boolean;
}

/** Memory lent for the length of a call or of a reply: valid until release(), which is called exactly once. */
export interface Lent {
  readonly chunks: Buffer[];
  release(): void;
}

/** See BlockBackend.cache: the most request memory one CACHE may hold at a time. */
export const CACHE_PIECE_BYTES = 1024 * 1024;

export interface BlockBackend {
  /** Size in bytes; a multiple of 512. */
  readonly size: number;
  readonly readOnly: boolean;
  /**
   * Read `length` bytes. When `into` is given (exactly `length` bytes, contents undefined),
   * fill it and resolve to it; every byte must be written, holes included.
   */
  read(offset: number, length: number, into?: Buffer): Promise<Buffer>;
  /**
   * Optional form of read that lends the backend's own memory instead of copying into a
   * buffer: pieces of `length` bytes in all, in order, holding the data as of the call, which
   * must not change until release() (the session calls it once the socket is done with the
   * reply; a write meanwhile must go elsewhere, e.g. copy on write). The session prefers it
   * to read.
   */
  readLent?(offset: number, length: number): Promise<Lent>;
  /**
   * Optional form of read for what needs no wait: fill all of `into` (exactly `length` bytes)
   * before returning and return true, or return false having changed nothing but `into`'s
   * contents (the session then calls read()). Throws what read() would reject with. The
   * session tries it first for every READ (not with readLent): a read answered on the spot
   * costs no promise and no turn of the event loop.
   */
  readNow?(offset: number, length: number, into: Buffer): boolean;
  /**
   * For a backend whose reads are CPU work on this thread (local memory or disk, nothing to
   * wait for): how many READs a connection executes at once (the rest wait their turn in
   * arrival order). Each one executing holds its reply buffer; more of them only hold more
   * memory. Absent: no limit beyond the session's (reads that wait on a remote store need
   * to be many).
   */
  readonly maxConcurrentReads?: number | undefined;
  /** `data` is owned by the backend after the call (the session never reuses it). */
  write(offset: number, data: Buffer, fua: boolean): Promise<void>;
  /**
   * Optional form of write for a backend that copies the data before it returns: the pieces
   * are lent, not given. Their bytes must have been copied (or otherwise used) by the time
   * the call returns, and no reference to them may be kept, not even until the promise
   * settles: the session reuses their memory as soon as the call returns. The session
   * prefers it to write, for every WRITE, and with it reads the socket into
   * buffers it reuses (FrameReader.useSlabs) instead of a fresh one per socket read.
   */
  writeLent?(offset: number, chunks: readonly Buffer[], fua: boolean): Promise<void>;
  /**
   * Optional form of writeLent for a write without FUA that needs no wait: done before
   * returning (true: as if writeLent had resolved), or nothing done at all (false: the session
   * then calls writeLent). Throws what writeLent would reject with. The pieces are lent as for
   * writeLent. Never asked for a FUA write (that waits for a flush).
   */
  writeNow?(offset: number, chunks: readonly Buffer[]): boolean;
  flush(): Promise<void>;
  trim(offset: number, length: number, fua: boolean): Promise<void>;
  zero(offset: number, length: number, options: ZeroOptions): Promise<void>;
  /**
   * base:allocation extents starting exactly at `offset`, contiguous, together covering at
   * least part of the range (they may stop early or run past it), at most `maxExtents` of
   * them (>= 1; 1 for REQ_ONE). Flags: NBD_STATE_HOLE, NBD_STATE_ZERO.
   *
   * The work of one call must be bounded by what its reply can carry, not by `length` (up
   * to 4 GiB) or by how fragmented the range is: stop early rather than walk it all. The
   * client asks again from where the reply ended, as the spec lets it.
   */
  blockStatus(offset: number, length: number, maxExtents: number): Promise<Extent[]>;
  /**
   * Read-ahead hint (NBD_CMD_CACHE): must not change what reads return. However long the
   * range (up to 4 GiB), it holds at most min(length, CACHE_PIECE_BYTES) bytes of request
   * memory at a time (warm in pieces, one after the other): the session counts that much of
   * the connection's in-flight memory bound for each CACHE, as it counts a READ's length.
   */
  cache(offset: number, length: number): Promise<void>;
}

/** An export opened for one connection; `release()` when the connection is gone. */
export interface ExportHandle {
  readonly name: string;
  readonly description: string;
  readonly backend: BlockBackend;
  /** Where the session counts this connection's requests (serve --metrics); none: nothing is counted. */
  readonly stats?: RequestStats;
  release(): void;
}

export interface ExportSummary {
  name: string;
  description: string;
}

/**
 * Where the server finds exports by name. `open` throws NotFoundError for an unknown name
 * (the client gets NBD_REP_ERR_UNKNOWN) and may throw LeaseHeldError, ShutdownError, ...
 * The empty name "" (kernel nbd-client without -N) is resolved by the provider.
 */
export interface ExportProvider {
  list(): Promise<ExportSummary[]>;
  open(name: string): Promise<ExportHandle>;
  /**
   * Optional: what NBD_OPT_INFO reports, from the catalog alone: no open, no lease, no store
   * writes, no effect on other hosts (nbdinfo --list and qemu send INFO for every export).
   * Resolves "" like open does, and throws like open for an unknown name. `name` in the
   * answer is the export's canonical name. Without it, INFO falls back to open + release.
   */
  info?(name: string): Promise<ExportInfo>;
}

export interface ExportInfo {
  name: string;
  size: number;
  readOnly: boolean;
  description: string;
}

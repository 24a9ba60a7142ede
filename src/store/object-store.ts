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
}

export interface ObjectHead extends ObjectInfo {
  etag?: string;
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

export interface ByteRange {
  offset: number;
  length: number;
}

export interface ListOptions {
  /** Only keys strictly after this one (S3 StartAfter). */
  startAfter?: string;
}

export interface ObjectStore {
  /** For logs and errors: "s3://bucket/prefix", "file:/var/lib/baton". */
  readonly description: string;
  get(key: string, range?: ByteRange): Promise<Buffer>;
  put(key: string, body: Buffer, options?: PutOptions): Promise<void>;
  /** Null when the key does not exist. */
  head(key: string): Promise<ObjectHead | null>;
  /** Keys starting with `prefix`, in lexicographic (UTF-8 byte) order. */
  list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo>;
  delete(key: string): Promise<void>;
  /** Release sockets, file handles. */
  close(): Promise<void>;
}

export async function listAll(store: ObjectStore, prefix: string, options?: ListOptions): Promise<ObjectInfo[]> {
  const out: ObjectInfo[] = [];
  for await (const o of store.list(prefix, options)) out.push(o);
  return out;
}

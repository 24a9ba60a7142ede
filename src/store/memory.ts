/**
 * MemoryObjectStore: the reference implementation of `ObjectStore`, a Map in one process.
 * Unit tests of the volume engine run on it, and the conformance tests hold the local-dir and
 * S3 stores to the same answers.
 *
 * It also owns the rules that make a key or a put portable across all three stores
 * (`validateKey`, `validateMetadata`, `validateRange`, `compareKeys`), so that code tested on
 * memory cannot write something S3 or a filesystem would refuse or order differently.
 *
 * Invariants:
 * - Create-only is atomic because the existence check and the insert happen in one
 *   synchronous turn of the event loop: no await between them.
 * - Bodies are copied in and out: a caller reusing its buffer cannot change stored bytes,
 *   and a caller mutating a returned buffer cannot either.
 * - list() orders by UTF-8 bytes (what S3 does), not by UTF-16 code units (what `<` does).
 */
import { randomBytes } from 'node:crypto';
import { InvalidArgumentError, NotFoundError, OutOfRangeError, PreconditionFailedError } from '../errors.js';
import type { ByteRange, ListOptions, ObjectHead, ObjectInfo, ObjectStore, PutOptions } from './object-store.js';

/** S3's limit on a key, in UTF-8 bytes. */
export const MAX_KEY_BYTES = 1024;
/** S3's limit on user metadata (keys + values, bytes). */
export const MAX_METADATA_BYTES = 2048;

const META_KEY = /^[a-z0-9][a-z0-9-]*$/;
// Printable ASCII without leading/trailing blanks: S3 trims header values and mangles non-ASCII.
const META_VALUE = /^[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?$/;

/**
 * A key every backend can store under the same name: non-empty, at most 1024 UTF-8 bytes, no
 * control characters, well-formed Unicode, and '/'-separated segments that are neither empty
 * nor "." or ".." (a filesystem would collapse those, and "a//b" or "/a" are usually bugs in
 * key construction).
 */
export function validateKey(key: string): void {
  if (typeof key !== 'string' || key.length === 0) throw new InvalidArgumentError('object key must be a non-empty string');
  if (Buffer.byteLength(key, 'utf8') > MAX_KEY_BYTES) {
    throw new InvalidArgumentError(`object key is longer than ${MAX_KEY_BYTES} bytes: ${key.slice(0, 64)}...`);
  }
  // Control characters cannot travel in S3's XML listings without URL-encoding them.
  if (/[\x00-\x1f\x7f]/.test(key)) throw new InvalidArgumentError(`object key contains a control character: ${JSON.stringify(key)}`);
  if (isWellFormedUtf16(key) === false) throw new InvalidArgumentError(`object key is not valid Unicode: ${JSON.stringify(key)}`);
  for (const seg of key.split('/')) {
    if (seg === '' || seg === '.' || seg === '..') {
      throw new InvalidArgumentError(`object key has an empty, "." or ".." segment: ${JSON.stringify(key)}`);
    }
  }
}

function isWellFormedUtf16(s: string): boolean {
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c >= 0xd800 && c <= 0xdbff) {
      const d = s.charCodeAt(i + 1);
      if (!(d >= 0xdc00 && d <= 0xdfff)) return false;
      i++;
    } else if (c >= 0xdc00 && c <= 0xdfff) {
      return false;
    }
  }
  return true;
}

/** Metadata that survives S3 (x-amz-meta-*) unchanged: lower-case keys, trimmed printable ASCII values. */
export function validateMetadata(metadata: Record<string, string> | undefined): void {
  if (metadata === undefined) return;
  let bytes = 0;
  for (const [k, v] of Object.entries(metadata)) {
    if (!META_KEY.test(k)) throw new InvalidArgumentError(`metadata key ${JSON.stringify(k)} must be lower-case [a-z0-9-]`);
    if (typeof v !== 'string' || !META_VALUE.test(v)) {
      throw new InvalidArgumentError(`metadata ${k} must be non-empty printable ASCII without surrounding blanks, got ${JSON.stringify(v)}`);
    }
    bytes += k.length + v.length;
  }
  if (bytes > MAX_METADATA_BYTES) throw new InvalidArgumentError(`metadata is ${bytes} bytes, more than the ${MAX_METADATA_BYTES} S3 allows`);
}

export function validateRange(range: ByteRange): void {
  const { offset, length } = range;
  if (!Number.isSafeInteger(offset) || offset < 0 || !Number.isSafeInteger(length) || length < 0) {
    throw new InvalidArgumentError(`byte range must be non-negative integers: offset=${offset} length=${length}`);
  }
}

/** The error every store throws for a range that does not lie inside the object. */
export function rangeError(key: string, range: ByteRange, size: number): OutOfRangeError {
  return new OutOfRangeError(`get ${key}: range offset=${range.offset} length=${range.length} is past the end of the object (size=${size})`);
}

/**
 * Orders strings by their UTF-8 bytes without encoding them. UTF-16 code-unit order differs
 * from code-point (= UTF-8 byte) order only between surrogates (code points >= U+10000) and
 * U+E000..U+FFFF; remapping those two blocks fixes it.
 */
export function compareKeys(a: string, b: string): number {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) {
    const x = a.charCodeAt(i);
    const y = b.charCodeAt(i);
    if (x !== y) return fixup(x) - fixup(y);
  }
  return a.length - b.length;
}

function fixup(c: number): number {
  if (c >= 0xd800 && c <= 0xdfff) return c + 0x2000;
  if (c >= 0xe000) return c - 0x800;
  return c;
}

interface Entry {
  body: Buffer;
  metadata: Record<string, string>;
  lastModified: Date;
  etag: string;
}

export class MemoryObjectStore implements ObjectStore {
  readonly description: string;
  readonly #objects = new Map<string, Entry>();

  /** `now` stamps lastModified: tests of time-based rules (GC grace) drive their own clock. */
  constructor(name = 'memory:', private readonly now: () => Date = () => new Date()) {
    this.description = name;
  }

  async get(key: string, range?: ByteRange, into?: Buffer): Promise<Buffer> {
    validateKey(key);
    if (range !== undefined) validateRange(range);
    const e = this.#objects.get(key);
    if (e === undefined) throw new NotFoundError(`get ${key}: no such object in ${this.description}`);
    if (range === undefined) return Buffer.from(e.body);
    if (range.offset + range.length > e.body.length) throw rangeError(key, range, e.body.length);
    const bytes = e.body.subarray(range.offset, range.offset + range.length);
    if (into !== undefined && into.length === bytes.length) { bytes.copy(into); return into; }
    return Buffer.from(bytes);
  }

  async put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    validateKey(key);
    validateMetadata(options?.metadata);
    const entry: Entry = {
      body: Buffer.from(body),
      metadata: { ...options?.metadata },
      lastModified: this.now(),
      etag: `"${randomBytes(16).toString('hex')}"`,
    };
    // No await between the check and the set: this is the atomicity of create-only.
    if (options?.ifNoneMatch === true && this.#objects.has(key)) {
      throw new PreconditionFailedError(`put ${key}: object already exists in ${this.description} (create-only put)`);
    }
    this.#objects.set(key, entry);
  }

  async head(key: string): Promise<ObjectHead | null> {
    validateKey(key);
    const e = this.#objects.get(key);
    if (e === undefined) return null;
    return { key, size: e.body.length, lastModified: e.lastModified, etag: e.etag, metadata: { ...e.metadata } };
  }

  async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    const after = options?.startAfter;
    const keys: string[] = [];
    const end = options?.endAt;
    for (const k of this.#objects.keys()) {
      if (k.startsWith(prefix) && (after === undefined || compareKeys(k, after) > 0) && (end === undefined || compareKeys(k, end) <= 0)) keys.push(k);
    }
    keys.sort(compareKeys);
    for (const key of keys) {
      // The key set is taken when the listing starts (as S3 does per page); an object deleted
      // since is skipped rather than reported with stale size.
      const e = this.#objects.get(key);
      if (e === undefined) continue;
      yield { key, size: e.body.length, lastModified: e.lastModified, etag: e.etag };
    }
  }

  async delete(key: string): Promise<void> {
    validateKey(key);
    this.#objects.delete(key);
  }

  async close(): Promise<void> {}

  /** For tests: how many objects are stored. */
  get size(): number {
    return this.#objects.size;
  }
}

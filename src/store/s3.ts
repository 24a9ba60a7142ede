/**
 * S3ObjectStore: `ObjectStore` over the S3 API (AWS S3, R2, MinIO, Ceph RGW) with
 * @aws-sdk/client-s3. Keys are stored under `prefix` in `bucket`.
 *
 * Invariants and why:
 * - Checksums only WHEN_REQUIRED: the SDK default streams aws-chunked bodies with CRC
 *   trailers, which RGW, R2 and MinIO versions reject or store corrupted (style.md §B1.1).
 * - Both http and https agents are sized (`maxSockets`, default 128): an http:// endpoint uses
 *   only httpAgent, and parallel block uploads would otherwise queue behind 50 sockets.
 * - Every error leaves as a typed BatonError (see `mapError`): transient ones (5xx, 429,
 *   409 ConditionalRequestConflict, network, timeouts) as StoreUnavailableError so decorators
 *   may retry; configuration mistakes (no bucket, bad credentials, wrong region) as
 *   BATON_ERR_INVALID_ARGUMENT with a message saying what to fix, never retried.
 * - The SDK itself retries (maxAttempts 3). A create-only put whose first attempt landed but
 *   whose reply was lost gets 412 on the SDK's retry; every create-only put carries a
 *   `baton-put-id`, and a 412 after more than one attempt is resolved by reading the id back
 *   (SlateDB verify_put_succeeded). RetryingObjectStore does the same for its own retries.
 * - A ranged get returns exactly the bytes asked for or throws: a short body is never success.
 */
import { Agent as HttpAgent } from 'node:http';
import { Agent as HttpsAgent } from 'node:https';
import {
  DeleteObjectCommand,
  GetObjectCommand,
  HeadObjectCommand,
  ListObjectsV2Command,
  PutObjectCommand,
  S3Client,
  type ListObjectsV2CommandOutput,
} from '@aws-sdk/client-s3';
import { NodeHttpHandler } from '@smithy/node-http-handler';
import {
  BatonError,
  IoError,
  NotFoundError,
  NotSupportedError,
  OutOfRangeError,
  PreconditionFailedError,
  StoreUnavailableError,
  errorMessage,
} from '../errors.js';
import { PUT_ID_META, newPutId } from './decorators.js';
import { rangeError, validateKey, validateMetadata, validateRange } from './memory.js';
import type { ByteRange, ListOptions, ObjectHead, ObjectInfo, ObjectStore, PutOptions } from './object-store.js';

export interface S3Credentials {
  accessKeyId: string;
  secretAccessKey: string;
  sessionToken?: string;
}

export interface S3StoreOptions {
  bucket: string;
  /** Key prefix inside the bucket; a trailing '/' is added if missing. */
  prefix?: string;
  /** For S3-compatible servers (MinIO, RGW, R2): implies path-style addressing unless forcePathStyle is false. */
  endpoint?: string;
  /** Default: $AWS_REGION, $AWS_DEFAULT_REGION, then us-east-1. */
  region?: string;
  forcePathStyle?: boolean;
  /** Concurrent connections per agent; size for parallel block uploads (default 128). */
  maxSockets?: number;
  /** Default: the AWS default chain (env, profile, SSO, instance role). */
  credentials?: S3Credentials;
  /** ListObjectsV2 MaxKeys (1..1000, default 1000); small values let tests exercise paging. */
  listPageSize?: number;
  /** SDK attempts per request (default 3). */
  maxAttempts?: number;
  connectionTimeoutMs?: number;
  /** No byte in either direction for this long fails the request (default 30 s). */
  socketTimeoutMs?: number;
  /** Whole request limit, a backstop for a trickling server (default 120 s). */
  requestTimeoutMs?: number;
}

type Op = 'get' | 'put' | 'head' | 'list' | 'delete';

interface SdkErrorShape {
  name?: unknown;
  code?: unknown;
  Code?: unknown;
  message?: unknown;
  $metadata?: { httpStatusCode?: number; attempts?: number };
}

const NETWORK_CODES = new Set([
  'ECONNREFUSED', 'ECONNRESET', 'EPIPE', 'ETIMEDOUT', 'ENOTFOUND', 'EAI_AGAIN', 'EHOSTUNREACH',
  'ENETUNREACH', 'ENETDOWN', 'ECONNABORTED', 'EADDRNOTAVAIL', 'ERR_STREAM_PREMATURE_CLOSE',
  'ERR_SOCKET_CONNECTION_TIMEOUT', 'UND_ERR_SOCKET', 'UND_ERR_CONNECT_TIMEOUT',
]);
const TRANSIENT_NAMES = new Set([
  'TimeoutError', 'RequestTimeout', 'RequestTimeoutException', 'SlowDown', 'Throttling', 'ThrottlingException',
  'TooManyRequestsException', 'InternalError', 'ServiceUnavailable', 'ConditionalRequestConflict',
  'OperationAborted', 'RequestTimeTooSkewed',
]);

function shape(err: unknown): SdkErrorShape {
  return typeof err === 'object' && err !== null ? (err as SdkErrorShape) : {};
}

export function normalizePrefix(prefix: string | undefined): string {
  let p = (prefix ?? '').replace(/^\/+/, '');
  if (p !== '' && !p.endsWith('/')) p += '/';
  return p;
}

export class S3ObjectStore implements ObjectStore {
  readonly description: string;
  readonly bucket: string;
  readonly prefix: string;
  readonly client: S3Client;
  readonly #endpoint: string;
  readonly #pageSize: number;

  constructor(opts: S3StoreOptions) {
    this.bucket = opts.bucket;
    this.prefix = normalizePrefix(opts.prefix);
    this.description = `s3://${this.bucket}/${this.prefix}`;
    this.#endpoint = opts.endpoint ?? 'AWS S3';
    this.#pageSize = Math.max(1, Math.min(1000, opts.listPageSize ?? 1000));
    const maxSockets = opts.maxSockets ?? 128;
    const forcePathStyle = opts.forcePathStyle ?? opts.endpoint !== undefined;
    this.client = new S3Client({
      region: opts.region ?? process.env.AWS_REGION ?? process.env.AWS_DEFAULT_REGION ?? 'us-east-1',
      ...(opts.endpoint !== undefined ? { endpoint: opts.endpoint } : {}),
      forcePathStyle,
      ...(opts.credentials !== undefined ? { credentials: opts.credentials } : {}),
      requestChecksumCalculation: 'WHEN_REQUIRED',
      responseChecksumValidation: 'WHEN_REQUIRED',
      maxAttempts: opts.maxAttempts ?? 3,
      retryMode: 'standard',
      requestHandler: new NodeHttpHandler({
        connectionTimeout: opts.connectionTimeoutMs ?? 3_000,
        socketTimeout: opts.socketTimeoutMs ?? 30_000,
        requestTimeout: opts.requestTimeoutMs ?? 120_000,
        throwOnRequestTimeout: true,
        httpAgent: new HttpAgent({ keepAlive: true, maxSockets }),
        httpsAgent: new HttpsAgent({ keepAlive: true, maxSockets }),
      }),
    });
  }

  #where(op: Op, key: string): string {
    return `${op} ${key} on ${this.description} (${this.#endpoint})`;
  }

  /** The one place SDK errors become BatonErrors. */
  mapError(op: Op, key: string, err: unknown): BatonError {
    if (err instanceof BatonError) return err;
    const e = shape(err);
    const name = typeof e.name === 'string' ? e.name : '';
    const code = typeof e.code === 'string' ? e.code : typeof e.Code === 'string' ? e.Code : '';
    const status = e.$metadata?.httpStatusCode;
    const where = this.#where(op, key);
    const detail = `${status !== undefined ? `HTTP ${status} ` : ''}${name || code}: ${errorMessage(err)}`;
    const invalid = (msg: string) => new BatonError('BATON_ERR_INVALID_ARGUMENT', `${where}: ${msg} (${detail})`, { cause: err });

    if (name === 'NoSuchBucket' || code === 'NoSuchBucket') {
      return invalid(`bucket ${this.bucket} does not exist: create it or check --store`);
    }
    if (name === 'CredentialsProviderError' || /could not load credentials/i.test(errorMessage(err))) {
      return invalid('no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE');
    }
    if (status === 403 || ['AccessDenied', 'InvalidAccessKeyId', 'SignatureDoesNotMatch', 'Forbidden'].includes(name)) {
      return invalid(`access denied to bucket ${this.bucket}: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket policy`);
    }
    if (status === 301 || name === 'PermanentRedirect' || name === 'AuthorizationHeaderMalformed') {
      return invalid(`bucket ${this.bucket} is in another region or needs another endpoint: pass --region (or --endpoint)`);
    }
    if (status === 404 || name === 'NoSuchKey' || name === 'NotFound') {
      return new NotFoundError(`${where}: no such object`);
    }
    if (status === 412 || name === 'PreconditionFailed') {
      return new PreconditionFailedError(`${where}: object already exists (create-only put)`);
    }
    if (status === 416 || name === 'InvalidRange') {
      return new OutOfRangeError(`${where}: range is past the end of the object`);
    }
    if (status === 501 || name === 'NotImplemented') {
      return new NotSupportedError(`${where}: the store does not implement this request (${detail})`);
    }
    if (
      status === 409 || status === 429 || (status !== undefined && status >= 500) ||
      TRANSIENT_NAMES.has(name) || NETWORK_CODES.has(code) || name === 'AbortError'
    ) {
      return new StoreUnavailableError(`${where}: store unavailable, retry later (${detail})`, { cause: err });
    }
    if (status === 400) return invalid('the store rejected the request');
    // An SDK error without an HTTP status is a transport failure we have no code for.
    if (e.$metadata !== undefined && status === undefined) {
      return new StoreUnavailableError(`${where}: store unavailable, retry later (${detail})`, { cause: err });
    }
    return new IoError(`${where}: unexpected error (${detail})`, { cause: err });
  }

  async get(key: string, range?: ByteRange): Promise<Buffer> {
    validateKey(key);
    if (range !== undefined) validateRange(range);
    // HTTP cannot ask for zero bytes; answer from HEAD so a missing key is still NotFound.
    if (range !== undefined && range.length === 0) {
      const h = await this.head(key);
      if (h === null) throw new NotFoundError(`${this.#where('get', key)}: no such object`);
      if (range.offset > h.size) throw rangeError(key, range, h.size);
      return Buffer.alloc(0);
    }
    const fullKey = this.prefix + key;
    let buf: Buffer;
    let contentRange: string | undefined;
    try {
      const res = await this.client.send(new GetObjectCommand({
        Bucket: this.bucket,
        Key: fullKey,
        ...(range !== undefined ? { Range: `bytes=${range.offset}-${range.offset + range.length - 1}` } : {}),
      }));
      if (res.Body === undefined) throw new StoreUnavailableError(`${this.#where('get', key)}: response had no body`);
      const arr = await res.Body.transformToByteArray();
      buf = Buffer.from(arr.buffer, arr.byteOffset, arr.byteLength);
      contentRange = res.ContentRange;
      if (res.ContentLength !== undefined && res.ContentLength !== buf.length) {
        throw new StoreUnavailableError(`${this.#where('get', key)}: body was ${buf.length} bytes, Content-Length said ${res.ContentLength}`);
      }
    } catch (err) {
      const mapped = this.mapError('get', key, err);
      if (mapped instanceof OutOfRangeError && range !== undefined) {
        const h = await this.head(key).catch(() => null);
        throw h === null ? mapped : rangeError(key, range, h.size);
      }
      throw mapped;
    }
    if (range === undefined || buf.length === range.length) {
      if (range !== undefined && contentRange !== undefined && !contentRange.startsWith(`bytes ${range.offset}-`)) {
        throw new StoreUnavailableError(`${this.#where('get', key)}: asked for offset ${range.offset}, got Content-Range ${contentRange}`);
      }
      return buf;
    }
    // A server that ignores Range answers 200 with the whole object.
    if (contentRange === undefined && buf.length >= range.offset + range.length) {
      return buf.subarray(range.offset, range.offset + range.length);
    }
    const total = contentRange !== undefined ? Number(/\/(\d+)$/.exec(contentRange)?.[1] ?? NaN) : buf.length;
    if (Number.isFinite(total) && range.offset + range.length > total) throw rangeError(key, range, total);
    throw new StoreUnavailableError(`${this.#where('get', key)}: short read, ${buf.length} of ${range.length} bytes (Content-Range ${contentRange ?? 'none'})`);
  }

  async put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    validateKey(key);
    const createOnly = options?.ifNoneMatch === true;
    let metadata = options?.metadata;
    if (createOnly && metadata?.[PUT_ID_META] === undefined) metadata = { ...metadata, [PUT_ID_META]: newPutId() };
    validateMetadata(metadata);
    try {
      await this.client.send(new PutObjectCommand({
        Bucket: this.bucket,
        Key: this.prefix + key,
        Body: body,
        ContentLength: body.length,
        ...(createOnly ? { IfNoneMatch: '*' } : {}),
        ...(metadata !== undefined ? { Metadata: metadata } : {}),
      }));
    } catch (err) {
      const mapped = this.mapError('put', key, err);
      const attempts = shape(err).$metadata?.attempts ?? 1;
      if (mapped instanceof PreconditionFailedError && createOnly && attempts > 1 && metadata !== undefined) {
        // The SDK retried: the 412 may be our own earlier attempt that landed.
        const h = await this.head(key);
        if (h !== null && h.metadata[PUT_ID_META] === metadata[PUT_ID_META]) return;
      }
      throw mapped;
    }
  }

  /** HEAD answers carry no error body, so a missing bucket looks like a missing key here; get, put and list name it. */
  async head(key: string): Promise<ObjectHead | null> {
    validateKey(key);
    try {
      const res = await this.client.send(new HeadObjectCommand({ Bucket: this.bucket, Key: this.prefix + key }));
      return {
        key,
        size: res.ContentLength ?? 0,
        lastModified: res.LastModified ?? new Date(0),
        ...(res.ETag !== undefined ? { etag: res.ETag } : {}),
        metadata: { ...res.Metadata },
      };
    } catch (err) {
      const mapped = this.mapError('head', key, err);
      if (mapped instanceof NotFoundError) return null;
      throw mapped;
    }
  }

  async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    let token: string | undefined;
    const strip = this.prefix.length;
    do {
      let page: ListObjectsV2CommandOutput;
      try {
        page = await this.client.send(new ListObjectsV2Command({
          Bucket: this.bucket,
          Prefix: this.prefix + prefix,
          MaxKeys: this.#pageSize,
          ...(options?.startAfter !== undefined ? { StartAfter: this.prefix + options.startAfter } : {}),
          ...(token !== undefined ? { ContinuationToken: token } : {}),
        }));
      } catch (err) {
        throw this.mapError('list', prefix, err);
      }
      for (const o of page.Contents ?? []) {
        if (o.Key === undefined) continue;
        yield { key: o.Key.slice(strip), size: o.Size ?? 0, lastModified: o.LastModified ?? new Date(0) };
      }
      token = page.IsTruncated === true ? page.NextContinuationToken : undefined;
    } while (token !== undefined);
  }

  async delete(key: string): Promise<void> {
    validateKey(key);
    try {
      await this.client.send(new DeleteObjectCommand({ Bucket: this.bucket, Key: this.prefix + key }));
    } catch (err) {
      const mapped = this.mapError('delete', key, err);
      if (mapped instanceof NotFoundError) return;
      throw mapped;
    }
  }

  async close(): Promise<void> {
    this.client.destroy();
  }
}

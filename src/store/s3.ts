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
 * - Every call is bounded (the SDK sets no timeouts by default, and an endpoint that accepts
 *   connections but never answers would hold a request forever): connecting (3 s), the time
 *   until the response headers arrive (15 s, plus the upload of the body at the slowest rate
 *   we accept, 1 MiB/s), silence on the socket in either direction (15 s), and the whole call,
 *   body transfer and the SDK's own retries included (60 s plus the transfer at 1 MiB/s).
 *   These are per call; the total time a caller waits across baton's retries is the budget of
 *   RetryingObjectStore (decorators.ts). A call that hits a limit fails as StoreUnavailableError
 *   naming the endpoint; a put that timed out may still land (the ambiguity below).
 * - A listing page that says it is truncated but carries no continuation token is refused
 *   (StoreUnsafeError): ending there would hand GC and fork points a partial listing.
 * - RequestTimeTooSkewed is a clock problem, not a permission one: the SDK corrects its clock
 *   offset from the server's answer and retries; if the store still refuses, the message says
 *   by how much the clocks differ and to fix the host's clock.
 * - Bodies are signed into the request (SigV4 payload hash) only where nothing else protects
 *   them in transit: not over https or to a loopback endpoint (payloadProtectedInTransit).
 * - The SDK itself retries (maxAttempts 3). A create-only put whose first attempt landed but
 *   whose reply was lost gets 412 on the SDK's retry; every create-only put carries a
 *   `baton-put-id`, and a 412 after more than one attempt is resolved by reading the id back
 *   (SlateDB verify_put_succeeded). RetryingObjectStore does the same for its own retries.
 * - A ranged get returns exactly the bytes asked for or throws: a short body is never success.
 * - GETs and PUTs go around the SDK's middleware (`#attempts`, `#getOnce`, `#exchange`): signed
 *   by `SigV4Signer` and sent (PUTs with node's http on the same agents, GETs with
 *   http-get.ts, below) to the URL the SDK's own
 *   endpoint rules give for the bucket, with the SDK's credentials and clock offset, the same
 *   limits and attempts, `Expect: 100-continue` for bodies of 2 MiB and more as the SDK sends
 *   it, and errors shaped like the SDK's so `mapError` is still the one place they are mapped.
 *   About a third of the CPU per small GET or PUT (sigv4.ts says how much): the small PUT is
 *   a FLUSH's one round trip. Where the endpoint rules ask for another signing
 *   scheme than plain SigV4 (S3 Express), they go through the SDK as before. HEAD, LIST and
 *   DELETE (rare, never on a guest's path) stay with the SDK.
 * - A direct request that settled no longer reads its body (#exchange): a failure destroyed
 *   it, a success waited for the body to be handed to the kernel.
 * - GETs go over http-get.ts's own keep-alive connections (plain TCP or TLS), which read a
 *   body straight into the buffer get() returns: with node's http, a fresh 64 KiB Buffer per
 *   socket read, its parser and streams per chunk and our copy of each chunk cost about twice
 *   the CPU per GiB (get() from a local radosgw, 8 MiB ranged GETs 16 at a time: 2.0-2.6 CPU-s
 *   per GiB at 223-479 MiB/s before, 1.1-1.3 at 391-697 MiB/s with http-get.ts).
 *   A connection is pooled again only after a complete, well-framed answer, and every failure
 *   destroys it, so a body buffer is never written after its get settled. Same limits, same
 *   error shapes (s3ErrorFromResponse, TimeoutError, node's error codes), same retries.
 */
import { Agent as HttpAgent, request as httpRequest, type ClientRequest, type IncomingMessage } from 'node:http';
import { Agent as HttpsAgent, request as httpsRequest } from 'node:https';
import { createHash } from 'node:crypto';
import { setTimeout as delay } from 'node:timers/promises';
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
  MisconfiguredError,
  NotFoundError,
  NotSupportedError,
  OutOfRangeError,
  PreconditionFailedError,
  StoreUnavailableError,
  StoreUnsafeError,
  errorMessage,
} from '../errors.js';
import { PUT_ID_META, newPutId } from './decorators.js';
import { HttpGetClient, MAX_ERROR_BODY, timeoutError } from './http-get.js';
import { systemWorld, turnBudget } from '../clock.js';
import { compareKeys, rangeError, validateKey, validateMetadata, validateRange } from './memory.js';
import { EMPTY_SHA256, SigV4Signer, UNSIGNED_PAYLOAD, amzDate, encodeKeyPath, type SigV4Credentials } from './sigv4.js';
import type { ByteRange, DeleteOptions, ListOptions, ObjectHead, ObjectInfo, ObjectStore, PutOptions } from './object-store.js';

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
  /** Per-call time limits; see S3_TIMEOUT_DEFAULTS. */
  connectionTimeoutMs?: number;
  /** From sending a request until its response headers arrive, plus the body's upload time at minBytesPerSecond (default 15 s). */
  firstByteTimeoutMs?: number;
  /** No byte in either direction for this long fails the request (default 15 s). */
  socketTimeoutMs?: number;
  /** The whole call (SDK retries and body transfer included), plus the body's transfer time at minBytesPerSecond (default 60 s). */
  requestTimeoutMs?: number;
  /** The slowest transfer rate a body is given time for (default 1 MiB/s). */
  minBytesPerSecond?: number;
  /** Hash every body into its SigV4 signature (default: only where nothing else protects it in transit; see payloadProtectedInTransit). */
  signPayload?: boolean;
}

/**
 * Whether a body sent to this endpoint is protected in transit without a signed payload:
 * over https (TLS authenticates every byte; AWS S3 when no endpoint is given), or over http
 * to a loopback address (no network to tamper with it). Signing a payload costs a SHA-256 of
 * every body on the event loop before it is sent: for 8 MiB segments, about 5 ms each, and
 * half of the CPU time of an upload through the SDK (1 GiB of 8 MiB puts to radosgw: 1.5 s of
 * CPU signed, 0.8 s unsigned). Elsewhere (plain http across a network) payloads are signed,
 * so a changed body is refused by the store.
 */
export function payloadProtectedInTransit(endpoint: string | undefined): boolean {
  if (endpoint === undefined) return true;
  let u: URL;
  try {
    u = new URL(endpoint);
  } catch {
    return false;
  }
  if (u.protocol === 'https:') return true;
  const host = u.hostname.replace(/^\[|\]$/g, '');
  return host === 'localhost' || host === '::1' || /^127\.\d+\.\d+\.\d+$/.test(host);
}

/** The per-call time limits, chosen for S3 (see the invariants at the top). */
export const S3_TIMEOUT_DEFAULTS = {
  /** TCP connect; a healthy endpoint answers in milliseconds, a dead address never. */
  connectionTimeoutMs: 3_000,
  /**
   * S3's time to first byte is tens of milliseconds, seconds in its worst tails and on a busy
   * RGW; 15 s is far past that and still well inside the 30 s a person waits.
   */
  firstByteTimeoutMs: 15_000,
  socketTimeoutMs: 15_000,
  requestTimeoutMs: 60_000,
  minBytesPerSecond: 1024 * 1024,
} as const;

export type S3Timeouts = Partial<Pick<S3StoreOptions, keyof typeof S3_TIMEOUT_DEFAULTS>>;

type Op = 'get' | 'put' | 'head' | 'list' | 'delete';

interface SdkErrorShape {
  name?: unknown;
  code?: unknown;
  Code?: unknown;
  message?: unknown;
  cause?: unknown;
  $metadata?: { httpStatusCode?: number; attempts?: number };
  /** RequestTimeTooSkewed bodies carry these (the SDK copies error body fields onto the error). */
  ServerTime?: unknown;
  RequestTime?: unknown;
  MaxAllowedSkewMilliseconds?: unknown;
  $response?: { headers?: Record<string, string | undefined> };
}

const NETWORK_CODES = new Set([
  'ECONNREFUSED', 'ECONNRESET', 'EPIPE', 'ETIMEDOUT', 'ENOTFOUND', 'EAI_AGAIN', 'EHOSTUNREACH',
  'ENETUNREACH', 'ENETDOWN', 'ECONNABORTED', 'EADDRNOTAVAIL', 'ERR_STREAM_PREMATURE_CLOSE',
  'ERR_SOCKET_CONNECTION_TIMEOUT', 'UND_ERR_SOCKET', 'UND_ERR_CONNECT_TIMEOUT',
]);
const TRANSIENT_NAMES = new Set([
  'TimeoutError', 'RequestTimeout', 'RequestTimeoutException', 'SlowDown', 'Throttling', 'ThrottlingException',
  'TooManyRequestsException', 'InternalError', 'ServiceUnavailable', 'ConditionalRequestConflict',
  'OperationAborted',
]);

/** "20 min", "3 s": for clock differences in messages. */
function roughDuration(ms: number): string {
  const a = Math.abs(ms);
  if (a >= 3_600_000) return `${(a / 3_600_000).toFixed(1)} h`;
  if (a >= 60_000) return `${Math.round(a / 60_000)} min`;
  return `${Math.round(a / 1000)} s`;
}

function shape(err: unknown): SdkErrorShape {
  return typeof err === 'object' && err !== null ? (err as SdkErrorShape) : {};
}

/** Where a GET goes without the SDK: the bucket's base URL from the SDK's endpoint rules. */
interface DirectTarget {
  protocol: 'http:' | 'https:';
  hostname: string;
  port: number | undefined;
  /** The Host header as signed and sent (URL.host: no port when it is the scheme's default). */
  host: string;
  /** '' (virtual-hosted: the bucket is in the host name) or '/bucket' (path style). */
  basePath: string;
  signer: SigV4Signer;
}

/** The S3 error codes that may mean this host's clock is off (the SDK's list): worth one retry once the offset is corrected. */
const CLOCK_SKEW_NAMES = new Set([
  'AuthFailure', 'InvalidSignatureException', 'RequestExpired', 'RequestInTheFuture', 'RequestTimeTooSkewed', 'SignatureDoesNotMatch',
]);
/** The SDK's threshold for "the clocks differ": its signer corrects its offset beyond this. */
const CLOCK_SKEW_MS = 300_000;
/**
 * Bodies this large ask `Expect: 100-continue` before they travel (the SDK's threshold, 2 MiB):
 * a refusal (a create-only put's 412, a bad signature) costs no upload and is read for sure.
 */
const EXPECT_CONTINUE_BYTES = 2 * 1024 * 1024;
/**
 * A request body goes into its socket this much at a time, each slice taking its bytes from the
 * process's TurnBudget (clock.ts), which request bodies share with segment encoding (#exchange).
 */
const BODY_SLICE = 1024 * 1024;
const bodyTurns = turnBudget(systemWorld);
/** How long a body waits for 100 Continue before it goes anyway (the SDK waits 1 s too). */
const CONTINUE_WAIT_MS = 1000;

function xmlText(s: string): string {
  return s.replace(/&(lt|gt|quot|apos|amp);/g, (_m, e: string) => ({ lt: '<', gt: '>', quot: '"', apos: "'", amp: '&' })[e]!);
}

/**
 * An S3 error answer shaped like the SDK's errors (name and Code from <Code>, the body's
 * fields, the status in $metadata, the headers in $response), so `mapError` maps both alike.
 */
function s3ErrorFromResponse(status: number, headers: Record<string, string | string[] | undefined>, body: string): Error & SdkErrorShape {
  const field = (tag: string): string | undefined => {
    const m = new RegExp(`<${tag}>([^<]*)</${tag}>`).exec(body);
    return m === null ? undefined : xmlText(m[1]!);
  };
  const code = field('Code') ?? (status === 404 ? 'NotFound' : `Http${status}`);
  const err = new Error(field('Message') ?? `HTTP ${status}${body === '' ? ' (no body)' : ''}`) as Error & SdkErrorShape & Record<string, unknown>;
  err.name = code;
  err.Code = code;
  err.$metadata = { httpStatusCode: status };
  const flat: Record<string, string | undefined> = {};
  for (const [k, v] of Object.entries(headers)) flat[k] = Array.isArray(v) ? v.join(', ') : v;
  err.$response = { headers: flat };
  for (const tag of ['ServerTime', 'RequestTime', 'MaxAllowedSkewMilliseconds']) {
    const v = field(tag);
    if (v !== undefined) err[tag] = v;
  }
  return err;
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
  /** Whether bodies are hashed into their signatures (S3StoreOptions.signPayload). */
  readonly signsPayload: boolean;
  readonly #endpoint: string;
  readonly #endpointOption: string | undefined;
  readonly #pageSize: number;
  readonly #firstByteMs: number;
  readonly #wholeMs: number;
  readonly #bytesPerMs: number;
  readonly #httpAgent: HttpAgent;
  readonly #httpsAgent: HttpsAgent;
  readonly #maxAttempts: number;
  readonly #connectMs: number;
  readonly #socketMs: number;
  /** The direct GETs' connections (http-get.ts): bodies read in place. */
  readonly #gets: HttpGetClient;
  /** Where and how a GET is sent without the SDK; null: through the SDK (see #directTarget). */
  #direct: Promise<DirectTarget | null> | undefined;

  constructor(opts: S3StoreOptions) {
    this.bucket = opts.bucket;
    this.prefix = normalizePrefix(opts.prefix);
    this.description = `s3://${this.bucket}/${this.prefix}`;
    this.#endpoint = opts.endpoint ?? 'AWS S3';
    this.#endpointOption = opts.endpoint;
    this.#pageSize = Math.max(1, Math.min(1000, opts.listPageSize ?? 1000));
    const d = S3_TIMEOUT_DEFAULTS;
    this.#firstByteMs = opts.firstByteTimeoutMs ?? d.firstByteTimeoutMs;
    this.#wholeMs = opts.requestTimeoutMs ?? d.requestTimeoutMs;
    this.#bytesPerMs = Math.max(1, opts.minBytesPerSecond ?? d.minBytesPerSecond) / 1000;
    const maxSockets = opts.maxSockets ?? 128;
    this.#httpAgent = new HttpAgent({ keepAlive: true, maxSockets });
    this.#httpsAgent = new HttpsAgent({ keepAlive: true, maxSockets });
    this.#gets = new HttpGetClient({ maxSockets });
    this.#maxAttempts = Math.max(1, opts.maxAttempts ?? 3);
    this.#connectMs = opts.connectionTimeoutMs ?? d.connectionTimeoutMs;
    this.#socketMs = opts.socketTimeoutMs ?? d.socketTimeoutMs;
    const forcePathStyle = opts.forcePathStyle ?? opts.endpoint !== undefined;
    this.client = new S3Client({
      region: opts.region ?? process.env.AWS_REGION ?? process.env.AWS_DEFAULT_REGION ?? 'us-east-1',
      ...(opts.endpoint !== undefined ? { endpoint: opts.endpoint } : {}),
      forcePathStyle,
      ...(opts.credentials !== undefined ? { credentials: opts.credentials } : {}),
      requestChecksumCalculation: 'WHEN_REQUIRED',
      responseChecksumValidation: 'WHEN_REQUIRED',
      maxAttempts: this.#maxAttempts,
      retryMode: 'standard',
      requestHandler: new NodeHttpHandler({
        connectionTimeout: this.#connectMs,
        socketTimeout: this.#socketMs,
        // The handler's "requestTimeout" runs from the start of a request until its response
        // headers arrive (time to first byte, upload included); each call sets its own, sized
        // for its body, in #call.
        requestTimeout: this.#firstByteMs,
        throwOnRequestTimeout: true,
        httpAgent: this.#httpAgent,
        httpsAgent: this.#httpsAgent,
      }),
    });
    this.signsPayload = opts.signPayload ?? !payloadProtectedInTransit(opts.endpoint);
    if (!this.signsPayload) {
      // SigV4 takes a payload hash given in x-amz-content-sha256 as it is (@smithy/signature-v4
      // getPayloadHash); UNSIGNED-PAYLOAD still signs the method, key, headers (If-None-Match,
      // metadata, Content-Length) and time. Set before the signer runs (the build step).
      this.client.middlewareStack.add((next) => async (args) => {
        const req = args.request as { headers?: Record<string, string> };
        if (req.headers && req.headers['x-amz-content-sha256'] === undefined) req.headers['x-amz-content-sha256'] = 'UNSIGNED-PAYLOAD';
        return next(args);
      }, { step: 'build', name: 'batonUnsignedPayload' });
    }
  }

  #where(op: Op, key: string): string {
    return `${op} ${key} on ${this.description} (${this.#endpoint})`;
  }

  /**
   * One bounded call: `run` sends with the abort signal and first-byte limit given, and reads
   * the body it registers with `onBody`. `bytes` is what travels (body up or range down), so
   * a big segment gets time for its transfer and a small request does not wait as long.
   * The whole-call limit aborts the SDK (which then makes no further attempts) and destroys a
   * body still streaming, so a server that trickles cannot hold the call either.
   */
  async #call<T>(
    bytes: number,
    run: (
      options: { abortSignal: AbortSignal; requestTimeout: number },
      onBody: (body: { destroy?: (err?: Error) => void }, length: number | undefined) => void,
    ) => Promise<T>,
  ): Promise<T> {
    const t0 = performance.now();
    const transferMs = bytes / this.#bytesPerMs;
    let wholeMs = Math.ceil(this.#wholeMs + transferMs);
    const ac = new AbortController();
    let body: { destroy?: (err?: Error) => void } | undefined;
    const expire = (): void => {
      const err = timeoutError(`no complete answer within ${wholeMs} ms (the whole-request limit)`);
      ac.abort(err);
      body?.destroy?.(err);
    };
    let timer = setTimeout(expire, wholeMs);
    try {
      return await run({ abortSignal: ac.signal, requestTimeout: Math.ceil(this.#firstByteMs + transferMs) }, (b, length) => {
        body = b;
        // A body bigger than the call was sized for (a whole-object get) gets its transfer time.
        if (length !== undefined && length > bytes) {
          clearTimeout(timer);
          wholeMs = Math.ceil(this.#wholeMs + length / this.#bytesPerMs);
          timer = setTimeout(expire, Math.max(0, t0 + wholeMs - performance.now()));
        }
      });
    } finally {
      clearTimeout(timer);
    }
  }

  /** The store refused the request's timestamp: say by how much the clocks differ. */
  #skewMessage(e: SdkErrorShape): string {
    const serverTime = typeof e.ServerTime === 'string' ? e.ServerTime : e.$response?.headers?.date;
    const server = serverTime !== undefined ? Date.parse(serverTime) : NaN;
    const allowed = Number(e.MaxAllowedSkewMilliseconds);
    let how = 'this host\'s clock differs too much from the store\'s';
    if (Number.isFinite(server)) {
      const skew = server - Date.now();
      how = `this host's clock is about ${roughDuration(skew)} ${skew > 0 ? 'behind' : 'ahead of'} the store's (store time ${serverTime}` +
        `${typeof e.RequestTime === 'string' ? `, request time ${e.RequestTime}` : ''}` +
        `${Number.isFinite(allowed) ? `, at most ${roughDuration(allowed)} allowed` : ''})`;
    }
    return `the store refuses the request's timestamp: ${how}; set the clock right (chrony, systemd-timesyncd or ntpd) and retry`;
  }

  /** The one place SDK errors become BatonErrors. */
  mapError(op: Op, key: string, err: unknown): BatonError {
    if (err instanceof BatonError) return err;
    const e = shape(err);
    const name = typeof e.name === 'string' ? e.name : '';
    const code = typeof e.code === 'string' ? e.code : typeof e.Code === 'string' ? e.Code : '';
    const status = e.$metadata?.httpStatusCode;
    const where = this.#where(op, key);
    const cause = e.cause instanceof Error ? `: ${e.cause.message}` : '';
    const detail = `${status !== undefined ? `HTTP ${status} ` : ''}${name || code}: ${errorMessage(err)}${cause}`;
    const invalid = (msg: string) => new BatonError('BATON_ERR_INVALID_ARGUMENT', `${where}: ${msg} (${detail})`, { cause: err });

    // Before the 403 rule: S3 answers a skewed clock with 403, but no credential is wrong.
    if (name === 'RequestTimeTooSkewed' || code === 'RequestTimeTooSkewed') {
      return new MisconfiguredError(`${where}: ${this.#skewMessage(e)} (${detail})`, { cause: err });
    }

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
    // No answer at all (refused, reset, timed out): say where we tried and what to check.
    const noAnswer = (): StoreUnavailableError => new StoreUnavailableError(
      `${where}: no answer from ${this.#endpoint}, retry later; if it persists, check that the endpoint is up and reachable from this host ` +
      `(--endpoint / BATON_S3_ENDPOINT, network, firewall) (${detail})`, { cause: err });
    if (status === undefined && (NETWORK_CODES.has(code) || name === 'TimeoutError' || name === 'AbortError')) return noAnswer();
    if (
      status === 409 || status === 429 || (status !== undefined && status >= 500) ||
      TRANSIENT_NAMES.has(name) || NETWORK_CODES.has(code) || name === 'AbortError'
    ) {
      return new StoreUnavailableError(`${where}: store unavailable, retry later (${detail})`, { cause: err });
    }
    // Node's HTTP parser refused the answer (HPE_*: not HTTP, a body past its length): the store
    // or something between us sent garbage; like a cut connection, worth another try.
    if (status === undefined && code.startsWith('HPE_')) {
      return new StoreUnavailableError(`${where}: the store's answer was not valid HTTP, retry later (${detail})`, { cause: err });
    }
    if (status === 400) return invalid('the store rejected the request');
    // An SDK error without an HTTP status is a transport failure we have no code for.
    if (e.$metadata !== undefined && status === undefined) return noAnswer();
    return new IoError(`${where}: unexpected error (${detail})`, { cause: err });
  }

  /**
   * Where GETs go without the SDK, resolved once with the SDK's own endpoint rules (so the
   * URL is the one the SDK would use: path style or virtual-hosted, FIPS, dual-stack, custom
   * endpoints). null sends GETs through the SDK: the rules ask for another signing scheme than
   * plain SigV4 (S3 Express), or cannot resolve (then the SDK says why, as before).
   */
  #directTarget(): Promise<DirectTarget | null> {
    return (this.#direct ??= (async (): Promise<DirectTarget | null> => {
      const c = this.client.config;
      try {
        const region = await c.region();
        const ep = c.endpointProvider({
          Bucket: this.bucket,
          Region: region,
          UseFIPS: await c.useFipsEndpoint(),
          UseDualStack: await c.useDualstackEndpoint(),
          ForcePathStyle: c.forcePathStyle,
          Accelerate: c.useAccelerateEndpoint,
          ...(this.#endpointOption !== undefined ? { Endpoint: this.#endpointOption } : {}),
        });
        const scheme = (ep.properties?.authSchemes as { name?: string; signingName?: string; signingRegion?: string }[] | undefined)?.[0];
        const url = ep.url;
        if (scheme?.name !== 'sigv4' || url.search !== '' || (url.protocol !== 'http:' && url.protocol !== 'https:')) return null;
        return {
          protocol: url.protocol,
          hostname: url.hostname.replace(/^\[|\]$/g, ''),
          port: url.port === '' ? undefined : Number(url.port),
          host: url.host,
          basePath: url.pathname.replace(/\/+$/, ''),
          signer: new SigV4Signer(scheme.signingRegion ?? region, scheme.signingName ?? 's3'),
        };
      } catch {
        return null;
      }
    })());
  }

  /**
   * A request signed here and sent with node's http (the invariants at the top say why), made
   * up to `maxAttempts` times. The SDK's behaviour it keeps: its credentials (refreshed as they
   * expire) and clock offset (corrected from an answer's Date header when the store says the
   * clocks differ, then one more attempt), the standard mode's jittered backoff between
   * attempts for transient failures, and its per-call limits (in #exchange); the whole call is
   * #call's, through `signal`. A failure leaves with `$metadata.attempts` set where it has
   * `$metadata` (an answer), as the SDK's do; the value says how many attempts it took.
   */
  async #attempts<T>(op: Op, fullKey: string, signal: AbortSignal, once: (creds: SigV4Credentials) => Promise<T>): Promise<{ value: T; attempts: number }> {
    for (let attempt = 1; ; attempt++) {
      try {
        const creds = await this.client.config.credentials();
        return { value: await once(creds), attempts: attempt };
      } catch (err) {
        if (signal.aborted) throw signal.reason;
        const e = shape(err);
        const name = typeof e.name === 'string' ? e.name : '';
        let skewCorrected = false;
        const serverDate = Date.parse(e.$response?.headers?.date ?? '');
        if (Number.isFinite(serverDate)) {
          const offset = this.client.config.systemClockOffset ?? 0;
          if (Math.abs(Date.now() + offset - serverDate) >= CLOCK_SKEW_MS) {
            this.client.config.systemClockOffset = serverDate - Date.now();
            skewCorrected = CLOCK_SKEW_NAMES.has(name);
          }
        }
        const retry = skewCorrected || this.mapError(op, fullKey, err) instanceof StoreUnavailableError;
        if (!retry || attempt >= this.#maxAttempts) {
          if (e.$metadata !== undefined) e.$metadata.attempts = attempt;
          throw err;
        }
        // The SDK's standard mode: full jitter over 100 ms doubling, at most 20 s.
        await delay(Math.random() * Math.min(20_000, 100 * 2 ** (attempt - 1)), undefined, { signal }).catch(() => { throw signal.reason; });
      }
    }
  }

  /** The headers every direct request signs: host, date (with the SDK's clock offset), payload hash, session token. */
  #baseHeaders(target: DirectTarget, payloadHash: string, creds: SigV4Credentials): Record<string, string> {
    const headers: Record<string, string> = {
      host: target.host,
      'x-amz-content-sha256': payloadHash,
      'x-amz-date': amzDate(Date.now() + (this.client.config.systemClockOffset ?? 0)),
    };
    if (creds.sessionToken !== undefined) headers['x-amz-security-token'] = creds.sessionToken;
    return headers;
  }

  /** One attempt of a ranged or whole GET: [body, Content-Range], or an error shaped as the SDK's. */
  async #getOnce(
    target: DirectTarget,
    fullKey: string,
    range: ByteRange | undefined,
    creds: SigV4Credentials,
    options: { abortSignal: AbortSignal; requestTimeout: number },
    onBody: (body: { destroy?: (err?: Error) => void }, length: number | undefined) => void,
    into?: Buffer,
  ): Promise<readonly [Buffer, string | undefined]> {
    const path = `${target.basePath}/${encodeKeyPath(fullKey)}`;
    const headers = this.#baseHeaders(target, EMPTY_SHA256, creds);
    if (range !== undefined) headers.range = `bytes=${range.offset}-${range.offset + range.length - 1}`;
    headers.authorization = target.signer.authorization({ method: 'GET', path, headers, payloadHash: EMPTY_SHA256 }, creds);
    // The body is read in place, within the process's budget per turn (http-get.ts says why).
    const res = await this.#gets.get(target, path, headers, {
      signal: options.abortSignal,
      connectMs: this.#connectMs,
      firstByteMs: options.requestTimeout,
      socketMs: this.#socketMs,
      budget: bodyTurns,
      onBody: (length, body) => onBody(body, length),
      ...(into !== undefined ? { into } : {}),
    });
    if (res.status < 200 || res.status > 299) throw s3ErrorFromResponse(res.status, res.headers, res.body.toString('utf8', 0, MAX_ERROR_BODY));
    const lengthHeader = res.headers['content-length'];
    const length = res.headers['transfer-encoding'] === undefined && lengthHeader !== undefined && /^\d+$/.test(lengthHeader) ? Number(lengthHeader) : undefined;
    if (length !== undefined && res.body.length !== length) {
      throw new StoreUnavailableError(`${this.#where('get', fullKey)}: body was ${res.body.length} bytes, Content-Length said ${length}`);
    }
    return [res.body, res.headers['content-range']];
  }

  /**
   * One attempt of a PUT. Signed as the SDK signs it (Content-Length, If-None-Match and the
   * metadata headers included; the payload hash or UNSIGNED-PAYLOAD as `signsPayload` says).
   * A body of EXPECT_CONTINUE_BYTES or more asks `Expect: 100-continue` first, as the SDK
   * does: a store that refuses the put (412 of a create-only put, a bad signature) says so
   * before the body travels, and its answer is read, never lost to a connection it closed on a
   * body it did not want. One that ignores Expect gets the body after CONTINUE_WAIT_MS.
   */
  #putOnce(
    target: DirectTarget,
    fullKey: string,
    body: Buffer,
    payloadHash: string,
    createOnly: boolean,
    metadata: Record<string, string> | undefined,
    creds: SigV4Credentials,
    options: { abortSignal: AbortSignal; requestTimeout: number },
  ): Promise<void> {
    const path = `${target.basePath}/${encodeKeyPath(fullKey)}`;
    const headers = this.#baseHeaders(target, payloadHash, creds);
    headers['content-length'] = String(body.length);
    if (createOnly) headers['if-none-match'] = '*';
    // validateMetadata: keys lower-case [a-z0-9-], values printable ASCII: header-safe as they are.
    for (const [k, v] of Object.entries(metadata ?? {})) headers[`x-amz-meta-${k}`] = v;
    headers.authorization = target.signer.authorization({ method: 'PUT', path, headers, payloadHash }, creds);
    return this.#exchange<void>(target, { method: 'PUT', path, headers, body }, options, (res, done) => {
      res.resume();
      res.on('end', () => done(undefined));
    });
  }

  /**
   * One HTTP exchange with the store, bounded by the same limits as the SDK's calls:
   * connecting, the response headers within `options.requestTimeout` of the start (the upload
   * included), silence on the socket, and `options.abortSignal` (the whole call). A 2xx answer
   * is handed to `read`; any other is read (up to MAX_ERROR_BODY) and fails as an error shaped
   * like the SDK's (s3ErrorFromResponse). Every failure destroys the request.
   *
   * When it settles, the request no longer reads `req.body`: a failure destroyed the request
   * (node drops the writes it had not made yet), and success waits for the request's 'finish'
   * (the whole body handed to the kernel) as well as for `read`. So a caller may reuse a body
   * once its put returned, whatever the outcome.
   */
  #exchange<T>(
    target: DirectTarget,
    r: { method: 'GET' | 'PUT'; path: string; headers: Record<string, string>; body?: Buffer },
    options: { abortSignal: AbortSignal; requestTimeout: number },
    read: (res: IncomingMessage, done: (value: T) => void, fail: (err: unknown) => void) => void,
  ): Promise<T> {
    const signal = options.abortSignal;
    const body = r.body;
    const expectContinue = body !== undefined && body.length >= EXPECT_CONTINUE_BYTES;
    return new Promise<T>((resolve, reject) => {
      let settled = false;
      let answered: { value: T } | null = null;
      // With Expect the body waits for 100 Continue (or CONTINUE_WAIT_MS); a final answer
      // before that means it never goes.
      let bodyState: 'waiting' | 'going' | 'never' = expectContinue ? 'waiting' : 'going';
      const timers: NodeJS.Timeout[] = [];
      // A failure destroys the request; one whose answer was read to its end (an error's XML)
      // has handed its connection back to the agent by then, and keeps it pooled.
      const finish = (err: unknown, value?: { value: T }): void => {
        if (settled) return;
        if (err === undefined && !req.writableFinished && bodyState !== 'never') {
          answered = value!; // the body is still on its way to the kernel: settle at 'finish'
          return;
        }
        settled = true;
        for (const t of timers) clearTimeout(t);
        signal.removeEventListener('abort', onAbort);
        if (err !== undefined || !req.writableFinished) req.destroy(); // a request never ended holds its socket
        if (err !== undefined) reject(err);
        else resolve(value!.value);
      };
      const fail = (err: unknown): void => finish(err);
      const onAbort = (): void => finish(signal.reason);
      const headers = expectContinue ? { ...r.headers, expect: '100-continue' } : r.headers; // Expect is never signed (SigV4)
      const req: ClientRequest = (target.protocol === 'https:' ? httpsRequest : httpRequest)({
        protocol: target.protocol,
        hostname: target.hostname,
        port: target.port,
        path: r.path,
        method: r.method,
        headers,
        agent: target.protocol === 'https:' ? this.#httpsAgent : this.#httpAgent,
      });
      // Listeners stay for the request's life: an error after the answer is settled is dropped here.
      req.on('error', fail);
      req.on('finish', () => { if (answered !== null) finish(undefined, answered); });
      signal.addEventListener('abort', onAbort, { once: true });
      if (signal.aborted) return onAbort();
      const firstByte = setTimeout(() => fail(timeoutError(`no response headers within ${options.requestTimeout} ms (the first-byte limit)`)), options.requestTimeout);
      timers.push(firstByte);
      req.setTimeout(this.#socketMs, () => fail(timeoutError(`no byte in either direction for ${this.#socketMs} ms (the socket limit)`)));
      req.on('socket', (sock) => {
        if (!sock.connecting) return;
        const t = setTimeout(() => fail(timeoutError(`no connection within ${this.#connectMs} ms (the connect limit)`)), this.#connectMs);
        timers.push(t);
        sock.once('connect', () => clearTimeout(t));
      });
      // The body goes once the store said 100 Continue, or after CONTINUE_WAIT_MS of silence
      // (a store that ignores Expect); never once it gave its final answer (that answer decides).
      const sendBody = (): void => {
        if (bodyState !== 'waiting' || settled) return;
        bodyState = 'going';
        writeBody(0);
      };
      // A body goes into the socket a slice at a time, within the process's budget per turn of
      // the event loop (clock.ts TurnBudget): handed over whole, 8 MiB went into the kernel in
      // one write (on loopback, the receiving side's work too), and sixteen uploads writing a
      // slice each in one turn still held the loop; a guest's 4 KiB read waited them out
      // (bench/volume.ts, the stall probe). Bodies go before encoding (priority -1): their
      // bytes are ready, and sent they free their memory.
      const writeBody = (at: number): void => {
        if (settled) return;
        if (body === undefined || body.length - at <= BODY_SLICE) {
          req.end(at === 0 ? body : body!.subarray(at));
          return;
        }
        req.write(body.subarray(at, at + BODY_SLICE));
        void bodyTurns.take(BODY_SLICE, -1).then(() => writeBody(at + BODY_SLICE));
      };
      req.on('response', (res: IncomingMessage) => {
        clearTimeout(firstByte);
        if (bodyState === 'waiting') bodyState = 'never'; // finish destroys the request, whose socket cannot be reused
        const status = res.statusCode ?? 0;
        let ended = false;
        res.on('error', fail);
        res.on('end', () => { ended = true; });
        res.on('close', () => {
          if (!ended) fail(Object.assign(new Error(`the connection closed before the whole answer arrived (HTTP ${status})`), { code: 'ERR_STREAM_PREMATURE_CLOSE' }));
        });
        if (status < 200 || status > 299) {
          const chunks: Buffer[] = [];
          let size = 0;
          res.on('data', (c: Buffer) => { if (size < MAX_ERROR_BODY) { chunks.push(c); size += c.length; } });
          res.on('end', () => fail(s3ErrorFromResponse(status, res.headers, Buffer.concat(chunks).toString('utf8', 0, MAX_ERROR_BODY))));
          return;
        }
        read(res, (value) => finish(undefined, { value }), fail);
      });
      if (!expectContinue) {
        writeBody(0);
        return;
      }
      req.once('continue', sendBody);
      timers.push(setTimeout(sendBody, CONTINUE_WAIT_MS));
      req.flushHeaders();
    });
  }

  async get(key: string, range?: ByteRange, into?: Buffer): Promise<Buffer> {
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
      // A whole-object get learns its size from the headers (onBody extends the limit then);
      // until they arrive it is sized like a small object.
      const direct = await this.#directTarget();
      [buf, contentRange] = await this.#call(range?.length ?? 0, async (sendOptions, onBody) => {
        if (direct !== null) return (await this.#attempts('get', fullKey, sendOptions.abortSignal, (creds) => this.#getOnce(direct, fullKey, range, creds, sendOptions, onBody, into))).value;
        const res = await this.client.send(new GetObjectCommand({
          Bucket: this.bucket,
          Key: fullKey,
          ...(range !== undefined ? { Range: `bytes=${range.offset}-${range.offset + range.length - 1}` } : {}),
        }), sendOptions);
        if (res.Body === undefined) throw new StoreUnavailableError(`${this.#where('get', key)}: response had no body`);
        onBody(res.Body as { destroy?: (err?: Error) => void }, res.ContentLength);
        const arr = await res.Body.transformToByteArray();
        const b = Buffer.from(arr.buffer, arr.byteOffset, arr.byteLength);
        if (res.ContentLength !== undefined && res.ContentLength !== b.length) {
          throw new StoreUnavailableError(`${this.#where('get', key)}: body was ${b.length} bytes, Content-Length said ${res.ContentLength}`);
        }
        return [b, res.ContentRange] as const;
      });
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
    const fullKey = this.prefix + key;
    try {
      const direct = await this.#directTarget();
      const attempts = await this.#call(body.length, async (sendOptions) => {
        if (direct !== null) {
          const payloadHash = this.signsPayload ? createHash('sha256').update(body).digest('hex') : UNSIGNED_PAYLOAD;
          return (await this.#attempts('put', fullKey, sendOptions.abortSignal, (creds) => this.#putOnce(direct, fullKey, body, payloadHash, createOnly, metadata, creds, sendOptions))).attempts;
        }
        const out = await this.client.send(new PutObjectCommand({
          Bucket: this.bucket,
          Key: fullKey,
          Body: body,
          ContentLength: body.length,
          ...(createOnly ? { IfNoneMatch: '*' } : {}),
          ...(metadata !== undefined ? { Metadata: metadata } : {}),
        }), sendOptions);
        return out.$metadata.attempts ?? 1;
      });
      // More than one attempt: an earlier one of this put may still be on its way.
      if (attempts > 1) options?.onRetry?.();
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
      const res = await this.#call(0, (sendOptions) => this.client.send(new HeadObjectCommand({ Bucket: this.bucket, Key: this.prefix + key }), sendOptions));
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
        page = await this.#call(0, (sendOptions) => this.client.send(new ListObjectsV2Command({
          Bucket: this.bucket,
          Prefix: this.prefix + prefix,
          MaxKeys: this.#pageSize,
          ...(options?.startAfter !== undefined ? { StartAfter: this.prefix + options.startAfter } : {}),
          ...(token !== undefined ? { ContinuationToken: token } : {}),
        }), sendOptions));
      } catch (err) {
        throw this.mapError('list', prefix, err);
      }
      let past = false;
      for (const o of page.Contents ?? []) {
        if (o.Key === undefined) continue;
        const key = o.Key.slice(strip);
        if (options?.endAt !== undefined && compareKeys(key, options.endAt) > 0) { past = true; break; }
        yield { key, size: o.Size ?? 0, lastModified: o.LastModified ?? new Date(0), ...(o.ETag !== undefined ? { etag: o.ETag } : {}) };
      }
      if (past || page.IsTruncated !== true) return;
      // "More follows" without a way to ask for it (or asking again for the same page) would
      // end the listing early or loop: both are a store bug, and a silently partial listing
      // is what GC and fork points must never see.
      const next = page.NextContinuationToken;
      if (next === undefined || next === '' || next === token) {
        throw new StoreUnsafeError(
          `${this.#where('list', prefix)}: the store said the listing is truncated but gave ` +
          `${next === undefined || next === '' ? 'no continuation token' : 'the same continuation token again'}; ` +
          'baton cannot trust a partial listing (garbage collection and forks depend on complete ones). The store is not S3-compatible here: use AWS S3, R2, MinIO or Ceph RGW',
        );
      }
      token = next;
    } while (token !== undefined);
  }

  async delete(key: string, options?: DeleteOptions): Promise<void> {
    validateKey(key);
    try {
      const out = await this.#call(0, (sendOptions) => this.client.send(new DeleteObjectCommand({ Bucket: this.bucket, Key: this.prefix + key }), sendOptions));
      // The SDK's own retries: an earlier attempt of this delete may still be on its way.
      if ((out.$metadata.attempts ?? 1) > 1) options?.onRetry?.();
    } catch (err) {
      if ((shape(err).$metadata?.attempts ?? 1) > 1) options?.onRetry?.();
      const mapped = this.mapError('delete', key, err);
      if (mapped instanceof NotFoundError) return;
      throw mapped;
    }
  }

  async close(): Promise<void> {
    this.#gets.close();
    this.client.destroy();
  }
}

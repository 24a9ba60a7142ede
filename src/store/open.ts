/**
 * openStore: turns a `--store` URL into an ObjectStore; parseStoreUrl: the one parser of
 * `--store` URLs, for everything that derives a location from one (the store itself, the
 * local lease directory, the plain backends in src/catalog.ts).
 *
 *   file:DIR, file:///abs/dir   LocalDirObjectStore (the embedded default)
 *   s3://bucket[/prefix]        S3ObjectStore wrapped in RetryingObjectStore
 *   memory:                     MemoryObjectStore (tests; nothing survives the process)
 *   ram:, raw:DIR               plain backends without the engine (src/catalog.ts), not object stores
 *
 * Only S3 is wrapped in the retrying decorator: local-dir errors are not transient (a full
 * disk does not fix itself in 2 s), and retrying them would only delay the message. Its
 * budget bounds how long one operation may take, retries included: DEFAULT_RETRY_BUDGET_MS
 * unless the caller chooses (the CLI gives commands a person waits for
 * INTERACTIVE_RETRY_BUDGET_MS); the S3 store bounds each call itself (s3.ts).
 * Every store but memory: checks, before its first operation, that this process's settings
 * (BATON_MAX_OPERATION_MS) are the ones the store records for all its hosts, and records
 * them at the first write (SettingsCheckedObjectStore in probe.ts).
 * Layers, bottom up: the store; injected faults (tests); counting (`instrument`: serve
 * --metrics, so every attempt the retry layer makes is a request, and injected faults look
 * like the store's own); the settings check; retries.
 * Opening does not probe; callers that will write run `probeStore` first.
 */
import { homedir } from 'node:os';
import { join, resolve } from 'node:path';
import { InvalidArgumentError } from '../errors.js';
import { FaultyObjectStore, InstrumentedObjectStore, RetryingObjectStore, type FaultOptions, type RetryOptions } from './decorators.js';
import { LocalDirObjectStore } from './local-dir.js';
import { MemoryObjectStore } from './memory.js';
import type { ObjectStore } from './object-store.js';
import { SettingsCheckedObjectStore, processSettings, type StoreSettings } from './probe.js';
import type { S3ObjectStore, S3StoreOptions, S3Timeouts } from './s3.js';
import type { ByteRange, DeleteOptions, ListOptions, ObjectHead, ObjectInfo, PutOptions } from './object-store.js';

/**
 * `file:` + ($BATON_HOME or $XDG_DATA_HOME/baton or ~/.local/share/baton) + `/store`, unless
 * $BATON_STORE names another. Defined once, in src/config.ts (the CLI's defaults live there).
 */
export { defaultStoreUrl } from '../config.js';

export interface OpenStoreOptions {
  /** S3-compatible endpoint URL; default $BATON_S3_ENDPOINT, else AWS. */
  endpoint?: string;
  region?: string;
  /** Tests; production uses the AWS default chain. */
  credentials?: S3StoreOptions['credentials'];
  maxSockets?: number;
  /** Retries of S3 requests; budgetMs defaults to DEFAULT_RETRY_BUDGET_MS. */
  retry?: RetryOptions;
  /** Per-call S3 limits (tests use small ones); see S3_TIMEOUT_DEFAULTS in s3.ts. */
  s3?: S3Timeouts & { maxAttempts?: number };
  /** What this process must agree on with the store (default: processSettings()). */
  settings?: StoreSettings;
  /**
   * Fault injection beneath the retry layer (tests and benchmarks: "20 ms per request",
   * "10% errors"). Also read from $BATON_FAULTS as JSON, e.g. {"latencyMs":20}.
   */
  faults?: FaultOptions;
  /**
   * Count requests, outcomes, bytes and latency (InstrumentedObjectStore, beneath the retry
   * layer). Off unless asked (serve --metrics): it adds a timer read and a promise per request.
   */
  instrument?: boolean;
}

export function faultsFromEnv(env: NodeJS.ProcessEnv = process.env): FaultOptions | undefined {
  const v = env.BATON_FAULTS;
  if (!v) return undefined;
  try {
    return JSON.parse(v) as FaultOptions;
  } catch {
    throw new InvalidArgumentError(`BATON_FAULTS must be JSON such as {"latencyMs":20,"errorRate":0.1}, got ${v}`);
  }
}

/** Every accepted form, for messages (the plain backends too: a user who typed `ram` means one). */
export const STORE_URL_FORMS = 'file:DIR or s3://bucket[/prefix], or memory:, ram: or raw:DIR';
const USAGE = `--store must be ${STORE_URL_FORMS}`;
// S3 bucket naming rules (lower-case, 3-63, no leading/trailing dot or dash).
const BUCKET = /^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$/;

/**
 * How long one store operation of a service (`baton serve`: commits, reads for clients) may
 * take, retries included: long enough to ride out a store restart, short enough that a dead
 * store turns into errors a client and the log can see.
 */
export const DEFAULT_RETRY_BUDGET_MS = 60_000;
/** The same for commands a person waits for (`baton ls`, `create`, `rm`...). */
export const INTERACTIVE_RETRY_BUDGET_MS = 30_000;

export function openStore(url: string, opts: OpenStoreOptions = {}): ObjectStore {
  const faults = opts.faults ?? faultsFromEnv();
  const plain = openPlainStore(url, opts);
  // Faults go beneath the retry layer, so what the engine sees is what retries leave over.
  let store: ObjectStore = faults ? new FaultyObjectStore(plain, faults) : plain;
  if (opts.instrument) store = new InstrumentedObjectStore(store);
  // A memory: store lives and dies with this process: nobody else to agree with.
  if (!(plain instanceof MemoryObjectStore)) store = new SettingsCheckedObjectStore(store, opts.settings ?? processSettings());
  if (plain instanceof LazyObjectStore || faults) {
    const named = plain instanceof LazyObjectStore
      ? { target: `${plain.description} at ${plain.endpoint}`, hint: 'check that the endpoint is up and reachable from this host (--endpoint / BATON_S3_ENDPOINT, network, firewall)' }
      : {};
    store = new RetryingObjectStore(store, { budgetMs: DEFAULT_RETRY_BUDGET_MS, ...named, ...opts.retry });
  }
  return store;
}

function openPlainStore(url: string, opts: OpenStoreOptions): ObjectStore {
  const loc = parseStoreUrl(url);
  if (loc.kind === 'memory') return new MemoryObjectStore();
  if (loc.kind === 'file') return new LocalDirObjectStore(loc.dir);
  if (loc.kind === 's3') {
    const { bucket, prefix } = loc;
    const endpoint = opts.endpoint ?? (process.env.BATON_S3_ENDPOINT || undefined);
    if (endpoint !== undefined && !/^https?:\/\/[^/]+/.test(endpoint)) {
      throw new InvalidArgumentError(`--endpoint ${endpoint}: must be an http:// or https:// URL, e.g. http://127.0.0.1:9000`);
    }
    const s3opts: S3StoreOptions = {
      bucket,
      prefix,
      ...(endpoint !== undefined ? { endpoint } : {}),
      ...(opts.region !== undefined ? { region: opts.region } : {}),
      ...(opts.credentials !== undefined ? { credentials: opts.credentials } : {}),
      ...(opts.maxSockets !== undefined ? { maxSockets: opts.maxSockets } : {}),
      // Sign every body even where TLS or loopback protects it (payloadProtectedInTransit).
      ...(process.env.BATON_S3_SIGN_PAYLOAD === '1' ? { signPayload: true } : {}),
      ...opts.s3,
    };
    return new LazyObjectStore(loc.description, async () => new (await import('./s3.js')).S3ObjectStore(s3opts), endpoint ?? `AWS S3 (${opts.region ?? process.env.AWS_REGION ?? process.env.AWS_DEFAULT_REGION ?? 'us-east-1'})`);
  }
  throw new InvalidArgumentError(`--store ${url}: ${loc.kind}: is a plain backend without the object-store engine (no forks, snapshots, leases or GC); use file:DIR, s3://bucket[/prefix] or memory: here`);
}

// ------------------------------------------------------------------ parsing `--store` URLs

/** Where a `--store` URL points: what parseStoreUrl returns. Paths are absolute. */
export type StoreLocation =
  | { kind: 'file'; dir: string }
  /** `prefix` as given (validated); `description` is `s3://bucket/` + the prefix normalized to end in `/`. */
  | { kind: 's3'; bucket: string; prefix: string; description: string }
  | { kind: 'memory' }
  | { kind: 'ram' }
  | { kind: 'raw'; dir: string };

/**
 * The one parser of `--store` URLs. Everything that derives a location from a store URL goes
 * through it (the store, the local lease directory next to it, `raw:`), so that two spellings
 * of one store (`file:~/s`, `file:/home/me/s`, `file:///home/me/s`, `file://localhost/home/me/s`,
 * a relative path from any working directory) always mean one directory: a lease directory
 * derived by other rules let two processes hold one volume with one token.
 *
 * `file:PATH` and `raw:PATH` take PATH as a path (relative to the working directory, `~` and
 * `~/...` expanded to the home directory, not %-decoded: what the store has always done);
 * `file://[localhost]/ABS` is a file URL and is %-decoded. Throws InvalidArgumentError naming
 * every accepted form.
 */
export function parseStoreUrl(url: string): StoreLocation {
  if (url === 'memory:' || url === 'memory://') return { kind: 'memory' };
  if (url === 'ram:' || url === 'ram://') return { kind: 'ram' };
  if (url.startsWith('file:')) return { kind: 'file', dir: parseLocalPath(url, 'file:') };
  if (url.startsWith('raw:')) return { kind: 'raw', dir: parseLocalPath(url, 'raw:') };
  if (url.startsWith('s3://')) {
    const rest = url.slice('s3://'.length);
    const slash = rest.indexOf('/');
    const bucket = slash < 0 ? rest : rest.slice(0, slash);
    const prefix = slash < 0 ? '' : rest.slice(slash + 1);
    if (!BUCKET.test(bucket) || bucket.includes('..')) {
      throw new InvalidArgumentError(`--store ${url}: "${bucket}" is not a valid S3 bucket name (3-63 characters of a-z 0-9 . -); ${USAGE}`);
    }
    if (prefix.split('/').some((s, i, a) => (s === '' && i < a.length - 1) || s === '.' || s === '..')) {
      throw new InvalidArgumentError(`--store ${url}: the prefix "${prefix}" has an empty, "." or ".." segment; ${USAGE}`);
    }
    // Same as S3ObjectStore's own (normalizePrefix), without loading the SDK to compute it.
    const description = `s3://${bucket}/${prefix === '' || prefix.endsWith('/') ? prefix : prefix + '/'}`;
    return { kind: 's3', bucket, prefix, description };
  }
  const scheme = /^([a-z][a-z0-9+.-]*):/i.exec(url)?.[1];
  const what = scheme ? `unknown kind of store "${scheme}:"` : 'not a store URL';
  throw new InvalidArgumentError(`--store ${JSON.stringify(url)}: ${what}; ${USAGE}`);
}

/**
 * One canonical string per store location: equal for every spelling of one store (the local
 * lease directory of a store that is not a local directory is named after it). For S3 it
 * is `s3://bucket` or `s3://bucket/prefix` without a trailing `/` (the spelling most users
 * type, so their lease directory stays where it was).
 */
export function storeLocationKey(loc: StoreLocation): string {
  switch (loc.kind) {
    case 'file': return `file:${loc.dir}`;
    case 'raw': return `raw:${loc.dir}`;
    case 'memory': return 'memory:';
    case 'ram': return 'ram:';
    case 's3': return loc.description.replace(/\/$/, '');
  }
}

function parseLocalPath(url: string, scheme: 'file:' | 'raw:'): string {
  let path: string;
  const rest = url.slice(scheme.length);
  if (rest.startsWith('//')) {
    // SCHEME:///abs (empty host) or SCHEME://localhost/abs; any other host is not on this machine.
    const auth = rest.slice(2);
    const slash = auth.indexOf('/');
    const host = slash < 0 ? auth : auth.slice(0, slash);
    if (host !== '' && host.toLowerCase() !== 'localhost') {
      throw new InvalidArgumentError(`--store ${url}: ${scheme} URLs cannot name another host ("${host}"); use ${scheme}///abs/path or ${scheme}DIR`);
    }
    try {
      path = slash < 0 ? '' : decodeURIComponent(auth.slice(slash));
    } catch {
      throw new InvalidArgumentError(`--store ${url}: a % in a ${scheme}// URL must start an escape such as %20 (write a literal % as %25)`);
    }
    if (path.includes('\0')) throw new InvalidArgumentError(`--store ${url}: the path contains a NUL byte`);
  } else {
    path = rest;
  }
  if (path === '') throw new InvalidArgumentError(`--store ${url}: no directory given; for example ${scheme}/var/lib/baton`);
  if (path === '~' || path.startsWith('~/')) path = join(homedir(), path.slice(1));
  return resolve(path);
}

/**
 * Loads the AWS SDK on first use: importing it costs ~0.7 s, which every command on a
 * local store (and every test that spawns the CLI) would otherwise pay.
 */
class LazyObjectStore implements ObjectStore {
  #store: Promise<S3ObjectStore> | null = null;
  /** `endpoint`: where requests go, for messages (the URL, or "AWS S3 (region)"). */
  constructor(readonly description: string, private readonly make: () => Promise<S3ObjectStore>, readonly endpoint: string) {}
  #get(): Promise<S3ObjectStore> { return (this.#store ??= this.make()); }
  async get(key: string, range?: ByteRange, into?: Buffer): Promise<Buffer> { return (await this.#get()).get(key, range, into); }
  async put(key: string, body: Buffer, options?: PutOptions): Promise<void> { return (await this.#get()).put(key, body, options); }
  async head(key: string): Promise<ObjectHead | null> { return (await this.#get()).head(key); }
  async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> { yield* (await this.#get()).list(prefix, options); }
  async delete(key: string, options?: DeleteOptions): Promise<void> { return (await this.#get()).delete(key, options); }
  async close(): Promise<void> { if (this.#store) await (await this.#store).close(); }
}

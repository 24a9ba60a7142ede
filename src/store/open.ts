/**
 * openStore: turns a `--store` URL into an ObjectStore.
 *
 *   file:DIR, file:///abs/dir   LocalDirObjectStore (the embedded default)
 *   s3://bucket[/prefix]        S3ObjectStore wrapped in RetryingObjectStore
 *   memory:                     MemoryObjectStore (tests; nothing survives the process)
 *
 * Only S3 is wrapped in the retrying decorator: local-dir errors are not transient (a full
 * disk does not fix itself in 2 s), and retrying them would only delay the message. Its
 * budget bounds how long one operation may take, retries included: DEFAULT_RETRY_BUDGET_MS
 * unless the caller chooses (the CLI gives commands a person waits for
 * INTERACTIVE_RETRY_BUDGET_MS); the S3 store bounds each call itself (s3.ts).
 * Every store but memory: checks, before its first operation, that this process's settings
 * (BATON_MAX_OPERATION_MS) are the ones the store records for all its hosts, and records
 * them at the first write (SettingsCheckedObjectStore in probe.ts).
 * Layers, bottom up: the store; injected faults (tests); the settings check; retries.
 * Opening does not probe; callers that will write run `probeStore` first.
 */
import { homedir } from 'node:os';
import { join, resolve } from 'node:path';
import { InvalidArgumentError } from '../errors.js';
import { FaultyObjectStore, RetryingObjectStore, type FaultOptions, type RetryOptions } from './decorators.js';
import { LocalDirObjectStore } from './local-dir.js';
import { MemoryObjectStore } from './memory.js';
import type { ObjectStore } from './object-store.js';
import { SettingsCheckedObjectStore, processSettings, type StoreSettings } from './probe.js';
import type { S3ObjectStore, S3StoreOptions, S3Timeouts } from './s3.js';
import type { ByteRange, ListOptions, ObjectHead, ObjectInfo, PutOptions } from './object-store.js';

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

const USAGE = '--store must be file:DIR or s3://bucket[/prefix]';
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
  if (url === 'memory:' || url === 'memory://') return new MemoryObjectStore();
  if (url.startsWith('file:')) return new LocalDirObjectStore(parseFileUrl(url));
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
      ...opts.s3,
    };
    // Same as S3ObjectStore's own (normalizePrefix), without loading the SDK to compute it.
    const description = `s3://${bucket}/${prefix === '' || prefix.endsWith('/') ? prefix : prefix + '/'}`;
    return new LazyObjectStore(description, async () => new (await import('./s3.js')).S3ObjectStore(s3opts), endpoint ?? `AWS S3 (${opts.region ?? process.env.AWS_REGION ?? process.env.AWS_DEFAULT_REGION ?? 'us-east-1'})`);
  }
  throw new InvalidArgumentError(`--store ${JSON.stringify(url)}: unknown kind of store; ${USAGE}`);
}

function parseFileUrl(url: string): string {
  let path: string;
  if (url.startsWith('file://')) {
    // file:///abs (empty host) or file://localhost/abs; any other host is not on this machine.
    const rest = url.slice('file://'.length);
    const slash = rest.indexOf('/');
    const host = slash < 0 ? rest : rest.slice(0, slash);
    if (host !== '' && host !== 'localhost') {
      throw new InvalidArgumentError(`--store ${url}: file URLs cannot name another host ("${host}"); use file:///abs/path or file:DIR`);
    }
    path = slash < 0 ? '' : decodeURIComponent(rest.slice(slash));
  } else {
    path = url.slice('file:'.length);
  }
  if (path === '') throw new InvalidArgumentError(`--store ${url}: no directory given; ${USAGE}`);
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
  async get(key: string, range?: ByteRange): Promise<Buffer> { return (await this.#get()).get(key, range); }
  async put(key: string, body: Buffer, options?: PutOptions): Promise<void> { return (await this.#get()).put(key, body, options); }
  async head(key: string): Promise<ObjectHead | null> { return (await this.#get()).head(key); }
  async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> { yield* (await this.#get()).list(prefix, options); }
  async delete(key: string): Promise<void> { return (await this.#get()).delete(key); }
  async close(): Promise<void> { if (this.#store) await (await this.#store).close(); }
}

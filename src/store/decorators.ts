/**
 * ObjectStore decorators (SlateDB style: each wraps a `next` store and changes one thing).
 *
 * - RetryingObjectStore: retries transient failures (StoreUnavailableError, TimeoutError) with
 *   exponential backoff and jitter. The hard case is a create-only put whose earlier attempt
 *   landed but whose reply was lost: the retry gets 412 although we won. Every put is stamped
 *   with `baton-put-id` metadata, and a 412 on a retry is resolved by reading the object's id
 *   back: ours means the earlier attempt succeeded (SlateDB verify_put_succeeded). A 412 on
 *   the first attempt is never second-guessed: it is a real conflict. A 412 is never retried.
 *   Besides the attempt count, an optional budget bounds the time one operation takes, its
 *   attempts and backoffs included (the AWS SDKs' "API call timeout"): an attempt still
 *   running at the deadline is abandoned (its outcome is then unknown, as for any timeout)
 *   and the error names the store and what to check, so a person waiting on a command gets an
 *   answer within the budget even from an endpoint that accepts connections and never answers.
 * - FaultyObjectStore: deterministic (seeded) fault injection for tests and benchmarks:
 *   latency, errors before the op, lost replies after the op, timeouts, a hang switch.
 * - InstrumentedObjectStore: counts requests, errors and bytes per operation, so a test can
 *   assert "one flush = N PUTs" and a benchmark can report request rates; also outcomes and
 *   a latency histogram per operation, which `serve --metrics` exports.
 */
import { randomBytes } from 'node:crypto';
import { PreconditionFailedError, StoreUnavailableError, TimeoutError, errorMessage, isBatonError } from '../errors.js';
import { DurationHistogram } from '../histogram.js';
import type { ByteRange, DeleteOptions, ListOptions, LocalObjects, ObjectHead, ObjectInfo, ObjectStore, PutOptions } from './object-store.js';

/** Metadata key stamped on every put so an ambiguous create-only retry can be resolved. */
export const PUT_ID_META = 'baton-put-id';

/** Unique and roughly time-ordered (readable in listings when debugging). */
export function newPutId(): string {
  return `${Date.now().toString(36)}-${randomBytes(8).toString('hex')}`;
}

export type StoreOp = 'get' | 'put' | 'head' | 'list' | 'delete';
export const STORE_OPS: readonly StoreOp[] = ['get', 'put', 'head', 'list', 'delete'];

const sleepMs = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** Errors after which the same request may succeed: the store said "later", or did not answer. */
export function isRetryable(err: unknown): boolean {
  return isBatonError(err, 'BATON_ERR_STORE_UNAVAILABLE') || isBatonError(err, 'BATON_ERR_TIMEOUT');
}

// ---------------------------------------------------------------------------------------------

/** Errors RetryingObjectStore made when a budget ran out: thrown as they are, never wrapped again. */
const OUT_OF_TIME = new WeakSet<object>();
function outOfTime<E extends Error>(err: E): E {
  OUT_OF_TIME.add(err);
  return err;
}

export interface RetryOptions {
  /** Total attempts including the first (default 6). */
  attempts?: number;
  /** First backoff (default 50 ms); doubles per attempt. */
  baseDelayMs?: number;
  /** Backoff ceiling (default 2000 ms). */
  maxDelayMs?: number;
  /** In [0, 1); default Math.random. Tests pass a seeded one. */
  random?: () => number;
  /** Default setTimeout; tests may pass a no-op to run fast. */
  sleep?: (ms: number) => Promise<void>;
  /**
   * Longest one operation may take, attempts and backoffs included (default: no limit beyond
   * `attempts`). A listing's budget restarts whenever it yields a key (a long listing makes
   * progress; only a stall is bounded), and the time the caller spends between keys is not
   * counted. The read-back that resolves an ambiguous create-only put gets a budget of its own.
   */
  budgetMs?: number;
  /** Named in the budget error, e.g. "s3://bucket/prefix/ at http://10.0.0.5:7480" (default the store's description). */
  target?: string;
  /** What to check when the budget runs out (default: that the store is up and reachable from this host). */
  hint?: string;
  /** Monotonic milliseconds; default performance.now. */
  now?: () => number;
  onRetry?: (info: { op: StoreOp; key: string; attempt: number; delayMs: number; error: unknown }) => void;
}

export class RetryingObjectStore implements ObjectStore {
  readonly description: string;
  readonly #attempts: number;
  readonly #base: number;
  readonly #max: number;
  readonly #random: () => number;
  readonly #sleep: (ms: number) => Promise<void>;
  readonly #onRetry: RetryOptions['onRetry'];
  readonly #budget: number;
  readonly #target: string;
  readonly #hint: string;
  readonly #now: () => number;
  /** Attempts after a first one, per op (each backoff before another try), for serve --metrics. */
  readonly retries: Record<StoreOp, number> = { get: 0, put: 0, head: 0, list: 0, delete: 0 };

  constructor(readonly next: ObjectStore, opts: RetryOptions = {}) {
    this.description = next.description;
    this.#attempts = Math.max(1, opts.attempts ?? 6);
    this.#base = opts.baseDelayMs ?? 50;
    this.#max = opts.maxDelayMs ?? 2_000;
    this.#random = opts.random ?? Math.random;
    this.#sleep = opts.sleep ?? sleepMs;
    this.#onRetry = opts.onRetry;
    this.#budget = opts.budgetMs !== undefined && opts.budgetMs > 0 ? opts.budgetMs : Infinity;
    this.#target = opts.target ?? next.description;
    this.#hint = opts.hint ?? 'check that the store is up and reachable from this host';
    this.#now = opts.now ?? (() => performance.now());
  }

  /** The store as its errors name it (with the endpoint, for S3). */
  get target(): string {
    return this.#target;
  }

  /** The budget this store gives one operation (Infinity: none). */
  get budgetMs(): number {
    return this.#budget;
  }

  #deadline(): number {
    return this.#now() + this.#budget;
  }

  #outOfTime(op: StoreOp, key: string, attempts: number, last: unknown): StoreUnavailableError {
    const why = last === undefined ? 'no answer' : `last error: ${errorMessage(last)}`;
    return outOfTime(new StoreUnavailableError(
      `${op} ${key} on ${this.#target}: gave up after ${(this.#budget / 1000).toFixed(1)} s and ${attempts} attempt${attempts === 1 ? '' : 's'} ` +
      `(${why}); ${this.#hint}`,
      { cause: last },
    ));
  }

  /**
   * One attempt, abandoned at `deadline`: the caller stops waiting, the request itself runs
   * on until its own limits end it (nothing here can cancel it), and its outcome is unknown.
   */
  async #attempt<T>(op: StoreOp, key: string, deadline: number, attempts: number, last: unknown, fn: () => Promise<T>): Promise<T> {
    if (this.#budget === Infinity) return fn();
    const p = fn();
    let timer: ReturnType<typeof setTimeout> | undefined;
    const expired = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(this.#outOfTime(op, key, attempts, last)), Math.max(0, deadline - this.#now()));
    });
    try {
      return await Promise.race([p, expired]);
    } finally {
      clearTimeout(timer);
      p.catch(() => {}); // an abandoned attempt's late failure is nobody's business
    }
  }

  /** Whether another attempt may start after this backoff; false means give up now. */
  #mayRetry(err: unknown, attempt: number, deadline: number, delayMs: number): boolean {
    return isRetryable(err) && attempt < this.#attempts && this.#now() + delayMs < deadline;
  }

  /** The error to throw when giving up: out of time is said as such, out of attempts is the last error. */
  #giveUp(op: StoreOp, key: string, err: unknown, attempt: number, deadline: number, delayMs: number): unknown {
    if (OUT_OF_TIME.has(err as object)) return err;
    if (isRetryable(err) && attempt < this.#attempts && this.#now() + delayMs >= deadline) return this.#outOfTime(op, key, attempt, err);
    return err;
  }

  /** "Equal jitter": half the exponential delay fixed, half random, so retries spread but never bunch at 0. */
  #delay(attempt: number): number {
    const d = Math.min(this.#max, this.#base * 2 ** (attempt - 1));
    return d / 2 + this.#random() * (d / 2);
  }

  async #backoff(op: StoreOp, key: string, attempt: number, error: unknown, delayMs: number): Promise<void> {
    this.retries[op]++;
    this.#onRetry?.({ op, key, attempt, delayMs, error });
    await this.#sleep(delayMs);
  }

  async #run<T>(op: StoreOp, key: string, fn: () => Promise<T>, onRetry?: () => void): Promise<T> {
    const deadline = this.#deadline();
    let last: unknown;
    for (let attempt = 1; ; attempt++) {
      try {
        return await this.#attempt(op, key, deadline, attempt, last, fn);
      } catch (err) {
        const delayMs = this.#delay(attempt);
        if (!this.#mayRetry(err, attempt, deadline, delayMs)) throw this.#giveUp(op, key, err, attempt, deadline, delayMs);
        onRetry?.();
        last = err;
        await this.#backoff(op, key, attempt, err, delayMs);
      }
    }
  }

  get(key: string, range?: ByteRange, into?: Buffer): Promise<Buffer> {
    // After a failed attempt the next ones read into memory of their own: the failed one may
    // still be receiving into `into`, and the caller, given back another buffer, knows not to
    // reuse it (ObjectStore.get). Reviewed finding: a retried GET returned `into`, the cache
    // reused it, and the abandoned attempt wrote the old object's bytes into the next fetch.
    let target = into;
    return this.#run('get', key, () => this.next.get(key, range, target), () => { target = undefined; });
  }

  head(key: string): Promise<ObjectHead | null> {
    return this.#run('head', key, () => this.next.head(key));
  }

  delete(key: string, options?: DeleteOptions): Promise<void> {
    return this.#run('delete', key, () => this.next.delete(key, options), options?.onRetry);
  }

  async put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    const putId = options?.metadata?.[PUT_ID_META] ?? newPutId();
    const opts: PutOptions = { ...options, metadata: { ...options?.metadata, [PUT_ID_META]: putId } };
    const createOnly = options?.ifNoneMatch === true;
    // True once an attempt failed in a way that may have hidden a landed write.
    let mayHaveLanded = false;
    const deadline = this.#deadline();
    let last: unknown;
    for (let attempt = 1; ; attempt++) {
      try {
        await this.#attempt('put', key, deadline, attempt, last, () => this.next.put(key, body, opts));
        return;
      } catch (err) {
        // A 412 is never retried: after an attempt that may have landed it is resolved by the
        // put id (ours: that attempt won; anything else: a real conflict), otherwise it is one.
        // The read-back gets its own budget: giving up on it would turn a put we may have won
        // into an error, which is safe (the outcome is reported unknown) but needlessly so.
        if (createOnly && mayHaveLanded && err instanceof PreconditionFailedError) {
          const h = await this.#run('head', key, () => this.next.head(key));
          if (h !== null && h.metadata[PUT_ID_META] === putId) return;
          throw err;
        }
        const delayMs = this.#delay(attempt);
        if (!this.#mayRetry(err, attempt, deadline, delayMs)) throw this.#giveUp('put', key, err, attempt, deadline, delayMs);
        mayHaveLanded = true;
        options?.onRetry?.();
        last = err;
        await this.#backoff('put', key, attempt, err, delayMs);
      }
    }
  }

  /** Resumes after the last key it yielded, so a failure mid-listing neither repeats nor skips keys. */
  async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    let after = options?.startAfter;
    let attempt = 1;
    let deadline = this.#deadline();
    let last: unknown;
    for (;;) {
      const it = this.next.list(prefix, { ...options, ...(after !== undefined ? { startAfter: after } : {}) })[Symbol.asyncIterator]();
      let pending = false;
      try {
        for (;;) {
          pending = true;
          const r = await this.#attempt('list', prefix, deadline, attempt, last, () => it.next());
          pending = false;
          if (r.done === true) return;
          yield r.value;
          // Progress: a long listing may survive any number of spaced-out errors, and the
          // caller's time between keys (this runs when it asks for the next) is not ours.
          after = r.value.key;
          attempt = 1;
          last = undefined;
          deadline = this.#deadline();
        }
      } catch (err) {
        const delayMs = this.#delay(attempt);
        if (!this.#mayRetry(err, attempt, deadline, delayMs)) throw this.#giveUp('list', prefix, err, attempt, deadline, delayMs);
        last = err;
        await this.#backoff('list', prefix, attempt, err, delayMs);
        attempt++;
      } finally {
        // Close the inner listing (the caller stopped early, or it failed). One abandoned at
        // the deadline may still be waiting for a page: close it when that ends, unwaited.
        // (An async generator queues return() behind its pending next().)
        const closed = Promise.resolve(it.return?.()).catch(() => {});
        if (!pending) await closed;
      }
    }
  }

  close(): Promise<void> {
    return this.next.close();
  }
}

// ---------------------------------------------------------------------------------------------

/** mulberry32: tiny, fast, good enough to make fault schedules reproducible from a seed. */
export function seededRandom(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

export interface FaultOptions {
  /** Seed for the fault schedule; the same seed and request order give the same faults. */
  seed?: number;
  /** Added before every request: one figure for all ops, or per op. Applies also to ops `ops` leaves out. */
  latencyMs?: number | Partial<Record<StoreOp, number>>;
  /** Probability of StoreUnavailableError before the op is done (nothing happened). */
  errorRate?: number;
  /** Probability the op is done and then StoreUnavailableError thrown (the ambiguous case). */
  lostReplyRate?: number;
  /** Probability the request is sent (the op runs) but the caller gives up after `timeoutMs`. */
  timeoutRate?: number;
  timeoutMs?: number;
  /** What a timeout throws (default 'timeout' = TimeoutError). */
  timeoutError?: 'timeout' | 'unavailable';
  /** Ops the probabilistic faults apply to (default all). */
  ops?: readonly StoreOp[];
}

export interface FaultCounters {
  requests: number;
  injectedErrors: number;
  lostReplies: number;
  timeouts: number;
  hung: number;
}

function zeroFaultCounters(): FaultCounters {
  return { requests: 0, injectedErrors: 0, lostReplies: 0, timeouts: 0, hung: 0 };
}

export class FaultyObjectStore implements ObjectStore {
  readonly description: string;
  readonly seed: number;
  #opts: FaultOptions;
  #rng: () => number;
  #hangGate: { promise: Promise<void>; release: () => void } | null = null;
  #failNext: { remaining: number; op: StoreOp | undefined }[] = [];
  #counters: Record<StoreOp, FaultCounters>;
  #pendingHung = 0;

  constructor(readonly next: ObjectStore, opts: FaultOptions = {}) {
    this.description = `faulty(${next.description})`;
    this.seed = opts.seed ?? Math.floor(Math.random() * 2 ** 32);
    this.#opts = { ...opts };
    this.#rng = seededRandom(this.seed);
    this.#counters = this.#zero();
  }

  #zero(): Record<StoreOp, FaultCounters> {
    return { get: zeroFaultCounters(), put: zeroFaultCounters(), head: zeroFaultCounters(), list: zeroFaultCounters(), delete: zeroFaultCounters() };
  }

  /** Change fault settings at run time (merged into the current ones; the RNG keeps its state). */
  setFaults(opts: Omit<FaultOptions, 'seed'>): void {
    this.#opts = { ...this.#opts, ...opts };
  }

  /** Every request from now on waits, without doing its op, until `unhang()`. */
  hang(): void {
    if (this.#hangGate !== null) return;
    let release!: () => void;
    const promise = new Promise<void>((r) => { release = r; });
    this.#hangGate = { promise, release };
  }

  /** Lets the parked requests (and new ones) through; they then run normally. */
  unhang(): void {
    const g = this.#hangGate;
    this.#hangGate = null;
    g?.release();
  }

  get isHung(): boolean {
    return this.#hangGate !== null;
  }

  /** Requests currently parked by `hang()`. */
  get pendingHung(): number {
    return this.#pendingHung;
  }

  /** The next `n` requests (of `op`, or of any op) fail with StoreUnavailableError before doing anything. */
  failNext(n: number, op?: StoreOp): void {
    if (n > 0) this.#failNext.push({ remaining: n, op });
  }

  counters(): Record<StoreOp, FaultCounters> & { total: FaultCounters } {
    const total = zeroFaultCounters();
    const out = this.#zero();
    for (const op of STORE_OPS) {
      out[op] = { ...this.#counters[op] };
      for (const k of Object.keys(total) as (keyof FaultCounters)[]) total[k] += this.#counters[op][k];
    }
    return { ...out, total };
  }

  resetCounters(): void {
    this.#counters = this.#zero();
  }

  /**
   * Decides one request's fate: waits out latency and any hang, applies failNext, then draws
   * from the seeded RNG. Throws for faults that happen before the op.
   */
  async #admit(op: StoreOp, key: string): Promise<'ok' | 'lost' | 'timeout'> {
    const c = this.#counters[op];
    c.requests++;
    const o = this.#opts;
    const latency = typeof o.latencyMs === 'number' ? o.latencyMs : o.latencyMs?.[op];
    if (latency !== undefined && latency > 0) await sleepMs(latency);
    while (this.#hangGate !== null) {
      c.hung++;
      this.#pendingHung++;
      try {
        await this.#hangGate.promise;
      } finally {
        this.#pendingHung--;
      }
    }
    const forced = this.#failNext.findIndex((f) => f.op === undefined || f.op === op);
    if (forced >= 0) {
      const f = this.#failNext[forced]!;
      if (--f.remaining <= 0) this.#failNext.splice(forced, 1);
      c.injectedErrors++;
      throw new StoreUnavailableError(`${op} ${key}: injected failure (failNext) on ${this.description}`);
    }
    if (o.ops !== undefined && !o.ops.includes(op)) return 'ok';
    const r = this.#rng();
    const pErr = o.errorRate ?? 0;
    const pLost = pErr + (o.lostReplyRate ?? 0);
    const pTimeout = pLost + (o.timeoutRate ?? 0);
    if (r < pErr) {
      c.injectedErrors++;
      throw new StoreUnavailableError(`${op} ${key}: injected error on ${this.description} (seed ${this.seed})`);
    }
    if (r < pLost) return 'lost';
    if (r < pTimeout) return 'timeout';
    return 'ok';
  }

  async #lost(op: StoreOp, key: string): Promise<never> {
    this.#counters[op].lostReplies++;
    throw new StoreUnavailableError(`${op} ${key}: injected lost reply on ${this.description} (seed ${this.seed}); the ${op} was done`);
  }

  /** The request went out (`started`); whether it lands before or after we give up is the store's business. */
  async #timeout(op: StoreOp, key: string, started: Promise<unknown>): Promise<never> {
    this.#counters[op].timeouts++;
    started.catch(() => {});
    const ms = this.#opts.timeoutMs ?? 0;
    await sleepMs(ms);
    const msg = `${op} ${key}: injected timeout after ${ms} ms on ${this.description} (seed ${this.seed})`;
    throw this.#opts.timeoutError === 'unavailable' ? new StoreUnavailableError(msg) : new TimeoutError(msg);
  }

  async #request<T>(op: StoreOp, key: string, fn: () => Promise<T>): Promise<T> {
    const fate = await this.#admit(op, key);
    if (fate === 'ok') return fn();
    if (fate === 'lost') {
      await fn();
      return this.#lost(op, key);
    }
    return this.#timeout(op, key, fn());
  }

  get(key: string, range?: ByteRange, into?: Buffer): Promise<Buffer> {
    return this.#request('get', key, () => this.next.get(key, range, into));
  }

  put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    return this.#request('put', key, () => this.next.put(key, body, options));
  }

  head(key: string): Promise<ObjectHead | null> {
    return this.#request('head', key, () => this.next.head(key));
  }

  delete(key: string, options?: DeleteOptions): Promise<void> {
    return this.#request('delete', key, () => this.next.delete(key, options));
  }

  /** A listing is one request for fault purposes: faults strike before the first key, or (lost reply) after the last. */
  async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    const fate = await this.#admit('list', prefix);
    if (fate === 'ok') {
      yield* this.next.list(prefix, options);
      return;
    }
    const drain = async (): Promise<void> => {
      for await (const _ of this.next.list(prefix, options)) { /* the reply is lost */ }
    };
    if (fate === 'lost') {
      await drain();
      await this.#lost('list', prefix);
    }
    await this.#timeout('list', prefix, drain());
  }

  close(): Promise<void> {
    this.unhang();
    return this.next.close();
  }
}

// ---------------------------------------------------------------------------------------------

export interface OpStats {
  /** Calls of this op. A listing counts once however many S3 pages it took. */
  requests: number;
  errors: number;
  /** Body bytes: returned by get, sent by put. */
  bytes: number;
  /** Objects reported by list. */
  items: number;
}

export type StoreStats = Record<StoreOp, OpStats> & { total: OpStats; inFlight: number; maxInFlight: number };

/**
 * How a request ended, as the metrics' `outcome` label: a bounded set. `not_found` and
 * `precondition_failed` are answers, not failures (a get of an absent key, a create-only put
 * that lost: how fencing works); `unavailable` and `timeout` are what the retry layer retries.
 */
export const STORE_OUTCOMES = ['ok', 'not_found', 'precondition_failed', 'unavailable', 'timeout', 'error'] as const;
export type StoreOutcome = (typeof STORE_OUTCOMES)[number];

function outcomeOf(err: unknown): StoreOutcome {
  if (isBatonError(err, 'BATON_ERR_NOT_FOUND')) return 'not_found';
  if (isBatonError(err, 'BATON_ERR_PRECONDITION_FAILED')) return 'precondition_failed';
  if (isBatonError(err, 'BATON_ERR_STORE_UNAVAILABLE')) return 'unavailable';
  if (isBatonError(err, 'BATON_ERR_TIMEOUT')) return 'timeout';
  return 'error';
}

/** Per op: requests by outcome, and how long they took (for a listing: the time spent waiting for the store, not the caller's time between keys). */
export interface OpMetrics {
  readonly outcomes: Record<StoreOutcome, number>;
  readonly seconds: DurationHistogram;
  /** Body bytes, as OpStats.bytes: received by get, sent by put. */
  bytes: number;
}

function zeroOpStats(): OpStats {
  return { requests: 0, errors: 0, bytes: 0, items: 0 };
}

function newOpMetrics(): OpMetrics {
  return { outcomes: { ok: 0, not_found: 0, precondition_failed: 0, unavailable: 0, timeout: 0, error: 0 }, seconds: new DurationHistogram(), bytes: 0 };
}

export class InstrumentedObjectStore implements ObjectStore {
  readonly description: string;
  /**
   * The inner store's: a decorator that only counts changes nothing about reads and puts, so
   * it passes it on (object-store.ts LocalObjects); hiding it would switch the engine to its
   * read cache. putParts is counted as a put; read() is passed on as it is, counted by the
   * store that does it (LocalObjects.reads: it is on the path of every NBD READ).
   */
  readonly local?: LocalObjects;
  #stats: Record<StoreOp, OpStats>;
  /** Live, never reset: Prometheus counters only grow (reset() leaves them alone). */
  readonly #metrics: Record<StoreOp, OpMetrics> = { get: newOpMetrics(), put: newOpMetrics(), head: newOpMetrics(), list: newOpMetrics(), delete: newOpMetrics() };
  #inFlight = 0;
  #maxInFlight = 0;

  constructor(readonly next: ObjectStore) {
    this.description = next.description;
    this.#stats = this.#zero();
    const inner = next.local;
    if (inner) {
      this.local = {
        read: (key, offset, length, out, outOff) => inner.read(key, offset, length, out, outOff),
        ...(inner.readNow ? { readNow: (key: string, offset: number, length: number, out: Buffer, outOff: number) => inner.readNow!(key, offset, length, out, outOff) } : {}),
        ...(inner.readvNow ? { readvNow: (key: string, offset: number, parts: readonly Buffer[]) => inner.readvNow!(key, offset, parts) } : {}),
        view: (key, offset, length, use) => inner.view(key, offset, length, use),
        readv: (key, offset, parts) => inner.readv(key, offset, parts),
        putParts: (key, parts, options) => this.#count('put', () => inner.putParts(key, parts, options), () => parts.reduce((n, p) => n + p.length, 0)),
        ...(inner.keys ? { keys: (prefix: string, options?: ListOptions) => this.#countedListing(inner.keys!(prefix, options)) } : {}),
        ...(inner.reads ? { reads: inner.reads } : {}),
      };
    }
  }

  #zero(): Record<StoreOp, OpStats> {
    return { get: zeroOpStats(), put: zeroOpStats(), head: zeroOpStats(), list: zeroOpStats(), delete: zeroOpStats() };
  }

  /** A snapshot: later requests do not change it. */
  stats(): StoreStats {
    const total = zeroOpStats();
    const out = this.#zero();
    for (const op of STORE_OPS) {
      out[op] = { ...this.#stats[op] };
      for (const k of Object.keys(total) as (keyof OpStats)[]) total[k] += this.#stats[op][k];
    }
    return { ...out, total, inFlight: this.#inFlight, maxInFlight: this.#maxInFlight };
  }

  /** Outcomes and latency per op since this store was made: live objects, read them, do not change them. */
  metrics(): Readonly<Record<StoreOp, OpMetrics>> {
    return this.#metrics;
  }

  /** Restarts stats() (tests measure one phase); metrics() keeps counting. */
  reset(): void {
    this.#stats = this.#zero();
    this.#maxInFlight = this.#inFlight;
  }

  /** A request starts: returns its start time. Each #begin is ended by exactly one #done or #failed. */
  #begin(op: StoreOp): number {
    this.#stats[op].requests++;
    this.#inFlight++;
    if (this.#inFlight > this.#maxInFlight) this.#maxInFlight = this.#inFlight;
    return performance.now();
  }

  #done(op: StoreOp, t0: number, bytes: number): void {
    this.#inFlight--;
    this.#stats[op].bytes += bytes;
    const m = this.#metrics[op];
    m.bytes += bytes;
    m.outcomes.ok++;
    m.seconds.observe((performance.now() - t0) / 1000);
  }

  #failed(op: StoreOp, t0: number, err: unknown): void {
    this.#inFlight--;
    this.#stats[op].errors++;
    const m = this.#metrics[op];
    m.outcomes[outcomeOf(err)]++;
    m.seconds.observe((performance.now() - t0) / 1000);
  }

  async #count<T>(op: StoreOp, fn: () => Promise<T>, bytesOf: (v: T) => number): Promise<T> {
    const t0 = this.#begin(op);
    let v: T;
    try {
      v = await fn();
    } catch (err) {
      this.#failed(op, t0, err);
      throw err;
    }
    this.#done(op, t0, bytesOf(v));
    return v;
  }

  get(key: string, range?: ByteRange, into?: Buffer): Promise<Buffer> {
    return this.#count('get', () => this.next.get(key, range, into), (b) => b.length);
  }

  put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    return this.#count('put', () => this.next.put(key, body, options), () => body.length);
  }

  head(key: string): Promise<ObjectHead | null> {
    return this.#count('head', () => this.next.head(key), () => 0);
  }

  delete(key: string, options?: DeleteOptions): Promise<void> {
    return this.#count('delete', () => this.next.delete(key, options), () => 0);
  }

  /**
   * One request however many pages; its duration is the time spent waiting for the store
   * (the awaits of the inner listing), not the caller's time between keys. A listing the
   * caller stops early counts as ok.
   */
  list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    return this.#countedListing(this.next.list(prefix, options));
  }

  async *#countedListing<T>(listing: AsyncIterable<T>): AsyncIterable<T> {
    const s = this.#stats.list;
    const m = this.#metrics.list;
    s.requests++;
    let waited = 0;
    let outcome: StoreOutcome = 'ok';
    const it = listing[Symbol.asyncIterator]();
    try {
      for (;;) {
        const t0 = performance.now();
        let r: IteratorResult<T>;
        try {
          r = await it.next();
        } finally {
          waited += performance.now() - t0;
        }
        if (r.done === true) break;
        s.items++;
        yield r.value;
      }
    } catch (err) {
      s.errors++;
      outcome = outcomeOf(err);
      throw err;
    } finally {
      m.outcomes[outcome]++;
      m.seconds.observe(waited / 1000);
      await it.return?.();
    }
  }

  close(): Promise<void> {
    return this.next.close();
  }
}

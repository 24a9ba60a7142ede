/**
 * probeStore: refuse a store that would make fencing a lie, before serving from it.
 * StoreSettings: refuse a process whose settings disagree with the ones every host of the
 * store must share.
 *
 * baton's safety (who may write a volume) rests on one primitive: a create-only put
 * (If-None-Match: *) of a key that exists must fail. A store that silently overwrites instead
 * (s3rver, some gateways) would let two hosts both believe they hold a volume. The probe also
 * checks read-after-write, which the volume engine assumes after every acknowledged put, and
 * that a put's metadata comes back: every create-only put carries a `baton-put-id`, and an
 * ambiguous outcome (the reply was lost, the retry got 412) is resolved by reading it back; on
 * a store that drops metadata every such put would look like another host's and fence the
 * volume.
 *
 * Invariants: the probe key is random under `_probe/`, so concurrent probes of the same store
 * never collide; it is deleted afterwards, also when the probe fails.
 */
import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import { CorruptError, MisconfiguredError, StoreUnsafeError, errorMessage, isBatonError } from '../errors.js';
import { maxOperationMs } from '../volume/format.js';
import { PUT_ID_META, RetryingObjectStore, isRetryable, newPutId } from './decorators.js';
import type { ByteRange, DeleteOptions, ListOptions, LocalObjects, ObjectHead, ObjectInfo, ObjectStore, PutOptions } from './object-store.js';

export const PROBE_PREFIX = '_probe/';

export interface ProbeResult {
  store: string;
  key: string;
  elapsedMs: number;
}

const HOW_TO_FIX =
  'baton needs conditional writes (If-None-Match: *), which AWS S3, Cloudflare R2, MinIO and Ceph RGW support; ' +
  'use one of them, or the local store (--store file:DIR)';

export async function probeStore(store: ObjectStore): Promise<ProbeResult> {
  const t0 = performance.now();
  const key = `${PROBE_PREFIX}${Date.now().toString(36)}-${randomBytes(8).toString('hex')}`;
  const first = randomBytes(64);
  const second = randomBytes(64);
  const putId = newPutId();
  let failed: unknown;
  try {
    await store.put(key, first, { ifNoneMatch: true, metadata: { [PUT_ID_META]: putId } });

    const back = await store.get(key);
    if (!back.equals(first)) {
      throw new StoreUnsafeError(`store ${store.description} returned different bytes right after a put of ${key} (no read-after-write consistency); baton cannot run on it`);
    }

    const head = await store.head(key);
    const gotId = head?.metadata[PUT_ID_META];
    if (gotId !== putId) {
      throw new StoreUnsafeError(
        `store ${store.description} does not keep a put's metadata: ${key} was put with ${PUT_ID_META}=${putId} and came back ` +
        `${head === null ? 'missing' : gotId === undefined ? `without it (metadata ${JSON.stringify(head.metadata)})` : `with ${gotId}`}. ` +
        'baton stamps every create-only put with an id and reads it back to tell its own retried put from another host\'s; ' +
        'without it every ambiguous put would fence the volume. Use a store that keeps object metadata (x-amz-meta-*): ' +
        'AWS S3, Cloudflare R2, MinIO, Ceph RGW, or the local store (--store file:DIR); check that no proxy strips x-amz-meta-* headers',
      );
    }

    let overwrote = false;
    try {
      await store.put(key, second, { ifNoneMatch: true });
      overwrote = true;
    } catch (err) {
      if (isBatonError(err, 'BATON_ERR_NOT_SUPPORTED')) {
        throw new StoreUnsafeError(`store ${store.description} does not support create-only puts (If-None-Match: *): ${errorMessage(err)}. ${HOW_TO_FIX}`);
      }
      if (!isBatonError(err, 'BATON_ERR_PRECONDITION_FAILED')) throw err;
    }
    if (overwrote) {
      throw new StoreUnsafeError(
        `store ${store.description} accepted a second create-only put of ${key}: it ignores If-None-Match: *, ` +
        `and baton's fencing relies on it (two hosts could both write one volume). ${HOW_TO_FIX}`,
      );
    }

    const after = await store.get(key);
    if (!after.equals(first)) {
      throw new StoreUnsafeError(`store ${store.description} refused a create-only put of ${key} but changed the object anyway; baton's fencing relies on If-None-Match: *. ${HOW_TO_FIX}`);
    }
    return { store: store.description, key, elapsedMs: performance.now() - t0 };
  } catch (err) {
    failed = err;
    throw err;
  } finally {
    if (failed !== undefined && isRetryable(failed)) {
      // The store does not answer: do not make the caller wait a second budget for the
      // cleanup of a key that most likely never landed; it runs on in the background.
      store.delete(key).catch(() => {});
    } else {
      try {
        await store.delete(key);
      } catch (err) {
        // Do not hide the probe's own verdict behind a cleanup failure.
        if (failed === undefined) throw err;
      }
    }
  }
}

/** The part of a pino logger waitForStore uses. */
export interface WaitLog {
  info(obj: object, msg: string): void;
  warn(obj: object, msg: string): void;
}

export interface WaitForStoreOptions {
  log: WaitLog;
  /** Named in the log (e.g. the S3 endpoint); default the store's description. */
  target?: string;
  /** Log "waiting" when an attempt has not answered after this long (default 2 s). */
  slowMs?: number;
  /** Pause after the first failed attempt (default 1 s), doubling up to maxDelayMs (default 30 s). */
  firstDelayMs?: number;
  maxDelayMs?: number;
  sleep?: (ms: number) => Promise<void>;
}

/**
 * probeStore for a service (`baton serve`): while the store does not answer, say so in the log
 * and keep trying with backoff, instead of failing or sitting silent. A service may well start
 * before its store or network is up (boot order, a store restarting), and should then come up
 * by itself; failing would only hand the same wait to a supervisor's restart loop. What retrying
 * cannot fix (no such bucket, bad credentials, an unsafe store, settings that disagree with
 * the store's) is not retryable and ends the wait with its own message.
 */
export async function waitForStore(store: ObjectStore, opts: WaitForStoreOptions): Promise<ProbeResult> {
  const target = opts.target ?? (store instanceof RetryingObjectStore ? store.target : store.description);
  const slowMs = opts.slowMs ?? 2_000;
  const maxDelay = opts.maxDelayMs ?? 30_000;
  const sleep = opts.sleep ?? ((ms: number) => new Promise<void>((r) => setTimeout(r, ms)));
  let delay = opts.firstDelayMs ?? 1_000;
  for (let attempt = 1; ; attempt++) {
    const slow = setTimeout(() => {
      opts.log.warn({ store: store.description, target, attempt }, `waiting for the store ${target} to answer (serve listens once it does)`);
    }, slowMs);
    try {
      return await probeStore(store);
    } catch (err) {
      if (!isRetryable(err)) throw err;
      opts.log.warn(
        { store: store.description, target, attempt, retryInMs: delay, err: errorMessage(err) },
        `the store ${target} does not answer; retrying in ${Math.round(delay / 1000)} s (serve listens once it answers): ${errorMessage(err)}`,
      );
      await sleep(delay);
      delay = Math.min(maxDelay, delay * 2);
    } finally {
      clearTimeout(slow);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Settings every host of a store must share

/** Where a store records them; outside `vol/` and `gc/`, so GC never considers it. */
export const STORE_SETTINGS_KEY = 'baton/settings.json';
const SETTINGS_FORMAT = 'baton-settings-1';

export interface StoreSettings {
  /**
   * See maxOperationMs() in src/volume/format.ts: GC's grace period is at least twice it and
   * its safety argument assumes every host bounds its operations by the same value.
   */
  maxOperationMs: number;
}

interface RecordedSettings extends StoreSettings {
  format: typeof SETTINGS_FORMAT;
  recordedAt?: string;
  recordedBy?: string;
}

/** This process's settings: BATON_MAX_OPERATION_MS, or the default. */
export function processSettings(): StoreSettings {
  return { maxOperationMs: maxOperationMs() };
}

function decodeSettings(b: Buffer, where: string): RecordedSettings {
  let v: unknown;
  try {
    v = JSON.parse(b.toString('utf8'));
  } catch {
    v = undefined;
  }
  const o = typeof v === 'object' && v !== null ? (v as Record<string, unknown>) : {};
  if (o.format !== SETTINGS_FORMAT || !Number.isSafeInteger(o.maxOperationMs) || (o.maxOperationMs as number) <= 0) {
    throw new CorruptError(
      `${STORE_SETTINGS_KEY} in ${where} is not a baton settings object (${b.toString('utf8', 0, 200)}); ` +
      `if no baton process uses this store, delete it and the next one records its own settings`,
    );
  }
  return {
    format: SETTINGS_FORMAT,
    maxOperationMs: o.maxOperationMs as number,
    ...(typeof o.recordedAt === 'string' ? { recordedAt: o.recordedAt } : {}),
    ...(typeof o.recordedBy === 'string' ? { recordedBy: o.recordedBy } : {}),
  };
}

function mismatch(where: string, rec: RecordedSettings, mine: StoreSettings): MisconfiguredError {
  const fromEnv = process.env.BATON_MAX_OPERATION_MS ? ' (from $BATON_MAX_OPERATION_MS)' : ' (the default)';
  const by = rec.recordedBy !== undefined || rec.recordedAt !== undefined
    ? `, recorded${rec.recordedBy !== undefined ? ` by ${rec.recordedBy}` : ''}${rec.recordedAt !== undefined ? ` at ${rec.recordedAt}` : ''}` : '';
  return new MisconfiguredError(
    `store ${where} is used with BATON_MAX_OPERATION_MS=${rec.maxOperationMs} (in its ${STORE_SETTINGS_KEY}${by}), ` +
    `but this process has ${mine.maxOperationMs}${fromEnv}: garbage collection is safe only when every host uses the same value. ` +
    `Run this process with BATON_MAX_OPERATION_MS=${rec.maxOperationMs}${rec.maxOperationMs === 60_000 ? ' (or unset it: that is the default)' : ''}; ` +
    `to change the value for the store, stop every baton process using it, delete ${STORE_SETTINGS_KEY} from the store ` +
    `(in a file: store, the file baton/settings.json@), and start them all with the new value`,
  );
}

/**
 * Compares this process's settings with the ones `store` records, recording them first (one
 * create-only put: racing processes agree on whichever landed) when none are and `record` is
 * set. Returns false when nothing is recorded and `record` is not set. Throws
 * MisconfiguredError on a difference, CorruptError on an unreadable record, and the store's
 * own errors (StoreUnavailableError: try again) otherwise.
 */
export async function checkStoreSettings(store: ObjectStore, mine: StoreSettings, record: boolean): Promise<boolean> {
  for (let round = 0; ; round++) {
    let body: Buffer | null;
    try {
      body = await store.get(STORE_SETTINGS_KEY);
    } catch (err) {
      if (!isBatonError(err, 'BATON_ERR_NOT_FOUND')) throw err;
      body = null;
    }
    if (body !== null) {
      const rec = decodeSettings(body, store.description);
      if (rec.maxOperationMs !== mine.maxOperationMs) throw mismatch(store.description, rec, mine);
      return true;
    }
    if (!record) return false;
    const rec: RecordedSettings = {
      format: SETTINGS_FORMAT, maxOperationMs: mine.maxOperationMs, recordedAt: new Date().toISOString(), recordedBy: `${hostname()} pid ${process.pid}`,
    };
    try {
      await store.put(STORE_SETTINGS_KEY, Buffer.from(JSON.stringify(rec, null, 2) + '\n'), { ifNoneMatch: true });
      return true;
    } catch (err) {
      // Another process recorded first (or our own earlier attempt did): compare with that.
      if (!isBatonError(err, 'BATON_ERR_PRECONDITION_FAILED') || round > 0) throw err;
    }
  }
}

/**
 * The store as every process opens it (open.ts): before its first operation, its settings
 * are compared with this process's, and a process that disagrees is refused on every
 * operation (MisconfiguredError, with what to do). Reads on a store that records none yet go
 * ahead without recording (a read-only process, `baton ls`, must not need write access); the
 * first put or delete records them first, so every store baton has written to has them.
 * After the check the cost per operation is one comparison.
 */
export class SettingsCheckedObjectStore implements ObjectStore {
  readonly description: string;
  #state: 'unchecked' | 'absent' | 'ok' = 'unchecked';
  #refused: unknown = null;
  #pending: Promise<void> | null = null;

  /** The inner store's, behind the same check as get and put (it changes nothing else). */
  readonly local?: LocalObjects;

  constructor(readonly next: ObjectStore, readonly settings: StoreSettings = processSettings()) {
    this.description = next.description;
    const inner = next.local;
    if (inner) {
      this.local = {
        read: (key, offset, length, out, outOff) => (this.#state === 'ok'
          ? inner.read(key, offset, length, out, outOff)
          : this.#ready(false).then(() => inner.read(key, offset, length, out, outOff))),
        // Only once the check passed: before, every read waits for it (read()).
        ...(inner.readNow ? { readNow: (key: string, offset: number, length: number, out: Buffer, outOff: number) => this.#state === 'ok' && inner.readNow!(key, offset, length, out, outOff) } : {}),
        ...(inner.readvNow ? { readvNow: (key: string, offset: number, parts: readonly Buffer[]) => this.#state === 'ok' && inner.readvNow!(key, offset, parts) } : {}),
        view: (key, offset, length, use) => (this.#state === 'ok'
          ? inner.view(key, offset, length, use)
          : this.#ready(false).then(() => inner.view(key, offset, length, use))),
        readv: (key, offset, parts) => (this.#state === 'ok'
          ? inner.readv(key, offset, parts)
          : this.#ready(false).then(() => inner.readv(key, offset, parts))),
        putParts: (key, parts, options) => (this.#state === 'ok'
          ? inner.putParts(key, parts, options)
          : this.#ready(true).then(() => inner.putParts(key, parts, options))),
        ...(inner.keys ? { keys: (prefix: string, options?: ListOptions) => (this.#state === 'ok' ? inner.keys!(prefix, options) : this.#checkedKeys(inner, prefix, options)) } : {}),
        ...(inner.reads ? { reads: inner.reads } : {}),
      };
    }
  }

  async #ready(mutating: boolean): Promise<void> {
    for (;;) {
      if (this.#refused !== null) throw this.#refused;
      if (this.#state === 'ok' || (this.#state === 'absent' && !mutating)) return;
      if (this.#pending !== null) {
        await this.#pending.catch(() => {});
        continue;
      }
      const p = (async () => {
        try {
          this.#state = (await checkStoreSettings(this.next, this.settings, mutating)) ? 'ok' : 'absent';
        } catch (err) {
          // A store that did not answer is asked again by the next operation; a verdict stays.
          if (isBatonError(err, 'BATON_ERR_MISCONFIGURED') || isBatonError(err, 'BATON_ERR_CORRUPT')) this.#refused = err;
          throw err;
        }
      })();
      this.#pending = p;
      try {
        await p;
      } finally {
        this.#pending = null;
      }
    }
  }

  get(key: string, range?: ByteRange, into?: Buffer): Promise<Buffer> {
    if (this.#state === 'ok') return this.next.get(key, range, into);
    return this.#ready(false).then(() => this.next.get(key, range, into));
  }

  head(key: string): Promise<ObjectHead | null> {
    if (this.#state === 'ok') return this.next.head(key);
    return this.#ready(false).then(() => this.next.head(key));
  }

  put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    if (this.#state === 'ok') return this.next.put(key, body, options);
    return this.#ready(true).then(() => this.next.put(key, body, options));
  }

  delete(key: string, options?: DeleteOptions): Promise<void> {
    if (this.#state === 'ok') return this.next.delete(key, options);
    return this.#ready(true).then(() => this.next.delete(key, options));
  }

  list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    if (this.#state === 'ok') return this.next.list(prefix, options);
    return this.#checkedList(prefix, options);
  }

  async *#checkedList(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    await this.#ready(false);
    yield* this.next.list(prefix, options);
  }

  async *#checkedKeys(inner: LocalObjects, prefix: string, options?: ListOptions): AsyncIterable<string> {
    await this.#ready(false);
    yield* inner.keys!(prefix, options);
  }

  close(): Promise<void> {
    return this.next.close();
  }
}

/**
 * A catalog on virtual time over a network with a tail (used by the catalog's timing tests:
 * test/unit/catalog-sim-findings.test.ts, catalog-rounds.test.ts). The World's clock moves
 * only when a test fires its next timer; every store request lands `landMs` after it was
 * issued (or never, or when the test lands it) and its client hears back at `replyMs`, so
 * a test can place each request of an operation exactly, and count the round trips an
 * operation takes in sequence as virtual time divided by one request's time. Every request
 * lands within M of being issued or never: the design's bound, which the network checks.
 */
import { BlockCache } from '../../src/cache.js';
import type { TimerHandle, World } from '../../src/clock.js';
import { TimeoutError } from '../../src/errors.js';
import { silentLogger } from '../../src/log.js';
import { RetryingObjectStore } from '../../src/store/decorators.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { listAll, type ByteRange, type ListOptions, type ObjectHead, type ObjectInfo, type ObjectStore, type PutOptions } from '../../src/store/object-store.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import { keys } from '../../src/volume/format.js';

export const MiB = 1024 * 1024;
/** M (virtual ms): the bound on an operation and on a request's landing; forkBudget = M/2, G = 2M. */
export const M = 10_000;
export const G = 2 * M;
const EPOCH = Date.UTC(2026, 0, 1);

// ------------------------------------------------------------------ a virtual world

interface Timer extends TimerHandle { at: number; seq: number; fn: () => void; cancelled: boolean }

/** Time passes only when the test fires the next timer; randomness is a counter. */
export class TestWorld implements World {
  t = 0;
  private seq = 0;
  private timers: Timer[] = [];
  private counter = 0;
  now(): number { return this.t; }
  wallTime(): Date { return new Date(EPOCH + this.t); }
  setTimeout(fn: () => void, ms: number): TimerHandle {
    const h: Timer = { at: this.t + Math.max(0, ms), seq: ++this.seq, fn, cancelled: false };
    this.timers.push(h);
    return h;
  }
  clearTimeout(h: TimerHandle): void { (h as Timer).cancelled = true; }
  yield(): Promise<void> { return new Promise((r) => setImmediate(r)); }
  randomBytes(n: number): Buffer {
    const b = Buffer.alloc(n);
    b.writeUInt32BE(++this.counter, n - 4);
    return b;
  }
  sleep(ms: number): Promise<void> { return new Promise((r) => { this.setTimeout(r, ms); }); }
  /** Fire the earliest live timer (time jumps to it); false if there is none. */
  fireNext(): boolean {
    this.timers = this.timers.filter((x) => !x.cancelled);
    if (this.timers.length === 0) return false;
    this.timers.sort((a, b) => a.at - b.at || a.seq - b.seq);
    const h = this.timers.shift()!;
    this.t = Math.max(this.t, h.at);
    h.fn();
    return true;
  }
  /** Run `p` to completion: let ready work run, then fire timers one at a time. */
  async drive<T>(p: Promise<T>): Promise<T> {
    let done = false;
    p.then(() => { done = true; }, () => { done = true; });
    for (;;) {
      await new Promise((r) => setImmediate(r));
      if (done) return p;
      if (!this.fireNext()) throw new Error('the world went quiet before the operation settled');
    }
  }
  /** Let every pending timer fire (late requests land, clients give up). */
  async quiesce(): Promise<void> {
    for (;;) {
      await new Promise((r) => setImmediate(r));
      if (!this.fireNext()) return;
    }
  }
}

// ------------------------------------------------------------------ a network with a tail

export type Op = 'get' | 'put' | 'head' | 'list' | 'delete';

/** What happens to one request: when it lands (null: never), when its client hears back. */
export interface Fate {
  /** ms after it was issued that it is applied at the store; null: never; 'held': when the test calls land(). */
  landMs: number | null | 'held';
  /** ms after it was issued that the reply (or, if it has not landed by then, a timeout) reaches the client. */
  replyMs: number;
  /** For a request that never lands: what the client gets (default: a timeout). */
  error?: () => Error;
}

export interface Sent { op: Op; key: string; issuedAt: number; n: number; body?: Buffer }

export const NORMAL: Fate = { landMs: 5, replyMs: 10 };

/**
 * Every request travels on the World's clock: it lands at the store `landMs` after it was
 * issued (or never) and its client hears back at `replyMs`; a reply that comes before the
 * landing is a timeout (the client gave up; the request still lands later). `fate` decides
 * per request; `land(s)` lands a held request now. Landing more than M after being issued is
 * outside the design's bound: the network refuses to do it (the test is then wrong).
 */
export class Network implements ObjectStore {
  readonly description = 'memory:';
  readonly log: string[] = [];
  private n = 0;
  fate: (s: Sent) => Fate = () => NORMAL;
  /** Called as a request lands (after it was applied). */
  onLand: (s: Sent) => void = () => {};
  readonly held = new Map<Sent, () => void>();
  beyondBound: string[] = [];

  constructor(readonly inner: MemoryObjectStore, readonly world: TestWorld) {}

  /** Land a held request now (it was sent long ago; its client may have given up). */
  land(s: Sent): void {
    const go = this.held.get(s);
    if (!go) throw new Error(`${s.op} ${s.key} is not held`);
    this.held.delete(s);
    go();
  }

  private request<T>(op: Op, key: string, apply: () => Promise<T>, body?: Buffer): Promise<T> {
    const w = this.world;
    const s: Sent = { op, key, issuedAt: w.now(), n: ++this.n, ...(body ? { body } : {}) };
    const fate = this.fate(s);
    return new Promise<T>((resolve, reject) => {
      let outcome: { ok: true; v: T } | { ok: false; e: unknown } | null = null;
      const doLand = (): void => {
        const late = w.now() - s.issuedAt;
        if (late > M) this.beyondBound.push(`${op} ${key} landed ${late} ms after it was issued`);
        this.log.push(`${w.now()} ${op} ${key} lands (issued at ${s.issuedAt})`);
        apply().then((v) => { outcome = { ok: true, v }; }, (e: unknown) => { outcome = { ok: false, e }; }).finally(() => this.onLand(s));
      };
      if (fate.landMs === 'held') this.held.set(s, doLand);
      else if (fate.landMs !== null) w.setTimeout(doLand, fate.landMs);
      w.setTimeout(() => {
        if (outcome === null) {
          reject(fate.landMs === null && fate.error ? fate.error() : new TimeoutError(`${op} ${key}: no answer within ${fate.replyMs} ms (test network)`));
        } else if (outcome.ok) resolve(outcome.v);
        else reject(outcome.e);
      }, fate.replyMs);
    });
  }

  get(key: string, range?: ByteRange): Promise<Buffer> { return this.request('get', key, () => this.inner.get(key, range)); }
  head(key: string): Promise<ObjectHead | null> { return this.request('head', key, () => this.inner.head(key)); }
  put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    const copy = Buffer.from(body);
    return this.request('put', key, () => this.inner.put(key, copy, options), copy);
  }
  delete(key: string): Promise<void> { return this.request('delete', key, () => this.inner.delete(key)); }
  async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    const items = await this.request('list', prefix, () => listAll(this.inner, prefix, options));
    yield* items;
  }
  close(): Promise<void> { return Promise.resolve(); }
}

export function setup(retry: { attempts: number; delayMs: number } = { attempts: 4, delayMs: 100 }) {
  const world = new TestWorld();
  const inner = new MemoryObjectStore('memory:', () => world.wallTime());
  const net = new Network(inner, world);
  const store = new RetryingObjectStore(net, {
    attempts: retry.attempts, baseDelayMs: retry.delayMs, maxDelayMs: retry.delayMs, random: () => 0.5,
    sleep: (ms) => world.sleep(ms), now: () => world.now(),
  });
  const cache = BlockCache.open({ capacityBytes: 16 * MiB });
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => cache, volume: { world, maxOperationMs: M, segmentBytes: MiB } });
  const metas = async (): Promise<string[]> => (await listAll(inner, 'vol/')).map((o) => o.key).filter((k) => k.endsWith('/meta'));
  const records = async (): Promise<string[]> => (await listAll(inner, keys.volumesPrefix)).map((o) => o.key);
  return { world, inner, net, store, catalog, metas, records };
}

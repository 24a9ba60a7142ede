/**
 * The simulated object store: one server (the objects, with the semantics of
 * src/store/memory.ts: create-only puts atomic at the moment a request is applied, ranged gets,
 * listings in UTF-8 byte order a page at a time, read-after-write), and one client per process
 * and role, through which every request travels as two messages on virtual time:
 *
 *   client --(latency)--> server applies --(latency)--> reply reaches the client's process
 *
 * Each request's fate is drawn from the seed: it may fail before it is applied (a 503), be
 * applied with its reply lost (a connection reset: the ambiguous case), never be answered
 * (applied or not; the client's request timeout fires), or be slow (a heavy tail: it arrives
 * and is applied seconds or minutes later, long after the client may have given up). Latencies
 * are independent, so requests complete out of order. A host can be cut off from the store
 * (requests refused, or black-holed until the client times out). Replies are timers of the
 * client's process: a paused host gets them late, a crashed one never.
 *
 * Audit (the GC promise): every get/head that reaches the server for a `vol/` key that was
 * deleted is judged (rules of test/unit/gc-race.test.ts):
 * - deleted by GC, read for its data (a cache fetch of a volume's read): a violation, whoever
 *   reads it;
 * - deleted by GC, read as metadata (a log record's header, a checkpoint, a meta during
 *   recovery or a view catching up): tolerated (gc.ts case 5: recovery then starts over from
 *   the newest checkpoint); counted, and the data checks judge what the read returns;
 * - deleted by `rm` (or a fork's undo): read by GC tolerated (it computes records it listed
 *   before the removal); metadata read by anybody else tolerated (the last holder's commit
 *   still in flight resolving a 412); data read by anybody else a violation (the workload
 *   never reads a volume that is being removed, so whatever reads its data needed it).
 * Requests of dead processes are not judged (nobody gets their replies).
 */

import { InvalidArgumentError, NotFoundError, PreconditionFailedError, StoreUnavailableError, TimeoutError } from '../../src/errors.js';
import { compareKeys, rangeError, validateKey, validateMetadata, validateRange } from '../../src/store/memory.js';
import type { ByteRange, ListOptions, ObjectHead, ObjectInfo, ObjectStore, PutOptions } from '../../src/store/object-store.js';
import { decodeCheckpoint } from '../../src/volume/format.js';
import type { Proc, Rng, Sim } from './world.js';

export interface StoreFaults {
  /** Latency of each message, log-uniform in [lo, hi] ms. */
  latencyMs: [number, number];
  /** Fails before it is applied (503). */
  failBefore: number;
  /** Applied; the reply is lost (connection reset): the client gets StoreUnavailableError. */
  lostReply: number;
  /** Never answered: applied (maybe late) or not, the client's timeout fires. */
  noReply: number;
  /** Heavy tail: arrives (and is applied) 1-180 s after it was sent. */
  slow: number;
  /** The client's request timeout (S3 client: whole request). */
  timeoutMs: number;
  /** Listing page size (S3: 1000; small here so listings span pages). */
  pageSize: number;
  /**
   * A request's key becomes unreachable for this client for 5-40 s (503 on every try, longer
   * than the retry budget: the partition serving it is down, or the path to it): an operation
   * meets one error it cannot retry away, at any of its requests.
   */
  stuck?: number;
}

export const NO_FAULTS: StoreFaults = { latencyMs: [1, 20], failBefore: 0, lostReply: 0, noReply: 0, slow: 0, timeoutMs: 30_000, pageSize: 1000 };

export type Role = 'gc' | 'admin' | 'host';
export type Tag = 'data' | 'meta';

interface Entry { body: Buffer; metadata: Record<string, string>; lastModified: Date; etag: string }
interface Deletion { by: Role; who: string; at: number; putId: string | undefined }

export interface StoreStats {
  requests: number;
  failedBefore: number;
  lostReplies: number;
  noReplies: number;
  slow: number;
  refused: number;
  /** Keys re-created after they were deleted (a stale writer at a position GC freed, e.g.). */
  recreated: number;
  /** ... of them log records that GC had deleted (stale writers at freed positions). */
  recreatedLog: number;
  /** ... whose record is another one than GC deleted there (a stale writer's: the case of 9.2). */
  staleRecordAtFreedPosition: number;
  /** Checkpoints put over an existing one (never, while checkpoints are create-only). */
  checkpointReplaced: number;
  /** Checkpoint puts (landed or refused) at a position whose checkpoint another writer wrote. */
  checkpointByOtherWriter: number;
  deletedByGc: number;
  toleratedMetaReads: number;
  gcReadsOfRemoved: number;
  metaReadsOfRemoved: number;
}

/** The volume id of a `vol/ID/...` key. */
function volumeIdOf(key: string): string { return key.split('/')[1] ?? ''; }

/** Who wrote a checkpoint: its token and the record it follows (format.ts decodeCheckpoint, any version). */
function checkpointWriter(body: Buffer): string {
  try {
    const cp = decodeCheckpoint(body, 'checkpoint');
    return `${cp.token}/${cp.lastId}`;
  } catch { return 'unreadable'; }
}

export class SimStoreServer {
  readonly description = 'sim:';
  private readonly objects = new Map<string, Entry>();
  /** Every key, in UTF-8 byte order (listings walk it). */
  private readonly sorted: string[] = [];
  private readonly deleted = new Map<string, Deletion>();
  /** When each key was last put (virtual ms). */
  private readonly putAt = new Map<string, number>();
  /**
   * Catalog records (volumes/...) removed by a delete that landed after its client had given
   * up on it, and after the record was created again: finding F1 (catalog.derive's undo).
   */
  readonly lateRecordDeletes = new Set<string>();
  /** Catalog records created by a put that landed after its client had given up on it (an undone attempt resurrected: F1 too). */
  readonly lateRecordPuts = new Set<string>();
  /** When each catalog record was last deleted (virtual ms). */
  private readonly recordDeletedAt = new Map<string, number>();
  /**
   * Catalog records brought back by a put that landed after its client had given up on it and
   * after the record had been removed (an earlier try of a create, landing after `rm`: F4).
   */
  readonly resurrectedRecords = new Set<string>();
  /** Volume ids whose meta GC deleted. */
  private readonly gcDeletedMetas = new Set<string>();
  /** ... and that a record created afterwards names (finding F3: a create slower than the grace). */
  readonly recordsWithoutMeta = new Set<string>();
  private etag = 0;
  readonly stats: StoreStats = {
    requests: 0, failedBefore: 0, lostReplies: 0, noReplies: 0, slow: 0, refused: 0, recreated: 0, recreatedLog: 0, staleRecordAtFreedPosition: 0, checkpointReplaced: 0, checkpointByOtherWriter: 0, deletedByGc: 0, toleratedMetaReads: 0, gcReadsOfRemoved: 0, metaReadsOfRemoved: 0,
  };
  /**
   * Set by the runner: a put landed that could make a stale writer's data visible (a log
   * position GC freed taken again by another record, a checkpoint replaced by another
   * writer's). The runner then has a fresh host read the volume soon (the check that nothing
   * a holder writes after losing its lease is ever visible, made where it could break).
   */
  onSuspicious: (volumeId: string, why: string) => void = () => {};
  private readonly freedWatchers = new Map<string, (() => void)[]>();
  /** Calls `cb` once GC deletes `key` (after it was created, if it does not exist yet). */
  whenFreed(key: string, cb: () => void): void {
    const w = this.freedWatchers.get(key);
    if (w) w.push(cb); else this.freedWatchers.set(key, [cb]);
  }
  /** Set by the runner: a GC promise broken. */
  onViolation: (msg: string) => void = () => {};
  /**
   * Set by the runner: why a read of deleted data by `proc` is outside what GC promises (a
   * read that has been running longer than M, the design bound; a holder whose lease ran
   * out), or null.
   */
  outsidePromise: (proc: Proc) => string | null = () => null;
  readonly tolerated: string[] = [];
  /**
   * Set by the runner: called as a request is about to be sent; true if the host was paused
   * right there (the request then leaves when the host resumes). A process stopped between
   * its last check and its next request is the stale writer of 9.2.
   */
  pauseBeforeSend: (proc: Proc, what: string, commitPoint: boolean) => boolean = () => false;
  /** With --verbose: every request as it is applied (and its fate). */
  traceApply: ((line: string) => void) | null = null;
  /** Until when the store throttles (a spell of 503s, see SimStoreClient.send). */
  throttledUntil = 0;
  /** Hosts cut off from the store, and how: refused at once, or black-holed (timeouts). */
  readonly cut = new Map<string, 'refuse' | 'blackhole'>();

  constructor(readonly sim: Sim) {}

  private wall(): Date { return new Date(this.sim.epochMs + this.sim.now); }

  // What a request does when it reaches the server (synchronous: atomic).

  /** M: a data read sent longer than this after its read resolved the map is outside GC's promise. */
  maxOperationMs = Infinity;

  audit(op: 'get' | 'head', key: string, role: Role, tag: Tag, proc: Proc, resolvedAt?: number): void {
    const d = this.deleted.get(key);
    if (!d) return;
    const who = `${proc.label}/${role}`;
    const ago = `${Math.round(this.sim.now - d.at)} ms after ${d.who} (${d.by}) deleted it`;
    if (d.by === 'gc') {
      if (tag === 'data') {
        const age = resolvedAt === undefined ? 0 : this.sim.now - resolvedAt;
        const why = age > this.maxOperationMs ? `a read whose map was resolved ${Math.round(age)} ms earlier, longer than M (the design's bound on an operation)` : this.outsidePromise(proc);
        if (why === null) this.onViolation(`GC deleted an object a live map still reads: ${who} ${op} ${key} for data, ${ago}`);
        else if (this.tolerated.length < 50) this.tolerated.push(`${who} ${op} ${key} (${ago}): ${why}`);
      } else this.stats.toleratedMetaReads++;
      return;
    }
    if (role === 'gc') { this.stats.gcReadsOfRemoved++; return; }
    // Metadata of a removed volume, read by an operation of its last holder still in flight (a
    // commit resolving a 412, a close): it fails, nothing is acknowledged. Data is another matter.
    if (tag === 'meta') { this.stats.metaReadsOfRemoved++; return; }
    this.onViolation(`rm deleted an object something still reads: ${who} ${op} ${key} (${tag}), ${ago}`);
  }

  get(key: string, range: ByteRange | undefined): Buffer {
    const e = this.objects.get(key);
    if (e === undefined) throw new NotFoundError(`get ${key}: no such object in ${this.description}`);
    if (range === undefined) return Buffer.from(e.body);
    if (range.offset + range.length > e.body.length) throw rangeError(key, range, e.body.length);
    return Buffer.from(e.body.subarray(range.offset, range.offset + range.length));
  }

  head(key: string): ObjectHead | null {
    const e = this.objects.get(key);
    if (e === undefined) return null;
    return { key, size: e.body.length, lastModified: e.lastModified, etag: e.etag, metadata: { ...e.metadata } };
  }

  put(key: string, body: Buffer, o: PutOptions | undefined, waiting = true, sentAt = this.sim.now): void {
    const otherWritersCheckpoint = key.includes('/checkpoint/') && this.objects.has(key) && checkpointWriter(this.objects.get(key)!.body) !== checkpointWriter(body);
    // Another writer's checkpoint for a position that has one (a stale writer at a position
    // GC freed: the case of 9.2; refused while checkpoints are create-only).
    if (otherWritersCheckpoint) this.stats.checkpointByOtherWriter++;
    if (o?.ifNoneMatch === true && this.objects.has(key)) {
      throw new PreconditionFailedError(`put ${key}: object already exists in ${this.description} (create-only put)`);
    }
    if (otherWritersCheckpoint) this.onSuspicious(volumeIdOf(key), `${key} replaced by another writer's checkpoint`);
    if (!waiting && key.startsWith('volumes/') && (this.recordDeletedAt.get(key) ?? -1) > sentAt) this.resurrectedRecords.add(key.slice('volumes/'.length));
    if (!waiting && key.startsWith('volumes/') && body.includes('"parent"')) this.lateRecordPuts.add(key.slice('volumes/'.length));
    if (key.startsWith('volumes/')) {
      const id = /"id":"([^"]+)"/.exec(body.toString('utf8'))?.[1];
      if (id !== undefined && this.gcDeletedMetas.has(id) && !this.objects.has(`vol/${id}/meta`)) this.recordsWithoutMeta.add(id);
    }
    const gone = this.deleted.get(key);
    if (gone) {
      this.deleted.delete(key);
      this.stats.recreated++;
      // A log position GC freed, taken again (a stale writer: what "the log is a chain" is for).
      if (key.includes('/log/') && gone.by === 'gc') {
        this.stats.recreatedLog++;
        if (o?.metadata?.['baton-put-id'] !== gone.putId) {
          this.stats.staleRecordAtFreedPosition++;
          this.onSuspicious(volumeIdOf(key), `${key} re-created at a position GC freed`);
        }
      }
      this.traceApply?.(`store: ${key} re-created after ${gone.who} (${gone.by}) deleted it`);
    }
    if (key.includes('/checkpoint/') && this.objects.has(key)) this.stats.checkpointReplaced++;
    this.putAt.set(key, this.sim.now);
    if (!this.objects.has(key)) this.sorted.splice(this.lowerBound(key), 0, key);
    this.objects.set(key, { body, metadata: { ...o?.metadata }, lastModified: this.wall(), etag: `"${++this.etag}"` });
  }

  delete(key: string, role: Role, who: string, waiting = true, sentAt = this.sim.now): void {
    if (!waiting && key.startsWith('volumes/') && this.objects.has(key) && (this.putAt.get(key) ?? -1) > sentAt) {
      this.lateRecordDeletes.add(key.slice('volumes/'.length));
    }
    const putId = this.objects.get(key)?.metadata['baton-put-id'];
    const existed = this.objects.delete(key);
    if (existed) this.sorted.splice(this.lowerBound(key), 1);
    if (existed && key.startsWith('volumes/')) this.recordDeletedAt.set(key, this.sim.now);
    if (existed && role === 'gc') {
      const w = this.freedWatchers.get(key);
      if (w) { this.freedWatchers.delete(key); for (const cb of w) cb(); }
    }
    if (existed && key.startsWith('vol/')) {
      this.deleted.set(key, { by: role, who, at: this.sim.now, putId });
      if (role === 'gc') {
        this.stats.deletedByGc++;
        if (key.endsWith('/meta')) this.gcDeletedMetas.add(key.slice('vol/'.length, -'/meta'.length));
      }
    }
  }

  /** The index of the first key >= `key` in `sorted`. */
  private lowerBound(key: string): number {
    let lo = 0;
    let hi = this.sorted.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (compareKeys(this.sorted[mid]!, key) < 0) lo = mid + 1; else hi = mid;
    }
    return lo;
  }

  listPage(prefix: string, after: string | undefined, pageSize: number): { items: ObjectInfo[]; truncated: boolean } {
    let i = this.lowerBound(after !== undefined && compareKeys(after, prefix) > 0 ? after : prefix);
    if (after !== undefined && this.sorted[i] === after) i++;
    const items: ObjectInfo[] = [];
    for (; i < this.sorted.length && this.sorted[i]!.startsWith(prefix); i++) {
      if (items.length === pageSize) return { items, truncated: true };
      const k = this.sorted[i]!;
      const e = this.objects.get(k)!;
      items.push({ key: k, size: e.body.length, lastModified: e.lastModified, etag: e.etag });
    }
    return { items, truncated: false };
  }

  /** For the final checks and the trace. */
  get size(): number { return this.objects.size; }
  keys(): string[] { return [...this.sorted]; }
}

/** One process's connection to the store, in one role, with the host's fault settings. */
export class SimStoreClient implements ObjectStore {
  readonly description = 'sim:';

  constructor(
    private readonly server: SimStoreServer,
    private readonly proc: Proc,
    private readonly faults: () => StoreFaults,
    private readonly rng: Rng,
    readonly role: Role,
    readonly tag: Tag = 'meta',
    /** For data reads: when the read resolved the map it fetches through. */
    private readonly resolvedAt?: number,
  ) {}
  /** Keys this client cannot reach until then (StoreFaults.stuck). */
  private readonly stuckUntil = new Map<string, number>();

  /** The same connection, its requests marked as reads of volume data for a read that resolved its map at `resolvedAt` (for the audit). */
  forData(resolvedAt?: number): SimStoreClient { return new SimStoreClient(this.server, this.proc, this.faults, this.rng, this.role, 'data', resolvedAt); }

  private get who(): string { return `${this.proc.label}/${this.role}`; }

  private latency(f: StoreFaults): number { return this.rng.logUniform(f.latencyMs[0], f.latencyMs[1]); }

  /**
   * One request: its fate is drawn when it is sent; `apply` runs at the server, atomically;
   * the reply is a timer of the sending process.
   */
  private request<T>(what: string, apply: (waiting: boolean) => T, commitPoint = false): Promise<T> {
    const proc = this.proc;
    const server = this.server;
    const sim = server.sim;
    const f = this.faults();
    const st = server.stats;
    st.requests++;
    return new Promise<T>((resolve, reject) => {
      if (proc.dead) return;
      if (server.pauseBeforeSend(proc, what, commitPoint)) proc.setTimeout(() => this.send(what, apply, f, resolve, reject), 0);
      else this.send(what, apply, f, resolve, reject);
    });
  }

  private send<T>(what: string, apply: (waiting: boolean) => T, f: StoreFaults, resolve: (v: T) => void, reject: (e: unknown) => void): void {
    const proc = this.proc;
    const server = this.server;
    const sim = server.sim;
    const st = server.stats;
    {
      let settled = false;
      const settle = (fn: () => void): void => { if (!settled) { settled = true; fn(); } };
      const timer = proc.setTimeout(() => settle(() => reject(new TimeoutError(`${what}: no answer within ${f.timeoutMs} ms from ${this.description}`))), f.timeoutMs);
      const reply = (err: unknown, value?: T, refusal = false): void => {
        // The reply travels back; a host cut off meanwhile never gets it. A refusal is the
        // cut itself answering (a refused connection): it arrives after the latency, not as a timeout.
        proc.setTimeout(() => {
          if (!refusal && server.cut.has(proc.host.name)) return; // lost on the way: the timeout fires
          proc.clearTimeout(timer);
          settle(() => (err !== undefined ? reject(err) : resolve(value as T)));
        }, this.latency(f));
      };
      const cut = server.cut.get(proc.host.name);
      if (cut === 'refuse') { st.refused++; reply(new StoreUnavailableError(`${what}: connection refused by ${this.description} (this host is cut off)`), undefined, true); return; }
      if (cut === 'blackhole') { st.noReplies++; return; }
      const r = this.rng.float();
      let fate: 'ok' | 'failBefore' | 'lostReply' | 'noReplyApplied' | 'noReplyDropped' = 'ok';
      const key = what.slice(what.indexOf(' ') + 1);
      if (f.stuck && (this.stuckUntil.get(key) ?? -1) < sim.now && this.rng.chance(f.stuck)) {
        this.stuckUntil.set(key, sim.now + this.rng.logUniform(5000, 40_000));
        server.traceApply?.(`store ${proc.label}/${this.role}: ${key} unreachable from here for a while`);
      }
      const stuck = (this.stuckUntil.get(key) ?? -1) >= sim.now;
      // A store throttles in spells (S3's 503 Slow Down while a partition is over its request
      // rate): one 503 may start a spell in which most requests, from every host, get one too,
      // so a few retries in a row can all fail.
      if (stuck) fate = 'failBefore';
      else if (f.failBefore > 0 && sim.now < server.throttledUntil && this.rng.chance(0.7)) fate = 'failBefore';
      else if (r < f.failBefore) {
        fate = 'failBefore';
        if (this.rng.chance(0.3)) server.throttledUntil = Math.max(server.throttledUntil, sim.now + this.rng.logUniform(200, 5000));
      } else if (r < f.failBefore + f.lostReply) fate = 'lostReply';
      else if (r < f.failBefore + f.lostReply + f.noReply) fate = this.rng.chance(0.5) ? 'noReplyApplied' : 'noReplyDropped';
      let toServer = this.latency(f);
      if (this.rng.chance(f.slow)) { st.slow++; toServer += this.rng.logUniform(1000, 180_000); }
      // The catalog relies on the design's bound on a request: it lands within M of being
      // issued, or never (format.ts timeBounds; catalog.ts abandon waits that long before an
      // undone attempt is made again). Catalog records' requests keep to it (as late as it
      // allows); the rest of the engine does not rely on it and meets the whole tail.
      if (what.includes(' volumes/')) toServer = Math.min(toServer, server.maxOperationMs - 1);
      const sentAt = sim.now;
      sim.after(toServer, () => {
        server.traceApply?.(`store ${proc.label}/${this.role} ${what} (sent at ${(sentAt / 1000).toFixed(3)}s): ${fate}${settled ? ', the client already gave up' : ''}`);
        if (fate === 'failBefore') { st.failedBefore++; reply(new StoreUnavailableError(`${what}: 503 Slow Down from ${this.description}`)); return; }
        if (fate === 'noReplyDropped') { st.noReplies++; return; }
        let value: T | undefined;
        let err: unknown;
        // The audit judges requests somebody still waits for (a late one that timed out, or
        // of a dead process, returns to nobody).
        try { value = apply(!settled && !proc.dead); } catch (e) { err = e; }
        if (fate === 'noReplyApplied') { st.noReplies++; return; }
        if (fate === 'lostReply') { st.lostReplies++; reply(new StoreUnavailableError(`${what}: connection reset by ${this.description} (the request was sent)`)); return; }
        reply(err, value);
      });
    }
  }

  get(key: string, range?: ByteRange): Promise<Buffer> {
    validateKey(key);
    if (range !== undefined) validateRange(range);
    const r = range ? { ...range } : undefined;
    return this.request(`get ${key}`, (waiting) => {
      if (waiting) this.server.audit('get', key, this.role, this.tag, this.proc, this.resolvedAt);
      return this.server.get(key, r);
    });
  }

  head(key: string): Promise<ObjectHead | null> {
    validateKey(key);
    return this.request(`head ${key}`, (waiting) => {
      if (waiting) this.server.audit('head', key, this.role, this.tag, this.proc);
      return this.server.head(key);
    });
  }

  put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    validateKey(key);
    validateMetadata(options?.metadata);
    // The bytes as sent: a caller reusing its buffer afterwards cannot change them.
    const copy = Buffer.from(body);
    const o: PutOptions = { ...options, ...(options?.metadata ? { metadata: { ...options.metadata } } : {}) };
    const sentAt = this.server.sim.now;
    return this.request(`put ${key}`, (waiting) => this.server.put(key, copy, o, waiting, sentAt), o.ifNoneMatch === true);
  }

  delete(key: string): Promise<void> {
    validateKey(key);
    const sentAt = this.server.sim.now;
    return this.request(`delete ${key}`, (waiting) => this.server.delete(key, this.role, this.who, waiting, sentAt));
  }

  async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    if (options?.startAfter !== undefined && typeof options.startAfter !== 'string') throw new InvalidArgumentError('startAfter must be a string');
    let after = options?.startAfter;
    const pageSize = this.faults().pageSize;
    for (;;) {
      const from = after;
      const page = await this.request(`list ${prefix}`, () => this.server.listPage(prefix, from, pageSize));
      for (const o of page.items) yield o;
      if (!page.truncated || page.items.length === 0) return;
      after = page.items[page.items.length - 1]!.key;
    }
  }

  close(): Promise<void> { return Promise.resolve(); }
}

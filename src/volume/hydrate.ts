/**
 * Hydration: a host that opens a volume fetches, in the background, what the volume's last
 * holder was working on (its working set, src/volume/working-set.ts, recorded in the newest
 * checkpoint and the log after it), its boot set first (what the last session's guest read
 * first after attaching: its mount) and then most recently used first, into the block cache, so the
 * guest's next reads hit the cache instead of waiting for the store one block at a time.
 * `all` goes on with the rest of the volume's data afterwards.
 *
 * How, and the bounds it keeps:
 * - The working set names volume ranges; they are resolved through the volume's committed map
 *   to object pieces (buffered writes are in memory, zeroes need nothing). Ranges are taken
 *   BATCH_BYTES at a time in recency order; within a batch the pieces are grouped by object,
 *   cut to the cache's blocks, merged across gaps of at most one block and split into ranged
 *   GETs of at most `fetchBytes`. So the order is most recent first batch by batch, and the
 *   requests are few and large.
 * - At most `concurrency` GETs in flight (serve --hydrate-concurrency): the share of the
 *   store's bandwidth hydration may take. At most `maxBytes` fetched (by default three quarters
 *   of the cache, so hydration never evicts what it brought, nor all of what the guest reads).
 * - Guest reads never wait behind it: they go to the block cache directly and fetch what they
 *   miss with their own GETs at once (hydration's queue is only ever drained by its own
 *   workers). A read that needs a block a hydration GET is already bringing does not wait for
 *   that GET alone either: hydration's GETs are background fetches (BlockCache.prefetch's flag), so
 *   the read sends its own for the blocks it needs and takes whichever answers first. Where a
 *   request's bytes, not its first byte, take the time (a store at the end of a slow link), a
 *   2 MiB GET among a full window of them takes many times one of 256 KiB, and a mount reads
 *   one block after another. (On the loopback radosgw of bench/hydrate.ts it made no
 *   difference: there the mount's reads were cache hits already.)
 * - While guest reads miss, hydration steps back: until GUEST_QUIET_MS after the last miss it
 *   keeps half its window (at least one GET) in flight, the GETs the guest promoted (below)
 *   first, so the guest's own GETs do not queue at the store behind a full window of large
 *   ones (on a store that shares a machine's CPU with everything else, radosgw here, a cold
 *   mount took 10x longer). Only half: a reader that misses again and again is best served by
 *   hydration getting ahead of it (a miss costs a store round trip; on a store whose latency,
 *   not its CPU, bounds it, a window of 8 is not what slows the miss). Starting only promoted
 *   GETs while the guest missed left hydration running 1.5-2x as long there (bench/hydrate.ts,
 *   file: +20 ms), the reader missing all the while.
 * - And the guest steers it: a read that misses moves the queued GETs around what it missed
 *   (that object's range, and the one after it) to the front of the queue (promote), so
 *   hydration fetches next what the guest is reading now. Recency order alone can be the
 *   reverse of a reader's order (a build replayed, files read again in the order written).
 * - It goes through BlockCache.prefetch, the sequential readers' prefetch machinery: blocks
 *   cached or in flight are skipped, and a failed fetch costs only the reads that then miss.
 *   The cache is keyed by immutable object keys, so what hydration brings can never be stale.
 * - It stops when the volume closes or is fenced (stop()), and when it is done nothing of it
 *   remains: no timer, no request (an idle volume stays silent).
 */

import { CACHE_BLOCK, type BlockCache } from '../cache.js';
import type { World } from '../clock.js';
import type { Logger } from '../log.js';
import type { ObjectStore } from '../store/object-store.js';

export const HYDRATE_MODES = ['off', 'working-set', 'all'] as const;
export type HydrateMode = typeof HYDRATE_MODES[number];

export interface HydrateOptions {
  mode: HydrateMode;
  /** Hydration GETs in flight at once (default DEFAULT_HYDRATE_CONCURRENCY). */
  concurrency?: number;
  /** At most this many bytes fetched (default: three quarters of the cache's capacity; never more than all of it). */
  maxBytes?: number;
  /** Largest hydration GET (default DEFAULT_HYDRATE_FETCH). */
  fetchBytes?: number;
  /** How long after a guest read's miss hydration steps back (default GUEST_QUIET_MS; tests). */
  guestQuietMs?: number;
}

export const DEFAULT_HYDRATE_CONCURRENCY = 8;
/**
 * 2 MiB per GET: large enough that a request's latency is paid rarely (8 in flight over a
 * 20 ms store bring about 800 MB/s), small enough that a guest read sharing a hydration GET
 * waits for little more than its own GET would take.
 */
export const DEFAULT_HYDRATE_FETCH = 2 * 1024 * 1024;
/** Volume bytes of ranges planned together (coalesced by object). */
const BATCH_BYTES = 16 * 1024 * 1024;
/** How long after a guest read's miss hydration keeps to its reduced window. */
const GUEST_QUIET_MS = 50;


export type HydrationState = 'running' | 'done' | 'stopped';

export interface HydrationStatus {
  mode: HydrateMode;
  state: HydrationState;
  /** Planning is finished (plannedBytes is the total). */
  planned: boolean;
  /** Bytes hydration means to fetch (missing from the cache when planned). */
  plannedBytes: number;
  /** Bytes its GETs brought. */
  fetchedBytes: number;
  /** Its GETs (prefetch calls) done. */
  requests: number;
  /** GETs that guest reads moved to the front (promote). */
  promoted: number;
  /** Working-set chunks it started from. */
  workingSetChunks: number;
  /** maxBytes stopped the plan before everything was planned. */
  truncated: boolean;
  /** Since it started (until it ended). */
  ms: number;
}

/** A committed piece of a volume: bytes [off, off+len) of object `key` (of `size` bytes). */
export interface ObjectPiece { key: string; size: number; off: number; len: number }

/** What hydration needs of a volume. */
export interface HydrationSource {
  /** Volume ranges in the order they should be fetched (most recently used first). */
  ranges(): Iterable<{ offset: number; length: number }>;
  /** The committed object pieces of [offset, offset+length), appended to `out`. */
  pieces(offset: number, length: number, out: ObjectPiece[]): void;
  /** How many working-set chunks `ranges` starts with (status only). */
  readonly workingSetChunks: number;
}

interface Unit {
  key: string;
  size: number;
  off: number;
  len: number;
  /** queued: waiting in `queue` (and maybe `urgent`); taken: a worker has it. */
  taken: boolean;
  /** Moved to `urgent` already. */
  promoted: boolean;
}

export class Hydration {
  /** Settles (never rejects) when hydration is done or stopped and its GETs have settled. */
  readonly done: Promise<void>;
  private stopped = false;
  private planning = true;
  /** Planned GETs in plan order (taken ones are skipped); `next` is the first not yet looked at. */
  private readonly queue: Unit[] = [];
  private next = 0;
  /** GETs the guest's reads promoted: taken before `queue`. */
  private urgent: Unit[] = [];
  /** Queued units of each object, in offset order (for promote). */
  private readonly byKey = new Map<string, Unit[]>();
  private promotedCount = 0;
  /** world.now() until which guest reads count as missing (guestMissed). */
  private guestUntil = 0;
  private readonly guestConcurrency: number;
  private readonly guestQuietMs: number;
  private wake: (() => void)[] = [];
  private plannedBytes = 0;
  private fetchedBytes = 0;
  private requests = 0;
  private truncated = false;
  private readonly t0: number;
  private endedAt: number | null = null;
  private readonly concurrency: number;
  private readonly maxBytes: number;
  private readonly fetchBlocks: number;

  constructor(
    private readonly source: HydrationSource,
    private readonly cache: BlockCache,
    private readonly store: ObjectStore,
    readonly options: HydrateOptions,
    private readonly world: World,
    private readonly log: Logger,
  ) {
    this.concurrency = Math.max(1, Math.floor(options.concurrency ?? DEFAULT_HYDRATE_CONCURRENCY));
    // Never more than the cache holds: past that, hydration would evict what it brought first
    // (the most recently used part of the working set).
    this.maxBytes = Math.max(0, Math.min(options.maxBytes ?? Math.floor(cache.capacityBytes * 0.75), cache.capacityBytes));
    this.fetchBlocks = Math.max(1, Math.floor((options.fetchBytes ?? DEFAULT_HYDRATE_FETCH) / CACHE_BLOCK));
    this.guestConcurrency = Math.max(1, Math.floor(this.concurrency / 2));
    this.guestQuietMs = options.guestQuietMs ?? GUEST_QUIET_MS;
    this.t0 = world.now();
    this.done = this.run().catch((err: unknown) => {
      // Planning walks maps; nothing in it should throw, but a hint must never take anything down.
      this.log.warn({ err: err instanceof Error ? err.message : String(err) }, 'hydration failed; reads fetch what they need');
    }).finally(() => { this.endedAt = this.world.now(); });
  }

  /** Stop: no new GET starts (those in flight finish and fill the cache). */
  stop(): void {
    if (this.stopped) return;
    this.stopped = true;
    this.queue.length = 0;
    this.next = 0;
    this.urgent = [];
    this.byKey.clear();
    for (const w of this.wake.splice(0)) w();
  }

  get isRunning(): boolean { return this.endedAt === null && !this.stopped; }

  /**
   * A guest read missed [off, off+len) of object `key`: fetch the queued GETs that cover it,
   * and the one after it, next. (The read itself does not wait for them: it has its own GET.)
   */
  promote(key: string, off: number, len: number): void {
    const units = this.byKey.get(key);
    if (!units) return;
    let last = -1;
    for (let i = 0; i < units.length; i++) {
      const u = units[i]!;
      if (u.off < off + len && off < u.off + u.len) last = i;
      else if (last >= 0 && u.off >= off + len) break;
    }
    if (last < 0) return;
    for (let i = 0; i <= Math.min(last + 1, units.length - 1); i++) {
      const u = units[i]!;
      const covers = u.off < off + len && off < u.off + u.len;
      if ((covers || i === last + 1) && !u.taken && !u.promoted) {
        u.promoted = true;
        this.urgent.push(u);
        this.promotedCount++;
      }
    }
    for (const w of this.wake.splice(0)) w();
  }

  /** A guest read is fetching from the store: step back for a while (see the top of the file). */
  guestMissed(): void {
    this.guestUntil = this.world.now() + this.guestQuietMs;
  }

  /** The next GET to make: promoted ones first, then in plan order. */
  private take(): Unit | undefined {
    while (this.urgent.length > 0) {
      const u = this.urgent.shift()!;
      if (!u.taken) return this.claim(u);
    }
    while (this.next < this.queue.length) {
      const u = this.queue[this.next++]!;
      if (!u.taken) return this.claim(u);
    }
    return undefined;
  }

  private claim(u: Unit): Unit {
    u.taken = true;
    const units = this.byKey.get(u.key);
    if (units) {
      const i = units.indexOf(u);
      if (i >= 0) units.splice(i, 1);
      if (units.length === 0) this.byKey.delete(u.key);
    }
    return u;
  }

  get isStopped(): boolean { return this.stopped; }

  status(): HydrationStatus {
    const ended = this.endedAt !== null;
    return {
      mode: this.options.mode,
      state: !ended ? 'running' : this.stopped ? 'stopped' : 'done',
      planned: !this.planning,
      plannedBytes: this.plannedBytes,
      fetchedBytes: this.fetchedBytes,
      requests: this.requests,
      promoted: this.promotedCount,
      workingSetChunks: this.source.workingSetChunks,
      truncated: this.truncated,
      ms: Math.round((this.endedAt ?? this.world.now()) - this.t0),
    };
  }

  private async run(): Promise<void> {
    const workers = Array.from({ length: this.concurrency }, (_, i) => this.worker(i));
    try {
      await this.plan();
    } finally {
      this.planning = false;
      for (const w of this.wake.splice(0)) w();
    }
    await Promise.all(workers);
    if (this.stopped) return;
    const s = this.status();
    this.log.info({ mode: s.mode, fetchedBytes: s.fetchedBytes, plannedBytes: s.plannedBytes, requests: s.requests, promoted: s.promoted, workingSetChunks: s.workingSetChunks, truncated: s.truncated, ms: s.ms }, 'hydration done');
  }

  private async worker(index: number): Promise<void> {
    for (;;) {
      if (this.stopped) return;
      const quietFor = this.guestUntil - this.world.now();
      if (quietFor > 0 && index >= this.guestConcurrency) {
        await new Promise<void>((r) => this.world.setTimeout(r, quietFor));
        continue;
      }
      const u = this.take();
      if (!u) {
        if (!this.planning) return;
        await new Promise<void>((r) => this.wake.push(r));
        continue;
      }
      const bytes = await this.cache.prefetch(this.store, u.key, u.size, u.off, u.len, true);
      this.fetchedBytes += bytes;
      this.requests++;
    }
  }

  /**
   * Turn the source's ranges into GETs, batch by batch (see the top of the file), queueing each
   * batch as soon as it is planned so the first GETs start at once. Every block is planned
   * once; blocks cached or in flight when planned are not counted against maxBytes.
   */
  private async plan(): Promise<void> {
    const plannedBlocks = new Set<string>();
    let batch: { offset: number; length: number }[] = [];
    let batchBytes = 0;
    const flush = (): boolean => {
      const ok = this.planBatch(batch, plannedBlocks);
      batch = [];
      batchBytes = 0;
      if (this.next < this.queue.length) for (const w of this.wake.splice(0)) w();
      return ok;
    };
    for (const r of this.source.ranges()) {
      if (this.stopped) return;
      batch.push(r);
      batchBytes += r.length;
      if (batchBytes >= BATCH_BYTES) {
        if (!flush()) return;
        await this.world.yield(); // planning is CPU work: let reads and renewals run between batches
      }
    }
    if (batch.length > 0 && !this.stopped) flush();
  }

  /**
   * Blocks [first, last] of object `key`, planned by a later batch, join a queued GET of the
   * same object that ends or starts next to them (within one block, as spans of one batch are
   * merged), if the two together stay within `fetchBlocks`: one GET instead of two. Batches are
   * recency slices of the volume, and an object's pieces fall into many of them (a workspace's
   * files are written into segments in one order and used in another): without this, a
   * hydration of the seed's workspace made 3x the GETs its objects and the 2 MiB cap need,
   * each a store round trip. The joined blocks are fetched with the earlier batch's, a little
   * ahead of their recency; a GET already taken is never changed.
   */
  private joinQueued(key: string, first: number, last: number): boolean {
    const units = this.byKey.get(key);
    if (!units) return false;
    for (const u of units) {
      if (u.taken) continue;
      const uFirst = u.off / CACHE_BLOCK;
      const uLast = uFirst + u.len / CACHE_BLOCK - 1;
      if (uLast < first - 2 || uFirst > last + 2) continue;
      const lo = Math.min(uFirst, first);
      const hi = Math.max(uLast, last);
      if (hi - lo + 1 > this.fetchBlocks) continue;
      // (Offset order in byKey holds: the blocks between the two belong to neither's neighbours.)
      u.off = lo * CACHE_BLOCK;
      u.len = (hi - lo + 1) * CACHE_BLOCK;
      return true;
    }
    return false;
  }

  /** Plan one batch; false once maxBytes is reached (stop planning). */
  private planBatch(ranges: { offset: number; length: number }[], plannedBlocks: Set<string>): boolean {
    const pieces: ObjectPiece[] = [];
    for (const r of ranges) this.source.pieces(r.offset, r.length, pieces);
    // Group by object, in order of first appearance (the batch's recency order).
    const byKey = new Map<string, { size: number; spans: [number, number][] }>();
    for (const p of pieces) {
      if (p.len <= 0) continue;
      let g = byKey.get(p.key);
      if (!g) { g = { size: p.size, spans: [] }; byKey.set(p.key, g); }
      g.spans.push([Math.floor(p.off / CACHE_BLOCK), Math.floor((p.off + p.len - 1) / CACHE_BLOCK)]);
    }
    for (const [key, g] of byKey) {
      g.spans.sort((a, b) => a[0] - b[0]);
      const merged: [number, number][] = [];
      for (const s of g.spans) {
        const last = merged[merged.length - 1];
        // A gap of one block is fetched with its neighbours: one request instead of two.
        if (last && s[0] <= last[1] + 2) last[1] = Math.max(last[1], s[1]);
        else merged.push([s[0], s[1]]);
      }
      for (const [first, lastBlock] of merged) {
        for (let b = first; b <= lastBlock; b += this.fetchBlocks) {
          const e = Math.min(lastBlock, b + this.fetchBlocks - 1);
          let bytes = 0;
          for (let x = b; x <= e; x++) {
            const id = `${key}#${x}`;
            if (plannedBlocks.has(id)) continue;
            const n = this.cache.missingBytes(key, g.size, x * CACHE_BLOCK, CACHE_BLOCK);
            if (n === 0) continue;
            bytes += n;
          }
          if (bytes === 0) continue;
          if (this.plannedBytes + bytes > this.maxBytes) { this.truncated = true; return false; }
          for (let x = b; x <= e; x++) plannedBlocks.add(`${key}#${x}`);
          this.plannedBytes += bytes;
          if (this.joinQueued(key, b, e)) continue;
          const u: Unit = { key, size: g.size, off: b * CACHE_BLOCK, len: (e - b + 1) * CACHE_BLOCK, taken: false, promoted: false };
          this.queue.push(u);
          // Kept in offset order (a later batch may plan lower offsets of the same object).
          const units = this.byKey.get(key);
          if (!units) this.byKey.set(key, [u]);
          else {
            let i = units.length;
            while (i > 0 && units[i - 1]!.off > u.off) i--;
            units.splice(i, 0, u);
          }
        }
      }
    }
    return true;
  }
}

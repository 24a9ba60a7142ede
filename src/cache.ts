/**
 * The local read cache: fixed-size blocks of immutable store objects, on local disk (or in
 * memory for tests), bounded by a byte capacity, evicted least-recently-used.
 *
 * Objects are never modified after they are written (every key is unique), so a cached
 * block can never go stale and needs no invalidation. The index lives in memory only: a new
 * process (another host) starts cold and fetches just what it reads. The backing file is
 * unlinked right after it is opened, so a crashed process leaves nothing behind.
 *
 * Misses are fetched with ranged GETs: adjacent missing blocks of one object are coalesced
 * into one request, and a sequential reader's readahead extends that request. Concurrent
 * misses of the same block share one fetch, and the fetched bytes serve every read that
 * waited for them whether or not they could be cached: a block is fetched once. The one
 * exception is a background fetch (prefetch with `background`: hydration's large GETs): a
 * read never waits for one alone. It sends its own GET for the blocks it needs and takes
 * whichever answers first (where a request's bytes take the time, a 2 MiB GET among eight in
 * flight takes many times a 256 KiB one, and a mount's reads come one after another).
 *
 * The cache is an optimisation and never a reason for a read to fail: a full or failing cache
 * disk is reported once and costs only speed (blocks come from the store until it works).
 */

import { strict as assert } from 'node:assert';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import { randomBytes } from 'node:crypto';
import { CorruptError } from './errors.js';
import { Slots } from './slots.js';
import { WRITE_CHUNK_BYTES } from './store/local-dir.js';
import type { ObjectStore } from './store/object-store.js';
import { BodyPool, type BodyHold, type BodyLease } from './body-pool.js';

export const CACHE_BLOCK = 256 * 1024;

/** Largest single ranged GET (coalesced misses + readahead). */
const MAX_FETCH = 8 * 1024 * 1024;
/** Fetches this long or longer (readahead, hydration) get their body from the cache's pool (fetchRun). */
const POOLED_FETCH_MIN = MAX_FETCH / 2;
/** Free GET bodies the pool keeps (64 MiB; let go 2-4 s after the last pooled fetch: BodyPool). */
const GET_BODIES_KEPT = 8;

/** Where cached blocks live: one slot of CACHE_BLOCK bytes per block. */
export interface Slab {
  read(slot: number, out: Buffer, outOff: number, from: number, length: number): Promise<void>;
  /** read(), before returning (a slab whose reads need no wait): for BlockCache.readNow. */
  readSync?(slot: number, out: Buffer, outOff: number, from: number, length: number): void;
  write(slot: number, data: Buffer): Promise<void>;
  close(): Promise<void>;
}

export class MemorySlab implements Slab {
  private readonly slots = new Map<number, Buffer>();
  async read(slot: number, out: Buffer, outOff: number, from: number, length: number): Promise<void> {
    this.readSync(slot, out, outOff, from, length);
  }
  readSync(slot: number, out: Buffer, outOff: number, from: number, length: number): void {
    this.slots.get(slot)!.copy(out, outOff, from, from + length);
  }
  async write(slot: number, data: Buffer): Promise<void> { this.slots.set(slot, Buffer.from(data)); }
  async close(): Promise<void> { this.slots.clear(); }
}

/**
 * At most this many slab writes in libuv's thread pool at once. The pool is small (4
 * threads by default) and FIFO, and it is shared with everything else in the process that
 * touches a file or resolves a name: lease files' renewals (src/lease/local.ts), `file:`
 * stores, DNS lookups. Hydration and cold reads fill the cache with thousands of block
 * writes at once; queued in the pool, a lease renewal waited behind all of them, and while
 * the disk was busy writing back that took longer than the lease's margin: a healthy host
 * lost its lease in the middle of a cold read (bench/volume.ts `stream`). Queued here
 * instead, the pool always has threads to spare. Two keep a disk busy: each write is a
 * block of 256 KiB.
 */
export const MAX_SLAB_WRITES = 2;

/**
 * Blocks in one local file. Reads are synchronous on purpose: the blocks were written moments
 * ago or are hot, so they are in the page cache, and a pread from the page cache costs a
 * few microseconds while a trip through libuv's thread pool costs tens.
 */
export class FileSlab implements Slab {
  /** Writes in the thread pool (`maxInUse`: the most at once so far, for tests). */
  readonly writes = new Slots(MAX_SLAB_WRITES);
  /** Writes made in the thread pool so far (each of one block or of several adjacent ones), and how many have settled. */
  poolWrites = 0;
  poolWritesSettled = 0;
  /** Block writes waiting for a place in the pool, in the order they came. */
  readonly #queue: { slot: number; data: Buffer; resolve: () => void; reject: (err: unknown) => void }[] = [];
  #draining = false;

  private constructor(private readonly fd: number) {}
  static async open(dir: string): Promise<FileSlab> {
    await fsp.mkdir(dir, { recursive: true });
    const p = path.join(dir, `blocks-${process.pid}-${randomBytes(4).toString('hex')}.bin`);
    const fd = fs.openSync(p, 'w+');
    fs.unlinkSync(p); // anonymous from now on: freed when the process ends, however it ends
    return new FileSlab(fd);
  }
  async read(slot: number, out: Buffer, outOff: number, from: number, length: number): Promise<void> {
    this.readSync(slot, out, outOff, from, length);
  }
  readSync(slot: number, out: Buffer, outOff: number, from: number, length: number): void {
    let done = 0;
    while (done < length) {
      const n = fs.readSync(this.fd, out, outOff + done, length - done, slot * CACHE_BLOCK + from + done);
      if (n === 0) throw new Error('cache file shorter than its index says');
      done += n;
    }
  }
  /**
   * Writes go through the thread pool: a commit writes tens of MiB through to the cache at
   * once, and doing that synchronously stalled the event loop for seconds (long enough to
   * miss lease renewals). Reads stay synchronous (small, and from the page cache). At most
   * MAX_SLAB_WRITES of them are in the pool at once; the rest wait here, in order.
   *
   * One block (256 KiB, WRITE_CHUNK_BYTES) per write system call, though each costs a trip
   * into the pool (20-100 µs of the event loop's own time): adjacent blocks were joined into
   * writes of up to 4 MiB, and the page cache then takes folios as large as the write, which
   * on a microVM that gives free memory back to its host fault at the host on every 4 KiB
   * (local-dir.ts WRITE_CHUNK_BYTES). 167 MiB of blocks written into a new FileSlab (what
   * hydrating the hydrate bench's workspace writes): 371-706 ms joined, 48-51 ms one block
   * per write (bench/README.md, session 17).
   */
  write(slot: number, data: Buffer): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      this.#queue.push({ slot, data, resolve, reject });
      if (!this.#draining) void this.#drain();
    });
  }
  async #drain(): Promise<void> {
    this.#draining = true;
    try {
      while (this.#queue.length > 0) {
        await this.writes.acquire();
        // Only this loop takes from the queue: it is not empty here.
        const w = this.#queue.shift()!;
        assert(w.data.length <= WRITE_CHUNK_BYTES, `a cache write of ${w.data.length} bytes (blocks are ${CACHE_BLOCK})`);
        this.poolWrites++;
        void this.#writeAt(w.slot * CACHE_BLOCK, w.data).then(w.resolve, w.reject).finally(() => {
          this.poolWritesSettled++;
          this.writes.release();
        });
      }
    } finally {
      this.#draining = false;
    }
  }
  /** Every byte of `data` from `position` (a short write goes on from where it stopped). */
  async #writeAt(position: number, data: Buffer): Promise<void> {
    let done = 0;
    while (done < data.length) {
      const n = await new Promise<number>((resolve, reject) => {
        fs.write(this.fd, data, done, data.length - done, position + done, (err, written) => (err ? reject(err) : resolve(written)));
      });
      if (n === 0) throw new Error('the cache file took no byte of a write');
      done += n;
    }
  }
  async close(): Promise<void> { fs.closeSync(this.fd); }
}

/**
 * One cached block. Slot ownership, which keeps a slot from being lost or shared:
 * - an entry owns its slot from insertion until it leaves the index;
 * - evicted (only with no readers): the slot passes straight to the new entry, whose write is
 *   chained after this entry's `ready`, so two writes never race on one slot;
 * - dropped after a failure (its write failed, or the disk failed a read of it): the slot goes
 *   back to `freeSlots` once its last reader is gone. Without that, every failed write cost a
 *   slot for good, and after as many cache-disk errors as slots the cache held nothing (17.10).
 * Readers are counted from the moment a read plans to copy from an entry (it is found in the
 * index) until that read settles; an entry that left the index gains no new readers.
 */
interface Entry {
  readonly slot: number;
  readonly length: number;
  /**
   * The block's bytes until its slab write succeeded; readers copy from here meanwhile (no
   * wait for the disk, and no second fetch if the write fails). Null once the slab holds it.
   */
  data: Buffer | null;
  /** Settles, never rejects, once this entry's slab write has settled. */
  ready: Promise<void>;
  readers: number;
  /** Left the index after a failure; its slot is freed when `readers` reaches 0. */
  dropped: boolean;
}

/** The bytes of one ranged GET of blocks, starting at byte `start` of the object. */
interface Fetched {
  start: number;
  data: Buffer;
  /** Settles (never rejects) once the blocks this fetch put in the cache are on its disk. */
  written: Promise<unknown>;
}

export interface CacheStats {
  hits: number;
  misses: number;
  fetches: number;
  bytesFetched: number;
  cachedBytes: number;
  /** Blocks pushed out (least recently used) to make room for another. */
  evictions: number;
  /** Reads that sent their own GET for blocks a background fetch (hydration) was bringing. */
  raced: number;
}

export interface BlockCacheOptions {
  /** Directory for the cache file; undefined keeps blocks in memory. */
  dir?: string;
  capacityBytes: number;
  /** Where blocks live; default a FileSlab in `dir`, or memory. Tests pass a faulty one. */
  slab?: Slab;
  /** Where the cache says that its disk is failing (and that it recovered). */
  log?: CacheLogger;
}

/** The part of a pino Logger the cache uses. */
export interface CacheLogger {
  warn(obj: object, msg: string): void;
  info(obj: object, msg: string): void;
}

export class BlockCache {
  private readonly index = new Map<string, Entry>(); // insertion order = LRU order
  private readonly freeSlots: number[] = [];
  private nextSlot = 0;
  private readonly maxSlots: number;
  private readonly inflight = new Map<string, Promise<Fetched>>();
  /** The fetches in `inflight` that background prefetches started (reads race them: top of the file). */
  private readonly background = new WeakSet<Promise<Fetched>>();
  /** Slab writes not yet settled (their entries' `ready`). */
  private readonly writing = new Set<Promise<void>>();
  /**
   * Bodies of large fetches in reused memory (src/body-pool.ts): on a 2-core VM the kernel
   * zeroing a fresh 8 MiB body per GET was a fifth of a cold read's cycles. A fetch's body
   * comes back once (1) its GET resolved (a failed GET's buffer may still be written by an
   * abandoned attempt: ObjectStore.get's `into`, never reused), (2) every block it put in the
   * cache was written to the slab (insertBlock's hold), and (3) every read that waited for
   * the fetch has copied from it (read() holds the lease of each fetch it waits for, taken
   * while the fetch is still in `inflight`, let go when it returns). fetchRun lets go of its
   * own hold when it takes the fetch out of `inflight`, so a read can only find a fetch whose
   * body is still held.
   */
  private readonly getBodies = new BodyPool(MAX_FETCH, GET_BODIES_KEPT);
  private readonly fetchLeases = new WeakMap<Promise<Fetched>, BodyLease>();
  /** The cache disk failed its last operation: warned once, until an operation succeeds again. */
  private diskFailing = false;
  readonly stats: CacheStats = { hits: 0, misses: 0, fetches: 0, bytesFetched: 0, cachedBytes: 0, evictions: 0, raced: 0 };

  private constructor(private readonly slab: Slab, capacityBytes: number, private readonly log: CacheLogger | undefined) {
    this.maxSlots = Math.max(16, Math.floor(capacityBytes / CACHE_BLOCK));
  }

  static async open(opts: BlockCacheOptions): Promise<BlockCache> {
    const slab = opts.slab ?? (opts.dir ? await FileSlab.open(opts.dir) : new MemorySlab());
    return new BlockCache(slab, opts.capacityBytes, opts.log);
  }

  private static id(key: string, block: number): string { return `${key}#${block}`; }

  /**
   * Put a whole object's bytes in the cache (write-through after an upload). With `hold`
   * (a pooled body: src/body-pool.ts), each block kept holds it once until that
   * block's slab write succeeded and its view of `data` is gone; a block whose write failed
   * keeps its view for its readers and never lets go.
   */
  insertObject(key: string, data: Buffer, hold?: BodyHold): void {
    for (let b = 0; b * CACHE_BLOCK < data.length; b++) {
      const from = b * CACHE_BLOCK;
      this.insertBlock(key, b, data.subarray(from, Math.min(from + CACHE_BLOCK, data.length)), hold);
    }
  }

  /**
   * Cache one block (best effort: a full cache whose blocks are all being read, or a failing
   * disk, leaves it out). `data` must not change afterwards; it is kept until written.
   */
  private insertBlock(key: string, block: number, data: Buffer, hold?: BodyHold): Promise<void> | undefined {
    const id = BlockCache.id(key, block);
    if (this.index.has(id)) return undefined;
    let slot: number;
    let after: Promise<void> = Promise.resolve();
    if (this.freeSlots.length > 0) slot = this.freeSlots.pop()!;
    else if (this.nextSlot < this.maxSlots) slot = this.nextSlot++;
    else {
      // Evict the least recently used block that nobody is reading right now.
      let victimId: string | null = null;
      for (const [vid, v] of this.index) if (v.readers === 0) { victimId = vid; break; }
      if (victimId === null) return undefined; // everything is being read: just don't cache this block
      const victim = this.index.get(victimId)!;
      this.index.delete(victimId);
      this.stats.cachedBytes -= victim.length;
      this.stats.evictions++;
      slot = victim.slot;
      // The victim's own write to this slot must land before ours does.
      after = victim.ready;
    }
    const entry: Entry = { slot, length: data.length, data, ready: Promise.resolve(), readers: 0, dropped: false };
    hold?.acquire();
    entry.ready = after.then(() => this.slab.write(slot, data)).then(
      () => {
        entry.data = null;
        hold?.release(); // the slab has the bytes and no reader can reach this view any more
        this.diskWorks();
      },
      (err: unknown) => {
        this.diskFailed(err, 'write');
        // Still ours (not evicted meanwhile, when the slot already passed on): give it back.
        // `data` stays, for the readers that planned to copy from this entry.
        if (this.index.get(id) === entry) this.drop(id, entry);
      },
    );
    const ready = entry.ready;
    this.writing.add(ready);
    void ready.then(() => this.writing.delete(ready));
    this.index.set(id, entry);
    this.stats.cachedBytes += data.length;
    return ready;
  }

  /** Take an entry out of the index after a failure; only once its write has settled. */
  private drop(id: string, e: Entry): void {
    this.index.delete(id);
    this.stats.cachedBytes -= e.length;
    e.dropped = true;
    if (e.readers === 0) this.freeSlots.push(e.slot);
  }

  private unpin(e: Entry): void {
    e.readers--;
    if (e.dropped && e.readers === 0) this.freeSlots.push(e.slot);
  }

  /**
   * A failing cache disk (full, or I/O errors) costs speed, never a read: blocks come from the
   * store meanwhile. It is said once when it starts failing, and again only after it worked.
   */
  private diskFailed(err: unknown, op: 'read' | 'write'): void {
    if (this.diskFailing) return;
    this.diskFailing = true;
    const code = (err as NodeJS.ErrnoException | null)?.code;
    this.log?.warn({ err, code, op },
      `read cache: the cache disk failed a ${op} (${err instanceof Error ? err.message : String(err)}); `
      + 'reads are served from the store, uncached, until it works again. Free space on the cache '
      + 'filesystem (--cache-dir) or check the disk.');
  }

  private diskWorks(): void {
    if (!this.diskFailing) return;
    this.diskFailing = false;
    this.log?.info({}, 'read cache: the cache disk works again; caching resumed');
  }

  /**
   * Read [offset, offset+length) of object `key` (of size `objectSize`) into out[outOff..],
   * from cache or store. `readahead` extends a miss fetch by that many bytes.
   *
   * When the returned promise settles, resolved or rejected, nothing writes into `out` any
   * more (the NBD layer hands the buffer to the next request then, 9.1): `out` is written only
   * by this function's own sequential copy phase, which starts after every fetch it needs
   * succeeded; fetches themselves never see `out`.
   */
  async read(store: ObjectStore, key: string, objectSize: number, offset: number, length: number, out: Buffer, outOff: number, readahead = 0): Promise<void> {
    // Blocks are cached under the object's key whatever their length, so a range past the
    // object's end (damaged metadata naming a raw object: framed ones are bounded when their
    // records are read) would copy short, or from the slot of a block that was never there,
    // i.e. another object's bytes (reviewed finding). Refused here, and checked per block below.
    if (length === 0) return;
    if (offset < 0 || offset + length > objectSize) throw new CorruptError(`${key}: a read of [${offset}, ${offset + length}) does not lie within the object's ${objectSize} bytes (damaged metadata?)`);
    const first = Math.floor(offset / CACHE_BLOCK);
    const last = Math.floor((offset + length - 1) / CACHE_BLOCK);
    // Plan: for each block, the cache entry (pinned until we are done) or the fetch that brings it.
    const entries: (Entry | null)[] = [];
    const fetches: (Promise<Fetched> | null)[] = [];
    const held: BodyLease[] = []; // pooled bodies of the fetches this read copies from (holdFetch)
    try {
      let b = first;
      while (b <= last) {
        const id = BlockCache.id(key, b);
        const e = this.index.get(id);
        if (e) {
          this.stats.hits++;
          this.index.delete(id); this.index.set(id, e); // touch: most recently used
          e.readers++;
          entries.push(e); fetches.push(null);
          b++;
          continue;
        }
        const shared = this.sharedFetch(id);
        if (shared !== undefined) { this.holdFetch(shared, held); entries.push(null); fetches.push(shared); b++; continue; }
        const pending = this.inflight.get(id);
        if (pending !== undefined) {
          // Blocks a background fetch is bringing: this read's own GET for them (and any
          // missing ones between), raced against that fetch per block (top of the file).
          const others: (Promise<Fetched> | undefined)[] = [pending];
          let runEnd = b;
          for (; runEnd < last; runEnd++) {
            const id1 = BlockCache.id(key, runEnd + 1);
            if (this.index.has(id1) || this.sharedFetch(id1) !== undefined) break;
            others.push(this.inflight.get(id1));
          }
          this.stats.misses += runEnd - b + 1;
          this.stats.raced++;
          const own = this.fetchRun(store, key, objectSize, b, runEnd);
          this.holdFetch(own, held);
          for (const other of others) {
            if (other) this.holdFetch(other, held);
            entries.push(null);
            fetches.push(other ? firstFulfilled(own, other) : own);
            b++;
          }
          continue;
        }
        // A run of missing blocks, extended by readahead (never past the object's end).
        let runEnd = this.extendMissing(key, b, b, last);
        if (runEnd === last && readahead > 0) {
          const lastBlock = Math.floor((objectSize - 1) / CACHE_BLOCK);
          runEnd = this.extendMissing(key, b, runEnd, Math.min(lastBlock, last + Math.ceil(readahead / CACHE_BLOCK)), MAX_FETCH / CACHE_BLOCK);
        }
        this.stats.misses += Math.min(runEnd, last) - b + 1;
        const p = this.fetchRun(store, key, objectSize, b, runEnd);
        this.holdFetch(p, held);
        for (; b <= Math.min(runEnd, last); b++) { entries.push(null); fetches.push(p); }
      }
      // Rejects on the first failed fetch while others may still run: they only fill the cache.
      const fetched = await Promise.all(fetches);

      // Copy phase: the only writer of `out`, one piece after another.
      for (let i = 0, blk = first; blk <= last; i++, blk++) {
        const blockStart = blk * CACHE_BLOCK;
        const from = Math.max(offset, blockStart);
        const to = Math.min(offset + length, blockStart + CACHE_BLOCK);
        const dst = outOff + (from - offset);
        // Fetched for (or with) this read: served from those bytes, cached or not (17.10).
        const f = fetched[i];
        if (f) { f.data.copy(out, dst, from - f.start, to - f.start); continue; }
        const e = entries[i]!;
        if (to - blockStart > e.length) throw new CorruptError(`${key}: block ${blk} holds ${e.length} bytes, a read wants ${to - blockStart} (the object is shorter than the metadata naming it says)`);
        if (e.data) { e.data.copy(out, dst, from - blockStart, to - blockStart); continue; }
        if (!e.dropped) {
          // data === null: the slab write succeeded, so the slot holds this block.
          try {
            await this.slab.read(e.slot, out, dst, from - blockStart, to - from);
            continue;
          } catch (err) {
            this.diskFailed(err, 'read');
            const id = BlockCache.id(key, blk);
            if (this.index.get(id) === e) this.drop(id, e); // never trusted again
          }
        }
        // The cache lost this block's bytes (the disk failed a read of it): from the store.
        const direct = await store.get(key, { offset: from, length: to - from });
        direct.copy(out, dst);
      }
    } finally {
      for (const e of entries) if (e) this.unpin(e);
      for (const l of held) l.release();
    }
  }

  /**
   * read(), done before returning when every block of the range is cached and can be read on
   * the spot (its bytes still in memory, or in a slab that reads synchronously): true once
   * `out` is filled; false when a block is missing (or still being fetched), was dropped after
   * its slab write failed, or the slab cannot read it now (read() then fetches it, or reports
   * the disk). Blocks found are touched as read() touches them; hits are counted on success
   * only. Synchronous from lookup to copy, so no block can be evicted or its slot reused in
   * between (eviction and drops run on other turns).
   */
  readNow(key: string, offset: number, length: number, out: Buffer, outOff: number): boolean {
    const slab = this.slab;
    if (!slab.readSync) return false;
    const first = Math.floor(offset / CACHE_BLOCK);
    const last = Math.floor((offset + length - 1) / CACHE_BLOCK);
    for (let blk = first; blk <= last; blk++) {
      const id = BlockCache.id(key, blk);
      const e = this.index.get(id);
      if (e === undefined || e.dropped) return false;
      this.index.delete(id); this.index.set(id, e); // touch: most recently used (it is cached, read or not)
      const blockStart = blk * CACHE_BLOCK;
      const from = Math.max(offset, blockStart);
      const to = Math.min(offset + length, blockStart + CACHE_BLOCK);
      const dst = outOff + (from - offset);
      if (to - blockStart > e.length) return false; // past what the block holds: read() says so
      if (e.data) { e.data.copy(out, dst, from - blockStart, to - blockStart); continue; }
      try {
        slab.readSync(e.slot, out, dst, from - blockStart, to - from);
      } catch {
        return false; // read() reads it again and, if the disk still fails, says so and drops it
      }
    }
    this.stats.hits += last - first + 1;
    return true;
  }

  /**
   * Bring [offset, offset+length) of object `key` into the cache without reading it: the
   * missing blocks, coalesced into ranged GETs of up to MAX_FETCH, skipping blocks cached or
   * being fetched. Resolves with the bytes it fetched once they are in and written to the
   * cache's disk; never rejects (a hint: a failed prefetch leaves the blocks to the reads that
   * want them). Waiting for the disk is what paces a caller that prefetches in a loop
   * (hydration) to what the disk takes: otherwise blocks waiting for their slab write
   * (MAX_SLAB_WRITES) would pile up in memory when the store is faster than the disk.
   * `background`: reads that need these blocks meanwhile do not wait for this fetch alone
   * (hydration's; the sequential readahead's are shared: its reader is about to want them).
   */
  async prefetch(store: ObjectStore, key: string, objectSize: number, offset: number, length: number, background = false): Promise<number> {
    const end = Math.min(offset + length, objectSize);
    if (end <= offset) return 0;
    const last = Math.floor((end - 1) / CACHE_BLOCK);
    const runs: Promise<Fetched>[] = [];
    for (let b = Math.floor(offset / CACHE_BLOCK); b <= last;) {
      if (!this.missing(key, b)) { b++; continue; }
      const runEnd = this.extendMissing(key, b, b, last, MAX_FETCH / CACHE_BLOCK);
      runs.push(this.fetchRun(store, key, objectSize, b, runEnd, background));
      b = runEnd + 1;
    }
    let bytes = 0;
    for (const r of await Promise.allSettled(runs)) {
      if (r.status !== 'fulfilled') continue;
      bytes += r.value.data.length;
      await r.value.written;
    }
    return bytes;
  }

  /**
   * Bytes of [offset, offset+length) of object `key` in blocks that are neither cached nor
   * being fetched (what a prefetch of that range would fetch now). Hydration plans with it.
   */
  missingBytes(key: string, objectSize: number, offset: number, length: number): number {
    const end = Math.min(offset + length, objectSize);
    if (end <= offset) return 0;
    let n = 0;
    for (let b = Math.floor(offset / CACHE_BLOCK), last = Math.floor((end - 1) / CACHE_BLOCK); b <= last; b++) {
      if (this.missing(key, b)) n += Math.min((b + 1) * CACHE_BLOCK, objectSize) - b * CACHE_BLOCK;
    }
    return n;
  }

  /**
   * Drop the cached blocks of [offset, offset+length) of object `key`: bytes read from them
   * failed their check (frames.ts), so the next read fetches them from the store. An entry
   * whose slab write has not settled yet leaves once it has (its slot must not pass on while
   * that write may still land in it); meanwhile a read that finds it fails its check the same
   * way and reads from the store.
   */
  forget(key: string, offset: number, length: number): void {
    if (length <= 0) return;
    for (let b = Math.floor(offset / CACHE_BLOCK), last = Math.floor((offset + length - 1) / CACHE_BLOCK); b <= last; b++) {
      const id = BlockCache.id(key, b);
      const e = this.index.get(id);
      if (!e) continue;
      if (e.data === null) this.drop(id, e);
      else void e.ready.then(() => { if (this.index.get(id) === e) this.drop(id, e); });
    }
  }

  /**
   * A read of [offset, offset+length) of object `key` would send a GET now: some block is
   * neither cached nor in a fetch it would share (a background fetch's blocks it fetches too).
   */
  wouldFetch(key: string, objectSize: number, offset: number, length: number): boolean {
    const end = Math.min(offset + length, objectSize);
    for (let b = Math.floor(offset / CACHE_BLOCK), last = Math.floor((end - 1) / CACHE_BLOCK); b <= last; b++) {
      const id = BlockCache.id(key, b);
      if (!this.index.has(id) && this.sharedFetch(id) === undefined) return true;
    }
    return false;
  }

  /** The fetch bringing block `id` that a read waits for instead of sending its own: one in flight, not a background one. */
  private sharedFetch(id: string): Promise<Fetched> | undefined {
    const p = this.inflight.get(id);
    return p === undefined || this.background.has(p) ? undefined : p;
  }

  /** Block `block` of `key` is neither cached nor being fetched. */
  private missing(key: string, block: number): boolean {
    const id = BlockCache.id(key, block);
    return !this.index.has(id) && !this.inflight.has(id);
  }

  /**
   * A run of missing blocks that starts at `start` and reaches `end` so far, extended while the
   * next block is missing, up to block `limit` and `maxBlocks` blocks in all: its last block.
   */
  private extendMissing(key: string, start: number, end: number, limit: number, maxBlocks = Infinity): number {
    while (end < limit && end - start + 1 < maxBlocks && this.missing(key, end + 1)) end++;
    return end;
  }

  /** How many bytes the cache holds at most. */
  get capacityBytes(): number { return this.maxSlots * CACHE_BLOCK; }

  private fetchRun(store: ObjectStore, key: string, objectSize: number, firstBlock: number, lastBlock: number, background = false): Promise<Fetched> {
    const start = firstBlock * CACHE_BLOCK;
    const end = Math.min((lastBlock + 1) * CACHE_BLOCK, objectSize);
    const pooled = end - start >= POOLED_FETCH_MIN ? this.getBodies.take(end - start) : null;
    let filledPooled = false;
    const p = (async (): Promise<Fetched> => {
      const data = await store.get(key, { offset: start, length: end - start }, pooled?.body);
      // Every store checks a ranged body's length; a short one here must never become blocks.
      if (data.length !== end - start) throw new CorruptError(`${key}: a GET of [${start}, ${end}) returned ${data.length} bytes`);
      this.stats.fetches++;
      this.stats.bytesFetched += data.length;
      // The blocks hold the pooled body only if the store read into it (it may return its own,
      // and then an attempt it gave up on may still write into ours: ObjectStore.get).
      filledPooled = pooled !== null && data === pooled.body;
      const hold = filledPooled ? pooled?.lease ?? undefined : undefined;
      const writes: Promise<void>[] = [];
      for (let blk = firstBlock; blk <= lastBlock; blk++) {
        const from = blk * CACHE_BLOCK - start;
        const w = this.insertBlock(key, blk, data.subarray(from, Math.min(from + CACHE_BLOCK, data.length)), hold);
        if (w) writes.push(w);
      }
      return { start, data, written: Promise.all(writes) };
    })();
    const ids: string[] = [];
    for (let blk = firstBlock; blk <= lastBlock; blk++) ids.push(BlockCache.id(key, blk));
    for (const id of ids) this.inflight.set(id, p);
    if (background) this.background.add(p);
    if (pooled?.lease) this.fetchLeases.set(p, pooled.lease);
    const done = (): void => { for (const id of ids) if (this.inflight.get(id) === p) this.inflight.delete(id); };
    // Out of `inflight` and fetchRun's own hold let go in one step: no read can take the fetch
    // afterwards (getBodies' note). A failed GET's body is never let go (never reused), nor
    // one the store did not return (it may still be written: ObjectStore.get).
    p.then(() => { done(); if (filledPooled) pooled?.lease?.release(); }, done);
    return p;
  }

  /** read(): hold the body of fetch `p` (if pooled) until the read returns (getBodies' note). */
  private holdFetch(p: Promise<Fetched>, held: BodyLease[]): void {
    const lease = this.fetchLeases.get(p);
    if (lease === undefined) return;
    lease.acquire();
    held.push(lease);
  }

  /** Settles when every slab write started so far has settled. */
  async drain(): Promise<void> {
    while (this.writing.size > 0) await Promise.all([...this.writing]);
  }

  async close(): Promise<void> {
    this.getBodies.close();
    await this.drain();
    this.index.clear();
    await this.slab.close();
  }
}

/**
 * The first of two fetches of the same blocks to succeed; if both fail, `own`'s error (the
 * read's own request, whose failure is the one to report). Each is handled: neither rejection
 * is left unobserved.
 */
function firstFulfilled(own: Promise<Fetched>, other: Promise<Fetched>): Promise<Fetched> {
  return new Promise((resolve, reject) => {
    let ownFailed: { err: unknown } | null = null;
    let otherFailed = false;
    own.then(resolve, (err: unknown) => { ownFailed = { err }; if (otherFailed) reject(err); });
    other.then(resolve, () => { otherFailed = true; if (ownFailed) reject(ownFailed.err); });
  });
}

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
 * misses of the same block share one fetch.
 */

import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import { randomBytes } from 'node:crypto';
import type { ObjectStore } from './store/object-store.js';

export const CACHE_BLOCK = 256 * 1024;
/** Largest single ranged GET (coalesced misses + readahead). */
const MAX_FETCH = 8 * 1024 * 1024;

/** Where cached blocks live: one slot of CACHE_BLOCK bytes per block. */
export interface Slab {
  read(slot: number, out: Buffer, outOff: number, from: number, length: number): Promise<void>;
  write(slot: number, data: Buffer): Promise<void>;
  close(): Promise<void>;
}

export class MemorySlab implements Slab {
  private readonly slots = new Map<number, Buffer>();
  async read(slot: number, out: Buffer, outOff: number, from: number, length: number): Promise<void> {
    this.slots.get(slot)!.copy(out, outOff, from, from + length);
  }
  async write(slot: number, data: Buffer): Promise<void> { this.slots.set(slot, Buffer.from(data)); }
  async close(): Promise<void> { this.slots.clear(); }
}

/**
 * Blocks in one local file. I/O is synchronous on purpose: the blocks were written moments
 * ago or are hot, so they are in the page cache, and a pread from the page cache costs a
 * few microseconds while a trip through libuv's thread pool costs tens.
 */
class FileSlab implements Slab {
  private constructor(private readonly fd: number) {}
  static async open(dir: string): Promise<FileSlab> {
    await fsp.mkdir(dir, { recursive: true });
    const p = path.join(dir, `blocks-${process.pid}-${randomBytes(4).toString('hex')}.bin`);
    const fd = fs.openSync(p, 'w+');
    fs.unlinkSync(p); // anonymous from now on: freed when the process ends, however it ends
    return new FileSlab(fd);
  }
  async read(slot: number, out: Buffer, outOff: number, from: number, length: number): Promise<void> {
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
   * miss lease renewals). Reads stay synchronous (small, and from the page cache).
   */
  async write(slot: number, data: Buffer): Promise<void> {
    let done = 0;
    while (done < data.length) {
      done += await new Promise<number>((resolve, reject) => {
        fs.write(this.fd, data, done, data.length - done, slot * CACHE_BLOCK + done, (err, n) => (err ? reject(err) : resolve(n)));
      });
    }
  }
  async close(): Promise<void> { fs.closeSync(this.fd); }
}

interface Entry { slot: number; length: number; ready: Promise<void>; readers: number }

export interface CacheStats {
  hits: number;
  misses: number;
  fetches: number;
  bytesFetched: number;
  cachedBytes: number;
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
  private readonly inflight = new Map<string, Promise<void>>();
  readonly stats: CacheStats = { hits: 0, misses: 0, fetches: 0, bytesFetched: 0, cachedBytes: 0 };

  private constructor(private readonly slab: Slab, capacityBytes: number) {
    this.maxSlots = Math.max(16, Math.floor(capacityBytes / CACHE_BLOCK));
  }

  static async open(opts: BlockCacheOptions): Promise<BlockCache> {
    const slab = opts.slab ?? (opts.dir ? await FileSlab.open(opts.dir) : new MemorySlab());
    return new BlockCache(slab, opts.capacityBytes);
  }

  private static id(key: string, block: number): string { return `${key}#${block}`; }

  /** Put a whole object's bytes in the cache (write-through after an upload). */
  insertObject(key: string, data: Buffer): void {
    for (let b = 0; b * CACHE_BLOCK < data.length; b++) {
      const from = b * CACHE_BLOCK;
      this.insertBlock(key, b, data.subarray(from, Math.min(from + CACHE_BLOCK, data.length)));
    }
  }

  private insertBlock(key: string, block: number, data: Buffer): void {
    const id = BlockCache.id(key, block);
    if (this.index.has(id)) return;
    let slot: number;
    let after: Promise<void> = Promise.resolve();
    if (this.freeSlots.length > 0) slot = this.freeSlots.pop()!;
    else if (this.nextSlot < this.maxSlots) slot = this.nextSlot++;
    else {
      // Evict the least recently used block that nobody is reading right now.
      let victimId: string | null = null;
      for (const [vid, v] of this.index) if (v.readers === 0) { victimId = vid; break; }
      if (victimId === null) return; // everything is being read: just don't cache this block
      const victim = this.index.get(victimId)!;
      this.index.delete(victimId);
      this.stats.cachedBytes -= victim.length;
      slot = victim.slot;
      // The victim's own write to this slot must land before ours does.
      after = victim.ready;
    }
    const entry: Entry = { slot, length: data.length, ready: Promise.resolve(), readers: 0 };
    entry.ready = after.then(() => this.slab.write(slot, data)).catch(() => {
      if (this.index.get(id) === entry) { this.index.delete(id); this.stats.cachedBytes -= entry.length; }
    });
    this.index.set(id, entry);
    this.stats.cachedBytes += data.length;
  }

  /**
   * Read [offset, offset+length) of object `key` (of size `objectSize`) into out[outOff..],
   * from cache or store. `readahead` extends a miss fetch by that many bytes.
   */
  async read(store: ObjectStore, key: string, objectSize: number, offset: number, length: number, out: Buffer, outOff: number, readahead = 0): Promise<void> {
    const first = Math.floor(offset / CACHE_BLOCK);
    const last = Math.floor((offset + length - 1) / CACHE_BLOCK);
    // Make sure every block is present (fetching runs of missing blocks), then copy.
    let b = first;
    const waits: Promise<void>[] = [];
    while (b <= last) {
      const id = BlockCache.id(key, b);
      const e = this.index.get(id);
      if (e) {
        this.stats.hits++;
        this.index.delete(id); this.index.set(id, e); // touch: most recently used
        b++;
        continue;
      }
      const pending = this.inflight.get(id);
      if (pending) { waits.push(pending); b++; continue; }
      // A run of missing blocks, extended by readahead (never past the object's end).
      let runEnd = b;
      while (runEnd + 1 <= last && !this.index.has(BlockCache.id(key, runEnd + 1)) && !this.inflight.has(BlockCache.id(key, runEnd + 1))) runEnd++;
      const lastBlock = Math.floor((objectSize - 1) / CACHE_BLOCK);
      if (runEnd === last && readahead > 0) {
        const extra = Math.ceil(readahead / CACHE_BLOCK);
        while (runEnd < lastBlock && runEnd - b + 1 < MAX_FETCH / CACHE_BLOCK && runEnd < last + extra
          && !this.index.has(BlockCache.id(key, runEnd + 1)) && !this.inflight.has(BlockCache.id(key, runEnd + 1))) runEnd++;
      }
      this.stats.misses += Math.min(runEnd, last) - b + 1;
      waits.push(this.fetchRun(store, key, objectSize, b, runEnd));
      b = Math.min(runEnd, last) + 1;
    }
    await Promise.all(waits);
    for (let blk = first; blk <= last; blk++) {
      const blockStart = blk * CACHE_BLOCK;
      const from = Math.max(offset, blockStart);
      const to = Math.min(offset + length, blockStart + CACHE_BLOCK);
      const e = this.index.get(BlockCache.id(key, blk));
      if (e) {
        e.readers++;
        try {
          await e.ready;
          // The block may have been dropped (failed write) while we waited; then use the store.
          if (this.index.get(BlockCache.id(key, blk)) === e) {
            await this.slab.read(e.slot, out, outOff + (from - offset), from - blockStart, to - from);
            continue;
          }
        } finally {
          e.readers--;
        }
      }
      const direct = await store.get(key, { offset: from, length: to - from });
      direct.copy(out, outOff + (from - offset));
    }
  }

  private fetchRun(store: ObjectStore, key: string, objectSize: number, firstBlock: number, lastBlock: number): Promise<void> {
    const start = firstBlock * CACHE_BLOCK;
    const end = Math.min((lastBlock + 1) * CACHE_BLOCK, objectSize);
    const p = (async () => {
      const data = await store.get(key, { offset: start, length: end - start });
      this.stats.fetches++;
      this.stats.bytesFetched += data.length;
      for (let blk = firstBlock; blk <= lastBlock; blk++) {
        const from = blk * CACHE_BLOCK - start;
        this.insertBlock(key, blk, data.subarray(from, Math.min(from + CACHE_BLOCK, data.length)));
      }
    })();
    const ids: string[] = [];
    for (let blk = firstBlock; blk <= lastBlock; blk++) ids.push(BlockCache.id(key, blk));
    for (const id of ids) this.inflight.set(id, p);
    void p.catch(() => {}).finally(() => { for (const id of ids) if (this.inflight.get(id) === p) this.inflight.delete(id); });
    return p;
  }

  /** Settles when every slab write started so far has settled. */
  async drain(): Promise<void> {
    await Promise.allSettled([...this.index.values()].map((e) => e.ready));
  }

  async close(): Promise<void> {
    await Promise.allSettled([...this.index.values()].map((e) => e.ready));
    this.index.clear();
    await this.slab.close();
  }
}

/**
 * The working set: which parts of a volume its holder read or wrote lately, most recently used
 * first, so that the next host to open the volume (a takeover, a handoff, a fork's first
 * attach, a restart that lost its cache) fetches those parts before the guest asks for them
 * (src/volume/hydrate.ts).
 *
 * Coarse on purpose: the volume is cut into chunks of `chunkBytes` (256 KiB, the read cache's
 * block size), and the record is the list of chunk indices touched, each once, in recency
 * order, at most `maxChunks` of them (65,536: 16 GiB of volume, 256 KiB in a checkpoint). A
 * touch of a chunk already recorded costs one Map lookup and a few typed-array stores
 * (RecencyList); the oldest chunk goes when the list is full.
 *
 * The boot set: besides recency, the record keeps the first BOOT_MAX_CHUNKS chunks this
 * session read after the volume opened (beginSession), in the order first read: what a
 * guest reads when it attaches (the file system's mount: superblock, group descriptors,
 * journal, root directory; then what its first commands read). Recency misses it: a mount's
 * blocks are read once and then live in the guest's page cache, so they end up at the cold
 * end of the record, and hydration fetched them last, while the next host's mount waited
 * for them one miss at a time behind hydration's own GETs (on radosgw a mount took 0.23-0.52
 * s with hydration running, 0.03-0.05 s without: bench/hydrate.ts). The next host hydrates
 * the boot set first (ranges). A checkpoint carries this session's boot set once it has one,
 * else the one this session loaded (a holder that served nothing passes its predecessor's on).
 *
 * It is a hint and never a source of data: it names volume offsets (not objects), which the
 * hydrating host resolves through its own map, and the block cache it fills is keyed by
 * immutable object keys. A wrong or stale working set costs bandwidth, never correctness. It
 * travels in checkpoints (format.ts, v4), so it costs no store request of its own and GC's
 * reference set is unchanged.
 */

import type { WorkingSetData } from './format.js';

export const WORKING_SET_CHUNK = 256 * 1024;
export const WORKING_SET_MAX_CHUNKS = 65_536;
/** Chunks in a boot set (64 MiB of volume at 256 KiB chunks: a mount and the first commands' reads). */
export const BOOT_MAX_CHUNKS = 256;
/** Chunks of a recorded working set taken over between two pauses (load). */
const LOAD_SLICE = 4096;

/**
 * Distinct numbers in recency order: a doubly linked list threaded through typed arrays, and
 * a Map from number to its slot that changes only when a number enters or leaves.
 *
 * Why not a Map in insertion order (delete + set per touch, as before): every random 4 KiB
 * READ touches a chunk, and a Map with thousands of entries that is deleted from and added
 * to at 100k touches a second rehashes every few thousand deletes into a new backing store
 * of 100-200 KiB, which V8 allocates in large-object space: old-generation garbage, and
 * major collections, made by reads (`perf` of fio randread QD32 on `file:`: Map delete, set
 * and lookup 4.7 % of the server's cycles, major GC about 6 %).
 */
export class RecencyList {
  private values = new Float64Array(0);
  /** Towards the least recent end; -1 at it. */
  private prev = new Int32Array(0);
  /** Towards the most recent end; -1 at it. Also links the free slots. */
  private next = new Int32Array(0);
  private readonly slotOf = new Map<number, number>();
  private oldest = -1;
  private newest = -1;
  private freeSlot = -1;
  private used = 0; // slots ever handed out (the arrays hold `used` of them)

  get size(): number { return this.slotOf.size; }

  has(v: number): boolean { return this.slotOf.has(v); }

  /** `v` becomes the most recent; true if it was not in the list. */
  touch(v: number): boolean {
    const s = this.slotOf.get(v);
    if (s !== undefined) {
      if (s !== this.newest) { this.unlink(s); this.linkNewest(s); }
      return false;
    }
    const slot = this.takeSlot();
    this.values[slot] = v;
    this.slotOf.set(v, slot);
    this.linkNewest(slot);
    return true;
  }

  /** Drop the least recent value (none: nothing happens). */
  dropOldest(): void {
    const s = this.oldest;
    if (s === -1) return;
    this.unlink(s);
    this.slotOf.delete(this.values[s]!);
    this.next[s] = this.freeSlot;
    this.freeSlot = s;
  }

  clear(): void {
    this.slotOf.clear();
    this.oldest = this.newest = this.freeSlot = -1;
    this.used = 0;
  }

  /** The values, least recent first. */
  oldestFirst(): number[] {
    const out: number[] = new Array<number>(this.size);
    let i = 0;
    for (let s = this.oldest; s !== -1; s = this.next[s]!) out[i++] = this.values[s]!;
    return out;
  }

  /** The most recent value (undefined when empty). */
  get mostRecent(): number | undefined { return this.newest === -1 ? undefined : this.values[this.newest]; }

  private takeSlot(): number {
    if (this.freeSlot !== -1) {
      const s = this.freeSlot;
      this.freeSlot = this.next[s]!;
      return s;
    }
    if (this.used === this.values.length) this.grow(Math.max(64, this.values.length * 2));
    return this.used++;
  }

  private grow(n: number): void {
    const values = new Float64Array(n); values.set(this.values); this.values = values;
    const prev = new Int32Array(n); prev.set(this.prev); this.prev = prev;
    const next = new Int32Array(n); next.set(this.next); this.next = next;
  }

  private unlink(s: number): void {
    const p = this.prev[s]!;
    const n = this.next[s]!;
    if (p === -1) this.oldest = n; else this.next[p] = n;
    if (n === -1) this.newest = p; else this.prev[n] = p;
  }

  private linkNewest(s: number): void {
    this.prev[s] = this.newest;
    this.next[s] = -1;
    if (this.newest === -1) this.oldest = s; else this.next[this.newest] = s;
    this.newest = s;
  }
}

export class WorkingSet {
  /** Chunk indices, least recently used first (its most recent one: a repeated touch of it costs nothing). */
  private readonly lru = new RecencyList();
  /** Chunks that entered the record since the last checkpoint took it (markSaved). */
  private added = 0;
  /** This session's boot set (see the header), in the order first read; recorded once beginSession was called. */
  private readonly boot: number[] = [];
  private readonly bootSeen = new Set<number>();
  private recordingBoot = false;
  /** The boot set of the record this one took over (load). */
  private loadedBoot: number[] = [];

  constructor(readonly chunkBytes = WORKING_SET_CHUNK, readonly maxChunks = WORKING_SET_MAX_CHUNKS) {
    if (!(chunkBytes >= 4096 && (chunkBytes & (chunkBytes - 1)) === 0)) throw new RangeError(`working set chunk size ${chunkBytes} is not a power of two of at least 4 KiB`);
    if (!(Number.isSafeInteger(maxChunks) && maxChunks > 0)) throw new RangeError(`working set bound ${maxChunks} is not a positive whole number`);
  }

  /** Chunks recorded. */
  get size(): number { return this.lru.size; }

  /** Chunks that entered the record since markSaved() (how much a new checkpoint would add). */
  get addedSinceSaved(): number { return this.added; }

  /**
   * [offset, offset + length) was read or written just now. Only reads enter the boot set: it
   * is what a new host should have before the guest asks, and a write needs nothing fetched.
   */
  touch(offset: number, length: number, read = false): void {
    if (length <= 0) return;
    const first = Math.floor(offset / this.chunkBytes);
    const last = Math.floor((offset + length - 1) / this.chunkBytes);
    const boot = read && this.recordingBoot && this.boot.length < BOOT_MAX_CHUNKS;
    // The chunk touched last, again (sequential small reads): nothing changes, unless a read makes it enter the boot set.
    if (first === last && first === this.lru.mostRecent && (!boot || this.bootSeen.has(first))) return;
    for (let c = first; c <= last; c++) this.touchChunk(c, boot);
  }

  /**
   * The volume starts serving: what is touched from now on, first touch first, is this
   * session's boot set (until it holds BOOT_MAX_CHUNKS). Not before: a recovery's replay of
   * the log touches what the log wrote, which is recency, not what a guest reads first.
   */
  beginSession(): void { this.recordingBoot = true; }

  private touchChunk(c: number, boot: boolean): void {
    if (boot && this.boot.length < BOOT_MAX_CHUNKS && !this.bootSeen.has(c)) {
      this.boot.push(c);
      this.bootSeen.add(c);
    }
    if (this.lru.touch(c)) this.added++;
    if (this.lru.size > this.maxChunks) this.lru.dropOldest();
  }

  /** The boot set hydration fetches first: this session's once it has one, else the one loaded. */
  bootChunks(): readonly number[] { return this.boot.length > 0 ? this.boot : this.loadedBoot; }

  /** The record for a checkpoint: chunk indices, most recently used first, and the boot set (if any). */
  snapshot(): WorkingSetData {
    const chunks = this.lru.oldestFirst().reverse();
    const boot = this.bootChunks();
    return { chunkBytes: this.chunkBytes, chunks, ...(boot.length > 0 ? { boot: [...boot] } : {}) };
  }

  /** A checkpoint holding the record as it is now was written (or started: see Volume.maybeCheckpoint). */
  markSaved(): void { this.added = 0; }

  /**
   * Take over a recorded working set (a checkpoint's) as the oldest part of this one: what this
   * host touches later is more recent. Chunks past `volumeSize` are dropped (a checkpoint is
   * trusted only as a hint), and a record of another chunk size is mapped onto ours.
   *
   * `pause` is awaited every LOAD_SLICE chunks: a full record (65,536 chunks, each then a Map
   * delete + set) took 6-11 ms in one go quiet and 20-26 ms in a recovery under load, at the
   * end of a recovery that otherwise leaves the event loop free every few ms (bench/scale.ts,
   * profiled). Nothing touches the record meanwhile: it is loaded before the volume serves.
   */
  async load(ws: WorkingSetData, volumeSize: number, pause: () => Promise<void> = async () => {}): Promise<void> {
    const limit = Math.ceil(volumeSize / this.chunkBytes);
    const mapped = (c: number, push: (x: number) => void): void => {
      const from = Math.floor((c * ws.chunkBytes) / this.chunkBytes);
      const to = Math.floor(((c + 1) * ws.chunkBytes - 1) / this.chunkBytes);
      for (let x = from; x <= to && x < limit; x++) push(x);
    };
    const bootSeen = new Set<number>();
    const loadedBoot: number[] = [];
    for (const c of ws.boot ?? []) {
      mapped(c, (x) => { if (loadedBoot.length < BOOT_MAX_CHUNKS && !bootSeen.has(x)) { bootSeen.add(x); loadedBoot.push(x); } });
    }
    this.loadedBoot = loadedBoot;
    const older: number[] = [];
    let since = 0;
    const step = async (): Promise<void> => { if (++since >= LOAD_SLICE) { since = 0; await pause(); } };
    for (const c of ws.chunks) {
      await step();
      mapped(c, (x) => older.push(x));
    }
    // `older` is most recent first; the Map wants least recent first, before what is already here.
    const mine = this.lru.oldestFirst();
    this.lru.clear();
    for (let i = older.length - 1; i >= 0; i--) {
      await step();
      this.lru.touch(older[i]!);
    }
    for (const c of mine) this.lru.touch(c);
    while (this.lru.size > this.maxChunks) this.lru.dropOldest();
  }

  /** Chunk ranges [offset, length) in the order hydration fetches them: the boot set first, then the rest most recently used first. */
  *ranges(volumeSize: number): IterableIterator<{ offset: number; length: number }> {
    const boot = [...this.bootChunks()];
    const inBoot = new Set(boot);
    const chunks = this.lru.oldestFirst();
    const range = (c: number): { offset: number; length: number } | null => {
      const offset = c * this.chunkBytes;
      return offset < volumeSize ? { offset, length: Math.min(this.chunkBytes, volumeSize - offset) } : null;
    };
    for (const c of boot) {
      const r = range(c);
      if (r) yield r;
    }
    for (let i = chunks.length - 1; i >= 0; i--) {
      if (inBoot.has(chunks[i]!)) continue;
      const r = range(chunks[i]!);
      if (r) yield r;
    }
  }
}

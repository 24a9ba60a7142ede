/**
 * PackedExtentMap: ExtentMap (extent-map.ts: read its header) for values that are
 * *locations*, kept without a JS object per extent. The committed map of a volume is one.
 *
 * Why: a map of 10M extents as ExtentMap holds 20M small heap objects (an extent and its
 * value), ~90 B each. Nothing in baton walks them at once any more, but V8's garbage
 * collector does: marking ~0.85 GB of small objects gave incremental steps of up to 38 ms
 * and atomic pauses of 0.1-3 s, i.e. event-loop stalls of 90-250 ms while checkpointing or
 * recovering a 10M-extent map (bench/scale.ts, issue 12). Here the extents are numbers in
 * typed arrays, which the GC never traces, and the heap holds no object per extent and none
 * per region either: a first version with one ArrayBuffer per region still had ~4 objects per
 * region (262k regions in a sparse 1 TiB volume: 88 MiB of heap, and scavenges of 10-50 ms
 * copying new regions while a map was recovered). What is left on the heap: the Map from
 * region number to block address (one hash table of small integers), the pool's pages, and
 * the source table (a few objects per object-store object the map names).
 *
 * Values. Every value is either a *constant* (the same for every byte it covers, like
 * "zeroes": slicing returns it; two neighbours join when they are the same constant) or a
 * *location*, "position `at` of source S" (the suffix `d` bytes in is position at + d; B,
 * right after A of length n, continues A when both name S and B's position is A's + n).
 * That is all ExtentMap's `slice` and `join` did for the committed map (volume.ts), so here
 * they are not functions but arithmetic on the packed numbers, and merging is always on.
 * A LocationCodec tells constants apart (small negative ids) and names a location's source
 * by a string; the map interns each source once in a table and stores its id.
 *
 * Layout: the same fixed regions as ExtentMap (extents never cross a region boundary, an
 * update costs the extents of one region). A region is a block of slots in a SlotPool (see
 * there: pages of typed arrays, a buddy allocator): a header slot (extent count, block
 * order), then one slot per extent, sorted by offset: Int32 offset from the region's start,
 * length, value id (< 0 a constant, else a table entry), and Float64 position in the source
 * (0 for constants): 20 bytes. A block doubles when full and halves when a quarter full.
 * Offsets and lengths within a region fit an int32: regionSize <= 2^30.
 *
 * The source table is reference-counted: refs[id] is how many extents of the live map name
 * id. When it drops to 0 the entry is freed and its id reused (so the table follows the
 * sources the map names now, not every object the volume ever wrote: objects compacted
 * away leave it). Chosen over rebuilding the table when mostly dead because a rebuild
 * renumbers every extent (10M ids in one synchronous step is tens of ms, or a chunked
 * rewrite racing with updates), while a count is O(1) per update. Frozen views may still
 * name an entry the live map dropped: while any view is open, entries that reach 0 are only
 * noted, and freed when the last view closes (if nothing took them up again meanwhile).
 *
 * Frozen views (freeze) work as ExtentMap's, by region: while a view is open, a region about
 * to change is first copied to a new block and the view keeps the old one (pinned until the
 * last view that saved it closes; then it goes back to the pool).
 *
 * Why a class of its own and not a codec option of ExtentMap: the two layouts share no
 * update code (array splices of objects vs. moves within typed arrays and a block pool), a
 * class with both would branch in every method, and the write buffer (values are Buffers,
 * few extents, short-lived) keeps ExtentMap as it was. What they share is in extent-map.ts:
 * the copy-on-write views and their region walk (RegionViews), the lookup piece shape and
 * gap merging. The unit tests run both against one byte model and against each other.
 */

import { strict as assert } from 'node:assert';
import { REGION_SIZE, RegionViews, pushGap, type Extent, type FrozenExtentMap, type Piece } from './extent-map.js';

/** See the header: how a PackedExtentMap reads and makes values. */
export interface LocationCodec<V> {
  /** v's constant id (a negative integer, -1 to -1000), or 0 if v is a location. */
  constant(v: V): number;
  /** The value of constant id `c`. */
  ofConstant(c: number): V;
  /** A location's source, named by a string (interned: one table entry per source). */
  source(v: V): string;
  /** A location's position in its source. */
  at(v: V): number;
  /** The location at position `at` of the source that `first` (a location of it) names. */
  locate(first: V, at: number): V;
}

const MIN_CONSTANT = -1000;

// ------------------------------------------------------------------ the slot pool

/**
 * Where a PackedExtentMap's regions live: slots of 20 bytes (one f64 in a page's `at`, three
 * i32 in its `ints`) in pages of typed arrays, handed out as blocks of 2^order slots by a
 * buddy allocator. A block's first slot is its header: ints [n (or FREE), order, next free]
 * and at [previous free] (the free lists run through the free blocks themselves, so the
 * allocator keeps no JS object per block either). Its extent i is in slot 1 + i.
 *
 * A block is named by its address, page * PAGE_SPAN + slot: a small integer, which is what
 * the map's Map from region number to region holds (a Map of small integers is one hash
 * table to V8's GC, not an object per entry).
 *
 * Pages grow with the pool (2^8 slots for the first, up to 2^16 = 1.25 MiB), a block bigger
 * than that gets a page of its own. Freed blocks merge with their buddy; a page that is
 * free again is given back (one is kept spare, so a map that grows and shrinks across a page
 * boundary does not allocate one per update). So the pool holds at most about twice what
 * the map's blocks need, and blocks at most twice their extents (capacities double).
 */
const PAGE_SPAN = 1 << 16;
const MIN_PAGE_ORDER = 8;
const MAX_PAGE_ORDER = 16;
/** Page indexes stay below this so that addresses are small integers (V8 Smis: < 2^30). */
const MAX_PAGES = 1 << 14;
/** A block of 2^2 slots: header and 3 extents. */
const MIN_ORDER = 2;
const FREE = -1;
const NONE = -1;
const EMPTY_F64 = new Float64Array(0);
const EMPTY_I32 = new Int32Array(0);

class SlotPool {
  readonly at: Float64Array[] = [];
  readonly ints: Int32Array[] = [];
  /** Per page: its order (2^order slots), or -1 once given back. */
  private readonly pageOrder: number[] = [];
  private readonly freePages: number[] = [];
  /** Per order: the first free block, or NONE. */
  private readonly heads: number[] = new Array<number>(32).fill(NONE);
  private spare = NONE;
  /** Slots in pages, and in blocks handed out. */
  slots = 0;
  used = 0;

  /** A block of 2^order slots; its header says (0 extents, order). */
  alloc(order: number): number {
    let k = order;
    let addr = NONE;
    for (; k < this.heads.length; k++) {
      if (this.heads[k] !== NONE) { addr = this.heads[k]!; this.unlink(addr, k); break; }
    }
    if (addr === NONE) {
      k = Math.max(order, Math.min(MAX_PAGE_ORDER, Math.max(MIN_PAGE_ORDER, Math.floor(Math.log2(Math.max(1, this.slots))))));
      addr = this.newPage(k) * PAGE_SPAN;
    }
    // Split down to the order asked for: the upper halves go to the free lists.
    while (k > order) {
      k--;
      this.link(addr + (1 << k), k);
    }
    const p = addr >>> 16;
    const h = 3 * (addr & 0xffff);
    this.ints[p]![h] = 0;
    this.ints[p]![h + 1] = order;
    this.used += 1 << order;
    return addr;
  }

  /** Give back the block at `addr` (merged with its free buddies; a page free again is given back). */
  release(addr: number, order: number): void {
    this.used -= 1 << order;
    const p = addr >>> 16;
    const pOrder = this.pageOrder[p]!;
    let off = addr & 0xffff;
    const I = this.ints[p]!;
    while (order < pOrder) {
      const b = off ^ (1 << order);
      if (I[3 * b] !== FREE || I[3 * b + 1] !== order) break;
      this.unlink(p * PAGE_SPAN + b, order);
      off = Math.min(off, b);
      order++;
    }
    if (order === pOrder) {
      if (this.spare === NONE) this.spare = p;
      else { this.dropPage(p); return; }
    }
    this.link(p * PAGE_SPAN + off, order);
  }

  private newPage(order: number): number {
    const p = this.freePages.pop() ?? this.pageOrder.length;
    if (p >= MAX_PAGES) throw new RangeError('PackedExtentMap: slot pool full');
    this.at[p] = new Float64Array(1 << order);
    this.ints[p] = new Int32Array(3 << order);
    this.pageOrder[p] = order;
    this.slots += 1 << order;
    return p;
  }

  private dropPage(p: number): void {
    this.slots -= 1 << this.pageOrder[p]!;
    this.at[p] = EMPTY_F64;
    this.ints[p] = EMPTY_I32;
    this.pageOrder[p] = -1;
    this.freePages.push(p);
  }

  private link(addr: number, order: number): void {
    const p = addr >>> 16;
    const h = 3 * (addr & 0xffff);
    const head = this.heads[order]!;
    this.ints[p]![h] = FREE;
    this.ints[p]![h + 1] = order;
    this.ints[p]![h + 2] = head;
    this.at[p]![addr & 0xffff] = NONE;
    if (head !== NONE) this.at[head >>> 16]![head & 0xffff] = addr;
    this.heads[order] = addr;
  }

  private unlink(addr: number, order: number): void {
    const p = addr >>> 16;
    const next = this.ints[p]![3 * (addr & 0xffff) + 2]!;
    const prev = this.at[p]![addr & 0xffff]!;
    if (prev === NONE) this.heads[order] = next;
    else this.ints[prev >>> 16]![3 * (prev & 0xffff) + 2] = next;
    if (next !== NONE) this.at[next >>> 16]![next & 0xffff] = prev;
    if (this.spare !== NONE && addr === this.spare * PAGE_SPAN && order === this.pageOrder[this.spare]) this.spare = NONE;
  }

  /** Free slots on the free lists (verify: with the blocks in use, they must make up the pages). */
  freeSlots(): number {
    let n = 0;
    for (let k = 0; k < this.heads.length; k++) {
      for (let a = this.heads[k]!; a !== NONE; a = this.ints[a >>> 16]![3 * (a & 0xffff) + 2]!) {
        if (this.ints[a >>> 16]![3 * (a & 0xffff)] !== FREE || this.ints[a >>> 16]![3 * (a & 0xffff) + 1] !== k) throw new Error(`PackedExtentMap.verify: free list ${k} holds a block that is not free of that order`);
        n += 1 << k;
      }
    }
    return n;
  }
}

/** The smallest order whose block holds a header and `n` extents. */
function orderFor(n: number): number {
  return Math.max(MIN_ORDER, Math.ceil(Math.log2(n + 1)));
}

export interface PackedExtentMapOptions {
  /** Bytes per region (tests use small ones); default REGION_SIZE. */
  regionSize?: number;
}

// ------------------------------------------------------------------ the region table

/** Regions per inner table of a RegionTable (16 GiB of volume at 4 MiB regions). */
export const TABLE_SPAN = 4096;

/**
 * Region number -> block address: a Map of bounded Maps. Why not one Map: a JS Map grows by
 * rehashing every entry in one synchronous step, and a map recovered from a checkpoint adds
 * its regions one after another: at 131,072 -> 262,144 regions (a 1 TiB volume written all
 * over) one set took 5-9 ms quiet and 13-27 ms in a recovery under load (bench/scale.ts,
 * profiled), and it doubles with the volume. Here no Map holds more than TABLE_SPAN entries
 * (an inner table: regions that share `floor(r / TABLE_SPAN)`) or more than one entry per
 * 16 GiB of volume (the outer one), so one set costs a bounded rehash at most, at any size;
 * memory stays what one Map costs, about an entry per region (a dense array per inner table
 * would cost 16 KiB for a sparse volume's lone region).
 *
 * Iteration (keys, entries) is in no particular order (as the Map it replaces: walks sort
 * region numbers a bucket at a time, RegionViews.open). It is safe while the table changes:
 * an inner table is looked up again for each step, and a region that stays in the table the
 * whole time is always visited (what a frozen view's walk relies on).
 */
export class RegionTable {
  private readonly outer = new Map<number, Map<number, number>>();
  private count = 0;

  get size(): number { return this.count; }

  get(r: number): number | undefined {
    return this.outer.get(Math.floor(r / TABLE_SPAN))?.get(r);
  }

  set(r: number, a: number): this {
    const t = Math.floor(r / TABLE_SPAN);
    let inner = this.outer.get(t);
    if (inner === undefined) { inner = new Map(); this.outer.set(t, inner); }
    const before = inner.size;
    inner.set(r, a);
    this.count += inner.size - before;
    assert(inner.size <= TABLE_SPAN, 'an inner region table holds at most TABLE_SPAN regions');
    return this;
  }

  delete(r: number): boolean {
    const t = Math.floor(r / TABLE_SPAN);
    const inner = this.outer.get(t);
    if (inner === undefined || !inner.delete(r)) return false;
    this.count--;
    if (inner.size === 0) this.outer.delete(t);
    return true;
  }

  *keys(): IterableIterator<number> {
    for (const [r] of this.entries()) yield r;
  }

  *entries(): IterableIterator<[number, number]> {
    for (const t of [...this.outer.keys()]) {
      // Looked up again: emptied and dropped meanwhile, a table has nothing left to visit (a
      // new one for the same numbers holds only regions made since).
      const inner = this.outer.get(t);
      if (inner === undefined) continue;
      // Map iteration is live: entries added during it are visited, deleted ones are not.
      for (const e of inner) yield e;
    }
  }

  [Symbol.iterator](): IterableIterator<[number, number]> { return this.entries(); }

  /** The most regions any one Map holds (at most TABLE_SPAN: the bound on a rehash), and how many inner tables there are. */
  shape(): { tables: number; largest: number } {
    let largest = this.outer.size;
    for (const inner of this.outer.values()) largest = Math.max(largest, inner.size);
    return { tables: this.outer.size, largest };
  }
}

export class PackedExtentMap<V> {
  /** Region number -> the address of its block in the pool (regions with no extent have none). */
  private readonly regions = new RegionTable();
  private readonly pool = new SlotPool();
  private count = 0;
  private readonly regionSize: number;

  // The source table (see the header). An id is free when firsts[id] is undefined.
  /** The value each source was first interned with: locate() makes the others from it. */
  private firsts: (V | undefined)[] = [];
  private keys: (string | undefined)[] = [];
  private refs: number[] = [];
  private ids = new Map<string, number>();
  private free: number[] = [];
  /** Entries whose count reached 0 while views were open: freed when the last one closes. */
  private unreferenced = new Set<number>();

  private readonly cow = new RegionViews<number>(this.regions, (a) => this.copyBlock(a, this.pool), () => this.viewsClosed(), (a) => this.pool.release(a, this.orderOf(a)));

  constructor(private readonly codec: LocationCodec<V>, options: PackedExtentMapOptions = {}) {
    this.regionSize = options.regionSize ?? REGION_SIZE;
    if (!(Number.isSafeInteger(this.regionSize) && this.regionSize > 0 && this.regionSize <= 2 ** 30)) throw new RangeError(`regionSize ${this.regionSize}: an integer in (0, 2^30]`);
  }

  get size(): number { return this.count; }

  isEmpty(): boolean { return this.count === 0; }

  /** Sources in the table (what it costs besides the regions). */
  get sources(): number { return this.ids.size; }

  /** Regions with extents, and the shape of the table that finds them (RegionTable.shape). */
  get regionTable(): { regions: number; tables: number; largest: number } { return { regions: this.regions.size, ...this.regions.shape() }; }

  /** Bytes of the pool's pages (the map's extents, with the room its blocks keep free). */
  get poolBytes(): number { return this.pool.slots * SLOT_BYTES; }

  // ---------------------------------------------------------------- the source table

  /** The id of v's constant or source, interning a new source (count 0: the caller takes it up). */
  private idOf(v: V): number {
    const c = this.codec.constant(v);
    if (c < 0) {
      if (!(c >= MIN_CONSTANT && Number.isInteger(c))) throw new RangeError(`constant id ${c}: an integer in [${MIN_CONSTANT}, -1]`);
      return c;
    }
    const key = this.codec.source(v);
    let id = this.ids.get(key);
    if (id === undefined) {
      id = this.free.pop() ?? this.firsts.length;
      this.firsts[id] = v;
      this.keys[id] = key;
      this.refs[id] = 0;
      this.ids.set(key, id);
    }
    return id;
  }

  private ref(id: number): void { if (id >= 0) this.refs[id]!++; }

  private unref(id: number): void {
    if (id < 0 || --this.refs[id]! > 0) return;
    if (this.cow.isOpen) this.unreferenced.add(id);
    else this.release(id);
  }

  private release(id: number): void {
    this.ids.delete(this.keys[id]!);
    this.firsts[id] = undefined;
    this.keys[id] = undefined;
    this.free.push(id);
  }

  private viewsClosed(): void {
    for (const id of this.unreferenced) if (this.refs[id] === 0 && this.firsts[id] !== undefined) this.release(id);
    this.unreferenced.clear();
  }

  private value(id: number, at: number): V {
    return id < 0 ? this.codec.ofConstant(id) : this.codec.locate(this.firsts[id]!, at);
  }

  // ---------------------------------------------------------------- blocks

  private orderOf(a: number): number { return this.pool.ints[a >>> 16]![3 * (a & 0xffff) + 1]!; }

  /** A copy of block `a` (of this map's pool) in `into`, with its capacity, or order `order`. */
  private copyBlock(a: number, into: SlotPool, order: number = this.orderOf(a)): number {
    const p = a >>> 16;
    const h = a & 0xffff;
    const n = this.pool.ints[p]![3 * h]!;
    const b = into.alloc(order);
    const q = b >>> 16;
    const g = b & 0xffff;
    into.ints[q]!.set(this.pool.ints[p]!.subarray(3 * (h + 1), 3 * (h + 1 + n)), 3 * (g + 1));
    into.at[q]!.set(this.pool.at[p]!.subarray(h + 1, h + 1 + n), g + 1);
    into.ints[q]![3 * g] = n;
    return b;
  }

  /** Region r's block `a` moves to a block of order `order` (growing or shrinking; only the map's own blocks, which no view keeps). */
  private move(r: number, a: number, order: number): number {
    const b = this.copyBlock(a, this.pool, order);
    this.pool.release(a, this.orderOf(a));
    this.regions.set(r, b);
    return b;
  }

  // ---------------------------------------------------------------- updates

  /** Make [offset, offset+length) hold `value` (the value describes the range's first byte). */
  set(offset: number, length: number, value: V): void {
    checkRange(offset, length);
    if (length === 0) return;
    const id = this.idOf(value);
    const at = id < 0 ? 0 : this.codec.at(value);
    this.update(offset, length, id, at);
  }

  /** Forget [offset, offset+length) (back to never-written). */
  delete(offset: number, length: number): void {
    checkRange(offset, length);
    this.update(offset, length, null, 0);
  }

  private update(offset: number, length: number, id: number | null, at: number): void {
    let pos = offset;
    const end = offset + length;
    while (pos < end) {
      const r = Math.floor(pos / this.regionSize);
      const base = r * this.regionSize;
      const rEnd = Math.min(base + this.regionSize, end);
      this.setInRegion(r, pos - base, rEnd - pos, id, id === null || id < 0 ? 0 : at + (pos - offset));
      pos = rEnd;
    }
  }

  /**
   * Region r's [rel, rel+len) becomes (id, at), or a gap for id null. Offsets relative to the
   * region. In a block at slot h of its page, extent i is slot e + i with e = h + 1: its
   * offset, length and id at ints[3(e+i)...], its position at at[e+i].
   */
  private setInRegion(r: number, rel: number, len: number, id: number | null, at: number): void {
    let a = this.regions.get(r);
    if (this.cow.isOpen) a = this.cow.preserve(r, a);
    if (a === undefined) {
      if (id === null) return;
      a = this.pool.alloc(MIN_ORDER);
      this.regions.set(r, a);
    }
    const end = rel + len;
    let I = this.pool.ints[a >>> 16]!;
    let A = this.pool.at[a >>> 16]!;
    let e = (a & 0xffff) + 1;
    const n = I[3 * e - 3]!;
    const first = firstEndingAfter(I, e, n, rel);
    let i = first;
    while (i < n && I[3 * (e + i)]! < end) i++;
    const removed = i - first;
    if (removed === 0 && id === null) return;
    // What is left of the first and last extents the range cuts (the same one if it cuts one).
    const x0 = 3 * (e + first);
    const xl = 3 * (e + i - 1);
    const hasLeft = removed > 0 && I[x0]! < rel;
    const hasRight = removed > 0 && I[xl]! + I[xl + 1]! > end;
    const lOff = hasLeft ? I[x0]! : 0;
    const lId = hasLeft ? I[x0 + 2]! : 0;
    const lAt = hasLeft ? A[e + first]! : 0;
    const rOff = hasRight ? I[xl]! : 0;
    const rLen = hasRight ? rOff + I[xl + 1]! - end : 0;
    const rId = hasRight ? I[xl + 2]! : 0;
    const rAt = hasRight && rId >= 0 ? A[e + i - 1]! + (end - rOff) : 0;
    // Counts: take up the new references before dropping the old ones, so an entry that
    // only changes extents is never freed in between.
    if (hasLeft) this.ref(lId);
    if (id !== null) this.ref(id);
    if (hasRight) this.ref(rId);
    for (let k = first; k < i; k++) this.unref(I[3 * (e + k) + 2]!);
    const added = (hasLeft ? 1 : 0) + (id !== null ? 1 : 0) + (hasRight ? 1 : 0);
    const delta = added - removed;
    const m = n + delta;
    if (m === 0) {
      this.pool.release(a, I[3 * e - 2]!);
      this.regions.delete(r);
      this.count += delta;
      return;
    }
    if (m + 1 > 1 << I[3 * e - 2]!) {
      a = this.move(r, a, orderFor(m));
      I = this.pool.ints[a >>> 16]!;
      A = this.pool.at[a >>> 16]!;
      e = (a & 0xffff) + 1;
    }
    if (delta !== 0) {
      I.copyWithin(3 * (e + first + added), 3 * (e + i), 3 * (e + n));
      A.copyWithin(e + first + added, e + i, e + n);
    }
    I[3 * e - 3] = m;
    this.count += delta;
    let w = e + first;
    if (hasLeft) put(I, A, w++, lOff, rel - lOff, lId, lAt);
    if (id !== null) put(I, A, w++, rel, len, id, at);
    if (hasRight) put(I, A, w++, end, rLen, rId, rAt);
    if (id !== null) {
      // The new extent sits at first + (a left remainder ? 1 : 0): merge it with the one
      // after, then with the one before (as ExtentMap does).
      const k = first + (hasLeft ? 1 : 0);
      this.join(I, A, e, k);
      this.join(I, A, e, k - 1);
    }
    this.checkAround(I, e, first - 1, first + added + 1, r);
    const order = I[3 * e - 2]!;
    if (order > MIN_ORDER && I[3 * e - 3]! + 1 <= (1 << order) >>> 2) this.move(r, a, order - 1);
  }

  /** Merge extents k and k+1 of the block whose extents start at slot e if k+1 continues k. */
  private join(I: Int32Array, A: Float64Array, e: number, k: number): void {
    const n = I[3 * e - 3]!;
    if (k < 0 || k + 1 >= n) return;
    const x = 3 * (e + k);
    const id = I[x + 2]!;
    if (I[x]! + I[x + 1]! !== I[x + 3] || id !== I[x + 5] || (id >= 0 && A[e + k]! + I[x + 1]! !== A[e + k + 1])) return;
    I[x + 1]! += I[x + 4]!;
    I.copyWithin(x + 3, x + 6, 3 * (e + n));
    A.copyWithin(e + k + 1, e + k + 2, e + n);
    I[3 * e - 3] = n - 1;
    this.count--;
    this.unref(id);
  }

  /**
   * Debug-cheap invariant check after an update: the extents from..to (clamped) of region r
   * (the ones it wrote and their neighbours) have positive lengths, lie within the region and
   * are sorted without overlap. O(1): the rest of the region did not move relative to itself.
   */
  private checkAround(I: Int32Array, e: number, from: number, to: number, r: number): void {
    const lo = Math.max(0, from);
    const hi = Math.min(I[3 * e - 3]! - 1, to);
    for (let k = lo; k <= hi; k++) {
      const x = 3 * (e + k);
      const off = I[x]!;
      const len = I[x + 1]!;
      if (!(off >= 0 && len > 0 && off + len <= this.regionSize && (k === 0 || I[x - 3]! + I[x - 2]! <= off))) {
        throw new Error(`PackedExtentMap: region ${r} broken at extent ${k} (offset ${off}, length ${len}): not sorted, overlapping or outside the region`);
      }
    }
  }

  /**
   * Add an extent after every extent already in its regions (building a map from a sorted
   * source, like a checkpoint, without a search per extent). Throws if it overlaps or comes
   * before what is there. Joins with the extent before it like set.
   */
  append(offset: number, length: number, value: V): void {
    checkRange(offset, length);
    let pos = offset;
    const end = offset + length;
    let id: number | undefined;
    let at0 = 0;
    while (pos < end) {
      const r = Math.floor(pos / this.regionSize);
      const base = r * this.regionSize;
      const rEnd = Math.min(base + this.regionSize, end);
      const rel = pos - base;
      let a = this.regions.get(r);
      if (this.cow.isOpen) a = this.cow.preserve(r, a);
      let n = 0;
      let lastEnd = 0;
      if (a !== undefined) {
        const I = this.pool.ints[a >>> 16]!;
        const h = 3 * (a & 0xffff);
        n = I[h]!;
        const x = h + 3 * n; // the last extent (n >= 1 in a block that is in the map)
        lastEnd = I[x]! + I[x + 1]!;
        if (lastEnd > rel) throw new RangeError(`append at ${pos} overlaps or precedes the extent at ${base + I[x]!}`);
      }
      // Interned only once it is known to go in (an entry nobody takes up would stay).
      if (id === undefined) { id = this.idOf(value); at0 = id < 0 ? 0 : this.codec.at(value); }
      const at = id < 0 ? 0 : at0 + (pos - offset);
      if (a === undefined) { a = this.pool.alloc(MIN_ORDER); this.regions.set(r, a); }
      let I = this.pool.ints[a >>> 16]!;
      let A = this.pool.at[a >>> 16]!;
      let e = (a & 0xffff) + 1;
      const x = 3 * (e + n - 1);
      if (n > 0 && lastEnd === rel && I[x + 2] === id && (id < 0 || A[e + n - 1]! + I[x + 1]! === at)) {
        I[x + 1]! += rEnd - pos;
      } else {
        if (n + 2 > 1 << I[3 * e - 2]!) {
          a = this.move(r, a, I[3 * e - 2]! + 1);
          I = this.pool.ints[a >>> 16]!;
          A = this.pool.at[a >>> 16]!;
          e = (a & 0xffff) + 1;
        }
        put(I, A, e + n, rel, rEnd - pos, id, at);
        I[3 * e - 3] = n + 1;
        this.count++;
        this.ref(id);
      }
      pos = rEnd;
    }
  }

  // ---------------------------------------------------------------- reads

  /** The pieces covering [offset, offset+length) in order, gaps included (value undefined). */
  lookup(offset: number, length: number): Piece<V>[] {
    const out: Piece<V>[] = [];
    let pos = offset;
    const end = offset + length;
    while (pos < end) {
      const r = Math.floor(pos / this.regionSize);
      const base = r * this.regionSize;
      const rEnd = Math.min(base + this.regionSize, end);
      const a = this.regions.get(r);
      if (a === undefined) {
        pushGap(out, pos, rEnd - pos);
        pos = rEnd;
        continue;
      }
      const I = this.pool.ints[a >>> 16]!;
      const A = this.pool.at[a >>> 16]!;
      const e = (a & 0xffff) + 1;
      const n = I[3 * e - 3]!;
      for (let i = firstEndingAfter(I, e, n, pos - base); i < n && pos < rEnd; i++) {
        const x = 3 * (e + i);
        const eOff = base + I[x]!;
        if (eOff >= rEnd) break;
        if (eOff > pos) {
          pushGap(out, pos, eOff - pos);
          pos = eOff;
        }
        const pEnd = Math.min(eOff + I[x + 1]!, rEnd);
        out.push({ offset: pos, length: pEnd - pos, value: this.value(I[x + 2]!, A[e + i]! + (pos - eOff)) });
        pos = pEnd;
      }
      if (pos < rEnd) {
        pushGap(out, pos, rEnd - pos);
        pos = rEnd;
      }
    }
    return out;
  }

  /** Every extent in offset order (a value object per extent: for small maps and tests; big walks use freeze). */
  *entries(): IterableIterator<Extent<V>> {
    const keys = [...this.regions.keys()].sort((a, b) => a - b);
    for (const r of keys) {
      const a = this.regions.get(r)!;
      const I = this.pool.ints[a >>> 16]!;
      const A = this.pool.at[a >>> 16]!;
      const e = (a & 0xffff) + 1;
      const base = r * this.regionSize;
      for (let i = 0; i < I[3 * e - 3]!; i++) {
        yield { offset: base + I[3 * (e + i)]!, length: I[3 * (e + i) + 1]!, value: this.value(I[3 * (e + i) + 2]!, A[e + i]!) };
      }
    }
  }

  /**
   * The map as it is now, for reading a piece at a time while the map goes on changing
   * (ExtentMap.freeze): a region's block is copied only when it changes while the view is
   * open (the view keeps the old block until it closes), and table entries the view names
   * stay until it is closed.
   */
  freeze(): FrozenExtentMap<V> {
    const view = this.cow.open();
    const regionSize = this.regionSize;
    return {
      size: this.count,
      walk: (fn, pause, chunk, due) => view.walk((r, a) => {
        const I = this.pool.ints[a >>> 16]!;
        const A = this.pool.at[a >>> 16]!;
        const e = (a & 0xffff) + 1;
        const n = I[3 * e - 3]!;
        const base = r * regionSize;
        for (let i = 0; i < n; i++) {
          const x = 3 * (e + i);
          if (fn(base + I[x]!, I[x + 1]!, this.value(I[x + 2]!, A[e + i]!)) === false) return false;
        }
        return n;
      }, pause, chunk, due),
      close: view.close,
    };
  }

  clone(): PackedExtentMap<V> {
    const m = new PackedExtentMap<V>(this.codec, { regionSize: this.regionSize });
    for (const [r, a] of this.regions) m.regions.set(r, this.copyBlock(a, m.pool));
    m.count = this.count;
    m.firsts = this.firsts.slice();
    m.keys = this.keys.slice();
    m.refs = this.refs.slice();
    m.ids = new Map(this.ids);
    m.free = this.free.slice();
    // The clone has no views: what only ours keep is free there.
    for (const id of this.unreferenced) if (m.refs[id] === 0 && m.firsts[id] !== undefined) m.release(id);
    return m;
  }

  /**
   * Every invariant, checked over the whole map (tests; O(map)): regions sorted, not
   * overlapping, within bounds, none empty, no two neighbours left joinable, the count, the
   * blocks (capacity, and with no view open, the pool's accounting), and the source table
   * (counts equal the extents naming each entry, one entry per source, free ids named by
   * nobody). Throws on the first violation.
   */
  verify(): void {
    const fail = (what: string): never => { throw new Error(`PackedExtentMap.verify: ${what}`); };
    let total = 0;
    let blockSlots = 0;
    const refs = new Array<number>(this.firsts.length).fill(0);
    for (const [r, a] of this.regions) {
      const I = this.pool.ints[a >>> 16]!;
      const A = this.pool.at[a >>> 16]!;
      const e = (a & 0xffff) + 1;
      const n = I[3 * e - 3]!;
      const order = I[3 * e - 2]!;
      if (n <= 0) fail(`region ${r} is empty or free (${n}) but kept`);
      if (!(order >= MIN_ORDER && n + 1 <= 1 << order)) fail(`region ${r} holds ${n} extents in a block of order ${order}`);
      blockSlots += 1 << order;
      for (let i = 0; i < n; i++) {
        const x = 3 * (e + i);
        const off = I[x]!;
        const len = I[x + 1]!;
        const id = I[x + 2]!;
        if (!(off >= 0 && len > 0 && off + len <= this.regionSize)) fail(`region ${r} extent ${i} [${off}, +${len}) outside the region`);
        if (i > 0) {
          const pEnd = I[x - 3]! + I[x - 2]!;
          if (pEnd > off) fail(`region ${r} extents ${i - 1} and ${i} overlap or are out of order`);
          if (pEnd === off && I[x - 1] === id && (id < 0 || A[e + i - 1]! + I[x - 2]! === A[e + i])) fail(`region ${r} extents ${i - 1} and ${i} are joinable`);
        }
        if (id >= 0) {
          if (this.firsts[id] === undefined) fail(`region ${r} extent ${i} names free entry ${id}`);
          refs[id]!++;
        } else if (id < MIN_CONSTANT) fail(`region ${r} extent ${i} has id ${id}`);
      }
      total += n;
    }
    if (total !== this.count) fail(`size ${this.count}, counted ${total}`);
    const { largest } = this.regions.shape();
    if (largest > TABLE_SPAN) fail(`a region table holds ${largest} regions (at most ${TABLE_SPAN})`);
    const free = this.pool.freeSlots();
    if (free + this.pool.used !== this.pool.slots) fail(`pool: ${this.pool.slots} slots, ${this.pool.used} in blocks, ${free} free`);
    if (!this.cow.isOpen && blockSlots !== this.pool.used) fail(`pool: ${this.pool.used} slots in blocks, the regions have ${blockSlots}`);
    let live = 0;
    for (let id = 0; id < this.firsts.length; id++) {
      if (this.firsts[id] === undefined) continue;
      live++;
      if (this.refs[id] !== refs[id]) fail(`entry ${id} (${this.keys[id]}) counts ${this.refs[id]}, named ${refs[id]} times`);
      if (this.ids.get(this.keys[id]!) !== id) fail(`entry ${id} is not the one its source ${this.keys[id]} maps to`);
      if (refs[id] === 0 && !this.unreferenced.has(id)) fail(`entry ${id} is named by nobody and not freed`);
    }
    if (live !== this.ids.size) fail(`${this.ids.size} sources map to ${live} entries`);
    for (const id of this.free) if (this.firsts[id] !== undefined) fail(`free id ${id} is in use`);
    if (this.free.length + live !== this.firsts.length) fail(`${this.firsts.length} ids: ${live} in use, ${this.free.length} free`);
  }
}

/** Bytes per slot: an f64 and three i32. */
const SLOT_BYTES = 20;

/** Index of the first extent (of the n starting at slot e) whose end is past `rel` (n if none). */
function firstEndingAfter(I: Int32Array, e: number, n: number, rel: number): number {
  let lo = 0;
  let hi = n;
  while (lo < hi) {
    const mid = (lo + hi) >>> 1;
    const x = 3 * (e + mid);
    if (I[x]! + I[x + 1]! <= rel) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

function put(I: Int32Array, A: Float64Array, slot: number, off: number, len: number, id: number, at: number): void {
  I[3 * slot] = off;
  I[3 * slot + 1] = len;
  I[3 * slot + 2] = id;
  A[slot] = at;
}

/** Offsets and lengths are whole bytes (an int32 would silently truncate a fraction). */
function checkRange(offset: number, length: number): void {
  if (!Number.isSafeInteger(offset) || !Number.isSafeInteger(length) || length < 0) throw new RangeError(`extent [${offset}, +${length}): whole numbers of bytes`);
}

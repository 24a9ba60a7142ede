/**
 * PackedExtentMap: ExtentMap (extent-map.ts: read its header) for values that are
 * *locations*, kept without a JS object per extent. The committed map of a volume is one.
 *
 * Why: a map of 10M extents as ExtentMap holds 20M small heap objects (an extent and its
 * value), ~90 B each. Nothing in baton walks them at once any more, but V8's garbage
 * collector does: marking ~0.85 GB of small objects gave incremental steps of up to 38 ms
 * and atomic pauses of 0.1-3 s, i.e. event-loop stalls of 90-250 ms while checkpointing or
 * recovering a 10M-extent map (bench/scale.ts, issue 12). Here a region is a few objects
 * whatever it holds, and the extents are numbers in an ArrayBuffer, which the GC never
 * traces: the heap holds ~4 objects per region and one per object-store object named.
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
 * update costs the extents of one region). A region is one ArrayBuffer with two views:
 * Float64 `at` (position in the source; 0 for constants) and Int32 `ints`, three per extent
 * (offset from the region's start, length, value id: < 0 a constant, else a table entry),
 * sorted by offset, 20 bytes per extent. Capacity doubles when full and halves when a
 * quarter full. Offsets and lengths within a region fit an int32: regionSize <= 2^30.
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
 * Why a class of its own and not a codec option of ExtentMap: the two layouts share no
 * update code (array splices of objects vs. moves within typed arrays), a class with both
 * would branch in every method, and the write buffer (values are Buffers, few extents,
 * short-lived) keeps ExtentMap as it was. What they share is in extent-map.ts: the region
 * walk of frozen views (RegionViews), the lookup piece shape and gap merging. The unit
 * tests run both against one byte model and against each other.
 */

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

/** Bytes per extent in a region's buffer: an f64 and three i32. */
const EXTENT_BYTES = 20;
/** A new region's capacity, in extents (the smallest it shrinks to). */
const MIN_CAP = 4;
const MIN_CONSTANT = -1000;

/** One region's extents, sorted by offset (see the header for the layout). */
class Region {
  n = 0;
  at: Float64Array;
  ints: Int32Array;

  constructor(cap: number) {
    const buf = new ArrayBuffer(cap * EXTENT_BYTES);
    this.at = new Float64Array(buf, 0, cap);
    this.ints = new Int32Array(buf, cap * 8, cap * 3);
  }

  get cap(): number { return this.at.length; }

  /** A region with the same extents and capacity `cap` (at least n). */
  copy(cap: number = this.cap): Region {
    const c = new Region(cap);
    c.n = this.n;
    c.at.set(this.at.subarray(0, this.n));
    c.ints.set(this.ints.subarray(0, 3 * this.n));
    return c;
  }

  /** Change the capacity in place (only regions no view keeps: the map's own). */
  resize(cap: number): void {
    const c = this.copy(cap);
    this.at = c.at;
    this.ints = c.ints;
  }
}

export interface PackedExtentMapOptions {
  /** Bytes per region (tests use small ones); default REGION_SIZE. */
  regionSize?: number;
}

export class PackedExtentMap<V> {
  private readonly regions = new Map<number, Region>();
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

  private readonly cow = new RegionViews<Region>(this.regions, (g) => g.copy(), () => this.viewsClosed());

  constructor(private readonly codec: LocationCodec<V>, options: PackedExtentMapOptions = {}) {
    this.regionSize = options.regionSize ?? REGION_SIZE;
    if (!(Number.isSafeInteger(this.regionSize) && this.regionSize > 0 && this.regionSize <= 2 ** 30)) throw new RangeError(`regionSize ${this.regionSize}: an integer in (0, 2^30]`);
  }

  get size(): number { return this.count; }

  isEmpty(): boolean { return this.count === 0; }

  /** Sources in the table (what it costs besides the regions). */
  get sources(): number { return this.ids.size; }

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

  /** Region r's [rel, rel+len) becomes (id, at), or a gap for id null. Offsets relative to the region. */
  private setInRegion(r: number, rel: number, len: number, id: number | null, at: number): void {
    let g = this.regions.get(r);
    if (this.cow.isOpen) g = this.cow.preserve(r, g);
    if (!g) {
      if (id === null) return;
      g = new Region(MIN_CAP);
      this.regions.set(r, g);
    }
    const end = rel + len;
    const n = g.n;
    let I = g.ints;
    let A = g.at;
    const first = firstEndingAfter(I, n, rel);
    let i = first;
    while (i < n && I[3 * i]! < end) i++;
    const removed = i - first;
    if (removed === 0 && id === null) return;
    // What is left of the first and last extents the range cuts (the same one if it cuts one).
    const hasLeft = removed > 0 && I[3 * first]! < rel;
    const last = i - 1;
    const hasRight = removed > 0 && I[3 * last]! + I[3 * last + 1]! > end;
    const lOff = hasLeft ? I[3 * first]! : 0;
    const lId = hasLeft ? I[3 * first + 2]! : 0;
    const lAt = hasLeft ? A[first]! : 0;
    const rOff = hasRight ? I[3 * last]! : 0;
    const rLen = hasRight ? rOff + I[3 * last + 1]! - end : 0;
    const rId = hasRight ? I[3 * last + 2]! : 0;
    const rAt = hasRight && rId >= 0 ? A[last]! + (end - rOff) : 0;
    // Counts: take up the new references before dropping the old ones, so an entry that
    // only changes extents is never freed in between.
    if (hasLeft) this.ref(lId);
    if (id !== null) this.ref(id);
    if (hasRight) this.ref(rId);
    for (let k = first; k < i; k++) this.unref(I[3 * k + 2]!);
    const added = (hasLeft ? 1 : 0) + (id !== null ? 1 : 0) + (hasRight ? 1 : 0);
    const delta = added - removed;
    if (n + delta > g.cap) {
      g.resize(Math.max(2 * g.cap, n + delta));
      I = g.ints;
      A = g.at;
    }
    if (delta !== 0) {
      I.copyWithin(3 * (first + added), 3 * i, 3 * n);
      A.copyWithin(first + added, i, n);
    }
    g.n = n + delta;
    this.count += delta;
    let w = first;
    if (hasLeft) put(g, w++, lOff, rel - lOff, lId, lAt);
    if (id !== null) put(g, w++, rel, len, id, at);
    if (hasRight) put(g, w++, end, rLen, rId, rAt);
    if (g.n === 0) { this.regions.delete(r); return; }
    if (id !== null) {
      // The new extent sits at first + (a left remainder ? 1 : 0): merge it with the one
      // after, then with the one before (as ExtentMap does).
      const k = first + (hasLeft ? 1 : 0);
      this.join(g, k);
      this.join(g, k - 1);
    }
    this.checkAround(g, first - 1, first + added + 1, r);
    this.maybeShrink(g);
  }

  /** Merge extents k and k+1 of g if k+1 continues k. */
  private join(g: Region, k: number): void {
    if (k < 0 || k + 1 >= g.n) return;
    const I = g.ints;
    const A = g.at;
    const a = 3 * k;
    const id = I[a + 2]!;
    if (I[a]! + I[a + 1]! !== I[a + 3] || id !== I[a + 5] || (id >= 0 && A[k]! + I[a + 1]! !== A[k + 1])) return;
    I[a + 1]! += I[a + 4]!;
    I.copyWithin(a + 3, a + 6, 3 * g.n);
    A.copyWithin(k + 1, k + 2, g.n);
    g.n--;
    this.count--;
    this.unref(id);
  }

  private maybeShrink(g: Region): void {
    if (g.cap > MIN_CAP && g.n <= g.cap >>> 2) g.resize(Math.max(MIN_CAP, g.cap >>> 1));
  }

  /**
   * Debug-cheap invariant check after an update: the extents from..to (clamped) of region r
   * (the ones it wrote and their neighbours) have positive lengths, lie within the region and
   * are sorted without overlap. O(1): the rest of the region did not move relative to itself.
   */
  private checkAround(g: Region, from: number, to: number, r: number): void {
    const I = g.ints;
    const lo = Math.max(0, from);
    const hi = Math.min(g.n - 1, to);
    for (let k = lo; k <= hi; k++) {
      const off = I[3 * k]!;
      const len = I[3 * k + 1]!;
      if (!(off >= 0 && len > 0 && off + len <= this.regionSize && (k === 0 || I[3 * k - 3]! + I[3 * k - 2]! <= off))) {
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
      let g = this.regions.get(r);
      if (this.cow.isOpen) g = this.cow.preserve(r, g);
      const n = g ? g.n : 0;
      const lastEnd = n > 0 ? g!.ints[3 * n - 3]! + g!.ints[3 * n - 2]! : 0;
      if (lastEnd > rel) throw new RangeError(`append at ${pos} overlaps or precedes the extent at ${base + g!.ints[3 * n - 3]!}`);
      // Interned only once it is known to go in (an entry nobody takes up would stay).
      if (id === undefined) { id = this.idOf(value); at0 = id < 0 ? 0 : this.codec.at(value); }
      const at = id < 0 ? 0 : at0 + (pos - offset);
      if (!g) { g = new Region(MIN_CAP); this.regions.set(r, g); }
      const I = g.ints;
      if (n > 0 && lastEnd === rel && I[3 * n - 1] === id && (id < 0 || g.at[n - 1]! + I[3 * n - 2]! === at)) {
        I[3 * n - 2]! += rEnd - pos;
      } else {
        if (n === g.cap) g.resize(2 * g.cap);
        put(g, n, rel, rEnd - pos, id, at);
        g.n++;
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
      const g = this.regions.get(r);
      if (!g) {
        pushGap(out, pos, rEnd - pos);
        pos = rEnd;
        continue;
      }
      const I = g.ints;
      for (let i = firstEndingAfter(I, g.n, pos - base); i < g.n && pos < rEnd; i++) {
        const eOff = base + I[3 * i]!;
        if (eOff >= rEnd) break;
        if (eOff > pos) {
          pushGap(out, pos, eOff - pos);
          pos = eOff;
        }
        const pEnd = Math.min(eOff + I[3 * i + 1]!, rEnd);
        out.push({ offset: pos, length: pEnd - pos, value: this.value(I[3 * i + 2]!, g.at[i]! + (pos - eOff)) });
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
      const g = this.regions.get(r)!;
      const base = r * this.regionSize;
      for (let i = 0; i < g.n; i++) {
        yield { offset: base + g.ints[3 * i]!, length: g.ints[3 * i + 1]!, value: this.value(g.ints[3 * i + 2]!, g.at[i]!) };
      }
    }
  }

  /**
   * The map as it is now, for reading a piece at a time while the map goes on changing
   * (ExtentMap.freeze): a region is copied only when it changes while the view is open, and
   * table entries the view names stay until it is closed.
   */
  freeze(): FrozenExtentMap<V> {
    const view = this.cow.open();
    const regionSize = this.regionSize;
    return {
      size: this.count,
      walk: (fn, pause, chunk) => view.walk((r, g) => {
        const base = r * regionSize;
        const I = g.ints;
        const A = g.at;
        for (let i = 0; i < g.n; i++) {
          if (fn(base + I[3 * i]!, I[3 * i + 1]!, this.value(I[3 * i + 2]!, A[i]!)) === false) return false;
        }
        return g.n;
      }, pause, chunk),
      close: view.close,
    };
  }

  clone(): PackedExtentMap<V> {
    const m = new PackedExtentMap<V>(this.codec, { regionSize: this.regionSize });
    for (const [r, g] of this.regions) m.regions.set(r, g.copy());
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
   * overlapping, within bounds, none empty, no two neighbours left joinable, the count, and
   * the source table (counts equal the extents naming each entry, one entry per source,
   * free ids named by nobody). Throws on the first violation.
   */
  verify(): void {
    const fail = (what: string): never => { throw new Error(`PackedExtentMap.verify: ${what}`); };
    let total = 0;
    const refs = new Array<number>(this.firsts.length).fill(0);
    for (const [r, g] of this.regions) {
      if (g.n === 0) fail(`region ${r} is empty but kept`);
      if (g.n > g.cap) fail(`region ${r} holds ${g.n} extents in a capacity of ${g.cap}`);
      const I = g.ints;
      for (let i = 0; i < g.n; i++) {
        const off = I[3 * i]!;
        const len = I[3 * i + 1]!;
        const id = I[3 * i + 2]!;
        if (!(off >= 0 && len > 0 && off + len <= this.regionSize)) fail(`region ${r} extent ${i} [${off}, +${len}) outside the region`);
        if (i > 0) {
          const pEnd = I[3 * i - 3]! + I[3 * i - 2]!;
          if (pEnd > off) fail(`region ${r} extents ${i - 1} and ${i} overlap or are out of order`);
          if (pEnd === off && I[3 * i - 1] === id && (id < 0 || g.at[i - 1]! + I[3 * i - 2]! === g.at[i])) fail(`region ${r} extents ${i - 1} and ${i} are joinable`);
        }
        if (id >= 0) {
          if (this.firsts[id] === undefined) fail(`region ${r} extent ${i} names free entry ${id}`);
          refs[id]!++;
        } else if (id < MIN_CONSTANT) fail(`region ${r} extent ${i} has id ${id}`);
      }
      total += g.n;
    }
    if (total !== this.count) fail(`size ${this.count}, counted ${total}`);
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

/** Index of the first extent of the region whose end is past `rel` (n if none). */
function firstEndingAfter(I: Int32Array, n: number, rel: number): number {
  let lo = 0;
  let hi = n;
  while (lo < hi) {
    const mid = (lo + hi) >>> 1;
    if (I[3 * mid]! + I[3 * mid + 1]! <= rel) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

function put(g: Region, k: number, off: number, len: number, id: number, at: number): void {
  g.ints[3 * k] = off;
  g.ints[3 * k + 1] = len;
  g.ints[3 * k + 2] = id;
  g.at[k] = at;
}

/** Offsets and lengths are whole bytes (an int32 would silently truncate a fraction). */
function checkRange(offset: number, length: number): void {
  if (!Number.isSafeInteger(offset) || !Number.isSafeInteger(length) || length < 0) throw new RangeError(`extent [${offset}, +${length}): whole numbers of bytes`);
}

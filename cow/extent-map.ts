/**
 * ExtentMap: for every byte range of a volume, what holds it. Non-overlapping extents,
 * kept in offset order; a later `set` over a range replaces whatever was there (splitting
 * the extents it cuts). Gaps are "never written".
 *
 * Layout: the address space is cut into fixed regions, each a small sorted array. An
 * update splices one region's array, so its cost is bounded by the extents in that region,
 * not by the whole map (a 1 TiB volume with millions of 4 KiB extents stays cheap), and a
 * lookup touches only the regions it covers. Extents never cross a region boundary (set
 * splits them there), which is what makes regions independent.
 *
 * Values are opaque to the map except for `slice`, which returns the value for a suffix
 * starting `delta` bytes into an extent (for a location "object K at offset O" that is
 * O + delta), and the optional `join`, which says whether a value continues another: given
 * extent A (value a, length n) and B starting where A ends, join(a, n, b) returns the value
 * of the one extent A+B (for locations: the same object, B's offset n bytes after A's) or
 * undefined. With `join`, a set merges the extent it made with such neighbours in its
 * region, so the map's size follows how fragmented the data is, not how many writes made
 * it (100 MiB written in 4 KiB requests into one object is one extent per region, not 25,600).
 * Merging never changes what any byte maps to. Values must be treated as immutable.
 *
 * This layout keeps a JS object per extent (and its value): right for the write buffer (few
 * extents, Buffer values), not for a committed map of millions of extents, whose objects V8's
 * garbage collector would mark again and again; that one is a PackedExtentMap (packed-map.ts),
 * same semantics, extents as numbers in typed arrays.
 */

export interface Extent<V> {
  offset: number;
  length: number;
  value: V;
}

/** One piece of a lookup: a value, or `undefined` for a never-written gap. */
export interface Piece<V> {
  offset: number;
  length: number;
  value: V | undefined;
}

/** Small enough that a region of 4 KiB extents splices in microseconds. */
export const REGION_SIZE = 4 * 1024 * 1024;

/** See the header: the value of A+B if B's value continues A's (A being `length` bytes long), else undefined. */
export type Join<V> = (a: V, length: number, b: V) => V | undefined;

export interface ExtentMapOptions<V> {
  join?: Join<V>;
  /** Bytes per region (tests use small ones); default REGION_SIZE. */
  regionSize?: number;
}

export class ExtentMap<V> {
  private readonly regions = new Map<number, Extent<V>[]>();
  private count = 0;
  private readonly regionSize: number;
  private readonly join: Join<V> | undefined;

  constructor(private readonly slice: (value: V, delta: number) => V, options: ExtentMapOptions<V> = {}) {
    this.regionSize = options.regionSize ?? REGION_SIZE;
    this.join = options.join;
  }

  get size(): number { return this.count; }

  /** Make [offset, offset+length) hold `value` (the value describes the range's first byte). */
  set(offset: number, length: number, value: V): void {
    let pos = offset;
    const end = offset + length;
    while (pos < end) {
      const r = Math.floor(pos / this.regionSize);
      const rEnd = Math.min((r + 1) * this.regionSize, end);
      this.setInRegion(r, pos, rEnd - pos, pos === offset ? value : this.slice(value, pos - offset));
      pos = rEnd;
    }
  }

  /** Forget [offset, offset+length) (back to never-written). */
  delete(offset: number, length: number): void {
    let pos = offset;
    const end = offset + length;
    while (pos < end) {
      const r = Math.floor(pos / this.regionSize);
      const rEnd = Math.min((r + 1) * this.regionSize, end);
      this.setInRegion(r, pos, rEnd - pos, undefined);
      pos = rEnd;
    }
  }

  private setInRegion(r: number, offset: number, length: number, value: V | undefined): void {
    let arr = this.regions.get(r);
    if (this.cow.isOpen) arr = this.cow.preserve(r, arr);
    if (!arr) {
      if (value === undefined) return;
      arr = [];
      this.regions.set(r, arr);
    }
    const end = offset + length;
    // First extent whose end is past `offset`.
    let lo = 0;
    let hi = arr.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      const e = arr[mid]!;
      if (e.offset + e.length <= offset) lo = mid + 1;
      else hi = mid;
    }
    const first = lo;
    const replacement: Extent<V>[] = [];
    let i = first;
    for (; i < arr.length; i++) {
      const e = arr[i]!;
      if (e.offset >= end) break;
      if (e.offset < offset) replacement.push({ offset: e.offset, length: offset - e.offset, value: e.value });
      const eEnd = e.offset + e.length;
      if (eEnd > end) replacement.push({ offset: end, length: eEnd - end, value: this.slice(e.value, end - e.offset) });
    }
    if (value !== undefined) {
      // Keep order: a left remainder (if any) comes first, then the new extent, then a right remainder.
      const at = replacement.length > 0 && replacement[0]!.offset < offset ? 1 : 0;
      replacement.splice(at, 0, { offset, length, value });
    }
    const removed = i - first;
    arr.splice(first, removed, ...replacement);
    this.count += replacement.length - removed;
    if (arr.length === 0) { this.regions.delete(r); return; }
    if (value !== undefined && this.join) {
      // The new extent sits at first + (a left remainder ? 1 : 0). Merge it with the
      // neighbour after, then the one before (new objects: extents handed out stay as they were).
      const at = first + (replacement.length > 0 && replacement[0]!.offset < offset ? 1 : 0);
      for (const k of [at, at - 1]) {
        const a = arr[k];
        const b = arr[k + 1];
        if (!a || !b || a.offset + a.length !== b.offset) continue;
        const joined = this.join(a.value, a.length, b.value);
        if (joined === undefined) continue;
        arr.splice(k, 2, { offset: a.offset, length: a.length + b.length, value: joined });
        this.count--;
      }
    }
  }

  /** The pieces covering [offset, offset+length) in order, gaps included (value undefined). */
  lookup(offset: number, length: number): Piece<V>[] {
    const out: Piece<V>[] = [];
    let pos = offset;
    const end = offset + length;
    while (pos < end) {
      const r = Math.floor(pos / this.regionSize);
      const rEnd = Math.min((r + 1) * this.regionSize, end);
      const arr = this.regions.get(r);
      if (!arr) {
        pushGap(out, pos, rEnd - pos);
        pos = rEnd;
        continue;
      }
      let lo = 0;
      let hi = arr.length;
      while (lo < hi) {
        const mid = (lo + hi) >>> 1;
        const e = arr[mid]!;
        if (e.offset + e.length <= pos) lo = mid + 1;
        else hi = mid;
      }
      for (let i = lo; i < arr.length && pos < rEnd; i++) {
        const e = arr[i]!;
        if (e.offset >= rEnd) break;
        if (e.offset > pos) {
          pushGap(out, pos, e.offset - pos);
          pos = e.offset;
        }
        const pEnd = Math.min(e.offset + e.length, rEnd);
        out.push({ offset: pos, length: pEnd - pos, value: pos === e.offset ? e.value : this.slice(e.value, pos - e.offset) });
        pos = pEnd;
      }
      if (pos < rEnd) {
        pushGap(out, pos, rEnd - pos);
        pos = rEnd;
      }
    }
    return out;
  }

  // ---------------------------------------------------------------- frozen views

  /**
   * Copy-on-write views (see RegionViews): an array is copied before it changes while a view
   * keeps it. Extents are never changed in place (a set makes new ones), so copying the array
   * is enough.
   */
  private readonly cow = new RegionViews<Extent<V>[]>(this.regions, (arr) => arr.slice());

  /**
   * The map as it is now, for reading a piece at a time while the map goes on changing
   * (a checkpoint of millions of extents, written without holding the event loop). Costs
   * nothing until a region changes; then that region is copied once per open view. Close it
   * when done (a view left open makes every changed region a copy).
   */
  freeze(): FrozenExtentMap<V> {
    const view = this.cow.open();
    return {
      size: this.count,
      walk: (fn, pause, chunk, due) => view.walk((_r, arr) => {
        for (const e of arr) if (fn(e.offset, e.length, e.value) === false) return false;
        return arr.length;
      }, pause, chunk, due),
      close: view.close,
    };
  }

  /**
   * Add an extent after every extent already in its regions (building a map from a sorted
   * source, like a checkpoint, without a search per extent). Throws if it overlaps or comes
   * before what is there. Joins with the extent before it like set.
   */
  append(offset: number, length: number, value: V): void {
    let pos = offset;
    const end = offset + length;
    while (pos < end) {
      const r = Math.floor(pos / this.regionSize);
      const rEnd = Math.min((r + 1) * this.regionSize, end);
      let arr = this.regions.get(r);
      if (this.cow.isOpen) arr = this.cow.preserve(r, arr);
      if (!arr) { arr = []; this.regions.set(r, arr); }
      const v = pos === offset ? value : this.slice(value, pos - offset);
      const last = arr[arr.length - 1];
      if (last && last.offset + last.length > pos) throw new RangeError(`append at ${pos} overlaps or precedes the extent at ${last.offset}`);
      const joined = last && last.offset + last.length === pos && this.join ? this.join(last.value, last.length, v) : undefined;
      if (joined !== undefined) arr[arr.length - 1] = { offset: last!.offset, length: last!.length + rEnd - pos, value: joined };
      else { arr.push({ offset: pos, length: rEnd - pos, value: v }); this.count++; }
      pos = rEnd;
    }
  }

  /** Every extent in offset order. */
  *entries(): IterableIterator<Extent<V>> {
    const keys = [...this.regions.keys()].sort((a, b) => a - b);
    for (const k of keys) yield* this.regions.get(k)!;
  }

  isEmpty(): boolean { return this.count === 0; }

  clone(): ExtentMap<V> {
    const m = new ExtentMap<V>(this.slice, { regionSize: this.regionSize, ...(this.join ? { join: this.join } : {}) });
    for (const [k, arr] of this.regions) m.regions.set(k, arr.map((e) => ({ ...e })));
    m.count = this.count;
    return m;
  }
}

/** freeze() orders region numbers in buckets of this many (see RegionViews.open). */
const REGIONS_PER_BUCKET = 4096;

/** A map as it was when frozen. */
export interface FrozenExtentMap<V> {
  /** Extents at freeze time. */
  readonly size: number;
  /**
   * Call `fn` for every extent at freeze time in offset order, awaiting `pause` after about
   * every `chunk` extents or region numbers, or earlier once `due` says the chunk has taken
   * long enough (asked after each region, and every 256 region numbers); `fn` returning
   * false ends the walk. Only while the view is open (a packed map may reuse what it names
   * once it is closed).
   */
  walk(fn: (offset: number, length: number, value: V) => void | false, pause: () => Promise<void>, chunk: number, due?: () => boolean): Promise<void>;
  /** Stop keeping this view (the map stops copying regions for it). */
  close(): void;
}

/** Region number -> region, as RegionViews uses it: a Map, or PackedExtentMap's RegionTable. */
export interface RegionIndex<R> {
  get(r: number): R | undefined;
  set(r: number, g: R): unknown;
  keys(): IterableIterator<number>;
}

/**
 * Frozen views of a map of regions (region number -> region R), for ExtentMap (R: an array
 * of extent objects) and PackedExtentMap (R: a packed region). A map calls preserve(r)
 * before it changes region r in any way while a view is open: each open view that has not
 * saved r yet keeps the region as it is (its R, or undefined if it does not exist yet), and
 * the map goes on with a copy of an R a view keeps. So a view costs nothing until a region
 * changes, and then that region is copied once (for all views that share it).
 */
export class RegionViews<R> {
  private readonly views: { saved: Map<number, R | undefined> }[] = [];
  /** How many open views keep each region they saved (only with `drop`). */
  private readonly pins = new Map<R, number>();

  /**
   * `copy`: a copy of a region (the map goes on with it). `onAllClosed`: called when the last
   * open view closes (a packed map then frees what only views named). `drop`: called with a
   * region the map no longer uses once no open view keeps it (a packed map frees its block;
   * without it, the GC takes arrays nobody references).
   */
  constructor(private readonly regions: RegionIndex<R>, private readonly copy: (r: R) => R, private readonly onAllClosed?: () => void, private readonly drop?: (r: R) => void) {}

  get isOpen(): boolean { return this.views.length > 0; }

  /** Before region r (now `g`) changes: the region the map should change (a copy if a view keeps `g`). */
  preserve(r: number, g: R | undefined): R | undefined {
    let kept = false;
    for (const v of this.views) {
      if (!v.saved.has(r)) {
        v.saved.set(r, g);
        if (g !== undefined && this.drop) this.pins.set(g, (this.pins.get(g) ?? 0) + 1);
      }
      if (g !== undefined && v.saved.get(r) === g) kept = true;
    }
    if (!kept || g === undefined) return g;
    const c = this.copy(g);
    this.regions.set(r, c);
    return c;
  }

  /**
   * A view of the regions as they are now: `walk` visits them in region order (`visit`
   * returns the work it did, in extents, or false to stop), awaiting `pause` as
   * FrozenExtentMap.walk says; `close` ends the view.
   */
  open(): { walk: (visit: (r: number, g: R) => number | false, pause: () => Promise<void>, chunk: number, due?: () => boolean) => Promise<void>; close: () => void } {
    const view = { saved: new Map<number, R | undefined>() };
    this.views.push(view);
    const regions = this.regions;
    let closed = false;
    const close = (): void => {
      if (closed) return;
      closed = true;
      const i = this.views.indexOf(view);
      if (i >= 0) this.views.splice(i, 1);
      // A region a view saved is one the map stopped using then (it went on with a copy).
      if (this.drop) {
        for (const g of view.saved.values()) {
          if (g === undefined) continue;
          const left = this.pins.get(g)! - 1;
          if (left > 0) { this.pins.set(g, left); continue; }
          this.pins.delete(g);
          this.drop(g);
        }
      }
      if (this.views.length === 0) this.onAllClosed?.();
    };
    // A region is in the view if it was in the map at freeze time: saved (changed since) with
    // its region, or not saved and still in the map (unchanged since).
    const at = (r: number): R | undefined => (view.saved.has(r) ? view.saved.get(r) : regions.get(r));
    const walk = async (visit: (r: number, g: R) => number | false, pause: () => Promise<void>, chunk: number, due?: () => boolean): Promise<void> => {
      // Region numbers in order without one big sort (262,144 regions in a 1 TiB volume took
      // tens of ms to sort): bucketed by their high part, each bucket sorted when its turn
      // comes. Collected a chunk at a time while the map may change: every region that existed
      // at freeze time is still in the map or saved, so the two key sets together cover it;
      // duplicates and regions made since are dropped when a bucket is read.
      const buckets = new Map<number, number[]>();
      const add = (r: number): void => {
        const b = Math.floor(r / REGIONS_PER_BUCKET);
        const list = buckets.get(b);
        if (list) list.push(r); else buckets.set(b, [r]);
      };
      let n = 0;
      for (const r of regions.keys()) {
        add(r);
        if (++n >= chunk || ((n & 255) === 0 && due?.())) { n = 0; await pause(); }
      }
      for (const r of view.saved.keys()) add(r);
      const order = [...buckets.keys()].sort((a, b) => a - b);
      let work = 0;
      for (const b of order) {
        const list = buckets.get(b)!.sort((x, y) => x - y);
        for (let i = 0; i < list.length; i++) {
          if (i > 0 && list[i] === list[i - 1]) continue;
          if (closed) throw new Error('a frozen view was walked after it was closed');
          const g = at(list[i]!);
          if (g === undefined) continue;
          const w = visit(list[i]!, g);
          if (w === false) return;
          work += w;
          if (work >= chunk || (due !== undefined && work > 0 && due())) { work = 0; await pause(); }
        }
      }
    };
    return { walk, close };
  }
}

/** Add a gap to a lookup's pieces (merged with a gap just before it). */
export function pushGap<V>(out: Piece<V>[], offset: number, length: number): void {
  const last = out[out.length - 1];
  if (last && last.value === undefined && last.offset + last.length === offset) last.length += length;
  else out.push({ offset, length, value: undefined });
}

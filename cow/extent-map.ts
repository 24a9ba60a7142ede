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
 * O + delta). Values must be treated as immutable.
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

export class ExtentMap<V> {
  private readonly regions = new Map<number, Extent<V>[]>();
  private count = 0;

  constructor(private readonly slice: (value: V, delta: number) => V, private readonly regionSize = REGION_SIZE) {}

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
    if (arr.length === 0) this.regions.delete(r);
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

  /** Every extent in offset order. */
  *entries(): IterableIterator<Extent<V>> {
    const keys = [...this.regions.keys()].sort((a, b) => a - b);
    for (const k of keys) yield* this.regions.get(k)!;
  }

  isEmpty(): boolean { return this.count === 0; }

  clone(): ExtentMap<V> {
    const m = new ExtentMap<V>(this.slice, this.regionSize);
    for (const [k, arr] of this.regions) m.regions.set(k, arr.map((e) => ({ ...e })));
    m.count = this.count;
    return m;
  }
}

function pushGap<V>(out: Piece<V>[], offset: number, length: number): void {
  const last = out[out.length - 1];
  if (last && last.value === undefined && last.offset + last.length === offset) last.length += length;
  else out.push({ offset, length, value: undefined });
}

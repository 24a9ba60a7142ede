/**
 * Comparing and accounting maps, from the maps alone (no data is read).
 *
 * A mapped extent is (volume offset, length, object key or null for zeroes, object
 * offset). Two volumes that share history map shared bytes to the very same object bytes,
 * so "same key and same object offset" means "same data"; anything else is reported as
 * different (it may still hold equal bytes by coincidence: the diff is conservative).
 */

export interface MappedExtent {
  offset: number;
  length: number;
  key: string | null;
  off: number;
  /**
   * Stored bytes per logical byte of its object (a framed object's stored size over its
   * logical size: compression; 1 when absent: raw objects store what they hold).
   */
  ratio?: number;
}

export interface Range { offset: number; length: number }

/** Byte ranges where two maps (sorted, non-overlapping; gaps = never written = zeroes) differ. */
export function diffMaps(a: Iterable<MappedExtent>, b: Iterable<MappedExtent>): Range[] {
  const out: Range[] = [];
  const push = (offset: number, length: number): void => {
    const last = out[out.length - 1];
    if (last && last.offset + last.length === offset) last.length += length;
    else out.push({ offset, length });
  };
  const ia = a[Symbol.iterator]();
  const ib = b[Symbol.iterator]();
  let ea = next(ia);
  let eb = next(ib);
  // Walk both lists by boundaries; a position covered by neither is zero in both.
  let pos = 0;
  for (;;) {
    while (ea && ea.offset + ea.length <= pos) ea = next(ia);
    while (eb && eb.offset + eb.length <= pos) eb = next(ib);
    if (!ea && !eb) break;
    const starts = [ea ? Math.max(ea.offset, pos) : Infinity, eb ? Math.max(eb.offset, pos) : Infinity];
    const start = Math.min(...starts);
    if (start > pos) pos = start;
    const inA = ea !== undefined && ea.offset <= pos;
    const inB = eb !== undefined && eb.offset <= pos;
    // The next boundary after pos.
    const ends: number[] = [];
    if (ea) ends.push(inA ? ea.offset + ea.length : ea.offset);
    if (eb) ends.push(inB ? eb.offset + eb.length : eb.offset);
    const end = Math.min(...ends.filter((e) => e > pos));
    const va = inA ? describe(ea!, pos) : null;
    const vb = inB ? describe(eb!, pos) : null;
    if (!sameSource(va, vb)) push(pos, end - pos);
    pos = end;
  }
  return out;
}

function next(it: Iterator<MappedExtent>): MappedExtent | undefined {
  const r = it.next();
  return r.done ? undefined : r.value;
}

/** What holds byte `pos`: null (zero) or key@offset. */
function describe(e: MappedExtent, pos: number): { key: string; off: number } | null {
  return e.key === null ? null : { key: e.key, off: e.off + (pos - e.offset) };
}

function sameSource(a: { key: string; off: number } | null, b: { key: string; off: number } | null): boolean {
  if (a === null || b === null) return a === b;
  return a.key === b.key && a.off === b.off;
}

/**
 * Logical bytes (what the guest wrote, as the map names it), and the same in stored bytes:
 * each extent's share of its object's stored size (compression makes these smaller; exact for
 * raw objects, and for framed ones in proportion to their logical bytes: frames compress
 * unevenly, so a part of an object is attributed its object's average).
 */
export interface Accounting {
  writtenBytes: number;
  exclusiveBytes: number;
  sharedBytes: number;
  writtenStoredBytes: number;
  exclusiveStoredBytes: number;
  sharedStoredBytes: number;
}

/**
 * For each map, the data bytes it maps, how many of them no other map references (the
 * space that dropping it would give back) and how many it shares with relatives.
 */
export function accountMaps(maps: Map<string, Iterable<MappedExtent>>): Map<string, Accounting> {
  // Per object: the byte intervals each map references.
  const byObject = new Map<string, { start: number; end: number; owner: string }[]>();
  const ratios = new Map<string, number>();
  const out = new Map<string, Accounting>();
  for (const [name, extents] of maps) {
    const acc: Accounting = { writtenBytes: 0, exclusiveBytes: 0, sharedBytes: 0, writtenStoredBytes: 0, exclusiveStoredBytes: 0, sharedStoredBytes: 0 };
    out.set(name, acc);
    for (const e of extents) {
      if (e.key === null) continue;
      acc.writtenBytes += e.length;
      acc.writtenStoredBytes += e.length * (e.ratio ?? 1);
      ratios.set(e.key, e.ratio ?? 1);
      let list = byObject.get(e.key);
      if (!list) { list = []; byObject.set(e.key, list); }
      list.push({ start: e.off, end: e.off + e.length, owner: name });
    }
  }
  for (const [key, list] of byObject) {
    const ratio = ratios.get(key)!;
    // Sweep the interval boundaries; between two boundaries the set of owners is fixed.
    const points: { at: number; owner: string; delta: 1 | -1 }[] = [];
    for (const iv of list) { points.push({ at: iv.start, owner: iv.owner, delta: 1 }, { at: iv.end, owner: iv.owner, delta: -1 }); }
    points.sort((x, y) => x.at - y.at || x.delta - y.delta);
    const active = new Map<string, number>();
    let prev = 0;
    for (const p of points) {
      if (p.at > prev && active.size > 0) {
        const len = p.at - prev;
        const owners = [...active.keys()];
        for (const o of owners) {
          const acc = out.get(o)!;
          // A map that references the same object bytes twice still counts them once per reference.
          const refs = active.get(o)!;
          if (owners.length === 1) { acc.exclusiveBytes += len * refs; acc.exclusiveStoredBytes += len * refs * ratio; } else { acc.sharedBytes += len * refs; acc.sharedStoredBytes += len * refs * ratio; }
        }
      }
      const n = (active.get(p.owner) ?? 0) + p.delta;
      if (n === 0) active.delete(p.owner); else active.set(p.owner, n);
      prev = p.at;
    }
  }
  for (const acc of out.values()) {
    acc.writtenStoredBytes = Math.round(acc.writtenStoredBytes);
    acc.exclusiveStoredBytes = Math.round(acc.exclusiveStoredBytes);
    acc.sharedStoredBytes = Math.round(acc.sharedStoredBytes);
  }
  return out;
}

/**
 * What one GC run leaves for the next, so that a record nothing changed costs nothing: per
 * record, what its recovery read (its inputs) and the keys it put in R (its contribution).
 * See "Reusing a record's contribution" in gc.ts for why reusing one is safe; this file only
 * stores, loads and compares.
 *
 * Stored as one object, `gc/state`, a plain put (a cache: any run may replace it, and a run
 * that cannot read it computes everything). Text, one JSON value per line, so that neither
 * writing nor reading it holds the event loop for the whole store:
 *
 *   {"format":"baton-gc-state","v":1,"keys":N,"records":M}    header
 *   ["vol/…","vol/…",…]                                          key table, up to 1000 a line
 *   {"name":…,"etag":…,"record":{…},"lists":[…],"metas":[…],"refs":[…]}   one line per record
 *
 * Keys in `lists` and `refs` are numbers into the key table: forks share their parent's
 * objects, and a key named by a hundred forks is stored once.
 */

import { CorruptError } from '../errors.js';
import { compareKeys } from '../store/memory.js';
import type { ObjectInfo } from '../store/object-store.js';
import { decodeVolumeRecord, type VolumeRecord } from './format.js';

export const GC_STATE_KEY = 'gc/state';
/**
 * Bump when what recovery (Volume.open) reads, or what a record contributes to R, changes:
 * a state written by other code is then ignored, never trusted.
 */
export const GC_STATE_VERSION = 1;

/** One listing a recovery made: prefix, StartAfter, the end bound it asked for, and every key it got with its etag. */
export interface ListInput {
  prefix: string;
  after: string | null;
  end: string | null;
  keys: [key: string, etag: string][];
}

/** A record's contribution to R and what it was computed from. */
export interface Contribution {
  /** The record's name and the etag of `volumes/<name>` it was read from. */
  name: string;
  etag: string;
  record: VolumeRecord;
  /** The listings its recovery made (every object it read is in one of them, or a meta). */
  lists: ListInput[];
  /** The metas read (by recovery or the ancestry walk), and whether each was there. */
  metas: [key: string, present: boolean][];
  /** The keys in R because of this record. */
  refs: string[];
}

/** The `vol/` listing of a run, for comparing a record's inputs against. */
export class ListingIndex {
  private readonly sorted: ObjectInfo[];
  private readonly byKey = new Map<string, ObjectInfo>();

  constructor(objects: readonly ObjectInfo[]) {
    // A store lists in key order; sorting again costs little and the comparison needs it.
    this.sorted = [...objects].sort((a, b) => compareKeys(a.key, b.key));
    for (const o of this.sorted) this.byKey.set(o.key, o);
  }

  has(key: string): boolean { return this.byKey.has(key); }

  /** The object as this listing shows it (undefined: not listed). */
  info(key: string): ObjectInfo | undefined { return this.byKey.get(key); }

  /** What a listing of `prefix` after `after` (exclusive) up to `end` (inclusive) returned, in key order. */
  *range(prefix: string, after: string | null, end: string | null): Generator<ObjectInfo> {
    const from = after !== null && compareKeys(after, prefix) > 0 ? after : prefix;
    let lo = 0;
    let hi = this.sorted.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (compareKeys(this.sorted[mid]!.key, from) < 0) lo = mid + 1; else hi = mid;
    }
    for (let i = lo; i < this.sorted.length; i++) {
      const o = this.sorted[i]!;
      if (after !== null && o.key === after) continue;
      if (!o.key.startsWith(prefix) || (end !== null && compareKeys(o.key, end) > 0)) return;
      yield o;
    }
  }

  /**
   * Does this listing hold exactly what `l` got: the same keys under its prefix, after its
   * StartAfter and up to its end, with the same etags? (An etag missing here never matches.)
   */
  sameAs(l: ListInput): boolean {
    let n = 0;
    for (const o of this.range(l.prefix, l.after, l.end)) {
      const want = l.keys[n];
      if (want === undefined || want[0] !== o.key || o.etag === undefined || want[1] !== o.etag) return false;
      n++;
    }
    return n === l.keys.length;
  }

  /** Every input of `c` is as this listing shows it now. */
  unchanged(c: Contribution): boolean {
    for (const [key, present] of c.metas) if (this.has(key) !== present) return false;
    for (const l of c.lists) if (!this.sameAs(l)) return false;
    return true;
  }
}

interface EncodedRecord {
  name: string;
  etag: string;
  record: VolumeRecord;
  lists: [string, string | null, string | null, [number, string][]][];
  metas: [string, boolean][];
  refs: number[];
}

/** The state object's body, built a few hundred records at a time (`pause` between). */
export async function encodeGcState(contributions: readonly Contribution[], pause: () => Promise<void>): Promise<Buffer> {
  const table = new Map<string, number>();
  const idx = (k: string): number => {
    let i = table.get(k);
    if (i === undefined) { i = table.size; table.set(k, i); }
    return i;
  };
  const lines: string[] = [];
  for (let n = 0; n < contributions.length; n++) {
    const c = contributions[n]!;
    const e: EncodedRecord = {
      name: c.name, etag: c.etag, record: c.record,
      lists: c.lists.map((l) => [l.prefix, l.after, l.end, l.keys.map(([k, etag]) => [idx(k), etag])]),
      metas: c.metas, refs: c.refs.map(idx),
    };
    lines.push(JSON.stringify(e));
    if (n % 256 === 255) await pause();
  }
  const keys = [...table.keys()];
  const head = [JSON.stringify({ format: 'baton-gc-state', v: GC_STATE_VERSION, keys: keys.length, records: contributions.length })];
  for (let i = 0; i < keys.length; i += 1000) {
    head.push(JSON.stringify(keys.slice(i, i + 1000)));
    if (i % 64_000 === 63_000) await pause();
  }
  return Buffer.from(`${head.join('\n')}\n${lines.join('\n')}\n`, 'utf8');
}

/**
 * The contributions a state holds, by record name; null if it was written by another version.
 * Anything malformed is CorruptError (the caller then computes everything).
 */
export async function decodeGcState(body: Buffer, pause: () => Promise<void>): Promise<Map<string, Contribution> | null> {
  const text = body.toString('utf8');
  let pos = 0;
  const line = (): string => {
    const nl = text.indexOf('\n', pos);
    if (nl < 0) throw new CorruptError(`${GC_STATE_KEY}: truncated`);
    const s = text.slice(pos, nl);
    pos = nl + 1;
    return s;
  };
  const parse = (s: string): unknown => {
    try { return JSON.parse(s); } catch { throw new CorruptError(`${GC_STATE_KEY}: a line is not JSON`); }
  };
  const header = parse(line()) as { format?: unknown; v?: unknown; keys?: unknown; records?: unknown };
  if (header.format !== 'baton-gc-state') throw new CorruptError(`${GC_STATE_KEY}: not a GC state`);
  if (header.v !== GC_STATE_VERSION) return null;
  if (!Number.isSafeInteger(header.keys) || !Number.isSafeInteger(header.records)) throw new CorruptError(`${GC_STATE_KEY}: bad header`);
  const nKeys = header.keys as number;
  const keys: string[] = [];
  while (keys.length < nKeys) {
    const chunk = parse(line());
    if (!Array.isArray(chunk) || chunk.length === 0 || !chunk.every((k) => typeof k === 'string')) throw new CorruptError(`${GC_STATE_KEY}: bad key table`);
    keys.push(...(chunk as string[]));
    if (keys.length % 64_000 === 0) await pause();
  }
  if (keys.length !== nKeys) throw new CorruptError(`${GC_STATE_KEY}: key table of the wrong length`);
  const key = (i: unknown): string => {
    if (typeof i !== 'number' || !Number.isInteger(i) || i < 0 || i >= keys.length) throw new CorruptError(`${GC_STATE_KEY}: key index out of range`);
    return keys[i]!;
  };
  const str = (s: unknown): string => {
    if (typeof s !== 'string') throw new CorruptError(`${GC_STATE_KEY}: expected a string`);
    return s;
  };
  const strOrNull = (s: unknown): string | null => (s === null ? null : str(s));
  const out = new Map<string, Contribution>();
  for (let n = 0; n < (header.records as number); n++) {
    const e = parse(line()) as Partial<EncodedRecord>;
    if (!Array.isArray(e.lists) || !Array.isArray(e.metas) || !Array.isArray(e.refs)) throw new CorruptError(`${GC_STATE_KEY}: bad record entry`);
    const c: Contribution = {
      name: str(e.name), etag: str(e.etag),
      record: decodeVolumeRecord(Buffer.from(JSON.stringify(e.record ?? null)), GC_STATE_KEY),
      lists: e.lists.map((l: unknown) => {
        if (!Array.isArray(l) || l.length !== 4 || !Array.isArray(l[3])) throw new CorruptError(`${GC_STATE_KEY}: bad listing entry`);
        return {
          prefix: str(l[0]), after: strOrNull(l[1]), end: strOrNull(l[2]),
          keys: (l[3] as unknown[]).map((p): [string, string] => {
            if (!Array.isArray(p) || p.length !== 2) throw new CorruptError(`${GC_STATE_KEY}: bad listed key`);
            return [key(p[0]), str(p[1])];
          }),
        };
      }),
      metas: e.metas.map((m: unknown): [string, boolean] => {
        if (!Array.isArray(m) || m.length !== 2 || typeof m[1] !== 'boolean') throw new CorruptError(`${GC_STATE_KEY}: bad meta entry`);
        return [str(m[0]), m[1]];
      }),
      refs: e.refs.map(key),
    };
    out.set(c.name, c);
    if (n % 256 === 255) await pause();
  }
  return out;
}

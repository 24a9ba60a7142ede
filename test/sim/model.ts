/**
 * The model of what was written and acknowledged, and the checks every read is held to.
 *
 * Contents. Volumes are read and written in 4 KiB blocks. Every write has a global id `wid`;
 * block `b` of write `wid` holds a header (magic, wid, b) and a pattern derived from both, so
 * any full block read says exactly which write it comes from (or that it is zeroes, or
 * garbage, or misplaced). A partial block is matched against every version that block ever
 * had in the volume's lineage.
 *
 * Versions. Per volume and block, the writes that touched it, in issue order (a trim or zero
 * is a version whose content is zeroes). Block index -1 stands for the volume's base: zeroes
 * for a volume created empty, its source's content at the fork point for a fork or snapshot.
 * A volume is written by sessions (a host's takeover under a lease token, until it closes or
 * the next session's takeover); a session ends when a later session's takeover resolved.
 *
 * The rules (a read of the committed state: a view, a fresh open, a fork's base, the part of
 * a writer's read that it did not write itself). Such a read sees the log as of some instant
 * in its window [lo, hi] (lo: when its map was loaded, at most M/2 before the read for a
 * view of a live volume; hi: when the read returned). The log only grows and every version
 * that lands lands before its session ended, so for the value x read at block b:
 * - x was written at b (in this volume, or in its lineage for the base), before hi;
 * - x is not a write its session issued after the session ended, or after its holder's lease
 *   ran out (a stale holder never makes anything visible);
 * - (floor) no version newer than x is known committed before lo: acknowledged by a FLUSH or
 *   FUA before lo, or seen by another read that returned before lo, or seen at all if its
 *   session ended before lo;
 * - (never committed) no earlier read whose window began after x's session ended saw a
 *   version older than x (then x never landed, and can never be seen);
 * - a fork's or snapshot's base is one fixed map: every read of its base at b sees the same
 *   x, and that x obeys these rules as a read of the source in the fork's window.
 * A writer's read of its own volume sees its own latest completed write at b (or a later
 * one in flight), or, where its session wrote nothing yet, its base: the committed state when
 * its takeover landed (a read with the takeover's window).
 * Violations name the rule, the block, and what was read.
 */

import { endianness } from 'node:os';
import { Sim } from './world.js';

export const BLOCK = 4096;
const MAGIC = 0x5349_4d42; // "SIMB"
const LE = endianness() === 'LE';

/** The 32-bit word at word `i` of block `b` of write `wid` (i >= 4). */
function word(wid: number, b: number, i: number): number {
  let h = Math.imul(wid ^ 0x85ebca6b, 0xc2b2ae35) ^ Math.imul(b + 1, 0x27d4eb2f) ^ Math.imul(i & 15, 0x165667b1);
  h ^= h >>> 15;
  h = Math.imul(h, 0x2c1b3c6d);
  return (h ^ (h >>> 12)) >>> 0;
}

/** Block `b` of write `wid` into `out` at `at` (BLOCK bytes). */
export function fillBlock(out: Buffer, at: number, wid: number, b: number): void {
  if (LE && (out.byteOffset + at) % 4 === 0) {
    // The same words, through a Uint32Array (a little-endian host): the hot path of every write and check.
    const w = new Uint32Array(out.buffer, out.byteOffset + at, BLOCK / 4);
    w[0] = MAGIC; w[1] = wid; w[2] = b; w[3] = word(wid, b, 3);
    for (let i = 4; i < BLOCK / 4; i++) w[i] = (word(wid, b, i) ^ (i >>> 4)) >>> 0;
    return;
  }
  out.writeUInt32LE(MAGIC, at);
  out.writeUInt32LE(wid, at + 4);
  out.writeUInt32LE(b, at + 8);
  out.writeUInt32LE(word(wid, b, 3), at + 12);
  // A 64-byte period (16 words), varied by the 64-byte index so a shifted piece never matches.
  for (let i = 16; i < BLOCK; i += 4) out.writeUInt32LE((word(wid, b, i >> 2) ^ (i >>> 6)) >>> 0, at + i);
}

const scratch = Buffer.alloc(BLOCK);
const ZERO = Buffer.alloc(BLOCK);

/** The content of version `wid` (0: zeroes) at block `b`, bytes [s, e). */
function content(wid: number, b: number, s: number, e: number): Buffer {
  if (wid === 0) return ZERO.subarray(s, e);
  fillBlock(scratch, 0, wid, b);
  return scratch.subarray(s, e);
}

// ------------------------------------------------------------------ model objects

export type Kind = 'volume' | 'snapshot';

export interface Version {
  wid: number;
  /** 0: zeroes (trim, zero). */
  zero: boolean;
  /** Position in its block's list. */
  idx: number;
  session: Session;
  issued: number;
  completed: number | null;
  failed: boolean;
  /** Issued when its holder's lease had already run out. */
  postLease: boolean;
}

export class Session {
  end = Infinity;
  /** Per block: the newest own version whose write completed successfully. */
  readonly lastCompleted: (Version | undefined)[];
  /** Per block: own versions in issue order. */
  constructor(readonly id: number, readonly vol: VolModel, readonly who: string, readonly token: number, readonly takeoverIssued: number, readonly takeoverResolved: number) {
    this.lastCompleted = new Array(vol.nblocks);
  }
  get label(): string { return `session ${this.id} (${this.who}, token ${this.token}) of ${this.vol.label}`; }
}

/** What is known about one version at one block: committed by `minHi`; seen by a read whose window began at `maxLo`. */
interface Evidence { minHi: number; maxLo: number }

export interface ForkPoint { source: VolModel; lo: number; hi: number }

export class VolModel {
  readonly blocks: Version[][];
  /** Per block: evidence per version idx (-1: the base). */
  readonly evidence: Map<number, Evidence>[];
  /** Per block: the base's content once seen (wid, 0 zeroes), or -1 unknown. */
  readonly basePin: Int32Array;
  readonly sessions: Session[] = [];
  removed = false;
  constructor(readonly id: string, readonly name: string, readonly kind: Kind, readonly nblocks: number, readonly fork: ForkPoint | null) {
    this.blocks = Array.from({ length: nblocks }, () => []);
    this.evidence = Array.from({ length: nblocks }, () => new Map());
    this.basePin = new Int32Array(nblocks).fill(fork ? -1 : 0);
  }
  get label(): string { return `${this.kind} ${this.name} (${this.id})`; }
  /** Every wid block `b` had anywhere in the lineage (for matching partial blocks). */
  lineageWids(b: number, out: Set<number>): void {
    for (const v of this.blocks[b]!) out.add(v.zero ? 0 : v.wid);
    if (this.fork) this.fork.source.lineageWids(b, out);
    else out.add(0);
  }
}

interface Write { vol: VolModel; first: number; n: number; versions: Version[] }

export class Violation extends Error {
  constructor(readonly check: string, message: string) { super(message); }
}

/** A read whose outcome could not be attributed to exactly one version: nothing is learned from it. */
type Option = { kind: 'own'; v: Version } | { kind: 'base'; wid: number };

export class Model {
  private nextWid = 1;
  private nextSession = 1;
  readonly writes = new Map<number, Write>();
  readonly vols = new Map<string, VolModel>();
  readonly stats = { reads: 0, blocksChecked: 0, ambiguous: 0, baseDelegations: 0, durableMarks: 0 };

  constructor(private readonly sim: Sim, private readonly fail: (v: Violation) => void) {}

  stamp(): number { return this.sim.stamp(); }

  volume(id: string, name: string, kind: Kind, nblocks: number, fork: ForkPoint | null): VolModel {
    const v = new VolModel(id, name, kind, nblocks, fork);
    this.vols.set(id, v);
    return v;
  }

  /**
   * A takeover resolved: the session begins. Takeover records land in token order (a lower
   * token finding a higher one in the log is refused: StaleTokenError), so every session
   * with a lower token ended by now, and this one already ended if a higher one began.
   */
  beginSession(vol: VolModel, who: string, token: number, issued: number): Session {
    const resolved = this.stamp();
    const s = new Session(this.nextSession++, vol, who, token, issued, resolved);
    for (const o of vol.sessions) {
      if (o.token < token) o.end = Math.min(o.end, resolved);
      else s.end = Math.min(s.end, o.takeoverResolved);
    }
    vol.sessions.push(s);
    return s;
  }

  /** A write (or trim/zero) of blocks [first, first+n) is issued by `s`. */
  issueWrite(s: Session, first: number, n: number, zero: boolean, postLease: boolean): { wid: number; data: Buffer | null } {
    const wid = this.nextWid++;
    const issued = this.stamp();
    const versions: Version[] = [];
    for (let b = first; b < first + n; b++) {
      const list = s.vol.blocks[b]!;
      const v: Version = { wid, zero, idx: list.length, session: s, issued, completed: null, failed: false, postLease };
      list.push(v);
      versions.push(v);
    }
    this.writes.set(wid, { vol: s.vol, first, n, versions });
    let data: Buffer | null = null;
    if (!zero) {
      data = Buffer.allocUnsafe(n * BLOCK);
      for (let i = 0; i < n; i++) fillBlock(data, i * BLOCK, wid, first + i);
    }
    return { wid, data };
  }

  writeDone(wid: number, ok: boolean): void {
    const w = this.writes.get(wid)!;
    const at = this.stamp();
    for (let i = 0; i < w.n; i++) {
      const v = w.versions[i]!;
      if (!ok) { v.failed = true; continue; }
      v.completed = at;
      const s = v.session;
      const b = w.first + i;
      const cur = s.lastCompleted[b];
      if (!cur || cur.idx < v.idx) s.lastCompleted[b] = v;
    }
  }

  /**
   * A FLUSH (or FUA write, or close) of session `s` issued at `issued` was acknowledged now:
   * every block's newest write completed before `issued` is committed.
   */
  durable(s: Session, issued: number, fuaWid?: number): void {
    const at = this.stamp();
    this.stats.durableMarks++;
    for (let b = 0; b < s.vol.nblocks; b++) {
      const v = s.lastCompleted[b];
      if (v && v.completed !== null && v.completed < issued) this.commitEvidence(s.vol, b, v.idx, at, -Infinity);
    }
    if (fuaWid !== undefined) {
      const w = this.writes.get(fuaWid)!;
      for (let i = 0; i < w.n; i++) this.commitEvidence(s.vol, w.first + i, w.versions[i]!.idx, at, -Infinity);
    }
  }

  private commitEvidence(vol: VolModel, b: number, idx: number, hi: number, lo: number): void {
    const m = vol.evidence[b]!;
    const e = m.get(idx);
    if (e) { e.minHi = Math.min(e.minHi, hi); e.maxLo = Math.max(e.maxLo, lo); } else m.set(idx, { minHi: hi, maxLo: lo });
  }

  /** When version idx of block b is known committed (Infinity: not known). */
  private knownBy(vol: VolModel, b: number, idx: number, e: Evidence): number {
    const v = vol.blocks[b]![idx]!;
    return Math.min(e.minHi, v.session.end);
  }

  // ------------------------------------------------------------------ reads

  /** Which versions the bytes `got` (block b, bytes [s, e)) can be, by content. */
  identify(vol: VolModel, b: number, got: Buffer, s: number, e: number): { wids: number[]; garbage: string | null } {
    if (s === 0 && e === BLOCK) {
      if (got.equals(ZERO)) return { wids: [0], garbage: null };
      const magic = got.readUInt32LE(0);
      if (magic !== MAGIC) return { wids: [], garbage: 'neither zeroes nor a block the simulator wrote' };
      const wid = got.readUInt32LE(4);
      const from = got.readUInt32LE(8);
      if (from !== b) return { wids: [], garbage: `block ${from} of write ${wid} at block ${b} (misplaced)` };
      if (!got.equals(content(wid, b, 0, BLOCK))) return { wids: [], garbage: `write ${wid}'s header over a body that is not its own` };
      return { wids: [wid], garbage: null };
    }
    const all = new Set<number>();
    vol.lineageWids(b, all);
    const wids = [...all].filter((w) => got.equals(content(w, b, s, e)));
    return { wids, garbage: wids.length ? null : `bytes [${s}, ${e}) match no version this block ever had` };
  }

  /**
   * Check a read of `buf` = volume bytes [offset, offset + buf.length) of `vol`.
   * `owner`: the session reading its own volume (null for a view / fresh open).
   */
  checkRead(vol: VolModel, owner: Session | null, offset: number, buf: Buffer, lo: number, hi: number, who: string): void {
    this.stats.reads++;
    const end = offset + buf.length;
    for (let b = Math.floor(offset / BLOCK); b * BLOCK < end; b++) {
      const s = Math.max(0, offset - b * BLOCK);
      const e = Math.min(BLOCK, end - b * BLOCK);
      const got = buf.subarray(b * BLOCK + s - offset, b * BLOCK + e - offset);
      this.stats.blocksChecked++;
      const id = this.identify(vol, b, got, s, e);
      const where = `${who} read ${vol.label} block ${b}`;
      if (id.garbage) { this.fail(new Violation('never-written', `${where}: ${id.garbage}`)); return; }
      const err = owner ? this.ownerBlock(owner, b, id.wids, lo, hi) : this.observe(vol, b, id.wids, lo, hi);
      if (err) { this.fail(new Violation(err.check, `${where}: ${err.message}`)); return; }
    }
  }

  private ownerBlock(s: Session, b: number, wids: number[], lo: number, hi: number): Violation | null {
    const vol = s.vol;
    // Its newest own write at b that completed before the read was issued.
    let last: Version | undefined;
    for (const v of vol.blocks[b]!) if (v.session === s && v.completed !== null && v.completed < lo && (!last || v.idx > last.idx)) last = v;
    const own = vol.blocks[b]!.filter((v) => v.session === s && wids.includes(v.zero ? 0 : v.wid));
    const okOwn = own.filter((v) => v.issued < hi && (!last || v.idx >= last.idx));
    if (okOwn.length > 0) return null;
    if (!last) {
      // Its base: the committed state when its takeover landed.
      const others = wids.filter((w) => w === 0 || !own.some((v) => v.wid === w));
      if (others.length > 0) {
        // The window is the takeover's resolution, not its start: the base is the state at
        // the instant the takeover landed, which includes every commit of every earlier
        // session (none can land after it), so what it lacks never landed.
        const err = this.observe(vol, b, others, s.takeoverResolved, s.takeoverResolved, s);
        if (!err) return null;
        return new Violation(err.check, `the writer's own read, of what it did not write itself: ${err.message}`);
      }
    }
    const what = wids.map((w) => (w === 0 ? 'zeroes' : `write ${w}`)).join(' or ');
    return new Violation('own-read', `the writer (${s.label}) read ${what}, not its own latest write ${last ? `(write ${last.wid})` : ''} or one in flight`);
  }

  /**
   * A read of the committed state of `vol` at block b, window [lo, hi]. Returns a violation,
   * or null (and records what it learned when the read is unambiguous).
   */
  observe(vol: VolModel, b: number, wids: number[], lo: number, hi: number, exclude?: Session, record = true): Violation | null {
    const options: Option[] = [];
    for (const v of vol.blocks[b]!) if (v.session !== exclude && wids.includes(v.zero ? 0 : v.wid)) options.push({ kind: 'own', v });
    for (const w of wids) if (w === 0 || !vol.blocks[b]!.some((v) => v.wid === w)) options.push({ kind: 'base', wid: w });
    let firstErr: Violation | null = null;
    const valid: Option[] = [];
    for (const o of options) {
      const err = o.kind === 'own' ? this.checkOwn(vol, b, o.v, lo, hi) : this.checkBase(vol, b, o.wid, lo, false);
      if (err) firstErr ??= err; else valid.push(o);
    }
    if (valid.length === 0) return firstErr ?? new Violation('never-written', `read ${wids.join('/')} which was never written here`);
    if (valid.length > 1) { this.stats.ambiguous++; return null; }
    if (!record) return null;
    const o = valid[0]!;
    if (o.kind === 'own') this.commitEvidence(vol, b, o.v.idx, hi, lo);
    else {
      this.checkBase(vol, b, o.wid, lo, true);
      this.commitEvidence(vol, b, -1, hi, lo);
    }
    return null;
  }

  private checkOwn(vol: VolModel, b: number, v: Version, lo: number, hi: number): Violation | null {
    const name = `${v.zero ? 'zeroes of' : ''} write ${v.wid} (${v.session.label})`;
    if (v.issued >= hi) return new Violation('future', `${name} was issued after the read returned`);
    if (v.issued >= v.session.end) return new Violation('stale-writer-visible', `${name} was issued after its session ended (a later takeover resolved): a stale holder's write is visible`);
    if (v.postLease) return new Violation('stale-writer-visible', `${name} was issued after its holder's lease ran out, and is visible`);
    for (const [idx, e] of vol.evidence[b]!) {
      if (idx > v.idx) {
        const k = this.knownBy(vol, b, idx, e);
        if (lo >= k) return new Violation('lost-write', `${name} is older than write ${vol.blocks[b]![idx]!.wid}, known committed at ${fmt(k)} before this read's map (${fmt(lo)}): an acknowledged or seen write went missing`);
      } else if (idx < v.idx && e.maxLo >= v.session.end) {
        return new Violation('never-committed-visible', `${name} is visible, but a read whose map was loaded at ${fmt(e.maxLo)}, after its session ended (${fmt(v.session.end)}), saw an older version: it never landed before its session ended`);
      }
    }
    return null;
  }

  /** The base of `vol` at b read as `wid`; with `commit`, pin it and tell the source (no side effect without). */
  private checkBase(vol: VolModel, b: number, wid: number, lo: number, commit: boolean): Violation | null {
    for (const [idx, e] of vol.evidence[b]!) {
      if (idx < 0) continue;
      const k = this.knownBy(vol, b, idx, e);
      if (lo >= k) return new Violation('lost-write', `the volume's base (${wid === 0 ? 'zeroes' : `write ${wid}`}) is visible, but write ${vol.blocks[b]![idx]!.wid} was known committed at ${fmt(k)}, before this read's map (${fmt(lo)})`);
    }
    if (!vol.fork) return wid === 0 ? null : new Violation('never-written', `write ${wid} at block ${b} of ${vol.label}, which was created empty and never had it there`);
    const pin = vol.basePin[b]!;
    if (pin >= 0) {
      if (pin !== wid) return new Violation('base-changed', `the base of ${vol.label} at block ${b} read as ${wid === 0 ? 'zeroes' : `write ${wid}`}, earlier as ${pin === 0 ? 'zeroes' : `write ${pin}`}: a fork point is one fixed map`);
      return null;
    }
    const f = vol.fork;
    this.stats.baseDelegations++;
    const err = this.observe(f.source, b, [wid], f.lo, f.hi, undefined, commit);
    if (err) return new Violation(err.check, `as the base of ${vol.label} (forked in ${fmt(f.lo)}..${fmt(f.hi)}): ${err.message}`);
    if (commit) vol.basePin[b] = wid;
    return null;
  }
}

/** A model stamp as virtual seconds. */
export function fmt(stamp: number): string {
  if (!Number.isFinite(stamp)) return String(stamp);
  return `${(stamp / 1e9).toFixed(3)}s`;
}

export { Sim };

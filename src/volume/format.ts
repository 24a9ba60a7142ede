/**
 * What a volume looks like in the object store. Every object is written once and never
 * modified; the only "mutation" is creating the next log position, with a create-only put.
 *
 *   volumes/<name>                     volume record (JSON): id, size. Create-only: names are unique.
 *   volumes/<name>@<snap>              snapshot record: read-only, a pointer to (volume id, log seq),
 *                                      and `of`: the id of the volume it was taken of.
 *   vol/<id>/meta                      a copy of the record under the id, so a fork can find its
 *                                      parent's ancestry even after the parent's name is removed.
 *   vol/<id>/log/<seq:20>              log record: header (JSON) + inline data. Create-only at the
 *                                      next sequence number: the commit point of a flush.
 *   vol/<id>/seg/<seq:20>-<nonce>-<n>  data segment uploaded before the log record that references it.
 *   vol/<id>/checkpoint/<seq:20>       the whole extent map as of log record <seq> (JSON).
 *
 * A flush whose data fits one segment is ONE put: the log record carries the data inline,
 * so the commit point and the data land together (one store round trip on the critical
 * path). Larger flushes upload full segments in parallel first, then the log record.
 *
 * Log record layout: "BATONLG1" | u32 BE header length | header JSON | inline data.
 * Extent sources in a header: >= 0 index into `segments`, INLINE (-1) the record's own
 * data, HOLE (-2) trimmed/zeroed that may read as a hole, ZERO (-3) zeroed and allocated.
 */

import { CorruptError } from '../errors.js';

export const LOG_MAGIC = Buffer.from('BATONLG1');
export const SRC_INLINE = -1;
export const SRC_HOLE = -2;
export const SRC_ZERO = -3;

export function seqStr(seq: number): string {
  return String(seq).padStart(20, '0');
}

export const keys = {
  volumeRecord: (name: string) => `volumes/${name}`,
  volumesPrefix: 'volumes/',
  volumePrefix: (id: string) => `vol/${id}/`,
  meta: (id: string) => `vol/${id}/meta`,
  logPrefix: (id: string) => `vol/${id}/log/`,
  log: (id: string, seq: number) => `vol/${id}/log/${seqStr(seq)}`,
  checkpointPrefix: (id: string) => `vol/${id}/checkpoint/`,
  checkpoint: (id: string, seq: number) => `vol/${id}/checkpoint/${seqStr(seq)}`,
  segment: (id: string, seq: number, nonce: string, n: number) => `vol/${id}/seg/${seqStr(seq)}-${nonce}-${n}`,
};

/** The log position a segment was uploaded for: vol/<id>/seg/<seq:20>-<nonce>-<n>. */
export function segmentSeq(key: string): number | null {
  const m = /\/seg\/(\d{20})-/.exec(key);
  return m ? Number(m[1]) : null;
}

export function seqFromKey(key: string): number {
  const s = key.slice(key.lastIndexOf('/') + 1);
  if (!/^\d{20}$/.test(s)) throw new CorruptError(`unexpected key in log: ${key}`);
  return Number(s);
}

export interface VolumeRecord {
  format: 'baton-volume-1';
  name: string;
  id: string;
  size: number;
  createdAt: string;
  /**
   * A fork or snapshot starts as its parent's map after log record `seq` of volume `id`
   * (the parent's last acknowledged flush when the fork was made). No data is copied.
   */
  parent?: { id: string; seq: number };
  /** Snapshots are read-only forever. */
  snapshot?: boolean;
  /**
   * Snapshots: the id of the volume they were taken of. A snapshot belongs to that identity,
   * not to its name prefix (a later volume may reuse the name). Absent in records made before
   * it existed: those are attributed by name.
   */
  of?: string;
}

export function encodeVolumeRecord(r: VolumeRecord): Buffer {
  return Buffer.from(JSON.stringify(r));
}

export function decodeVolumeRecord(b: Buffer, key: string): VolumeRecord {
  let r: VolumeRecord;
  try { r = JSON.parse(b.toString('utf8')) as VolumeRecord; } catch { throw new CorruptError(`${key}: volume record is not JSON`); }
  if (r.format !== 'baton-volume-1' || typeof r.id !== 'string' || !Number.isSafeInteger(r.size)) {
    throw new CorruptError(`${key}: not a baton volume record (format ${String(r.format)})`);
  }
  return r;
}

/** [offset, length, source, sourceOffset] */
export type RecordExtent = [number, number, number, number];

export interface LogHeader {
  /** 1: before records were chained (no id/prev); 2: chained. Both are read. */
  v: 1 | 2;
  kind: 'commit' | 'takeover';
  seq: number;
  volumeId: string;
  /** Fencing token of the writer (see recordCounts). */
  token: number;
  time: string;
  segments: { key: string; size: number }[];
  extents: RecordExtent[];
  inlineLength: number;
  /**
   * This record's identity: random, written once. A writer whose create-only put of this
   * position failed without an answer, or found the position taken, reads the record there
   * and compares ids: the same id means its own put landed (v2; absent in v1 records).
   */
  id?: string;
  /**
   * The id of the record at seq - 1 that this writer had applied ('' for a volume's first
   * record). Recovery accepts a record only if it follows the one before it: a record that
   * a stale writer re-created at a position garbage collection freed names the record it
   * saw there, not the one its successor names, so it can never be spliced into the log
   * (see "The log is a chain" in volume.ts).
   */
  prev?: string;
}

/**
 * The token rule, in one place: does a log record count?
 * `fence` is the highest token of a takeover record before this one (or the checkpoint's).
 * - A takeover record always counts; it raises the fence to its token.
 * - A commit counts iff its token is at least the fence: a commit below it comes from a
 *   writer that a later takeover fenced (by construction it cannot land, see
 *   Volume.takeover; this is the second line of defence).
 * Writers without a lease commit with the fence they recovered (they fence nobody, and
 * their acknowledged records must count).
 */
export function recordCounts(h: Pick<LogHeader, 'kind' | 'token'>, fence: number): boolean {
  return h.kind === 'takeover' || h.token >= fence;
}

/** The fence after a record that counted. */
export function fenceAfter(h: Pick<LogHeader, 'kind' | 'token'>, fence: number): number {
  return h.kind === 'takeover' ? Math.max(fence, h.token) : fence;
}

/**
 * The chain rule: may record `h` follow the record whose id is `lastId`? Unknown ids (v1
 * records and checkpoints, written before the chain existed) are accepted.
 */
export function followsChain(h: Pick<LogHeader, 'prev'>, lastId: string | undefined): boolean {
  return h.prev === undefined || lastId === undefined || h.prev === lastId;
}

export function encodeLogRecord(h: LogHeader, inline: Buffer[]): { body: Buffer; dataStart: number } {
  const json = Buffer.from(JSON.stringify(h));
  const dataStart = 12 + json.length;
  const body = Buffer.allocUnsafe(dataStart + h.inlineLength);
  LOG_MAGIC.copy(body, 0);
  body.writeUInt32BE(json.length, 8);
  json.copy(body, 12);
  let off = dataStart;
  for (const b of inline) { b.copy(body, off); off += b.length; }
  if (off !== body.length) throw new Error('encodeLogRecord: inline data does not match inlineLength');
  return { body, dataStart };
}

/** Bytes needed to read a header, given the first 12 bytes (magic + length). */
export function logHeaderLength(prefix: Buffer, key: string): number {
  if (prefix.length < 12 || !prefix.subarray(0, 8).equals(LOG_MAGIC)) throw new CorruptError(`${key}: not a baton log record`);
  return prefix.readUInt32BE(8);
}

export function decodeLogHeader(b: Buffer, key: string): { header: LogHeader; dataStart: number } {
  const len = logHeaderLength(b, key);
  if (b.length < 12 + len) throw new CorruptError(`${key}: truncated log header`);
  let h: LogHeader;
  try { h = JSON.parse(b.subarray(12, 12 + len).toString('utf8')) as LogHeader; } catch { throw new CorruptError(`${key}: log header is not JSON`); }
  if ((h.v !== 1 && h.v !== 2) || !Array.isArray(h.extents) || !Array.isArray(h.segments)) throw new CorruptError(`${key}: unsupported log record version`);
  if (h.v === 2 && (typeof h.id !== 'string' || typeof h.prev !== 'string')) throw new CorruptError(`${key}: v2 log record without id/prev`);
  return { header: h, dataStart: 12 + len };
}

export interface Checkpoint {
  /** 1: no lastId; 2: with lastId. */
  v: 1 | 2;
  volumeId: string;
  /** Last log record included. */
  seq: number;
  /** Highest fencing token seen in the log up to `seq`. */
  token: number;
  /** The id of log record `seq` (v2): the next record must name it as `prev`. */
  lastId?: string;
  time: string;
  objects: [string, number][];
  /** [offset, length, objectIndex | SRC_HOLE | SRC_ZERO, objectOffset] */
  extents: RecordExtent[];
}

export function decodeCheckpoint(b: Buffer, key: string): Checkpoint {
  let c: Checkpoint;
  try { c = JSON.parse(b.toString('utf8')) as Checkpoint; } catch { throw new CorruptError(`${key}: checkpoint is not JSON`); }
  if ((c.v !== 1 && c.v !== 2) || !Array.isArray(c.extents) || !Array.isArray(c.objects)) throw new CorruptError(`${key}: unsupported checkpoint version`);
  return c;
}

/**
 * M: the longest a multi-step operation may take between reading or writing the store's
 * state and landing what depends on it: a fork or snapshot (read of the fork point -> its
 * record), a create (its id record `meta` -> its name; for both, slower attempts are undone
 * and made again, catalog.ts landRecord) and a read-only view (map load -> reads through it;
 * older maps are refreshed first). Also the bound on a single store request: it lands within
 * M of being issued, or never (assumed of the store and the network, not enforced; an undone
 * attempt waits M before its name is put again, catalog.ts abandon).
 * Garbage collection relies on it: its grace period must be at least twice this (see
 * src/volume/gc.ts), and every host must use the same value. BATON_MAX_OPERATION_MS
 * lowers it for tests that exercise GC in seconds.
 */
export function maxOperationMs(): number {
  const env = process.env.BATON_MAX_OPERATION_MS;
  if (env !== undefined && env !== '') {
    const n = Number(env);
    if (Number.isSafeInteger(n) && n > 0) return n;
  }
  return 60_000;
}

/**
 * Every time bound garbage collection's safety argument (src/volume/gc.ts) relies on, in
 * one place, derived from M = maxOperationMs:
 * - a fork or snapshot lands its record within `forkBudgetMs` of reading its fork point,
 *   and a create lands its name within `forkBudgetMs` of putting its meta (slower attempts
 *   are undone and made again: catalog.ts landRecord);
 * - a store request lands within `maxOperationMs` of being issued, or never: an undone
 *   attempt waits that long before the name is put again (catalog.ts abandon), so that no
 *   late delete or put of it lands on the new record;
 * - a read-only view of a live volume never reads through a map older than
 *   `viewMaxAgeMs` (it refreshes first: volume.ts);
 * - a GC run lists the records again `fixedPointWaitMs` after its last map load, until no
 *   new record appears (gc.ts);
 * - the grace period between a mark and the delete is at least `minGraceMs`.
 * The argument needs forkBudget + fixedPointWait <= grace and viewMaxAge < grace; a create's
 * meta needs forkBudget + maxOperationMs < grace (a name put still unresolved when the budget
 * ran out lands within M of being issued, before GC can find the meta old); asserted here.
 */
export interface TimeBounds {
  maxOperationMs: number;
  forkBudgetMs: number;
  viewMaxAgeMs: number;
  fixedPointWaitMs: number;
  minGraceMs: number;
}

export function timeBounds(m: number = maxOperationMs()): TimeBounds {
  if (!(Number.isFinite(m) && m > 0)) throw new RangeError(`maxOperationMs must be a positive number of ms, not ${m}`);
  const b: TimeBounds = { maxOperationMs: m, forkBudgetMs: m / 2, viewMaxAgeMs: m / 2, fixedPointWaitMs: m / 2, minGraceMs: 2 * m };
  if (!(b.forkBudgetMs + b.fixedPointWaitMs <= b.minGraceMs && b.viewMaxAgeMs < b.minGraceMs && b.forkBudgetMs + b.maxOperationMs < b.minGraceMs)) throw new Error('GC time bounds are inconsistent');
  return b;
}

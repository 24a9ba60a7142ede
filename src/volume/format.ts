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
  v: 1;
  kind: 'commit' | 'takeover';
  seq: number;
  volumeId: string;
  /** Fencing token of the writer (0 when no lease is configured). */
  token: number;
  time: string;
  segments: { key: string; size: number }[];
  extents: RecordExtent[];
  inlineLength: number;
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
  if (h.v !== 1 || !Array.isArray(h.extents) || !Array.isArray(h.segments)) throw new CorruptError(`${key}: unsupported log record version`);
  return { header: h, dataStart: 12 + len };
}

export interface Checkpoint {
  v: 1;
  volumeId: string;
  /** Last log record included. */
  seq: number;
  /** Highest fencing token seen in the log up to `seq`. */
  token: number;
  time: string;
  objects: [string, number][];
  /** [offset, length, objectIndex | SRC_HOLE | SRC_ZERO, objectOffset] */
  extents: RecordExtent[];
}

export function decodeCheckpoint(b: Buffer, key: string): Checkpoint {
  let c: Checkpoint;
  try { c = JSON.parse(b.toString('utf8')) as Checkpoint; } catch { throw new CorruptError(`${key}: checkpoint is not JSON`); }
  if (c.v !== 1 || !Array.isArray(c.extents) || !Array.isArray(c.objects)) throw new CorruptError(`${key}: unsupported checkpoint version`);
  return c;
}

/**
 * The longest a multi-step operation may take between reading the store's state and
 * landing what depends on it: a fork (read of the fork point -> its record; slower ones
 * are undone and made again) and a read-only view (map load -> reads through it; older
 * maps are refreshed first).
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

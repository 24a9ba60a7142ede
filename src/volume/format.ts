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
 *   vol/<id>/checkpoint/<seq:20>       the whole extent map as of log record <seq>, and the writer's
 *                                      working set (binary, v4; v3 without the working set, and
 *                                      JSON in v1/v2, still read).
 *
 * A flush whose data fits one segment is ONE put: the log record carries the data inline,
 * so the commit point and the data land together (one store round trip on the critical
 * path). Larger flushes upload full segments in parallel first, then the log record.
 *
 * Log record layout: v3 (framed data, issue 16): "BATONLG3" | u32 BE header length | u32 BE
 * crc32 of the header JSON | header JSON | inline data as frames (frames.ts). An encrypted
 * volume's records are v4, v3 with the header's MAC (MAC_BYTES) between the crc and the JSON,
 * and its checkpoints v6 (CHECKPOINT_MAGIC_V6): a bucket writer cannot point its extents at
 * other authentic frames (encodeLogRecord, CheckpointSum). v1/v2 (still read,
 * and written for volumes whose record says `data.format: 'raw'`): "BATONLG1" | u32 BE header
 * length | header JSON | raw inline data.
 * Extent sources in a header: >= 0 index into `segments`, INLINE (-1) the record's own
 * data, HOLE (-2) trimmed/zeroed that may read as a hole, ZERO (-3) zeroed and allocated.
 * Offsets into data (an extent's source offset) are logical for framed objects (v3 records'
 * segments and inline data) and stored offsets for raw ones: an object is one or the other, so
 * "the same key and offset is the same data" holds for both (cow/diff.ts).
 *
 * Framed objects carry their frame index in the metadata that names them (a v3 header's
 * `segments[i].frames` and `inline.frames`, a v5 checkpoint's object table), so reads find
 * their frames without a request (docs/rfc-frames.md).
 */

import { createHmac, timingSafeEqual, type Hmac } from 'node:crypto';
import { CorruptError } from '../errors.js';
import { FrameIndex, crc32, lengthsFromString, lengthsToString } from './frames.js'; // zlib's crc32, faster where it can be

export const LOG_MAGIC = Buffer.from('BATONLG1');
export const LOG_MAGIC_V3 = Buffer.from('BATONLG3');
export const LOG_MAGIC_V4 = Buffer.from('BATONLG4');
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
  /** Attribute records of a volume id (size and expiry changes): outside vol/, so GC never lists them. */
  attrsPrefix: (id: string) => `attrs/${id}/`,
  attrs: (id: string, seq: number) => `attrs/${id}/${seqStr(seq)}`,
  logPrefix: (id: string) => `vol/${id}/log/`,
  log: (id: string, seq: number) => `vol/${id}/log/${seqStr(seq)}`,
  checkpointPrefix: (id: string) => `vol/${id}/checkpoint/`,
  checkpoint: (id: string, seq: number) => `vol/${id}/checkpoint/${seqStr(seq)}`,
  segment: (id: string, seq: number, nonce: string, n: number) => `vol/${id}/seg/${seqStr(seq)}-${nonce}-${n}`,
  /** Fork markers: an empty object per fork or snapshot of `parentId`, naming the child (FORK_MARKER_RE). */
  forksPrefix: (parentId: string) => `vol/${parentId}/forks/`,
  forkMarker: (parentId: string, childId: string, childName: string) => `vol/${parentId}/forks/${childId}/${childName}`,
  /** Put by a record's maker once the record stands for good (catalog.ts landRecord, `settles`): empty. */
  settled: (id: string) => `vol/${id}/settled`,
};

/**
 * vol/<parent-id>/forks/<child-id>/<child-name>: put by every fork and snapshot (with its meta,
 * before its name) so that a volume's descendants can be found from its id alone, without
 * reading every record (accounting: catalog.ts infoWithAccounting). Nothing reads data through
 * it: a marker wrong or missing can only make accounting look at every record (records
 * made before markers) or skip a record that is not there. GC keeps a marker as long as the
 * child's meta (gc.ts), so a removed volume's markers lead on to its descendants while any live.
 */
const FORK_MARKER_RE = /^vol\/([^/]+)\/forks\/([^/]+)\/([^/]+)$/;

export function forkMarkerOf(key: string): { parent: string; child: string; name: string } | null {
  const m = FORK_MARKER_RE.exec(key);
  return m ? { parent: m[1]!, child: m[2]!, name: m[3]! } : null;
}

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

/**
 * How a volume stores its data (issue 16). Part of the record, so fixed at creation: a fork or
 * snapshot takes its source's (with its own data key added to the keyring: keys.ts).
 * - format: 'framed' (frames with checksums, frames.ts) or 'raw' (the layout before issue 16:
 *   no frames, no checks; kept for compatibility tests and as a benchmark baseline);
 * - compression: 'lz4' or 'none' (frames that do not shrink are stored raw either way);
 * - encryption: present for an encrypted volume (keys.ts).
 * A record without `data` (made before issue 16) writes framed lz4 frames from now on.
 */
export interface DataSettings {
  format: 'framed' | 'raw';
  compression: 'lz4' | 'none';
  encryption?: EncryptionSettings;
}

/** An encrypted volume's keyring: the data key of every volume whose objects its map may name, wrapped by the master key. */
export interface EncryptionSettings {
  alg: 'aes-256-gcm';
  /** Which master key wraps the data keys (keys.ts keyId): a clear refusal when another one is given. */
  keyId: string;
  /** Volume id -> its data key wrapped by the master key (base64): this volume's own (if it writes) and its ancestors'. */
  keys: Record<string, string>;
}

export const DEFAULT_DATA: DataSettings = { format: 'framed', compression: 'lz4' };

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
  /** How its data is stored (absent: made before issue 16, see DataSettings). */
  data?: DataSettings;
  /** When it expires (ISO time): GC removes it after that unless a host serves it (docs/rfc-lifecycle.md). */
  expiresAt?: string;
  /**
   * The largest size this volume's log (and its ancestors' up to its fork point) may name
   * extents within, when larger than `size`: a volume shrunk, or forked from one. Absent: `size`.
   */
  recoverySize?: number;
  /**
   * Made by a baton that marks every fork and snapshot (keys.forkMarker): if a volume's root
   * ancestor has it, every descendant of that root has a marker (a descendant is made after its
   * root, by a baton as new or newer: mixed versions are not supported for writing).
   */
  forksMarked?: true;
  /**
   * Its maker puts keys.settled(id) once the record stands for good (catalog.ts landRecord):
   * until then a fork or snapshot may still be undone after its name landed (its source
   * went first), and a fork made of it meanwhile must not trust it (derive). Absent in
   * records made before: those are trusted as before.
   */
  settles?: true;
  /** A fork's or snapshot's source as it was read (name and id): what a fork of this one checks while this one is not settled. */
  source?: { name: string; id: string };
}

/**
 * attrs/<id>/<seq:20>: a change of a volume's size or expiry, created with a create-only put at
 * the next position. The newest record that sets a field wins over the volume record's.
 * `expiresAt: null` clears the expiry.
 */
export interface AttrsRecord {
  format: 'baton-attrs-1';
  size?: number;
  expiresAt?: string | null;
  time: string;
}

export function decodeAttrsRecord(b: Buffer, key: string): AttrsRecord {
  let r: AttrsRecord;
  try { r = JSON.parse(b.toString('utf8')) as AttrsRecord; } catch { throw new CorruptError(`${key}: attribute record is not JSON`); }
  if (r.format !== 'baton-attrs-1' || (r.size !== undefined && !Number.isSafeInteger(r.size))) throw new CorruptError(`${key}: not a baton attribute record`);
  return r;
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
  if (r.data !== undefined) checkDataSettings(r.data, key);
  return r;
}

function checkDataSettings(d: DataSettings, key: string): void {
  const bad = (why: string): never => { throw new CorruptError(`${key}: data settings: ${why}`); };
  if (typeof d !== 'object' || d === null) bad('not an object');
  if (d.format !== 'framed' && d.format !== 'raw') bad(`unknown format ${String(d.format)} (a newer baton's?)`);
  if (d.compression !== 'lz4' && d.compression !== 'none') bad(`unknown compression ${String(d.compression)}`);
  const e = d.encryption;
  if (e !== undefined) {
    if (d.format !== 'framed') bad('encryption needs framed data');
    if (e.alg !== 'aes-256-gcm' || typeof e.keyId !== 'string' || typeof e.keys !== 'object' || e.keys === null) bad('unknown encryption settings');
    for (const v of Object.values(e.keys)) if (typeof v !== 'string') bad('a wrapped key is not a string');
  }
}

/** The data settings a record stands for (DEFAULT_DATA for records made before they existed). */
export function dataSettings(r: VolumeRecord): DataSettings {
  return r.data ?? DEFAULT_DATA;
}

/** [offset, length, source, sourceOffset] */
export type RecordExtent = [number, number, number, number];

/** A segment a log record names: stored size, and for framed segments (v3) their logical size and frame index. */
export interface SegmentRef {
  key: string;
  size: number;
  /** v3: logical bytes. */
  logical?: number;
  /** v3: stored length of every frame (frames.ts lengthsToString). */
  frames?: string;
}

export interface LogHeader {
  /** 1: before records were chained (no id/prev); 2: chained; 3: chained, data framed. All are read. */
  v: 1 | 2 | 3;
  kind: 'commit' | 'takeover';
  seq: number;
  volumeId: string;
  /** Fencing token of the writer (see recordCounts). */
  token: number;
  time: string;
  segments: SegmentRef[];
  extents: RecordExtent[];
  /** Stored bytes of inline data after the header. */
  inlineLength: number;
  /** v3: logical frame size of every framed object this record names. */
  frameBytes?: number;
  /** v3 with inline data: its logical size and frame index. */
  inline?: { logical: number; frames: string };
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

/**
 * The authentication of an encrypted volume's log records and checkpoints (issue 16): an
 * HMAC-SHA256 under the writing volume's metadata key (keys.ts metaKeyOf) of a label, the
 * object's key and the bytes, so a record or checkpoint changed, made up, or moved to another
 * key or volume fails it. The crc stays beside it (rot is told apart from tampering, and readers
 * without keys, GC and `info`, still check it).
 */
export const MAC_BYTES = 32;

function metadataMac(metaKey: Buffer, label: string, objectKey: string): Hmac {
  return createHmac('sha256', metaKey).update(`baton ${label} v1\0${objectKey}\0`, 'utf8');
}

/** How a reader checks a record's or checkpoint's MAC: undefined, it does not (a reader without keys); null, the volume's records carry none (keys.ts); a key, it must. */
export type MetaKey = Buffer | null | undefined;

/**
 * A log record's bytes. With `auth` (an encrypted volume's writer), v4: the v3 layout with
 * the header's MAC between the crc and the JSON ("BATONLG4" | u32 BE header length | u32 BE
 * crc32 | 32-byte MAC | header JSON | frames). The header is still v 3: only the envelope differs.
 */
export function encodeLogRecord(h: LogHeader, inline: Buffer[], auth?: { metaKey: Buffer; objectKey: string }): { body: Buffer; dataStart: number } {
  const json = Buffer.from(JSON.stringify(h));
  const v3 = h.v === 3;
  if (auth && !v3) throw new Error('encodeLogRecord: only a v3 header is authenticated');
  const dataStart = (auth ? 16 + MAC_BYTES : v3 ? 16 : 12) + json.length;
  const body = Buffer.allocUnsafe(dataStart + h.inlineLength);
  (auth ? LOG_MAGIC_V4 : v3 ? LOG_MAGIC_V3 : LOG_MAGIC).copy(body, 0);
  body.writeUInt32BE(json.length, 8);
  if (v3) body.writeUInt32BE(crc32(json), 12);
  if (auth) metadataMac(auth.metaKey, 'log', auth.objectKey).update(json).digest().copy(body, 16);
  json.copy(body, dataStart - json.length);
  let off = dataStart;
  for (const b of inline) { b.copy(body, off); off += b.length; }
  if (off !== body.length) throw new Error('encodeLogRecord: inline data does not match inlineLength');
  return { body, dataStart };
}

/** Bytes needed to read a whole header (magic, length fields, MAC and JSON), given at least the first 16 bytes of the record (or all of it). */
export function logHeaderEnd(prefix: Buffer, key: string): number {
  if (prefix.length >= 12 && prefix.subarray(0, 8).equals(LOG_MAGIC)) return 12 + prefix.readUInt32BE(8);
  if (prefix.length >= 16 && prefix.subarray(0, 8).equals(LOG_MAGIC_V3)) return 16 + prefix.readUInt32BE(8);
  if (prefix.length >= 16 && prefix.subarray(0, 8).equals(LOG_MAGIC_V4)) return 16 + MAC_BYTES + prefix.readUInt32BE(8);
  throw new CorruptError(`${key}: not a baton log record`);
}

/**
 * A log record's header. `metaKey` (MetaKey): with a key, the record must be authenticated
 * (v4) and its MAC must hold, else CorruptError: a bucket writer cannot point an encrypted
 * volume's extents elsewhere, nor pass a record off without a MAC.
 */
export function decodeLogHeader(b: Buffer, key: string, metaKey?: MetaKey): { header: LogHeader; dataStart: number } {
  const end = logHeaderEnd(b, key);
  const v4 = b.subarray(0, 8).equals(LOG_MAGIC_V4);
  const v3 = v4 || b.subarray(0, 8).equals(LOG_MAGIC_V3);
  if (b.length < end) throw new CorruptError(`${key}: truncated log header`);
  const json = b.subarray(v4 ? 16 + MAC_BYTES : v3 ? 16 : 12, end);
  if (v3 && crc32(json) !== b.readUInt32BE(12)) throw new CorruptError(`${key}: log header checksum mismatch`);
  if (metaKey) {
    if (!v4) throw new CorruptError(`${key}: log record of an encrypted volume without its MAC (its records are authenticated: this one was not written by it)`);
    const mac = metadataMac(metaKey, 'log', key).update(json).digest();
    if (!timingSafeEqual(mac, b.subarray(16, 16 + MAC_BYTES))) throw new CorruptError(`${key}: log record authentication failed (tampered, moved, or another key's record)`);
  }
  let h: LogHeader;
  try { h = JSON.parse(json.toString('utf8')) as LogHeader; } catch { throw new CorruptError(`${key}: log header is not JSON`); }
  if ((v3 ? h.v !== 3 : h.v !== 1 && h.v !== 2) || !Array.isArray(h.extents) || !Array.isArray(h.segments)) throw new CorruptError(`${key}: unsupported log record version`);
  if (h.v >= 2 && (typeof h.id !== 'string' || typeof h.prev !== 'string')) throw new CorruptError(`${key}: v${h.v} log record without id/prev`);
  if (v3) {
    if (!Number.isSafeInteger(h.frameBytes)) throw new CorruptError(`${key}: v3 log record without a frame size`);
    if (h.inlineLength > 0 && (typeof h.inline !== 'object' || h.inline === null)) throw new CorruptError(`${key}: v3 log record with inline data but no frame index`);
  }
  return { header: h, dataStart: end };
}

/** The frame index of segment `i` of a v3 record (null for v1/v2 records: raw segments). CorruptError if it does not add up. */
export function segmentFrames(h: LogHeader, i: number, key: string): FrameIndex | null {
  if (h.v !== 3) return null;
  const s = h.segments[i]!;
  const what = `${key}: segment ${s.key}`;
  const idx = FrameIndex.fromLengths(h.frameBytes!, s.logical ?? -1, 0, lengthsFromString(s.frames, what), what);
  if (idx.stored !== s.size) throw new CorruptError(`${what}: frames of ${idx.stored} bytes in a segment of ${s.size}`);
  return idx;
}

/** The frame index of a v3 record's inline data, which starts at `dataStart` (null for v1/v2 or no inline data). */
export function inlineFrames(h: LogHeader, dataStart: number, recordSize: number, key: string): FrameIndex | null {
  if (h.v !== 3 || h.inlineLength === 0) return null;
  const what = `${key}: inline data`;
  const idx = FrameIndex.fromLengths(h.frameBytes!, h.inline!.logical, dataStart, lengthsFromString(h.inline!.frames, what), what);
  if (idx.stored !== h.inlineLength || dataStart + h.inlineLength !== recordSize) throw new CorruptError(`${what}: frames of ${idx.stored} bytes, header says ${h.inlineLength}, record ${recordSize - dataStart}`);
  return idx;
}

/** A segment reference of a v3 header for a framed segment. */
export function framedSegmentRef(key: string, logical: number, lengths: Uint32Array, stored: number): SegmentRef {
  return { key, size: stored, logical, frames: lengthsToString(lengths) };
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

/**
 * Checkpoint v3/v4, binary, so that a map of millions of extents is written and read a chunk at
 * a time (the event loop serves other volumes in between) and never becomes one string (V8's
 * string limit is about 512 MiB; JSON of 10M extents was near it):
 *
 *   "BATONCP4" | u32 BE header length | header JSON (CheckpointHeader)
 *   | objects: per object u16 LE key length, the key (UTF-8), f64 LE size
 *   | extents: per extent 24 bytes: f64 LE offset, u32 LE length, i32 LE source (object index,
 *     SRC_HOLE or SRC_ZERO), f64 LE offset in the object; in volume order, not overlapping
 *   | v4 only: the working set, per entry u32 LE chunk index (volume offset / chunkBytes),
 *     most recently used first (header `workingSet`: chunkBytes and the entry count). In v5,
 *     header `workingSet.boot` (optional) says how many leading entries are the boot set
 *     (first read after the volume opened, in that order; src/volume/working-set.ts); a
 *     reader that does not know it takes them for the most recent chunks.
 *
 * v3 ("BATONCP3", header v 3) is the same without the working set; both are read. The working
 * set is a hint (what the writer read and wrote lately, src/volume/working-set.ts): a new host
 * fetches those parts of the volume first (src/volume/hydrate.ts). It rides in the checkpoint
 * so that it costs no request of its own and garbage collection's reference set and argument
 * (gc.ts) are unchanged: it names volume offsets, never objects.
 */
export const CHECKPOINT_MAGIC_V3 = Buffer.from('BATONCP3');
export const CHECKPOINT_MAGIC_V4 = Buffer.from('BATONCP4');
/**
 * v5 (issue 16): v4 with, per object after its size, a u8 kind: 0 raw, 1 framed, then for a
 * framed object u32 LE frame size, f64 LE logical size, f64 LE base (stored offset of frame 0),
 * u32 LE frame count and that many u32 LE stored frame lengths; the working set section is
 * optional (header `workingSet`); and a u32 LE crc32 of every byte before it ends the body.
 */
export const CHECKPOINT_MAGIC = Buffer.from('BATONCP5');
/**
 * v6: an encrypted volume's v5 checkpoint (header still v 5), authenticated: the crc is followed
 * by a 32-byte MAC (MAC_BYTES, metadataMac 'checkpoint') of the same bytes, bound to the key.
 */
export const CHECKPOINT_MAGIC_V6 = Buffer.from('BATONCP6');

/** A v5/v6 checkpoint: its trailer's length (crc, and a v6 one's MAC after it), or 0 for any other. */
function checkedTrailer(b: Buffer): number {
  if (b.length < 16) return 0;
  const m = b.subarray(0, 8);
  return m.equals(CHECKPOINT_MAGIC) ? 4 : m.equals(CHECKPOINT_MAGIC_V6) ? 4 + MAC_BYTES : 0;
}

/** A reader with a metadata key takes only authenticated (v6) checkpoints. */
function requireMac(key: string, v6: boolean, metaKey: MetaKey): void {
  if (metaKey && !v6) throw new CorruptError(`${key}: checkpoint of an encrypted volume without its MAC (its checkpoints are authenticated: this one was not written by it)`);
}

/**
 * The running check of a v5/v6 checkpoint's bytes (the crc, and the MAC when the reader has the
 * key). `metaKey` (MetaKey) with a key: the checkpoint must be v6, else CorruptError.
 */
class CheckpointSum {
  private crc = 0;
  private readonly mac: Hmac | null;
  constructor(private readonly key: string, v6: boolean, metaKey: MetaKey) {
    requireMac(key, v6, metaKey);
    this.mac = metaKey && v6 ? metadataMac(metaKey, 'checkpoint', key) : null;
  }
  update(b: Buffer): void {
    this.crc = crc32(b, this.crc);
    this.mac?.update(b);
  }
  /** `trailer`: the bytes after the checked ones (crc, MAC). */
  verify(trailer: Buffer): void {
    if (this.crc !== trailer.readUInt32LE(0)) throw new CorruptError(`${this.key}: checkpoint checksum mismatch`);
    if (this.mac && !timingSafeEqual(this.mac.digest(), trailer.subarray(4, 4 + MAC_BYTES))) {
      throw new CorruptError(`${this.key}: checkpoint authentication failed (tampered, moved, or another key's checkpoint)`);
    }
  }
}
export const CHECKPOINT_EXTENT_BYTES = 24;
/** Bytes per working-set entry in a v4 checkpoint. */
export const WORKING_SET_ENTRY_BYTES = 4;

export interface CheckpointHeader {
  v: 3 | 4 | 5;
  volumeId: string;
  seq: number;
  token: number;
  lastId?: string;
  time: string;
  objects: number;
  extents: number;
  /** v4 (always), v5 (when present): the working set section that follows the extents. */
  workingSet?: { chunkBytes: number; entries: number; boot?: number };
}

/** An object a checkpoint names: key, stored size, and its frame index if it is framed (v5). */
export type CheckpointObject = [key: string, size: number, frames?: FrameIndex | null];

/** A working set as a checkpoint carries it: chunk indices (offset / chunkBytes), most recently used first. */
export interface WorkingSetData {
  chunkBytes: number;
  chunks: number[];
  /** The boot set (working-set.ts): chunks in the order first read after the volume opened; hydrated first. */
  boot?: number[];
}

/** A decoded checkpoint of any version: its header, objects, and its extents read a chunk at a time. */
export interface CheckpointData {
  v: 1 | 2 | 3 | 4 | 5;
  volumeId: string;
  seq: number;
  token: number;
  lastId?: string;
  objects: CheckpointObject[];
  extentCount: number;
  /** v4: the writer's working set when it wrote the checkpoint (absent in older versions). */
  workingSet?: WorkingSetData;
  /**
   * Call fn for every extent in order, awaiting `pause` after every `chunk` of them, or
   * earlier when `due` (asked every 256 extents) says the chunk has taken long enough (so a
   * big map is built without holding the event loop). Throws CorruptError for an extent
   * outside [0, volumeSize) or naming a missing object.
   */
  forEachExtent(volumeSize: number, fn: (offset: number, length: number, src: number, srcOff: number) => void, pause: () => Promise<void>, chunk?: number, due?: () => boolean): Promise<void>;
}

/** Extents per chunk when maps are written, read or walked (about 1 ms of work each here, once the code is optimized). */
export const CHECKPOINT_CHUNK = 4_000;
/**
 * A chunk also ends after this many ms (of the World's clock, so the simulator's chunks stay
 * deterministic): code that has not run yet in a process is interpreted at first, and a
 * recovery's first chunks of 4,000 extents took 12-24 ms each here before it was optimized.
 */
export const CHUNK_MS = 5;

/** Bytes of a v5 checkpoint's crc computed between two pauses (checkCheckpoint). */
const CRC_SLICE = 4 * 1024 * 1024;

/**
 * Check a v5/v6 checkpoint's crc (and MAC, CheckpointSum) a slice at a time, pausing in
 * between (a checkpoint of 10M extents is 240 MiB: its crc in one go held the event loop for
 * ~150 ms). Older versions have none: nothing to check, unless the reader needs a MAC. Then
 * decode it with `{ checked: true }`.
 */
export async function checkCheckpoint(b: Buffer, key: string, pause: () => Promise<void>, metaKey?: MetaKey): Promise<void> {
  const trailer = checkedTrailer(b);
  const sum = new CheckpointSum(key, trailer > 4, metaKey);
  if (trailer === 0) return;
  const end = b.length - trailer;
  for (let at = 0; at < end; at += CRC_SLICE) {
    if (at > 0) await pause();
    sum.update(b.subarray(at, Math.min(at + CRC_SLICE, end)));
  }
  sum.verify(b.subarray(end));
}

/** Decode a checkpoint of any version. A v5/v6 one is checked here (crc, and MAC with `metaKey`) unless `checked` (checkCheckpoint did, with the same metaKey). */
export function decodeCheckpoint(b: Buffer, key: string, opts: { checked?: boolean; metaKey?: MetaKey } = {}): CheckpointData {
  const trailer = checkedTrailer(b);
  if (!opts.checked) {
    const sum = new CheckpointSum(key, trailer > 4, opts.metaKey);
    if (trailer > 0) {
      sum.update(b.subarray(0, b.length - trailer));
      sum.verify(b.subarray(b.length - trailer));
    }
  }
  if (trailer > 0) return decodeCheckpointBinary(b.subarray(0, b.length - trailer), key, 5);
  if (b.length >= 12 && b.subarray(0, 8).equals(CHECKPOINT_MAGIC_V4)) return decodeCheckpointBinary(b, key, 4);
  if (b.length >= 12 && b.subarray(0, 8).equals(CHECKPOINT_MAGIC_V3)) return decodeCheckpointBinary(b, key, 3);
  let c: Checkpoint;
  try { c = JSON.parse(b.toString('utf8')) as Checkpoint; } catch { throw new CorruptError(`${key}: checkpoint is not JSON`); }
  if ((c.v !== 1 && c.v !== 2) || !Array.isArray(c.extents) || !Array.isArray(c.objects)) throw new CorruptError(`${key}: unsupported checkpoint version`);
  return {
    v: c.v, volumeId: c.volumeId, seq: c.seq, token: c.token, ...(c.lastId !== undefined ? { lastId: c.lastId } : {}), objects: c.objects, extentCount: c.extents.length,
    forEachExtent: async (volumeSize, fn, pause, chunk = CHECKPOINT_CHUNK, due) => {
      let since = 0;
      for (let i = 0; i < c.extents.length; i++) {
        if (++since > chunk || ((since & 255) === 0 && due?.())) { since = 1; await pause(); }
        const [off, len, src, srcOff] = c.extents[i]!;
        checkCheckpointExtent(key, volumeSize, c.objects.length, off, len, src);
        fn(off, len, src, srcOff);
      }
    },
  };
}

function checkCheckpointExtent(key: string, volumeSize: number, objects: number, off: number, len: number, src: number): void {
  if (!(off >= 0 && len > 0 && off + len <= volumeSize)) throw new CorruptError(`${key}: checkpoint extent [${off}, +${len}) out of range`);
  if (src !== SRC_HOLE && src !== SRC_ZERO && !(src >= 0 && src < objects)) throw new CorruptError(`${key}: checkpoint extent names object ${src} of ${objects}`);
}

/** A working-set chunk size a checkpoint may name: a power of two from 4 KiB to 1 GiB. */
function validChunkBytes(n: unknown): n is number {
  return typeof n === 'number' && Number.isSafeInteger(n) && n >= 4096 && n <= 2 ** 30 && (n & (n - 1)) === 0;
}

/** What precedes a binary checkpoint's extents: its header and object table, and where the sections after them begin. */
interface CheckpointHead {
  h: CheckpointHeader;
  objects: CheckpointObject[];
  /** Byte offset of the first extent; the working set (wsEntries of them) follows the extents. */
  extentsAt: number;
  hasWs: boolean;
  wsEntries: number;
}

/** A checkpoint's head ran past the bytes at hand (parseCheckpointHead with `partial`: read more). */
class HeadIncomplete extends Error {}

/**
 * Parse a binary checkpoint's header and object table from `b`, its first bytes. `partial`:
 * `b` may be only a prefix of the object: running past its end throws HeadIncomplete (read
 * a longer prefix); without it, that is corruption.
 */
function parseCheckpointHead(b: Buffer, key: string, version: 3 | 4 | 5, partial = false): CheckpointHead {
  const short = (what: string): never => { throw partial ? new HeadIncomplete(what) : new CorruptError(`${key}: ${what}`); };
  if (b.length < 12) short('checkpoint header runs past the end');
  const hlen = b.readUInt32BE(8);
  if (12 + hlen > b.length) short('checkpoint header runs past the end');
  let h: CheckpointHeader;
  try { h = JSON.parse(b.subarray(12, 12 + hlen).toString('utf8')) as CheckpointHeader; } catch { throw new CorruptError(`${key}: checkpoint header is not JSON`); }
  if (h.v !== version || !Number.isSafeInteger(h.objects) || !Number.isSafeInteger(h.extents) || h.objects < 0 || h.extents < 0) throw new CorruptError(`${key}: unsupported checkpoint header`);
  let wsEntries = 0;
  const hasWs = version === 4 || (version === 5 && h.workingSet !== undefined);
  if (hasWs) {
    const ws = h.workingSet;
    if (!ws || !validChunkBytes(ws.chunkBytes) || !Number.isSafeInteger(ws.entries) || ws.entries < 0) throw new CorruptError(`${key}: checkpoint working set header is invalid`);
    if (ws.boot !== undefined && !(Number.isSafeInteger(ws.boot) && ws.boot >= 0 && ws.boot <= ws.entries)) throw new CorruptError(`${key}: checkpoint boot set header is invalid`);
    wsEntries = ws.entries;
  }
  // The object table is small (one entry per object, and for framed objects 4 bytes per
  // frame: 128 KiB per GiB of data): read at once.
  const objects: CheckpointObject[] = [];
  let pos = 12 + hlen;
  const past = (n: number): void => { if (pos + n > b.length) short('checkpoint object table runs past the end'); };
  for (let i = 0; i < h.objects; i++) {
    past(2);
    const klen = b.readUInt16LE(pos);
    past(2 + klen + 8);
    const okey = b.toString('utf8', pos + 2, pos + 2 + klen);
    const size = b.readDoubleLE(pos + 2 + klen);
    pos += 2 + klen + 8;
    if (version < 5) { objects.push([okey, size]); continue; }
    past(1);
    const kind = b[pos++]!;
    if (kind === 0) { objects.push([okey, size, null]); continue; }
    if (kind !== 1) throw new CorruptError(`${key}: object ${okey} of unknown kind ${kind}`);
    past(24);
    const frameBytes = b.readUInt32LE(pos);
    const logical = b.readDoubleLE(pos + 4);
    const base = b.readDoubleLE(pos + 12);
    const n = b.readUInt32LE(pos + 20);
    pos += 24;
    past(4 * n);
    const lengths = new Uint32Array(n);
    for (let k = 0; k < n; k++) lengths[k] = b.readUInt32LE(pos + 4 * k);
    pos += 4 * n;
    const idx = FrameIndex.fromLengths(frameBytes, logical, base, lengths, `${key}: object ${okey}`);
    if (base + idx.stored > size) throw new CorruptError(`${key}: object ${okey}: frames past its end`);
    objects.push([okey, size, idx]);
  }
  return { h, objects, extentsAt: pos, hasWs, wsEntries };
}

/** The working set section (`entries` chunk indices at `at` in `b`) of a checkpoint whose header is `h`. */
function workingSetAt(b: Buffer, at: number, head: CheckpointHead): WorkingSetData | undefined {
  if (!head.hasWs) return undefined;
  const all = new Array<number>(head.wsEntries);
  for (let i = 0; i < head.wsEntries; i++) all[i] = b.readUInt32LE(at + i * WORKING_SET_ENTRY_BYTES);
  // The boot set leads the entries (so a reader that knows no boot set takes it for the most recent chunks: still a fair hint).
  const boot = head.h.workingSet!.boot ?? 0;
  return { chunkBytes: head.h.workingSet!.chunkBytes, chunks: boot > 0 ? all.slice(boot) : all, ...(boot > 0 ? { boot: all.slice(0, boot) } : {}) };
}

/**
 * The extents of one piece of a checkpoint (`count` of them at byte `at` of `b`), checked and
 * passed to fn in order, awaiting `pause` as forEachExtent says. `state` carries the walk
 * across pieces: where the previous extent ended, and the extents since the last pause.
 */
async function extentsIn(b: Buffer, at: number, count: number, key: string, volumeSize: number, objects: number, fn: (offset: number, length: number, src: number, srcOff: number) => void, pause: () => Promise<void>, chunk: number, due: (() => boolean) | undefined, state: { prevEnd: number; since: number }): Promise<void> {
  // A DataView, not Buffer's readDoubleLE: that one is a JS function V8 did not inline here,
  // and a recovery of 10M extents spent about a third of its CPU in it (bench/scale.ts, profiled).
  const dv = new DataView(b.buffer, b.byteOffset, b.byteLength);
  for (let i = 0; i < count; i++) {
    if (++state.since > chunk || ((state.since & 255) === 0 && due?.())) { state.since = 1; await pause(); }
    const x = at + i * CHECKPOINT_EXTENT_BYTES;
    const off = dv.getFloat64(x, true);
    const len = dv.getUint32(x + 8, true);
    const src = dv.getInt32(x + 12, true);
    const srcOff = dv.getFloat64(x + 16, true);
    checkCheckpointExtent(key, volumeSize, objects, off, len, src);
    if (off < state.prevEnd) throw new CorruptError(`${key}: checkpoint extents out of order at ${off}`);
    state.prevEnd = off + len;
    fn(off, len, src, srcOff);
  }
}

function decodeCheckpointBinary(b: Buffer, key: string, version: 3 | 4 | 5): CheckpointData {
  const head = parseCheckpointHead(b, key, version);
  const { h, objects, extentsAt } = head;
  const wsAt = extentsAt + h.extents * CHECKPOINT_EXTENT_BYTES;
  const total = wsAt + head.wsEntries * WORKING_SET_ENTRY_BYTES;
  if (total !== b.length) throw new CorruptError(`${key}: checkpoint is ${b.length} bytes, its header says ${total}`);
  const workingSet = workingSetAt(b, wsAt, head);
  return {
    v: version, volumeId: h.volumeId, seq: h.seq, token: h.token, ...(h.lastId !== undefined ? { lastId: h.lastId } : {}), objects, extentCount: h.extents,
    ...(workingSet ? { workingSet } : {}),
    forEachExtent: (volumeSize, fn, pause, chunk = CHECKPOINT_CHUNK, due) =>
      extentsIn(b, extentsAt, h.extents, key, volumeSize, objects.length, fn, pause, chunk, due, { prevEnd: 0, since: 0 }),
  };
}

/** How a checkpoint too big to read at once is read: its size, and any range of it. */
export interface CheckpointRanges {
  size: number;
  read(offset: number, length: number): Promise<Buffer>;
}

/** A checkpoint larger than this is read a range of this size at a time (readCheckpointInRanges). */
export const CHECKPOINT_RANGE_BYTES = 8 * 1024 * 1024;
/** The first read of a checkpoint in ranges: its header and object table are usually within it. */
const CHECKPOINT_HEAD_BYTES = 1024 * 1024;

/**
 * Read a v5 checkpoint a range at a time: its head (header and object table) and its tail
 * (working set and crc) now, its extents `rangeBytes` at a time while forEachExtent walks
 * them (the next range read while one is decoded). Why: read at once, a checkpoint of 10M
 * extents is one 216 MiB buffer, whose allocation made V8 run a full GC that held a
 * recovery's event loop 44-51 ms (bench/scale.ts, profiled), and which a host recovering
 * several big volumes at once holds for each. In ranges, a recovery holds two ranges.
 *
 * The crc (and a v6 checkpoint's MAC, with `metaKey`: CheckpointSum) covers every byte in
 * order, so it is complete only when the walk ends: the walk checks it last and throws
 * CorruptError on a mismatch, after fn saw every extent. What fn
 * built from them is then not the checkpoint's and must be dropped (Volume.resetTo builds
 * a new map and keeps it only once the walk returned). Every extent is still checked on its
 * own as it goes (range, order, object), so nothing fn sees is out of range meanwhile.
 * A checkpoint is written once and never replaced (create-only), so its ranges are of one
 * version; were it deleted meanwhile, a read throws NotFoundError, like a whole read.
 *
 * Returns null for anything but a v5/v6 checkpoint (older ones have no crc: read them whole).
 */
export async function readCheckpointInRanges(src: CheckpointRanges, key: string, rangeBytes = CHECKPOINT_RANGE_BYTES, metaKey?: MetaKey): Promise<CheckpointData | null> {
  const size = src.size;
  if (size < 16) return null;
  let headBytes = Math.min(size, CHECKPOINT_HEAD_BYTES);
  let headBuf = await src.read(0, headBytes);
  const trailer = checkedTrailer(headBuf);
  if (trailer === 0) return null;
  // A v5 checkpoint where a MAC is needed is refused here, before anything of it is used.
  requireMac(key, trailer > 4, metaKey);
  const newSum = (): CheckpointSum => new CheckpointSum(key, trailer > 4, metaKey);
  let head: CheckpointHead;
  for (;;) {
    try {
      head = parseCheckpointHead(headBuf.subarray(0, Math.min(headBytes, size - trailer)), key, 5, headBytes < size);
      break;
    } catch (err) {
      if (!(err instanceof HeadIncomplete)) throw err;
      headBytes = Math.min(size, headBytes * 4);
      headBuf = await src.read(0, headBytes);
    }
  }
  const { h, objects, extentsAt } = head;
  const wsAt = extentsAt + h.extents * CHECKPOINT_EXTENT_BYTES;
  const total = wsAt + head.wsEntries * WORKING_SET_ENTRY_BYTES + trailer;
  if (total !== size) throw new CorruptError(`${key}: checkpoint is ${size} bytes, its header says ${total}`);
  const tail = await src.read(wsAt, size - wsAt);
  const workingSet = workingSetAt(tail, 0, head);
  const headPart = headBuf.subarray(0, Math.min(extentsAt, headBuf.length));
  const perRange = Math.max(1, Math.floor(rangeBytes / CHECKPOINT_EXTENT_BYTES));
  return {
    v: 5, volumeId: h.volumeId, seq: h.seq, token: h.token, ...(h.lastId !== undefined ? { lastId: h.lastId } : {}), objects, extentCount: h.extents,
    ...(workingSet ? { workingSet } : {}),
    forEachExtent: async (volumeSize, fn, pause, chunk = CHECKPOINT_CHUNK, due) => {
      const sum = newSum();
      sum.update(headPart);
      // The head read may have run into the extents: those come again with their ranges.
      const state = { prevEnd: 0, since: 0 };
      const rangeOf = (first: number): Promise<Buffer> => {
        const n = Math.min(perRange, h.extents - first);
        return src.read(extentsAt + first * CHECKPOINT_EXTENT_BYTES, n * CHECKPOINT_EXTENT_BYTES);
      };
      let next: Promise<Buffer> | null = h.extents > 0 ? rangeOf(0) : null;
      for (let first = 0; first < h.extents; first += perRange) {
        const b = await next!;
        const count = Math.min(perRange, h.extents - first);
        next = first + perRange < h.extents ? rangeOf(first + perRange) : null;
        // A read left unawaited when the walk throws must not become an unhandled rejection.
        next?.catch(() => {});
        if (b.length !== count * CHECKPOINT_EXTENT_BYTES) throw new CorruptError(`${key}: a range of the checkpoint came back ${b.length} bytes, not ${count * CHECKPOINT_EXTENT_BYTES}`);
        sum.update(b);
        await extentsIn(b, 0, count, key, volumeSize, objects.length, fn, pause, chunk, due, state);
      }
      sum.update(tail.subarray(0, tail.length - trailer));
      sum.verify(tail.subarray(tail.length - trailer));
    },
  };
}

/**
 * Encode a checkpoint from a source that can walk the map twice (the first walk finds the
 * objects and sizes the buffer, the second writes the extents), pausing after every chunk.
 * `walk` calls its callback for every extent in volume order with the object key (or null
 * for zeroes, `src` then SRC_HOLE or SRC_ZERO), the object's size and its frame index (null
 * for a raw object). Writes v5 (with a working set if given); `version` 3 or 4 writes the older
 * formats (tests of their readers), which cannot name framed objects.
 */
export async function encodeCheckpoint(
  header: Omit<CheckpointHeader, 'v' | 'objects' | 'extents' | 'workingSet'>,
  walk: (fn: (offset: number, length: number, key: string | null, src: number, srcOff: number, objectSize: number, frames?: FrameIndex | null) => void, pause: () => Promise<void>) => Promise<void>,
  pause: () => Promise<void>,
  workingSet?: WorkingSetData,
  version: 3 | 4 | 5 = 5,
  auth?: { metaKey: Buffer; objectKey: string },
): Promise<Buffer> {
  if (auth && version !== 5) throw new RangeError('only a v5 checkpoint is authenticated (v6)');
  const trailer = version !== 5 ? 0 : auth ? 4 + MAC_BYTES : 4;
  if (workingSet) {
    if (!validChunkBytes(workingSet.chunkBytes)) throw new RangeError(`working set chunk size ${workingSet.chunkBytes} is not a power of two from 4 KiB to 1 GiB`);
    if (workingSet.boot?.length && version !== 5) throw new RangeError(`a v${version} checkpoint carries no boot set`);
  }
  // The boot set leads the working set's entries (workingSetAt).
  const wsEntries = workingSet ? [...(workingSet.boot ?? []), ...workingSet.chunks] : [];
  for (const c of wsEntries) if (!(Number.isInteger(c) && c >= 0 && c <= 0xffffffff)) throw new RangeError(`working set chunk ${c} does not fit in 32 bits`);
  if (version === 4 && !workingSet) throw new RangeError('a v4 checkpoint has a working set');
  if (version === 3 && workingSet) throw new RangeError('a v3 checkpoint has no working set');
  const index = new Map<string, number>();
  const sizes: number[] = [];
  const frames: (FrameIndex | null)[] = [];
  let extents = 0;
  let tableBytes = 0;
  await walk((_o, _l, key, _s, _so, size, fr) => {
    extents++;
    if (key !== null && !index.has(key)) {
      index.set(key, index.size);
      sizes.push(size);
      frames.push(fr ?? null);
      if (fr && version !== 5) throw new RangeError(`a v${version} checkpoint cannot name framed object ${key}`);
      tableBytes += 2 + Buffer.byteLength(key) + 8 + (version === 5 ? 1 + (fr ? 24 + 4 * fr.frames : 0) : 0);
    }
  }, pause);
  const bootCount = workingSet?.boot?.length ?? 0;
  const ws = workingSet ? { workingSet: { chunkBytes: workingSet.chunkBytes, entries: wsEntries.length, ...(bootCount > 0 ? { boot: bootCount } : {}) } } : {};
  const h: CheckpointHeader = { v: version, ...header, objects: index.size, extents, ...ws };
  const hjson = Buffer.from(JSON.stringify(h));
  const extentsAt = 12 + hjson.length + tableBytes;
  const wsAt = extentsAt + extents * CHECKPOINT_EXTENT_BYTES;
  const end = wsAt + wsEntries.length * WORKING_SET_ENTRY_BYTES;
  const out = Buffer.allocUnsafe(end + trailer);
  (version === 5 ? (auth ? CHECKPOINT_MAGIC_V6 : CHECKPOINT_MAGIC) : version === 4 ? CHECKPOINT_MAGIC_V4 : CHECKPOINT_MAGIC_V3).copy(out, 0);
  out.writeUInt32BE(hjson.length, 8);
  hjson.copy(out, 12);
  let pos = 12 + hjson.length;
  let i = 0;
  for (const [key, idx] of index) {
    const klen = out.write(key, pos + 2, 'utf8');
    if (klen > 0xffff) throw new CorruptError(`checkpoint: object key longer than 65535 bytes: ${key.slice(0, 80)}...`);
    out.writeUInt16LE(klen, pos);
    out.writeDoubleLE(sizes[idx]!, pos + 2 + klen);
    pos += 2 + klen + 8;
    if (version === 5) {
      const fr = frames[idx];
      out[pos++] = fr ? 1 : 0;
      if (fr) {
        out.writeUInt32LE(fr.frameBytes, pos);
        out.writeDoubleLE(fr.logical, pos + 4);
        out.writeDoubleLE(fr.base, pos + 12);
        out.writeUInt32LE(fr.frames, pos + 20);
        pos += 24;
        for (let k = 0; k < fr.frames; k++, pos += 4) out.writeUInt32LE(fr.ends[k + 1]! - fr.ends[k]!, pos);
      }
    }
    if (++i % CHECKPOINT_CHUNK === 0) await pause();
  }
  if (pos !== extentsAt) throw new Error('checkpoint: object table size miscounted');
  let n = 0;
  await walk((offset, length, key, src, srcOff) => {
    if (n >= extents) throw new Error('checkpoint: the second walk found more extents than the first');
    const at = extentsAt + n * CHECKPOINT_EXTENT_BYTES;
    out.writeDoubleLE(offset, at);
    out.writeUInt32LE(length, at + 8);
    out.writeInt32LE(key === null ? src : index.get(key)!, at + 12);
    out.writeDoubleLE(key === null ? 0 : srcOff, at + 16);
    n++;
  }, pause);
  if (n !== extents) throw new Error(`checkpoint: the walks disagree (${extents} then ${n} extents)`);
  wsEntries.forEach((c, k) => out.writeUInt32LE(c, wsAt + k * WORKING_SET_ENTRY_BYTES));
  if (version === 5) {
    let c = 0;
    const mac = auth ? metadataMac(auth.metaKey, 'checkpoint', auth.objectKey) : null;
    for (let at = 0; at < end; at += CRC_SLICE) {
      if (at > 0) await pause();
      const slice = out.subarray(at, Math.min(at + CRC_SLICE, end));
      c = crc32(slice, c);
      mac?.update(slice);
    }
    out.writeUInt32LE(c, end);
    mac?.digest().copy(out, end + 4);
  }
  return out;
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

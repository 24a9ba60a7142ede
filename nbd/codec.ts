/**
 * The NBD wire codec: pure functions over Buffers, no sockets (pg-protocol style).
 *
 * Decoders take exactly the bytes of one frame (the session's reader knows the sizes) and
 * either return values or throw: ProtocolError where the spec lets us hang up (bad magic,
 * unknown client flags), InvalidArgumentError where it wants an error reply (a malformed
 * option payload). 64-bit values stay `bigint` here; the session checks ranges once and
 * converts. Layouts cite doc/proto.md ("Handshake", "Transmission", "Structured replies").
 */

import { InvalidArgumentError, ProtocolError } from '../src/errors.js';
import * as C from './constants.js';

// ---------------------------------------------------------------- handshake

/** Server greeting: NBDMAGIC, IHAVEOPT, u16 handshake flags (proto.md "Newstyle negotiation"). */
export function encodeGreeting(handshakeFlags: number): Buffer {
  const b = Buffer.allocUnsafe(C.GREETING_SIZE);
  b.writeBigUInt64BE(C.NBDMAGIC, 0);
  b.writeBigUInt64BE(C.IHAVEOPT, 8);
  b.writeUInt16BE(handshakeFlags, 16);
  return b;
}

/**
 * Client flags (u32). The spec: the server MUST drop the connection on an unknown bit, or
 * on C_NO_ZEROES when NO_ZEROES was not offered.
 */
export function decodeClientFlags(b: Buffer, offeredHandshakeFlags: number): number {
  if (b.length !== 4) throw new ProtocolError(`client flags: expected 4 bytes, got ${b.length}`);
  const flags = b.readUInt32BE(0);
  const known = C.NBD_FLAG_C_FIXED_NEWSTYLE | C.NBD_FLAG_C_NO_ZEROES;
  if ((flags & ~known) !== 0) throw new ProtocolError(`client flags: unknown bits 0x${(flags >>> 0).toString(16)}`);
  if ((flags & C.NBD_FLAG_C_NO_ZEROES) && !(offeredHandshakeFlags & C.NBD_FLAG_NO_ZEROES)) {
    throw new ProtocolError('client flags: NO_ZEROES set but not offered');
  }
  return flags;
}

export interface OptionHeader {
  option: number;
  length: number;
}

/** Option request header: IHAVEOPT, u32 option, u32 length. */
export function decodeOptionHeader(b: Buffer): OptionHeader {
  if (b.length !== C.OPTION_HEADER_SIZE) throw new ProtocolError(`option header: expected 16 bytes, got ${b.length}`);
  if (b.readBigUInt64BE(0) !== C.IHAVEOPT) throw new ProtocolError('option header: bad magic (expected IHAVEOPT)');
  return { option: b.readUInt32BE(8), length: b.readUInt32BE(12) };
}

export interface InfoRequest {
  name: string;
  infoTypes: number[];
}

/** NBD_OPT_INFO / NBD_OPT_GO payload: u32 namelen, name, u16 count, count × u16. Lengths must add up exactly. */
export function decodeInfoRequest(data: Buffer): InfoRequest {
  if (data.length < 6) throw new InvalidArgumentError(`INFO/GO payload too short (${data.length} bytes, need at least 6)`);
  const nameLen = data.readUInt32BE(0);
  if (nameLen > C.NBD_MAX_STRING) throw new InvalidArgumentError(`export name too long (${nameLen} bytes)`);
  if (4 + nameLen + 2 > data.length) throw new InvalidArgumentError('INFO/GO name length runs past the option');
  const name = decodeString(data.subarray(4, 4 + nameLen), 'export name');
  const count = data.readUInt16BE(4 + nameLen);
  if (6 + nameLen + 2 * count !== data.length) {
    throw new InvalidArgumentError(`INFO/GO payload length ${data.length} does not match ${count} info requests`);
  }
  const infoTypes: number[] = [];
  for (let i = 0; i < count; i++) infoTypes.push(data.readUInt16BE(6 + nameLen + 2 * i));
  return { name, infoTypes };
}

export interface MetaContextRequest {
  exportName: string;
  queries: string[];
}

/** LIST/SET_META_CONTEXT payload: u32 namelen, name, u32 nqueries, nqueries × (u32 len, query). */
export function decodeMetaContextRequest(data: Buffer): MetaContextRequest {
  let off = 0;
  const need = (n: number, what: string): void => {
    if (off + n > data.length) throw new InvalidArgumentError(`meta context request: ${what} runs past the option`);
  };
  need(4, 'export name length');
  const nameLen = data.readUInt32BE(off); off += 4;
  if (nameLen > C.NBD_MAX_STRING) throw new InvalidArgumentError('meta context request: export name too long');
  need(nameLen, 'export name');
  const exportName = decodeString(data.subarray(off, off + nameLen), 'export name'); off += nameLen;
  need(4, 'query count');
  const n = data.readUInt32BE(off); off += 4;
  const queries: string[] = [];
  for (let i = 0; i < n; i++) {
    need(4, 'query length');
    const qlen = data.readUInt32BE(off); off += 4;
    if (qlen > C.NBD_MAX_STRING) throw new InvalidArgumentError('meta context request: query too long');
    need(qlen, 'query');
    queries.push(decodeString(data.subarray(off, off + qlen), 'query')); off += qlen;
  }
  if (off !== data.length) throw new InvalidArgumentError('meta context request: trailing bytes');
  return { exportName, queries };
}

const strictUtf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

/** NBD strings are UTF-8 without NUL; anything else is refused, never repaired. */
export function decodeString(b: Buffer, what: string): string {
  let s: string;
  try { s = strictUtf8.decode(b); } catch { throw new InvalidArgumentError(`${what} is not valid UTF-8`); }
  if (s.includes('\0')) throw new InvalidArgumentError(`${what} contains a NUL byte`);
  return s;
}

/** Option reply: u64 magic, u32 option, u32 reply type, u32 length, data. */
export function encodeOptionReply(option: number, replyType: number, data?: Buffer): Buffer {
  const len = data ? data.length : 0;
  const b = Buffer.allocUnsafe(C.OPTION_REPLY_HEADER_SIZE + len);
  b.writeBigUInt64BE(C.NBD_REP_MAGIC, 0);
  b.writeUInt32BE(option, 8);
  b.writeUInt32BE(replyType >>> 0, 12);
  b.writeUInt32BE(len, 16);
  if (data) data.copy(b, C.OPTION_REPLY_HEADER_SIZE);
  return b;
}

/** Error reply with a human-readable message (the spec allows one; libnbd shows it). */
export function encodeOptionError(option: number, errType: number, message: string): Buffer {
  return encodeOptionReply(option, errType, Buffer.from(truncateUtf8(message, C.NBD_MAX_STRING)));
}

/** NBD_INFO_EXPORT body: u16 type, u64 size, u16 transmission flags (length exactly 12). */
export function encodeInfoExport(size: number, transmissionFlags: number): Buffer {
  const b = Buffer.allocUnsafe(12);
  b.writeUInt16BE(C.NBD_INFO_EXPORT, 0);
  b.writeBigUInt64BE(BigInt(size), 2);
  b.writeUInt16BE(transmissionFlags, 10);
  return b;
}

export function encodeInfoString(infoType: typeof C.NBD_INFO_NAME | typeof C.NBD_INFO_DESCRIPTION, s: string): Buffer {
  const body = Buffer.from(truncateUtf8(s, C.NBD_MAX_STRING));
  const b = Buffer.allocUnsafe(2 + body.length);
  b.writeUInt16BE(infoType, 0);
  body.copy(b, 2);
  return b;
}

/** NBD_INFO_BLOCK_SIZE body: u16 type, u32 minimum, u32 preferred, u32 maximum (length exactly 14). */
export function encodeInfoBlockSize(min: number, preferred: number, max: number): Buffer {
  const b = Buffer.allocUnsafe(14);
  b.writeUInt16BE(C.NBD_INFO_BLOCK_SIZE, 0);
  b.writeUInt32BE(min, 2);
  b.writeUInt32BE(preferred, 6);
  b.writeUInt32BE(max >>> 0, 10);
  return b;
}

/** NBD_REP_SERVER body for LIST: u32 namelen, name, description (the rest). */
export function encodeServerEntry(name: string, description: string): Buffer {
  const n = Buffer.from(name);
  const d = Buffer.from(truncateUtf8(description, C.NBD_MAX_STRING - n.length));
  const b = Buffer.allocUnsafe(4 + n.length + d.length);
  b.writeUInt32BE(n.length, 0);
  n.copy(b, 4);
  d.copy(b, 4 + n.length);
  return b;
}

/** NBD_REP_META_CONTEXT body: u32 context id, name. */
export function encodeMetaContext(id: number, name: string): Buffer {
  const n = Buffer.from(name);
  const b = Buffer.allocUnsafe(4 + n.length);
  b.writeUInt32BE(id, 0);
  n.copy(b, 4);
  return b;
}

/** Answer to NBD_OPT_EXPORT_NAME: u64 size, u16 flags, then 124 zero bytes unless both sides agreed on NO_ZEROES. */
export function encodeExportNameReply(size: number, transmissionFlags: number, noZeroes: boolean): Buffer {
  const b = Buffer.alloc(noZeroes ? 10 : 134);
  b.writeBigUInt64BE(BigInt(size), 0);
  b.writeUInt16BE(transmissionFlags, 8);
  return b;
}

// ---------------------------------------------------------------- transmission

export interface Request {
  flags: number;
  type: number;
  /** Opaque 8 bytes, echoed verbatim (the kernel's is host-endian). */
  cookie: Buffer;
  offset: bigint;
  length: number;
}

/** Request header (28 bytes): u32 magic, u16 flags, u16 type, 8-byte cookie, u64 offset, u32 length. */
export function decodeRequest(b: Buffer): Request {
  if (b.length !== C.REQUEST_SIZE) throw new ProtocolError(`request: expected 28 bytes, got ${b.length}`);
  const magic = b.readUInt32BE(0);
  if (magic !== C.NBD_REQUEST_MAGIC) throw new ProtocolError(`request: bad magic 0x${magic.toString(16)}`);
  return {
    flags: b.readUInt16BE(4),
    type: b.readUInt16BE(6),
    cookie: Buffer.from(b.subarray(8, 16)),
    offset: b.readBigUInt64BE(16),
    length: b.readUInt32BE(24),
  };
}

/** Simple reply (16 bytes): u32 magic, u32 error, cookie. READ data (error 0 only) follows separately. */
export function encodeSimpleReply(error: number, cookie: Buffer): Buffer {
  const b = Buffer.allocUnsafe(C.SIMPLE_REPLY_SIZE);
  writeSimpleReply(b, error, cookie);
  return b;
}

/** The simple reply's SIMPLE_REPLY_SIZE bytes into b[0..]: for a READ reply whose data follows in the same buffer. */
export function writeSimpleReply(b: Buffer, error: number, cookie: Buffer): void {
  b.writeUInt32BE(C.NBD_SIMPLE_REPLY_MAGIC, 0);
  b.writeUInt32BE(error, 4);
  cookie.copy(b, 8, 0, 8);
}

function structuredHeader(b: Buffer, flags: number, type: number, cookie: Buffer, payloadLength: number): void {
  b.writeUInt32BE(C.NBD_STRUCTURED_REPLY_MAGIC, 0);
  b.writeUInt16BE(flags, 4);
  b.writeUInt16BE(type, 6);
  cookie.copy(b, 8, 0, 8);
  b.writeUInt32BE(payloadLength, 16);
}

/** NBD_REPLY_TYPE_NONE: the empty final chunk (DONE must be set). */
export function encodeNoneChunk(cookie: Buffer): Buffer {
  const b = Buffer.allocUnsafe(C.STRUCTURED_REPLY_HEADER_SIZE);
  structuredHeader(b, C.NBD_REPLY_FLAG_DONE, C.NBD_REPLY_TYPE_NONE, cookie, 0);
  return b;
}

/**
 * Header of an OFFSET_DATA chunk: the 20-byte chunk header plus the u64 offset. The data
 * itself is written after it without copying it into this buffer.
 */
export function encodeOffsetDataHeader(cookie: Buffer, offset: bigint, dataLength: number, done: boolean): Buffer {
  const b = Buffer.allocUnsafe(OFFSET_DATA_HEADER_SIZE);
  writeOffsetDataHeader(b, cookie, offset, dataLength, done);
  return b;
}

/** The chunk header and offset of an OFFSET_DATA chunk before its data. */
export const OFFSET_DATA_HEADER_SIZE = C.STRUCTURED_REPLY_HEADER_SIZE + 8;

/** encodeOffsetDataHeader's OFFSET_DATA_HEADER_SIZE bytes into b[0..]: for a chunk whose data follows in the same buffer. */
export function writeOffsetDataHeader(b: Buffer, cookie: Buffer, offset: bigint, dataLength: number, done: boolean): void {
  structuredHeader(b, done ? C.NBD_REPLY_FLAG_DONE : 0, C.NBD_REPLY_TYPE_OFFSET_DATA, cookie, 8 + dataLength);
  b.writeBigUInt64BE(offset, 20);
}

/** OFFSET_HOLE chunk: u64 offset, u32 size (non-zero). */
export function encodeOffsetHole(cookie: Buffer, offset: bigint, size: number, done: boolean): Buffer {
  const b = Buffer.allocUnsafe(C.STRUCTURED_REPLY_HEADER_SIZE + 12);
  structuredHeader(b, done ? C.NBD_REPLY_FLAG_DONE : 0, C.NBD_REPLY_TYPE_OFFSET_HOLE, cookie, 12);
  b.writeBigUInt64BE(offset, 20);
  b.writeUInt32BE(size, 28);
  return b;
}

export interface Extent {
  length: number;
  /** base:allocation flags: NBD_STATE_HOLE | NBD_STATE_ZERO. */
  flags: number;
}

/** BLOCK_STATUS chunk: u32 context id, then (u32 length, u32 flags) per extent. */
export function encodeBlockStatusChunk(cookie: Buffer, contextId: number, extents: readonly Extent[], done: boolean): Buffer {
  const payload = 4 + 8 * extents.length;
  const b = Buffer.allocUnsafe(C.STRUCTURED_REPLY_HEADER_SIZE + payload);
  structuredHeader(b, done ? C.NBD_REPLY_FLAG_DONE : 0, C.NBD_REPLY_TYPE_BLOCK_STATUS, cookie, payload);
  b.writeUInt32BE(contextId, 20);
  let off = 24;
  for (const e of extents) {
    b.writeUInt32BE(e.length, off);
    b.writeUInt32BE(e.flags, off + 4);
    off += 8;
  }
  return b;
}

/**
 * ERROR chunk: u32 error, u16 message length, message. qemu rejects non-data payloads over
 * 1000 bytes, so the message is capped well below that.
 */
export function encodeErrorChunk(cookie: Buffer, error: number, message: string, done: boolean): Buffer {
  const msg = Buffer.from(truncateUtf8(message, 512));
  const payload = 6 + msg.length;
  const b = Buffer.allocUnsafe(C.STRUCTURED_REPLY_HEADER_SIZE + payload);
  structuredHeader(b, done ? C.NBD_REPLY_FLAG_DONE : 0, C.NBD_REPLY_TYPE_ERROR, cookie, payload);
  b.writeUInt32BE(error, 20);
  b.writeUInt16BE(msg.length, 24);
  msg.copy(b, 26);
  return b;
}

/** Cut a string to at most `maxBytes` of UTF-8 without splitting a character. */
export function truncateUtf8(s: string, maxBytes: number): string {
  if (Buffer.byteLength(s) <= maxBytes) return s;
  let out = '';
  let used = 0;
  for (const ch of s) {
    const n = Buffer.byteLength(ch);
    if (used + n > maxBytes) break;
    out += ch;
    used += n;
  }
  return out;
}

/**
 * Spec values for the fuzzer, spelled out from NetworkBlockDevice/nbd doc/proto.md and
 * /work/shared/notes/nbd-protocol.md §1.1 (deliberately not imported from nbd/constants.ts:
 * the oracle must not share a mistake with the server), and the world the fuzz server
 * serves (shared by the runner and the child process that runs the server).
 */

export const NBDMAGIC = 0x4e42444d41474943n;
export const IHAVEOPT = 0x49484156454f5054n;
export const REP_MAGIC = 0x0003e889045565a9n;
export const REQUEST_MAGIC = 0x25609513;
export const SIMPLE_MAGIC = 0x67446698;
export const STRUCTURED_MAGIC = 0x668e33ef;

export const OPT = {
  EXPORT_NAME: 1, ABORT: 2, LIST: 3, PEEK_EXPORT: 4, STARTTLS: 5, INFO: 6, GO: 7,
  STRUCTURED_REPLY: 8, LIST_META: 9, SET_META: 10, EXTENDED_HEADERS: 11,
} as const;

export const REP = {
  ACK: 1, SERVER: 2, INFO: 3, META_CONTEXT: 4,
  ERR_UNSUP: 0x80000001, ERR_POLICY: 0x80000002, ERR_INVALID: 0x80000003, ERR_PLATFORM: 0x80000004,
  ERR_TLS_REQD: 0x80000005, ERR_UNKNOWN: 0x80000006, ERR_SHUTDOWN: 0x80000007,
  ERR_BLOCK_SIZE_REQD: 0x80000008, ERR_TOO_BIG: 0x80000009,
} as const;

export const INFO = { EXPORT: 0, NAME: 1, DESCRIPTION: 2, BLOCK_SIZE: 3 } as const;

export const TF = {
  HAS_FLAGS: 0x1, READ_ONLY: 0x2, SEND_FLUSH: 0x4, SEND_FUA: 0x8, ROTATIONAL: 0x10, SEND_TRIM: 0x20,
  SEND_WRITE_ZEROES: 0x40, SEND_DF: 0x80, CAN_MULTI_CONN: 0x100, SEND_RESIZE: 0x200, SEND_CACHE: 0x400,
  SEND_FAST_ZERO: 0x800, BLOCK_STATUS_PAYLOAD: 0x1000,
} as const;

export const CMD = { READ: 0, WRITE: 1, DISC: 2, FLUSH: 3, TRIM: 4, CACHE: 5, WRITE_ZEROES: 6, BLOCK_STATUS: 7, RESIZE: 8 } as const;
export const CMD_NAMES: Record<number, string> = {
  0: 'READ', 1: 'WRITE', 2: 'DISC', 3: 'FLUSH', 4: 'TRIM', 5: 'CACHE', 6: 'WRITE_ZEROES', 7: 'BLOCK_STATUS', 8: 'RESIZE',
};
export const CF = { FUA: 0x1, NO_HOLE: 0x2, DF: 0x4, REQ_ONE: 0x8, FAST_ZERO: 0x10, PAYLOAD_LEN: 0x20 } as const;

export const CHUNK = { NONE: 0, OFFSET_DATA: 1, OFFSET_HOLE: 2, BLOCK_STATUS: 5, BLOCK_STATUS_EXT: 6, ERROR: 0x8001, ERROR_OFFSET: 0x8002 } as const;
export const REPLY_FLAG_DONE = 1;
export const STATE_HOLE = 1;
export const STATE_ZERO = 2;

export const E = { OK: 0, EPERM: 1, EIO: 5, ENOMEM: 12, EINVAL: 22, ENOSPC: 28, EOVERFLOW: 75, ENOTSUP: 95, ESHUTDOWN: 108 } as const;
export const ERRNO_NAMES: Record<number, string> = { 0: 'OK', 1: 'EPERM', 5: 'EIO', 12: 'ENOMEM', 22: 'EINVAL', 28: 'ENOSPC', 75: 'EOVERFLOW', 95: 'ENOTSUP', 108: 'ESHUTDOWN' };
/** The spec's error values; anything else in a reply is a bug. */
export const SPEC_ERRNOS = new Set<number>(Object.values(E).filter((e) => e !== 0));

export const MAX_STRING = 4096;
export const BASE_ALLOCATION = 'base:allocation';
export const MiB = 1024 * 1024;
export const KiB = 1024;
/** The payload limit the server documents and advertises (nbd/session.ts MAX_PAYLOAD, from the spec's 32 MiB). */
export const MAX_PAYLOAD = 32 * MiB;

export function optName(o: number): string {
  for (const [k, v] of Object.entries(OPT)) if (v === o) return k;
  return `opt${o >>> 0}`;
}
export function repName(t: number): string {
  for (const [k, v] of Object.entries(REP)) if (v === t) return k;
  return `0x${(t >>> 0).toString(16)}`;
}
export const isRepError = (t: number): boolean => (t & 0x80000000) !== 0;

// ------------------------------------------------------------------ the world the fuzz server serves

/** Server limits the fuzzer aims at (passed to the child; the oracle knows them). */
export interface ServerLimits {
  maxInflight: number;
  maxInflightBytes: number;
  maxOptions: number;
  maxOptionLength: number;
  handshakeTimeoutMs: number;
}

export interface World {
  /** One writable volume per lane: fz0, fz1, ... Only lane i ever writes fz<i>. */
  lanes: number;
  laneSize: number;
  /** A read-only snapshot with known contents (ro@s of volume ro). */
  roName: string;
  roSize: number;
  /** The well-behaved client's volume. */
  victimName: string;
  victimSize: number;
  limits: ServerLimits;
}

export function laneVolume(lane: number): string { return `fz${lane}`; }

export function allExportNames(w: World): string[] {
  const names = [w.roName.split('@')[0]!, w.roName, w.victimName];
  for (let i = 0; i < w.lanes; i++) names.push(laneVolume(i));
  return names.sort();
}

/** The known contents of the read-only snapshot: a pattern over its first half, zeroes after. */
export function roPatternByte(offset: number, roSize: number): number {
  if (offset >= roSize / 2) return 0;
  return ((offset * 131) ^ (offset >>> 9) ^ (offset >>> 17) ^ 0x5a) & 0xff;
}

export function roPattern(offset: number, length: number, roSize: number): Buffer {
  const b = Buffer.allocUnsafe(length);
  for (let i = 0; i < length; i++) b[i] = roPatternByte(offset + i, roSize);
  return b;
}

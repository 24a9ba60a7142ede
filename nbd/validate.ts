/**
 * Request validation, done once per request before any backend call (nbdkit's
 * validate_request). Returns either the request's range as safe numbers or the errno the
 * spec asks for (proto.md "Error values", "Request types"):
 *   unknown command or flag, flag on the wrong command  -> EINVAL
 *   write-type command on a read-only export           -> EPERM
 *   write / write-zeroes past the end                  -> ENOSPC
 *   read / trim / cache / block-status past the end    -> EINVAL
 *   READ longer than the payload cap                   -> EINVAL (EOVERFLOW with DF)
 *   FLUSH with a non-zero offset or length             -> EINVAL
 * FUA is accepted on every command, as SEND_FUA obliges.
 */

import * as C from './constants.js';
import type { Request } from './codec.js';

export interface ValidationContext {
  size: number;
  readOnly: boolean;
  structuredReplies: boolean;
  /** base:allocation was selected for this export by SET_META_CONTEXT. */
  blockStatusEnabled: boolean;
  maxPayload: number;
}

export type Validated =
  | { ok: true; offset: number; length: number }
  | { ok: false; errno: number; message: string };

const ALLOWED_FLAGS: Record<number, number> = {
  [C.NBD_CMD_READ]: C.NBD_CMD_FLAG_FUA | C.NBD_CMD_FLAG_DF,
  [C.NBD_CMD_WRITE]: C.NBD_CMD_FLAG_FUA,
  [C.NBD_CMD_FLUSH]: C.NBD_CMD_FLAG_FUA,
  [C.NBD_CMD_TRIM]: C.NBD_CMD_FLAG_FUA,
  [C.NBD_CMD_CACHE]: C.NBD_CMD_FLAG_FUA,
  [C.NBD_CMD_WRITE_ZEROES]: C.NBD_CMD_FLAG_FUA | C.NBD_CMD_FLAG_NO_HOLE | C.NBD_CMD_FLAG_FAST_ZERO,
  [C.NBD_CMD_BLOCK_STATUS]: C.NBD_CMD_FLAG_FUA | C.NBD_CMD_FLAG_REQ_ONE,
};

export const COMMAND_NAMES: Record<number, string> = {
  [C.NBD_CMD_READ]: 'read',
  [C.NBD_CMD_WRITE]: 'write',
  [C.NBD_CMD_DISC]: 'disc',
  [C.NBD_CMD_FLUSH]: 'flush',
  [C.NBD_CMD_TRIM]: 'trim',
  [C.NBD_CMD_CACHE]: 'cache',
  [C.NBD_CMD_WRITE_ZEROES]: 'write_zeroes',
  [C.NBD_CMD_BLOCK_STATUS]: 'block_status',
};

function fail(errno: number, message: string): Validated {
  return { ok: false, errno, message };
}

export function validateRequest(req: Request, ctx: ValidationContext): Validated {
  const name = COMMAND_NAMES[req.type];
  const allowed = ALLOWED_FLAGS[req.type];
  if (name === undefined || allowed === undefined) return fail(C.NBD_EINVAL, `unknown command ${req.type}`);
  if ((req.flags & ~allowed) !== 0) {
    return fail(C.NBD_EINVAL, `${name}: invalid flags 0x${req.flags.toString(16)}`);
  }
  if ((req.flags & C.NBD_CMD_FLAG_DF) && !ctx.structuredReplies) {
    return fail(C.NBD_EINVAL, `${name}: DF flag without structured replies`);
  }
  const isWriteType = req.type === C.NBD_CMD_WRITE || req.type === C.NBD_CMD_TRIM || req.type === C.NBD_CMD_WRITE_ZEROES;
  if (isWriteType && ctx.readOnly) return fail(C.NBD_EPERM, `${name}: export is read-only`);

  if (req.type === C.NBD_CMD_FLUSH) {
    if (req.offset !== 0n || req.length !== 0) return fail(C.NBD_EINVAL, 'flush: offset and length must be 0');
    return { ok: true, offset: 0, length: 0 };
  }
  if (req.type === C.NBD_CMD_BLOCK_STATUS) {
    if (!ctx.blockStatusEnabled) return fail(C.NBD_EINVAL, 'block_status: no metadata context was negotiated');
    if (req.length === 0) return fail(C.NBD_EINVAL, 'block_status: length must not be 0');
  }
  if (req.type === C.NBD_CMD_READ && req.length > ctx.maxPayload) {
    return fail((req.flags & C.NBD_CMD_FLAG_DF) ? C.NBD_EOVERFLOW : C.NBD_EINVAL,
      `read: length ${req.length} exceeds the maximum ${ctx.maxPayload}`);
  }
  // offset (u64) + length (u32) cannot overflow a bigint; compare before narrowing to number.
  if (req.offset + BigInt(req.length) > BigInt(ctx.size)) {
    const errno = req.type === C.NBD_CMD_WRITE || req.type === C.NBD_CMD_WRITE_ZEROES ? C.NBD_ENOSPC : C.NBD_EINVAL;
    return fail(errno, `${name}: offset and length out of range: offset=${req.offset} length=${req.length} size=${ctx.size}`);
  }
  return { ok: true, offset: Number(req.offset), length: req.length };
}

export interface TransmissionFlagOptions {
  readOnly: boolean;
  structuredReplies: boolean;
}

/**
 * What we advertise, and why each bit is honest: FLUSH/FUA go through the backend's flush
 * path; TRIM and WRITE_ZEROES are map operations, so FAST_ZERO is always fast; one backend
 * object per export makes CAN_MULTI_CONN true; reads are never fragmented, so DF holds
 * whenever structured replies are on; CACHE is a read-ahead hint.
 */
export function transmissionFlags(o: TransmissionFlagOptions): number {
  let f = C.NBD_FLAG_HAS_FLAGS | C.NBD_FLAG_SEND_FLUSH | C.NBD_FLAG_SEND_FUA | C.NBD_FLAG_CAN_MULTI_CONN | C.NBD_FLAG_SEND_CACHE;
  if (o.readOnly) f |= C.NBD_FLAG_READ_ONLY;
  else f |= C.NBD_FLAG_SEND_TRIM | C.NBD_FLAG_SEND_WRITE_ZEROES | C.NBD_FLAG_SEND_FAST_ZERO;
  if (o.structuredReplies) f |= C.NBD_FLAG_SEND_DF;
  return f;
}

/**
 * Make extents' lengths multiples of `align` (the advertised minimum block size), as the
 * spec requires of BLOCK_STATUS, except at the end of the export. A block that straddles
 * extents with different flags gets the AND of their flags: a block is reported as a hole
 * (or as zero) only if all of it is. Trailing partial blocks are dropped when something
 * precedes them (extents may stop early).
 */
export function alignExtents(extents: readonly { length: number; flags: number }[], start: number, align: number, exportSize: number): { length: number; flags: number }[] {
  if (start % align !== 0) return extents.map((e) => ({ length: e.length, flags: e.flags }));
  const out: { length: number; flags: number }[] = [];
  let outEnd = start;
  const push = (end: number, flags: number): void => {
    const last = out[out.length - 1];
    if (last && last.flags === flags) last.length += end - outEnd;
    else out.push({ length: end - outEnd, flags });
    outEnd = end;
  };
  let partial: { blockStart: number; flags: number } | null = null;
  let pos = start;
  for (const e of extents) {
    // Extents may run past the export's end; nothing there is reported.
    const end = Math.min(pos + e.length, exportSize);
    while (pos < end) {
      const bs = pos - (pos % align);
      const be = Math.min(bs + align, exportSize);
      if (pos === bs && end >= be) {
        const runEnd = end >= exportSize ? exportSize : end - (end % align);
        push(runEnd, e.flags);
        pos = runEnd;
      } else {
        const flags: number = partial && partial.blockStart === bs ? partial.flags & e.flags : e.flags;
        partial = { blockStart: bs, flags };
        pos = Math.min(end, be);
        if (pos === be) { push(be, flags); partial = null; }
      }
    }
    if (pos >= exportSize) return out;
  }
  if (out.length === 0 && partial) out.push({ length: pos - partial.blockStart, flags: partial.flags });
  return out;
}

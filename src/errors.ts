/**
 * Typed errors with stable codes (undici style). Every failure that can reach a
 * client or a user is one of these; `nbd/errno.ts` maps them to NBD errnos in one
 * place, and the CLI prints `message` (which says what to do) and exits non-zero.
 *
 * Grouped by what the caller must do:
 * - retry later:      StoreUnavailableError
 * - fix the input:    InvalidArgumentError, OutOfRangeError, NotFoundError, AlreadyExistsError
 * - not allowed:      ReadOnlyError, LeaseHeldError, NotSupportedError, TlsRequiredError
 * - peer not trusted: TlsError (a TLS handshake failed, or the client's certificate or key was refused)
 * - fix the setup:    MisconfiguredError (this process disagrees with what the store records),
 *                     StoreUnsafeError (the store breaks a guarantee baton relies on)
 * - caller's choice:  AbortedError (the AbortSignal given to an API call fired)
 * - terminal:         FencedError (another host took the volume), ShutdownError, CorruptError
 *                     (ChecksumError: stored data failed its check: EIO, never the bytes)
 * - give the key:     KeyError (an encrypted volume without its master key, or with another)
 */

export type BatonErrorCode =
  | 'BATON_ERR_INVALID_ARGUMENT'
  | 'BATON_ERR_OUT_OF_RANGE'
  | 'BATON_ERR_NO_SPACE'
  | 'BATON_ERR_READ_ONLY'
  | 'BATON_ERR_NOT_SUPPORTED'
  | 'BATON_ERR_NOT_FOUND'
  | 'BATON_ERR_ALREADY_EXISTS'
  | 'BATON_ERR_PRECONDITION_FAILED'
  | 'BATON_ERR_STORE_UNAVAILABLE'
  | 'BATON_ERR_STORE_UNSAFE'
  | 'BATON_ERR_MISCONFIGURED'
  | 'BATON_ERR_IO'
  | 'BATON_ERR_LEASE_HELD'
  | 'BATON_ERR_LEASE_LOST'
  | 'BATON_ERR_FENCED'
  | 'BATON_ERR_SHUTDOWN'
  | 'BATON_ERR_CORRUPT'
  | 'BATON_ERR_TIMEOUT'
  | 'BATON_ERR_PROTOCOL'
  | 'BATON_ERR_TLS'
  | 'BATON_ERR_TLS_REQUIRED'
  | 'BATON_ERR_KEY'
  | 'BATON_ERR_ABORTED';

export class BatonError extends Error {
  readonly code: BatonErrorCode;
  constructor(code: BatonErrorCode, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.code = code;
  }
}

/** Bad input from a client or a user: fix the request. */
export class InvalidArgumentError extends BatonError {
  constructor(message: string) { super('BATON_ERR_INVALID_ARGUMENT', message); }
}

/** A read, trim or block-status past the end of the volume. */
export class OutOfRangeError extends BatonError {
  constructor(message: string) { super('BATON_ERR_OUT_OF_RANGE', message); }
}

/** A write past the end of the volume (NBD says ENOSPC for this). */
export class NoSpaceError extends BatonError {
  constructor(message: string) { super('BATON_ERR_NO_SPACE', message); }
}

export class ReadOnlyError extends BatonError {
  constructor(message: string) { super('BATON_ERR_READ_ONLY', message); }
}

/** The operation cannot be done the way it was asked (e.g. FAST_ZERO that would not be fast). */
export class NotSupportedError extends BatonError {
  constructor(message: string) { super('BATON_ERR_NOT_SUPPORTED', message); }
}

export class NotFoundError extends BatonError {
  constructor(message: string) { super('BATON_ERR_NOT_FOUND', message); }
}

export class AlreadyExistsError extends BatonError {
  constructor(message: string) { super('BATON_ERR_ALREADY_EXISTS', message); }
}

/** A create-only (If-None-Match: *) put found the key taken. The store's word, not ours. */
export class PreconditionFailedError extends BatonError {
  constructor(message: string) { super('BATON_ERR_PRECONDITION_FAILED', message); }
}

/** The object store did not answer or answered with a transient error: retry later. */
export class StoreUnavailableError extends BatonError {
  constructor(message: string, options?: { cause?: unknown }) { super('BATON_ERR_STORE_UNAVAILABLE', message, options); }
}

/**
 * The store breaks a guarantee baton relies on: create-only puts (fencing would be a lie),
 * metadata that survives a put (ambiguous puts could not be resolved), complete listings
 * (GC and fork points would work from a partial view).
 */
export class StoreUnsafeError extends BatonError {
  constructor(message: string) { super('BATON_ERR_STORE_UNSAFE', message); }
}

/**
 * This process's configuration disagrees with the one the store records for every host (e.g.
 * BATON_MAX_OPERATION_MS, on which GC's safety rests), or with the host's environment (a
 * clock the store refuses). Not retryable: the message says what to change.
 */
export class MisconfiguredError extends BatonError {
  constructor(message: string, options?: { cause?: unknown }) { super('BATON_ERR_MISCONFIGURED', message, options); }
}

/** A local I/O failure (cache disk, local file backend). */
export class IoError extends BatonError {
  constructor(message: string, options?: { cause?: unknown }) { super('BATON_ERR_IO', message, options); }
}

/** Another host holds the volume's lease. The message names the holder. */
export class LeaseHeldError extends BatonError {
  constructor(message: string) { super('BATON_ERR_LEASE_HELD', message); }
}

/** This host's lease could not be renewed in time; it stops acknowledging writes. */
export class LeaseLostError extends BatonError {
  constructor(message: string) { super('BATON_ERR_LEASE_LOST', message); }
}

/** A newer holder committed a takeover record: this host can never write this volume again under its old token. */
export class FencedError extends BatonError {
  constructor(message: string) { super('BATON_ERR_FENCED', message); }
}

export class ShutdownError extends BatonError {
  constructor(message: string) { super('BATON_ERR_SHUTDOWN', message); }
}

/** Stored metadata failed validation: do not guess, stop and report. */
export class CorruptError extends BatonError {
  constructor(message: string) { super('BATON_ERR_CORRUPT', message); }
}

/**
 * A frame of stored data failed its check (crc, length, or AES-GCM authentication): bit rot,
 * a truncated or foreign object, or tampering. The read fails (EIO to the client) rather than
 * return those bytes; the object and frame are named so an operator can find them.
 */
export class ChecksumError extends CorruptError {
  constructor(readonly objectKey: string, readonly frame: number, readonly reason: string) {
    super(`${objectKey}: frame ${frame} failed its check (${reason})`);
  }
}

/**
 * An encrypted volume cannot be opened with the key this process has: none was given, it is
 * another key than the volume's, or the volume's data key does not unwrap with it. Give the
 * right master key (--key-file, BATON_KEY_FILE, BATON_KEY). Refused at attach, before any read.
 */
export class KeyError extends BatonError {
  constructor(message: string) { super('BATON_ERR_KEY', message); }
}

export class TimeoutError extends BatonError {
  constructor(message: string) { super('BATON_ERR_TIMEOUT', message); }
}

/** The peer broke a MUST of the NBD protocol (bad magic, unknown client flags): the connection is dropped. */
export class ProtocolError extends BatonError {
  constructor(message: string) { super('BATON_ERR_PROTOCOL', message); }
}

/**
 * A TLS handshake did not produce a trusted session: the client's certificate, PSK identity
 * or key was refused, or the handshake itself failed or stalled. The connection is closed;
 * `identity` is what the client claimed, when it got that far (for the log line).
 */
export class TlsError extends BatonError {
  constructor(message: string, readonly identity?: string, options?: { cause?: unknown }) { super('BATON_ERR_TLS', message, options); }
}

/** An option other than STARTTLS or ABORT before TLS, on a server that requires TLS (NBD_REP_ERR_TLS_REQD). */
export class TlsRequiredError extends BatonError {
  constructor(message: string) { super('BATON_ERR_TLS_REQUIRED', message); }
}

/**
 * The AbortSignal an API call was given fired (src/api.ts). Checked between the steps of an
 * operation, never inside one: what the steps already did stands, as each says.
 */
export class AbortedError extends BatonError {
  constructor(message: string, options?: { cause?: unknown }) { super('BATON_ERR_ABORTED', message, options); }
}

export function isBatonError(err: unknown, code?: BatonErrorCode): err is BatonError {
  return err instanceof BatonError && (code === undefined || err.code === code);
}

export function errorMessage(err: unknown): string {
  if (err instanceof Error) return err.message;
  return String(err);
}

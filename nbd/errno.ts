/**
 * The one place where errors become NBD errnos (proto.md "Error values"). Everything not
 * listed is EIO: the kernel turns every error into EIO anyway, and EIO is the answer that
 * never lets a client believe a write or flush succeeded.
 */

import { BatonError } from '../src/errors.js';
import * as C from './constants.js';

export function toNbdErrno(err: unknown): number {
  if (!(err instanceof BatonError)) return C.NBD_EIO;
  switch (err.code) {
    case 'BATON_ERR_INVALID_ARGUMENT':
    case 'BATON_ERR_OUT_OF_RANGE':
      return C.NBD_EINVAL;
    case 'BATON_ERR_NO_SPACE':
      return C.NBD_ENOSPC;
    case 'BATON_ERR_READ_ONLY':
      return C.NBD_EPERM;
    case 'BATON_ERR_NOT_SUPPORTED':
      return C.NBD_ENOTSUP;
    case 'BATON_ERR_SHUTDOWN':
      return C.NBD_ESHUTDOWN;
    default:
      return C.NBD_EIO;
  }
}

/** The option-haggling counterpart: which NBD_REP_ERR_* a failed open becomes. */
export function toOptionError(err: unknown): number {
  if (!(err instanceof BatonError)) return C.NBD_REP_ERR_PLATFORM;
  switch (err.code) {
    case 'BATON_ERR_NOT_FOUND':
    case 'BATON_ERR_INVALID_ARGUMENT':
      return C.NBD_REP_ERR_UNKNOWN;
    case 'BATON_ERR_LEASE_HELD':
    case 'BATON_ERR_FENCED':
    case 'BATON_ERR_KEY': // an encrypted volume without its key: refused, with the message saying which key
      return C.NBD_REP_ERR_POLICY;
    case 'BATON_ERR_SHUTDOWN':
      return C.NBD_REP_ERR_SHUTDOWN;
    case 'BATON_ERR_TLS_REQUIRED':
      return C.NBD_REP_ERR_TLS_REQD;
    default:
      return C.NBD_REP_ERR_PLATFORM;
  }
}

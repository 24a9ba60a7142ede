/**
 * NBD wire constants, named as in NetworkBlockDevice/nbd doc/proto.md (cross-checked
 * against libnbd lib/nbd-protocol.h, which the notes found most trustworthy: the option
 * reply magic is 64-bit, the BLOCK_STATUS chunk is 5 and the ERROR chunk is 0x8001).
 */

export const NBDMAGIC = 0x4e42444d41474943n; // "NBDMAGIC"
export const IHAVEOPT = 0x49484156454f5054n; // "IHAVEOPT"
export const NBD_REP_MAGIC = 0x0003e889045565a9n;
export const NBD_REQUEST_MAGIC = 0x25609513;
export const NBD_SIMPLE_REPLY_MAGIC = 0x67446698;
export const NBD_STRUCTURED_REPLY_MAGIC = 0x668e33ef;
export const NBD_EXTENDED_REQUEST_MAGIC = 0x21e41c71;

// Handshake flags (server, u16)
export const NBD_FLAG_FIXED_NEWSTYLE = 1 << 0;
export const NBD_FLAG_NO_ZEROES = 1 << 1;
// Client flags (u32)
export const NBD_FLAG_C_FIXED_NEWSTYLE = 1 << 0;
export const NBD_FLAG_C_NO_ZEROES = 1 << 1;

// Options
export const NBD_OPT_EXPORT_NAME = 1;
export const NBD_OPT_ABORT = 2;
export const NBD_OPT_LIST = 3;
export const NBD_OPT_PEEK_EXPORT = 4;
export const NBD_OPT_STARTTLS = 5;
export const NBD_OPT_INFO = 6;
export const NBD_OPT_GO = 7;
export const NBD_OPT_STRUCTURED_REPLY = 8;
export const NBD_OPT_LIST_META_CONTEXT = 9;
export const NBD_OPT_SET_META_CONTEXT = 10;
export const NBD_OPT_EXTENDED_HEADERS = 11;

// Option reply types
export const NBD_REP_ACK = 1;
export const NBD_REP_SERVER = 2;
export const NBD_REP_INFO = 3;
export const NBD_REP_META_CONTEXT = 4;
export const NBD_REP_ERR_UNSUP = 0x80000001;
export const NBD_REP_ERR_POLICY = 0x80000002;
export const NBD_REP_ERR_INVALID = 0x80000003;
export const NBD_REP_ERR_PLATFORM = 0x80000004;
export const NBD_REP_ERR_TLS_REQD = 0x80000005;
export const NBD_REP_ERR_UNKNOWN = 0x80000006;
export const NBD_REP_ERR_SHUTDOWN = 0x80000007;
export const NBD_REP_ERR_BLOCK_SIZE_REQD = 0x80000008;
export const NBD_REP_ERR_TOO_BIG = 0x80000009;

// Info types
export const NBD_INFO_EXPORT = 0;
export const NBD_INFO_NAME = 1;
export const NBD_INFO_DESCRIPTION = 2;
export const NBD_INFO_BLOCK_SIZE = 3;

// Transmission flags (u16)
export const NBD_FLAG_HAS_FLAGS = 1 << 0;
export const NBD_FLAG_READ_ONLY = 1 << 1;
export const NBD_FLAG_SEND_FLUSH = 1 << 2;
export const NBD_FLAG_SEND_FUA = 1 << 3;
export const NBD_FLAG_ROTATIONAL = 1 << 4;
export const NBD_FLAG_SEND_TRIM = 1 << 5;
export const NBD_FLAG_SEND_WRITE_ZEROES = 1 << 6;
export const NBD_FLAG_SEND_DF = 1 << 7;
export const NBD_FLAG_CAN_MULTI_CONN = 1 << 8;
export const NBD_FLAG_SEND_RESIZE = 1 << 9;
export const NBD_FLAG_SEND_CACHE = 1 << 10;
export const NBD_FLAG_SEND_FAST_ZERO = 1 << 11;

// Commands
export const NBD_CMD_READ = 0;
export const NBD_CMD_WRITE = 1;
export const NBD_CMD_DISC = 2;
export const NBD_CMD_FLUSH = 3;
export const NBD_CMD_TRIM = 4;
export const NBD_CMD_CACHE = 5;
export const NBD_CMD_WRITE_ZEROES = 6;
export const NBD_CMD_BLOCK_STATUS = 7;

// Command flags (u16)
export const NBD_CMD_FLAG_FUA = 1 << 0;
export const NBD_CMD_FLAG_NO_HOLE = 1 << 1;
export const NBD_CMD_FLAG_DF = 1 << 2;
export const NBD_CMD_FLAG_REQ_ONE = 1 << 3;
export const NBD_CMD_FLAG_FAST_ZERO = 1 << 4;

// Structured reply
export const NBD_REPLY_FLAG_DONE = 1 << 0;
export const NBD_REPLY_TYPE_NONE = 0;
export const NBD_REPLY_TYPE_OFFSET_DATA = 1;
export const NBD_REPLY_TYPE_OFFSET_HOLE = 2;
export const NBD_REPLY_TYPE_BLOCK_STATUS = 5;
export const NBD_REPLY_TYPE_ERROR = 0x8001;
export const NBD_REPLY_TYPE_ERROR_OFFSET = 0x8002;

// base:allocation status flags
export const NBD_STATE_HOLE = 1 << 0;
export const NBD_STATE_ZERO = 1 << 1;

// Errors (NBD errno values, not the host's)
export const NBD_EPERM = 1;
export const NBD_EIO = 5;
export const NBD_ENOMEM = 12;
export const NBD_EINVAL = 22;
export const NBD_ENOSPC = 28;
export const NBD_EOVERFLOW = 75;
export const NBD_ENOTSUP = 95;
export const NBD_ESHUTDOWN = 108;

export const BASE_ALLOCATION = 'base:allocation';

/** Sizes of fixed frames. */
export const GREETING_SIZE = 18;
export const OPTION_HEADER_SIZE = 16;
export const OPTION_REPLY_HEADER_SIZE = 20;
export const REQUEST_SIZE = 28;
export const SIMPLE_REPLY_SIZE = 16;
export const STRUCTURED_REPLY_HEADER_SIZE = 20;

/** The spec's hard cap for strings in option payloads. */
export const NBD_MAX_STRING = 4096;

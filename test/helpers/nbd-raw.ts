/**
 * A tiny hand-written NBD client for bad-input tests: it can send anything, including what a
 * real client never would. Frame layouts are written here from the spec (NetworkBlockDevice/nbd
 * doc/proto.md, "Fixed newstyle negotiation" and "Transmission"), deliberately NOT imported from
 * nbd/codec.ts, so a codec bug cannot hide behind a test that shares it.
 *
 * All integers big-endian. Only simple replies are parsed (we never ask for structured replies).
 */

import * as net from 'node:net';

// ------------------------------------------------------------------ constants (proto.md)

export const NBDMAGIC = 0x4e42444d41474943n; // "NBDMAGIC"
export const IHAVEOPT = 0x49484156454f5054n; // "IHAVEOPT"
export const OPTION_REPLY_MAGIC = 0x0003e889045565a9n;
export const REQUEST_MAGIC = 0x25609513;
export const SIMPLE_REPLY_MAGIC = 0x67446698;

export const FLAG_FIXED_NEWSTYLE = 1;
export const FLAG_NO_ZEROES = 2;

export const OPT = {
  EXPORT_NAME: 1,
  ABORT: 2,
  LIST: 3,
  STARTTLS: 5,
  INFO: 6,
  GO: 7,
  STRUCTURED_REPLY: 8,
} as const;

export const REP = {
  ACK: 1,
  SERVER: 2,
  INFO: 3,
  META_CONTEXT: 4,
  ERR_UNSUP: 0x80000001,
  ERR_POLICY: 0x80000002,
  ERR_INVALID: 0x80000003,
  ERR_UNKNOWN: 0x80000006,
} as const;

export const INFO = { EXPORT: 0, NAME: 1, DESCRIPTION: 2, BLOCK_SIZE: 3 } as const;

export const TFLAG = {
  HAS_FLAGS: 0x0001,
  READ_ONLY: 0x0002,
  SEND_FLUSH: 0x0004,
  SEND_FUA: 0x0008,
  SEND_TRIM: 0x0020,
  SEND_WRITE_ZEROES: 0x0040,
  CAN_MULTI_CONN: 0x0100,
} as const;

export const CMD = { READ: 0, WRITE: 1, DISC: 2, FLUSH: 3, TRIM: 4, CACHE: 5, WRITE_ZEROES: 6, BLOCK_STATUS: 7 } as const;
export const CMD_FLAG_FUA = 0x01;

export const ERRNO = { OK: 0, EPERM: 1, EIO: 5, ENOMEM: 12, EINVAL: 22, ENOSPC: 28, EOVERFLOW: 75, ENOTSUP: 95, ESHUTDOWN: 108 } as const;

// ------------------------------------------------------------------ frame builders

/** Client flags answer to the greeting: u32. */
export function clientFlagsFrame(flags: number): Buffer {
  const b = Buffer.alloc(4);
  b.writeUInt32BE(flags >>> 0, 0);
  return b;
}

/** Option request: u64 magic, u32 option, u32 length, data. `length` may lie (for bad-input tests). */
export function optionFrame(option: number, data: Buffer = Buffer.alloc(0), opts: { magic?: bigint; length?: number } = {}): Buffer {
  const h = Buffer.alloc(16);
  h.writeBigUInt64BE(opts.magic ?? IHAVEOPT, 0);
  h.writeUInt32BE(option >>> 0, 8);
  h.writeUInt32BE((opts.length ?? data.length) >>> 0, 12);
  return Buffer.concat([h, data]);
}

/** INFO/GO data: u32 name length, name, u16 number of info requests, u16 each. */
export function infoGoData(name: string, infoTypes: number[] = []): Buffer {
  const n = Buffer.from(name, 'utf8');
  const b = Buffer.alloc(4 + n.length + 2 + 2 * infoTypes.length);
  b.writeUInt32BE(n.length, 0);
  n.copy(b, 4);
  b.writeUInt16BE(infoTypes.length, 4 + n.length);
  infoTypes.forEach((t, i) => b.writeUInt16BE(t, 6 + n.length + 2 * i));
  return b;
}

export interface RequestFields {
  flags?: number;
  type: number;
  cookie: bigint;
  offset: bigint;
  length: number;
  magic?: number;
}

/** Request: u32 magic, u16 flags, u16 type, u64 cookie, u64 offset, u32 length (28 bytes), then payload. */
export function requestFrame(r: RequestFields, payload?: Buffer): Buffer {
  const h = Buffer.alloc(28);
  h.writeUInt32BE((r.magic ?? REQUEST_MAGIC) >>> 0, 0);
  h.writeUInt16BE(r.flags ?? 0, 4);
  h.writeUInt16BE(r.type, 6);
  h.writeBigUInt64BE(r.cookie, 8);
  h.writeBigUInt64BE(r.offset, 16);
  h.writeUInt32BE(r.length >>> 0, 24);
  return payload ? Buffer.concat([h, payload]) : h;
}

// ------------------------------------------------------------------ frame parsers

export interface OptionReply {
  magic: bigint;
  option: number;
  type: number;
  data: Buffer;
}

export interface SimpleReply {
  magic: number;
  error: number;
  cookie: bigint;
}

export class ClosedError extends Error {
  constructor(readonly partial: Buffer) {
    super(`connection closed by the server (${partial.length} bytes left unread)`);
  }
}

export class ReadTimeoutError extends Error {}

// ------------------------------------------------------------------ the client

export type Address = string | { host: string; port: number };

export class RawClient {
  private buf: Buffer = Buffer.alloc(0);
  private waiter: (() => void) | null = null;
  private closedFlag = false;
  private readonly closedP: Promise<void>;
  /** Every byte ever received, for "the server sent nothing" assertions. */
  received = 0;

  private constructor(readonly sock: net.Socket) {
    this.closedP = new Promise((resolve) => {
      const done = (): void => {
        if (!this.closedFlag) {
          this.closedFlag = true;
          this.wake();
          resolve();
        }
      };
      sock.on('end', done);
      sock.on('close', done);
      sock.on('error', done);
    });
    sock.on('data', (d: Buffer) => {
      this.received += d.length;
      this.buf = this.buf.length === 0 ? d : Buffer.concat([this.buf, d]);
      this.wake();
    });
  }

  static connect(addr: Address): Promise<RawClient> {
    return new Promise((resolve, reject) => {
      const s = typeof addr === 'string' ? net.connect(addr) : net.connect(addr.port, addr.host);
      s.setNoDelay?.(true);
      s.once('connect', () => { s.off('error', reject); resolve(new RawClient(s)); });
      s.once('error', reject);
    });
  }

  private wake(): void {
    const w = this.waiter;
    this.waiter = null;
    w?.();
  }

  get closed(): boolean { return this.closedFlag; }
  get buffered(): number { return this.buf.length; }

  /** Exactly n bytes; rejects with ClosedError if the server hangs up first, ReadTimeoutError on timeout. */
  async read(n: number, timeoutMs = 10_000): Promise<Buffer> {
    const deadline = Date.now() + timeoutMs;
    while (this.buf.length < n) {
      if (this.closedFlag) throw new ClosedError(this.buf);
      const left = deadline - Date.now();
      if (left <= 0) throw new ReadTimeoutError(`timed out waiting for ${n} bytes (have ${this.buf.length})`);
      await new Promise<void>((resolve) => {
        const wake = (): void => { clearTimeout(timer); resolve(); };
        const timer = setTimeout(() => { if (this.waiter === wake) this.waiter = null; resolve(); }, left);
        this.waiter = wake;
      });
    }
    const out = this.buf.subarray(0, n);
    this.buf = this.buf.subarray(n);
    return Buffer.from(out);
  }

  write(b: Buffer): Promise<void> {
    return new Promise((resolve, reject) => {
      if (this.sock.destroyed) { reject(new Error('socket destroyed')); return; }
      this.sock.write(b, (err) => (err ? reject(err) : resolve()));
    });
  }

  /** Resolves true if the server closed the connection within timeoutMs. */
  async waitClosed(timeoutMs: number): Promise<boolean> {
    if (this.closedFlag) return true;
    let timer: NodeJS.Timeout | undefined;
    const r = await Promise.race([
      this.closedP.then(() => true),
      new Promise<boolean>((resolve) => { timer = setTimeout(() => resolve(false), timeoutMs); }),
    ]);
    clearTimeout(timer);
    return r;
  }

  /** Drop whatever is buffered and return it. */
  drain(): Buffer {
    const b = this.buf;
    this.buf = Buffer.alloc(0);
    return b;
  }

  destroy(): void {
    this.sock.destroy();
  }

  // -------------------------------------------------------------- handshake

  /** Read the 18-byte greeting; returns its handshake flags after checking both magics. */
  async greeting(): Promise<number> {
    const g = await this.read(18);
    if (g.readBigUInt64BE(0) !== NBDMAGIC) throw new Error(`bad greeting magic ${g.subarray(0, 8).toString('hex')}`);
    if (g.readBigUInt64BE(8) !== IHAVEOPT) throw new Error(`bad greeting option magic ${g.subarray(8, 16).toString('hex')}`);
    return g.readUInt16BE(16);
  }

  async optionReply(): Promise<OptionReply> {
    const h = await this.read(20);
    const len = h.readUInt32BE(16);
    return { magic: h.readBigUInt64BE(0), option: h.readUInt32BE(8), type: h.readUInt32BE(12), data: await this.read(len) };
  }

  /** Send one option and collect replies up to the final one (ACK or an error). */
  async option(option: number, data?: Buffer): Promise<OptionReply[]> {
    await this.write(optionFrame(option, data));
    const out: OptionReply[] = [];
    for (;;) {
      const r = await this.optionReply();
      out.push(r);
      if (r.type === REP.ACK || (r.type & 0x80000000) !== 0) return out;
    }
  }

  /**
   * Greeting + client flags (FIXED_NEWSTYLE|NO_ZEROES) + GO without structured replies.
   * Returns the export size and transmission flags from NBD_INFO_EXPORT.
   */
  async handshakeGo(name: string): Promise<{ size: bigint; eflags: number }> {
    await this.greeting();
    await this.write(clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
    return this.go(name);
  }

  async go(name: string): Promise<{ size: bigint; eflags: number }> {
    const replies = await this.option(OPT.GO, infoGoData(name));
    const last = replies[replies.length - 1]!;
    if (last.type !== REP.ACK) throw new Error(`GO ${name} failed: reply type 0x${last.type.toString(16)} ${last.data.toString('utf8')}`);
    const exp = replies.find((r) => r.type === REP.INFO && r.data.readUInt16BE(0) === INFO.EXPORT);
    if (!exp || exp.data.length !== 12) throw new Error('GO reply lacks a well-formed NBD_INFO_EXPORT');
    return { size: exp.data.readBigUInt64BE(2), eflags: exp.data.readUInt16BE(10) };
  }

  // -------------------------------------------------------------- transmission (simple replies)

  async simpleReply(timeoutMs?: number): Promise<SimpleReply> {
    const h = await this.read(16, timeoutMs);
    return { magic: h.readUInt32BE(0), error: h.readUInt32BE(4), cookie: h.readBigUInt64BE(8) };
  }

  /** READ; returns the error and, on success, exactly `length` bytes. */
  async readAt(cookie: bigint, offset: bigint, length: number, flags = 0): Promise<{ reply: SimpleReply; data: Buffer | null }> {
    await this.write(requestFrame({ type: CMD.READ, flags, cookie, offset, length }));
    const reply = await this.simpleReply();
    const data = reply.magic === SIMPLE_REPLY_MAGIC && reply.error === 0 ? await this.read(length) : null;
    return { reply, data };
  }

  async writeAt(cookie: bigint, offset: bigint, data: Buffer, flags = 0): Promise<SimpleReply> {
    await this.write(requestFrame({ type: CMD.WRITE, flags, cookie, offset, length: data.length }, data));
    return this.simpleReply();
  }

  async command(r: RequestFields): Promise<SimpleReply> {
    await this.write(requestFrame(r));
    return this.simpleReply();
  }

  async disconnect(): Promise<void> {
    await this.write(requestFrame({ type: CMD.DISC, cookie: 0n, offset: 0n, length: 0 }));
    this.sock.end();
  }
}

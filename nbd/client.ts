/**
 * A minimal NBD client: fixed newstyle handshake with NBD_OPT_GO, then CACHE and DISC with
 * simple replies (no structured replies are asked for). What `baton prefetch` needs to ask a
 * running server to warm its read cache (NBD_CMD_CACHE, doc/proto.md "Request types"); not a
 * general client (nbdinfo, nbdcopy, qemu and the kernel are those).
 *
 * Frames follow doc/proto.md: "Fixed newstyle negotiation" (option haggling, NBD_REP_INFO with
 * NBD_INFO_EXPORT, NBD_REP_ACK) and "Transmission" (request and simple reply headers). All
 * integers are big-endian.
 */

import * as net from 'node:net';
import * as C from './constants.js';
import type { ListenAddress } from './server.js';

const NBDMAGIC = 0x4e42444d41474943n;
const IHAVEOPT = 0x49484156454f5054n;
const OPTION_REPLY_MAGIC = 0x0003e889045565a9n;
const REP_ERR_BIT = 0x80000000;

/** Exact-length reads over a socket's byte stream. */
class ByteReader {
  private chunks: Buffer[] = [];
  private have = 0;
  private want: { n: number; resolve: (b: Buffer) => void; reject: (e: Error) => void } | null = null;
  private failed: Error | null = null;

  constructor(sock: net.Socket) {
    sock.on('data', (d: Buffer) => { this.chunks.push(d); this.have += d.length; this.pump(); });
    sock.on('error', (e) => this.fail(e));
    sock.on('close', () => this.fail(new Error('the NBD server closed the connection')));
  }

  private fail(e: Error): void {
    this.failed ??= e;
    const w = this.want;
    if (w) { this.want = null; w.reject(e); }
  }

  private pump(): void {
    const w = this.want;
    if (!w || this.have < w.n) return;
    const all = this.chunks.length === 1 ? this.chunks[0]! : Buffer.concat(this.chunks);
    const out = all.subarray(0, w.n);
    const rest = all.subarray(w.n);
    this.chunks = rest.length > 0 ? [rest] : [];
    this.have = rest.length;
    this.want = null;
    w.resolve(out);
  }

  read(n: number): Promise<Buffer> {
    if (this.want) return Promise.reject(new Error('internal error: overlapping reads'));
    if (n === 0) return Promise.resolve(Buffer.alloc(0));
    return new Promise<Buffer>((resolve, reject) => {
      this.want = { n, resolve, reject };
      this.pump();
      if (this.want && this.failed) this.fail(this.failed);
    });
  }
}

export class NbdError extends Error {
  constructor(message: string, readonly errno?: number) { super(message); }
}

export class NbdClient {
  private cookie = 1n;
  private readonly pending = new Map<bigint, { resolve: () => void; reject: (e: Error) => void; what: string }>();
  private readonly inflight = new Set<Promise<void>>();
  private closed = false;

  private constructor(private readonly sock: net.Socket, private readonly reader: ByteReader, readonly exportName: string, readonly size: number, readonly flags: number) {
    void this.readReplies();
  }

  /** Connect and negotiate `exportName` with NBD_OPT_GO. */
  static async connect(addr: ListenAddress, exportName: string): Promise<NbdClient> {
    const sock = 'path' in addr ? net.connect(addr.path) : net.connect(addr.port, addr.host);
    const reader = new ByteReader(sock);
    await new Promise<void>((resolve, reject) => {
      sock.once('connect', resolve);
      sock.once('error', reject);
    });
    try {
      const hello = await reader.read(18);
      if (hello.readBigUInt64BE(0) !== NBDMAGIC || hello.readBigUInt64BE(8) !== IHAVEOPT) throw new NbdError('not an NBD server speaking newstyle negotiation');
      const hflags = hello.readUInt16BE(16);
      if (!(hflags & C.NBD_FLAG_FIXED_NEWSTYLE)) throw new NbdError('the NBD server does not speak fixed newstyle negotiation');
      const cflags = C.NBD_FLAG_C_FIXED_NEWSTYLE | (hflags & C.NBD_FLAG_NO_ZEROES ? C.NBD_FLAG_C_NO_ZEROES : 0);
      const cf = Buffer.alloc(4);
      cf.writeUInt32BE(cflags);
      const name = Buffer.from(exportName, 'utf8');
      const data = Buffer.alloc(4 + name.length + 2);
      data.writeUInt32BE(name.length, 0);
      name.copy(data, 4);
      data.writeUInt16BE(0, 4 + name.length); // no information requests: NBD_INFO_EXPORT comes anyway
      const opt = Buffer.alloc(16);
      opt.writeBigUInt64BE(IHAVEOPT, 0);
      opt.writeUInt32BE(C.NBD_OPT_GO, 8);
      opt.writeUInt32BE(data.length, 12);
      sock.write(Buffer.concat([cf, opt, data]));
      let size = -1;
      let flags = 0;
      for (;;) {
        const h = await reader.read(20);
        if (h.readBigUInt64BE(0) !== OPTION_REPLY_MAGIC) throw new NbdError('bad option reply magic from the NBD server');
        const type = h.readUInt32BE(12);
        const body = await reader.read(h.readUInt32BE(16));
        if (type & REP_ERR_BIT) throw new NbdError(`the NBD server refused export "${exportName}": ${body.toString('utf8') || `error 0x${type.toString(16)}`}`);
        if (type === C.NBD_REP_INFO && body.length >= 12 && body.readUInt16BE(0) === C.NBD_INFO_EXPORT) {
          size = Number(body.readBigUInt64BE(2));
          flags = body.readUInt16BE(10);
        } else if (type === C.NBD_REP_ACK) {
          break;
        }
      }
      if (size < 0) throw new NbdError('the NBD server did not say the export\'s size');
      return new NbdClient(sock, reader, exportName, size, flags);
    } catch (err) {
      sock.destroy();
      throw err;
    }
  }

  private async readReplies(): Promise<void> {
    try {
      for (;;) {
        const r = await this.reader.read(16);
        if (r.readUInt32BE(0) !== C.NBD_SIMPLE_REPLY_MAGIC) throw new NbdError('bad reply magic from the NBD server (structured replies were not asked for)');
        const errno = r.readUInt32BE(4);
        const cookie = r.readBigUInt64BE(8);
        const p = this.pending.get(cookie);
        if (!p) throw new NbdError(`reply for an unknown request (cookie ${cookie})`);
        this.pending.delete(cookie);
        if (errno === 0) p.resolve();
        else p.reject(new NbdError(`${p.what}: the NBD server answered errno ${errno}`, errno));
      }
    } catch (err) {
      for (const p of this.pending.values()) p.reject(err as Error);
      this.pending.clear();
    }
  }

  private request(type: number, offset: number, length: number, what: string): Promise<void> {
    if (this.closed) return Promise.reject(new NbdError('connection closed'));
    const cookie = this.cookie++;
    const b = Buffer.alloc(28);
    b.writeUInt32BE(C.NBD_REQUEST_MAGIC, 0);
    b.writeUInt16BE(0, 4);
    b.writeUInt16BE(type, 6);
    b.writeBigUInt64BE(cookie, 8);
    b.writeBigUInt64BE(BigInt(offset), 16);
    b.writeUInt32BE(length, 24);
    const p = new Promise<void>((resolve, reject) => this.pending.set(cookie, { resolve, reject, what }));
    this.inflight.add(p);
    void p.catch(() => {}).finally(() => this.inflight.delete(p));
    this.sock.write(b);
    return p;
  }

  /** NBD_CMD_CACHE of [offset, offset+length): resolves when the server has the range warm. */
  cache(offset: number, length: number): Promise<void> {
    if (!(this.flags & C.NBD_FLAG_SEND_CACHE)) return Promise.reject(new NbdError('the NBD server does not take CACHE requests'));
    return this.request(C.NBD_CMD_CACHE, offset, length, `CACHE ${offset}+${length}`);
  }

  /** NBD_CMD_DISC (after the requests in flight were answered) and close. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await Promise.allSettled([...this.inflight]);
    const b = Buffer.alloc(28);
    b.writeUInt32BE(C.NBD_REQUEST_MAGIC, 0);
    b.writeUInt16BE(C.NBD_CMD_DISC, 6);
    await new Promise<void>((resolve) => this.sock.end(b, () => resolve()));
    this.sock.destroy();
  }
}

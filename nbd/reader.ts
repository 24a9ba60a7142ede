/**
 * Incremental frame reader over a Duplex: one 'data' event is not one frame. Frames are
 * taken by exact size; a frame inside one chunk is returned as a subarray (no copy), a
 * frame spanning chunks is copied once. Buffered bytes are bounded: past `highWater` the
 * socket is paused, so a client that floods us cannot grow memory without limit.
 *
 * Bytes arrive one of two ways. By default as Node's 'data' events: a fresh buffer of up to
 * 64 KiB per socket read, which a consumer may keep. After useSlabs() (a net.Socket whose
 * consumer lends its payloads, see lend()), the socket reads into slabs the reader reuses:
 * no allocation per read, up to a slab's free space per read. A slab's bytes then never
 * leave the reader except copied or lent, so once every byte read into a slab is consumed,
 * the slab serves the next reads.
 */

import * as net from 'node:net';
import type { Duplex } from 'node:stream';
import { BatonError } from '../src/errors.js';
import type { Lent } from './backend.js';

export class ConnectionClosedError extends BatonError {
  constructor() { super('BATON_ERR_SHUTDOWN', 'connection closed by peer'); }
}


/**
 * Read slabs. A Unix socket read returns what the peer has queued (up to about 200 KiB with
 * default socket buffers), so one slab takes several reads; a read goes into what is left of
 * the current slab while at least MIN_READ is left. A connection in slab mode always holds
 * the slab its next read goes into, idle or not: 1 MiB, next to the up to maxInflightBytes
 * of request memory it may hold.
 */
const SLAB_BYTES = 1024 * 1024;
const MIN_READ = 64 * 1024;
/** Free slabs kept for reuse, over all connections (the rest are left to the collector). */
const MAX_FREE_SLABS = 16;
const freeSlabs: Buffer[] = [];

class Slab {
  /** Bytes read into the slab and not yet consumed (copied out, or lent and released). */
  pending = 0;
  /** No more reads go into it. */
  private full = false;
  private freed = false;
  constructor(readonly buf: Buffer) {}

  static take(): Slab { return new Slab(freeSlabs.pop() ?? Buffer.allocUnsafeSlow(SLAB_BYTES)); }

  consumed(n: number): void {
    this.pending -= n;
    this.maybeFree();
  }

  retire(): void {
    this.full = true;
    this.maybeFree();
  }

  private maybeFree(): void {
    if (!this.full || this.pending !== 0 || this.freed) return;
    this.freed = true;
    if (freeSlabs.length < MAX_FREE_SLABS) freeSlabs.push(this.buf);
  }
}

export class FrameReader {
  private chunks: Buffer[] = [];
  /** The slab each chunk lies in (null: a buffer from a 'data' event). */
  private owners: (Slab | null)[] = [];
  private head = 0; // offset into chunks[0]
  private buffered = 0;
  private waiter: { n: number; resolve: (b: Buffer) => void; reject: (e: Error) => void } | null = null;
  private piecesWaiter: { n: number; resolve: (x: Lent) => void; reject: (e: Error) => void } | null = null;
  private ended = false;
  private paused = false;
  private slabs = false;

  private readonly onDataEvent = (chunk: Buffer): void => this.onData(chunk, null);
  private readonly onEndEvent = (): void => this.onEnd();

  constructor(private readonly sock: Duplex, private highWater = 64 * 1024 * 1024) {
    sock.on('data', this.onDataEvent);
    sock.on('end', this.onEndEvent);
    sock.on('close', this.onEndEvent);
    sock.on('error', this.onEndEvent);
  }

  /**
   * Stop reading the stream (STARTTLS hands the socket to TLS): the listeners go, and the
   * reader is ended. Returns how many bytes it had buffered and nobody consumed; for
   * STARTTLS that must be 0 (a client may not send anything before the server's ACK), and
   * any such bytes are dropped with the reader. Only before slab mode (useSlabs) and with no
   * read waiting.
   */
  detach(): number {
    if (this.slabs || this.waiter || this.piecesWaiter) throw new Error('FrameReader: detach while reading into slabs or with a read waiting');
    this.sock.off('data', this.onDataEvent);
    this.sock.off('end', this.onEndEvent);
    this.sock.off('close', this.onEndEvent);
    this.sock.off('error', this.onEndEvent);
    if (this.paused) { this.paused = false; this.sock.resume(); }
    const left = this.buffered;
    this.chunks = [];
    this.owners = [];
    this.head = 0;
    this.buffered = 0;
    this.ended = true;
    return left;
  }

  get bufferedBytes(): number { return this.buffered; }

  /** Whether the socket reads into reused slabs (useSlabs succeeded). */
  get readsIntoSlabs(): boolean { return this.slabs; }

  /** Exactly `n` bytes (maybe a subarray of a received chunk), or rejects with ConnectionClosedError. */
  read(n: number): Promise<Buffer> {
    const b = this.tryRead(n);
    if (b) return Promise.resolve(b);
    if (this.ended) return Promise.reject(new ConnectionClosedError());
    if (this.waiter || this.piecesWaiter) return Promise.reject(new Error('FrameReader: concurrent read'));
    if (this.paused && n > this.buffered) this.resume(); // the frame needs more than we hold
    return new Promise((resolve, reject) => { this.waiter = { n, resolve, reject }; });
  }

  /** Synchronous fast path: the frame if it is fully buffered, else null. */
  tryRead(n: number): Buffer | null {
    if (this.buffered < n) return null;
    const out = this.take(n);
    this.resumeIfDrained();
    return out;
  }

  /**
   * Exactly `n` bytes as the received pieces, lent: valid until release(). For a consumer
   * that copies them before it returns (BlockBackend.writeLent); nothing is copied here.
   */
  tryLend(n: number): Lent | null {
    return this.buffered >= n ? this.lendPieces(n) : null;
  }

  lend(n: number): Promise<Lent> {
    const lent = this.tryLend(n);
    return lent ? Promise.resolve(lent) : this.waitPieces(n);
  }

  /**
   * Read a net.Socket into reused slabs from now on instead of Node's fresh buffer per read.
   * This is Node's `onread` option (a buffer generator and a callback), which net.Server
   * offers no way to pass for the sockets it accepts; it is set here the way net.Socket's
   * constructor sets it, on the socket's own symbols. Returns false, and 'data' events stay
   * in charge, for any other stream or a Node whose sockets no longer look that way.
   */
  useSlabs(): boolean {
    if (this.slabs || this.ended || !(this.sock instanceof net.Socket)) return this.slabs;
    const sock = this.sock as net.Socket & Record<symbol, unknown> & { _handle?: { useUserBuffer?: (b: Buffer) => void } };
    const symbols = Object.getOwnPropertySymbols(sock);
    const symbol = (name: string): symbol | undefined => symbols.find((s) => s.description === name);
    const kBuffer = symbol('kBuffer');
    const kBufferGen = symbol('kBufferGen');
    const kBufferCb = symbol('kBufferCb');
    const handle = sock._handle;
    if (!kBuffer || !kBufferGen || !kBufferCb || sock[kBuffer] !== null || typeof handle?.useUserBuffer !== 'function') return false;
    let slab = Slab.take();
    let used = 0;
    // Node calls this after every read for the buffer of the next one.
    const next = (): Buffer => {
      if (slab.buf.length - used < MIN_READ) {
        slab.retire();
        slab = Slab.take();
        used = 0;
      }
      return slab.buf.subarray(used);
    };
    const first = next();
    sock[kBuffer] = first;
    sock[kBufferGen] = next;
    sock[kBufferCb] = (nread: number, buf: Buffer): void => {
      used += nread;
      slab.pending += nread;
      this.onData(buf.subarray(0, nread), slab);
    };
    handle.useUserBuffer(first);
    this.slabs = true;
    return true;
  }

  private waitPieces(n: number): Promise<Lent> {
    if (this.ended) return Promise.reject(new ConnectionClosedError());
    if (this.waiter || this.piecesWaiter) return Promise.reject(new Error('FrameReader: concurrent read'));
    if (this.paused) this.resume();
    return new Promise((resolve, reject) => { this.piecesWaiter = { n, resolve, reject }; });
  }

  /** `n` buffered bytes as subarrays of the chunks they lie in; `owners` gets each one's slab. */
  private takePieces(n: number, owners: (Slab | null)[]): Buffer[] {
    this.buffered -= n;
    const out: Buffer[] = [];
    let left = n;
    while (left > 0) {
      const c = this.chunks[0]!;
      const k = Math.min(c.length - this.head, left);
      out.push(c.subarray(this.head, this.head + k));
      owners.push(this.owners[0] ?? null);
      left -= k;
      this.advance(k);
    }
    this.resumeIfDrained();
    return out;
  }

  private lendPieces(n: number): Lent {
    const owners: (Slab | null)[] = [];
    const chunks = this.takePieces(n, owners);
    let released = false;
    return {
      chunks,
      release: () => {
        if (released) return;
        released = true;
        for (let i = 0; i < chunks.length; i++) owners[i]?.consumed(chunks[i]!.length);
      },
    };
  }

  private take(n: number): Buffer {
    this.buffered -= n;
    const first = this.chunks[0]!;
    if (first.length - this.head >= n && this.owners[0] === null) {
      const out = first.subarray(this.head, this.head + n);
      this.advance(n);
      return out;
    }
    // Spans chunks, or lies in a slab whose bytes will be reused: copied.
    const out = Buffer.allocUnsafe(n);
    let filled = 0;
    while (filled < n) {
      const c = this.chunks[0]!;
      const k = Math.min(c.length - this.head, n - filled);
      c.copy(out, filled, this.head, this.head + k);
      this.owners[0]?.consumed(k);
      filled += k;
      this.advance(k);
    }
    return out;
  }

  /** Past `k` bytes of the first chunk (at most what is left of it). */
  private advance(k: number): void {
    this.head += k;
    if (this.head === this.chunks[0]!.length) {
      this.chunks.shift();
      this.owners.shift();
      this.head = 0;
    }
  }

  private onData(chunk: Buffer, owner: Slab | null): void {
    if (chunk.length === 0) return;
    this.chunks.push(chunk);
    this.owners.push(owner);
    this.buffered += chunk.length;
    const w = this.waiter;
    if (w && this.buffered >= w.n) {
      this.waiter = null;
      w.resolve(this.take(w.n));
    }
    const pw = this.piecesWaiter;
    if (pw && this.buffered >= pw.n) {
      this.piecesWaiter = null;
      pw.resolve(this.lendPieces(pw.n));
    }
    if (!this.paused && this.buffered > this.highWater && !(this.waiter && this.waiter.n > this.buffered) && !(this.piecesWaiter && this.piecesWaiter.n > this.buffered)) {
      this.paused = true;
      this.sock.pause();
    }
  }

  /** Change the bound on buffered bytes (a session raises it when transmission starts). */
  setHighWater(bytes: number): void {
    this.highWater = bytes;
    this.resumeIfDrained();
  }

  private resumeIfDrained(): void {
    if (this.paused && this.buffered < this.highWater / 2) this.resume();
  }

  private resume(): void {
    this.paused = false;
    this.sock.resume();
  }

  private onEnd(): void {
    if (this.ended) return;
    this.ended = true;
    const w = this.waiter;
    this.waiter = null;
    if (w) w.reject(new ConnectionClosedError());
    const pw = this.piecesWaiter;
    this.piecesWaiter = null;
    if (pw) pw.reject(new ConnectionClosedError());
  }
}

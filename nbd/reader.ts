/**
 * Incremental frame reader over a Duplex: one 'data' event is not one frame. Frames are
 * taken by exact size; a frame inside one chunk is returned as a subarray (no copy), a
 * frame spanning chunks is copied once. Buffered bytes are bounded: past `highWater` the
 * socket is paused, so a client that floods us cannot grow memory without limit.
 */

import type { Duplex } from 'node:stream';
import { BatonError } from '../src/errors.js';

export class ConnectionClosedError extends BatonError {
  constructor() { super('BATON_ERR_SHUTDOWN', 'connection closed by peer'); }
}

export class FrameReader {
  private chunks: Buffer[] = [];
  private head = 0; // offset into chunks[0]
  private buffered = 0;
  private waiter: { n: number; resolve: (b: Buffer) => void; reject: (e: Error) => void } | null = null;
  private chunksWaiter: { n: number; resolve: (b: Buffer[]) => void; reject: (e: Error) => void } | null = null;
  private ended = false;
  private paused = false;

  constructor(private readonly sock: Duplex, private readonly highWater = 64 * 1024 * 1024) {
    sock.on('data', (chunk: Buffer) => this.onData(chunk));
    sock.on('end', () => this.onEnd());
    sock.on('close', () => this.onEnd());
    sock.on('error', () => this.onEnd());
  }

  get bufferedBytes(): number { return this.buffered; }

  /** Exactly `n` bytes (maybe a subarray of a received chunk), or rejects with ConnectionClosedError. */
  read(n: number): Promise<Buffer> {
    const b = this.tryRead(n);
    if (b) return Promise.resolve(b);
    if (this.ended) return Promise.reject(new ConnectionClosedError());
    if (this.waiter) return Promise.reject(new Error('FrameReader: concurrent read'));
    if (this.paused && n > this.buffered) this.resume(); // the frame needs more than we hold
    return new Promise((resolve, reject) => { this.waiter = { n, resolve, reject }; });
  }

  /** Synchronous fast path: the frame if it is fully buffered, else null. */
  tryRead(n: number): Buffer | null {
    if (this.buffered < n) return null;
    const out = this.take(n);
    if (this.paused && this.buffered < this.highWater / 2) this.resume();
    return out;
  }

  /**
   * Exactly `n` bytes as the received pieces (subarrays, no copy): for a consumer that
   * copies them somewhere anyway, this saves assembling one contiguous buffer.
   */
  readChunks(n: number): Promise<Buffer[]> {
    if (this.buffered >= n) return Promise.resolve(this.takeChunks(n));
    if (this.ended) return Promise.reject(new ConnectionClosedError());
    if (this.waiter || this.chunksWaiter) return Promise.reject(new Error('FrameReader: concurrent read'));
    if (this.paused) this.resume();
    return new Promise((resolve, reject) => { this.chunksWaiter = { n, resolve, reject }; });
  }

  private takeChunks(n: number): Buffer[] {
    this.buffered -= n;
    const out: Buffer[] = [];
    let left = n;
    while (left > 0) {
      const c = this.chunks[0]!;
      const k = Math.min(c.length - this.head, left);
      out.push(c.subarray(this.head, this.head + k));
      left -= k;
      this.head += k;
      if (this.head === c.length) { this.chunks.shift(); this.head = 0; }
    }
    if (this.paused && this.buffered < this.highWater / 2) this.resume();
    return out;
  }

  private take(n: number): Buffer {
    this.buffered -= n;
    const first = this.chunks[0]!;
    if (first.length - this.head >= n) {
      const out = first.subarray(this.head, this.head + n);
      this.head += n;
      if (this.head === first.length) { this.chunks.shift(); this.head = 0; }
      return out;
    }
    const out = Buffer.allocUnsafe(n);
    let filled = 0;
    while (filled < n) {
      const c = this.chunks[0]!;
      const k = Math.min(c.length - this.head, n - filled);
      c.copy(out, filled, this.head, this.head + k);
      filled += k;
      this.head += k;
      if (this.head === c.length) { this.chunks.shift(); this.head = 0; }
    }
    return out;
  }

  private onData(chunk: Buffer): void {
    if (chunk.length === 0) return;
    this.chunks.push(chunk);
    this.buffered += chunk.length;
    const w = this.waiter;
    if (w && this.buffered >= w.n) {
      this.waiter = null;
      w.resolve(this.take(w.n));
    }
    const cw = this.chunksWaiter;
    if (cw && this.buffered >= cw.n) {
      this.chunksWaiter = null;
      cw.resolve(this.takeChunks(cw.n));
    }
    if (!this.paused && this.buffered > this.highWater && !(this.waiter && this.waiter.n > this.buffered) && !(this.chunksWaiter && this.chunksWaiter.n > this.buffered)) {
      this.paused = true;
      this.sock.pause();
    }
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
    const cw = this.chunksWaiter;
    this.chunksWaiter = null;
    if (cw) cw.reject(new ConnectionClosedError());
  }
}

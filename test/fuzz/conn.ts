/**
 * The fuzzer's socket: sends exactly the bytes it is given (split as told), and reads the
 * server's bytes by exact size from a chunk queue (no Buffer.concat per 'data' event, so a
 * 32 MiB READ reply costs one copy). Every read has a deadline: a server that goes quiet is
 * a hang, reported as such.
 */

import * as net from 'node:net';

export class Hang extends Error {}
export class Eof extends Error {
  constructor(readonly have: number, readonly want: number) { super(`the server closed the connection (${have} of ${want} bytes of the next frame received)`); }
}

export class Conn {
  private chunks: Buffer[] = [];
  private head = 0;
  private buffered = 0;
  private ended = false;
  private waiter: (() => void) | null = null;
  /** Bytes received in all. */
  received = 0;
  /** Why the socket ended ('end', 'close', or an error code such as ECONNRESET). */
  endReason = '';
  private destroyedByUs = false;

  private constructor(readonly sock: net.Socket) {
    sock.on('data', (c: Buffer) => {
      this.received += c.length;
      this.chunks.push(c);
      this.buffered += c.length;
      this.wake();
    });
    const end = (why: string) => (): void => { if (!this.ended) { this.ended = true; this.endReason = why; } this.wake(); };
    sock.on('end', end('end'));
    sock.on('close', end('close'));
    sock.on('error', (err: NodeJS.ErrnoException) => end(err.code ?? 'error')());
  }

  static connect(path: string, timeoutMs: number): Promise<Conn> {
    return new Promise((resolve, reject) => {
      const s = net.connect({ path, allowHalfOpen: true });
      const timer = setTimeout(() => { s.destroy(); reject(new Hang(`connect to ${path} took more than ${timeoutMs} ms`)); }, timeoutMs);
      s.once('connect', () => { clearTimeout(timer); s.off('error', onErr); resolve(new Conn(s)); });
      const onErr = (err: Error): void => { clearTimeout(timer); reject(err); };
      s.once('error', onErr);
    });
  }

  private wake(): void { const w = this.waiter; this.waiter = null; w?.(); }

  get eof(): boolean { return this.ended; }
  get unread(): number { return this.buffered; }
  get destroyed(): boolean { return this.destroyedByUs; }

  private async waitFor(cond: () => boolean, deadline: number, what: () => string): Promise<void> {
    while (!cond()) {
      const left = deadline - Date.now();
      if (left <= 0) throw new Hang(what());
      await new Promise<void>((resolve) => {
        const timer = setTimeout(() => { if (this.waiter === done) this.waiter = null; resolve(); }, left);
        const done = (): void => { clearTimeout(timer); resolve(); };
        this.waiter = done;
      });
    }
  }

  /** Exactly n bytes, or Eof, or Hang at the deadline (an absolute Date.now() value). */
  async read(n: number, deadline: number): Promise<Buffer> {
    if (this.buffered < n) {
      await this.waitFor(() => this.buffered >= n || this.ended, deadline, () => `no reply: waited for ${n} bytes, have ${this.buffered}`);
      if (this.buffered < n) throw new Eof(this.buffered, n);
    }
    return this.take(n);
  }

  private take(n: number): Buffer {
    this.buffered -= n;
    const first = this.chunks[0];
    if (first && first.length - this.head >= n) {
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

  /** Resolves when the server has closed its side; throws Hang at the deadline. Bytes still unread are the caller's to check. */
  async waitEof(deadline: number, what: string): Promise<void> {
    await this.waitFor(() => this.ended, deadline, () => `the server did not close the connection (${what}); ${this.buffered} unread bytes`);
  }

  /** Resolves once at least one byte is buffered or the socket ended (or the deadline passed). */
  async waitData(deadline: number): Promise<void> {
    await this.waitFor(() => this.buffered > 0 || this.ended, deadline, () => 'no data');
  }

  /** Write, ignoring errors (the server may hang up on us, which the oracle decides about). */
  write(b: Buffer): Promise<void> {
    return new Promise((resolve) => {
      if (this.sock.destroyed || this.sock.writableEnded) { resolve(); return; }
      const ok = this.sock.write(b, () => resolve());
      void ok;
    });
  }

  /** Write without waiting for the kernel to take the bytes (pipelining). */
  writeNoWait(b: Buffer): void {
    if (this.sock.destroyed || this.sock.writableEnded) return;
    this.sock.write(b);
  }

  /** Half-close: our FIN, we keep reading. */
  end(): void { if (!this.sock.destroyed) this.sock.end(); }

  destroy(): void { this.destroyedByUs = true; this.sock.destroy(); this.ended = true; this.wake(); }
}

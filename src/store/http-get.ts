/**
 * HttpGetClient: a minimal HTTP/1.1 client for GET requests whose bodies are read in place:
 * the kernel (or TLS) writes a 2xx body straight into the Buffer the caller gets back, through
 * net's `onread` option with a buffer function. Used by S3ObjectStore for its GETs (s3.ts).
 *
 * Why: node's http allocates a fresh 64 KiB Buffer per socket read and runs its parser and
 * stream machinery per chunk, and the caller copied every chunk once more into its body. Against
 * a local radosgw, 128 ranged GETs of 8 MiB, 16 at a time: http.request 1.5-1.9 CPU-s per GiB at
 * 507-592 MiB/s; a keep-alive socket reading bodies in place 0.73-0.75 CPU-s per GiB at
 * 799-847 MiB/s (a prototype). S3ObjectStore.get, same load: 2.0-2.6 CPU-s per GiB before,
 * 1.1-1.3 with this client (it also signs, and pauses for the turn budget in 64 KiB reads).
 *
 * What it does and no more: one request at a time per connection (no pipelining), `GET path
 * HTTP/1.1` with the caller's headers (the caller signs them; Host is added if absent), a pool
 * of idle keep-alive connections per (protocol, host, port), plain TCP for http: and TLS
 * (default CA verification and server name check, as https.request does) for https:. Response
 * framing: Content-Length, chunked transfer-encoding, or until the connection closes; 1xx
 * interim answers are skipped. A 2xx body with a Content-Length is read in place; anything
 * else (error answers, a chunked 2xx) is read through a small scratch buffer and copied.
 *
 * Invariants:
 * - A connection goes back to the pool only after a complete, well-framed response whose
 *   framing allows reuse (a Content-Length or chunked body, no `Connection: close`, HTTP/1.1 or
 *   an explicit keep-alive, no bytes past the body in what was read). Bytes arriving on an idle
 *   connection, or its close, destroy it.
 * - Every failure (limit, abort, error, protocol error, the caller's destroy) destroys the
 *   socket: it is never returned to the pool.
 * - A body buffer is never written after its GET settled: a failure destroys the socket (its
 *   handle is closed at once, so no read lands anywhere), and a success settles inside the read
 *   that completed the body, after which the socket's next read buffer is chosen anew: the
 *   connection's scratch buffer while idle, the next request's buffers after that.
 * - Limits, as S3ObjectStore's requests had them with node's http: connecting (`connectMs`,
 *   until the TCP connection is up), the response headers within `firstByteMs` of the start
 *   (waiting for a free connection included), silence on the socket in either direction
 *   (`socketMs`, from the connection on), and `signal` (the whole call). Their errors are named
 *   TimeoutError with the same messages.
 * - A kept-alive connection the server had closed fails the GET before any byte of an answer as
 *   ECONNRESET (what node's http said too), which S3ObjectStore treats as transient and retries.
 * - Body bytes of a 2xx answer are accounted to `budget` (the process's TurnBudget, clock.ts):
 *   once a turn's budget is spent, the socket stops reading until a later turn grants more.
 */
import { connect as netConnect, isIP, type OnReadOpts, type Socket } from 'node:net';
import { connect as tlsConnect, type ConnectionOptions } from 'node:tls';

export interface GetEndpoint {
  protocol: 'http:' | 'https:';
  /** A name or an address (IPv6 without brackets). */
  hostname: string;
  /** undefined: the scheme's default (80, 443). */
  port: number | undefined;
}

/** What a TurnBudget (clock.ts) offers: spend what arrived, wait for the next turn's grant. */
export interface GetBudget {
  spend(bytes: number): boolean;
  take(bytes: number, priority?: number): Promise<void>;
}

export interface GetOptions {
  signal: AbortSignal;
  connectMs: number;
  firstByteMs: number;
  socketMs: number;
  /**
   * A 2xx answer's headers arrived: its Content-Length (undefined if it has none) and a handle
   * whose destroy(err) ends the GET with err (and destroys its connection) at any time until
   * it settles; after that, a no-op.
   */
  onBody?: (length: number | undefined, body: { destroy(err?: Error): void }) => void;
  /** Body bytes of a 2xx answer are spent here; false pauses the socket until take(0, -1). */
  budget?: GetBudget;
  /**
   * A 2xx body of exactly this length is read into it (ObjectStore.get's `into`); another
   * length gets a buffer of its own. Written only until the GET settles.
   */
  into?: Buffer;
}

export interface GetResponse {
  status: number;
  /** Names in lower case; a repeated header's values joined with ', '. */
  headers: Record<string, string>;
  /** A 2xx answer's whole body; any other answer's first MAX_ERROR_BODY bytes. */
  body: Buffer;
}

export interface HttpGetClientOptions {
  /** Connections per endpoint in use at once; more GETs wait for one (default 128, as the store's agents). */
  maxSockets?: number;
  /** Idle connections kept per endpoint (default maxSockets). */
  maxIdle?: number;
  /** An idle connection is closed after this long unused (default 4 s; S3 closes idle ones after about 20 s). */
  idleMs?: number;
  /** Extra options for tls.connect (tests pass `ca`); the defaults verify as https.request does. */
  tls?: Pick<ConnectionOptions, 'ca' | 'rejectUnauthorized'>;
}

/** The response header block may be at most this big (node's http allows 16 KiB; S3 sends under 1 KiB). */
export const MAX_HEADER_BYTES = 64 * 1024;
/** An error answer's body is kept up to this much (S3's XML errors are a few hundred bytes). */
export const MAX_ERROR_BODY = 64 * 1024;
/** Header bytes and copied bodies are read through a scratch buffer of this size per connection. */
const SCRATCH_BYTES = 16 * 1024;
/**
 * A body read in place is read at most this much per read: a read's bytes are accounted to
 * the turn budget only after they arrived, so a larger read would overrun a turn's budget by
 * as much (one socket's reads of one turn stop at the read that spent it).
 */
export const READ_SLICE = 64 * 1024;
const MAX_CHUNK_LINE = 4096;

/** An error node's http would have given for the same thing (its codes are what s3.ts maps). */
function codedError(code: string, message: string): Error & { code: string } {
  return Object.assign(new Error(message), { code });
}

/** A limit's error, named as the SDK names its own (s3.ts's requests use it too). */
export function timeoutError(message: string): Error {
  return Object.assign(new Error(message), { name: 'TimeoutError' });
}

type Framing = { kind: 'length'; length: number } | { kind: 'chunked' } | { kind: 'eof' };

/** One endpoint's connections: idle ones (most recently used last) and a count of those in use. */
class Pool {
  readonly idle: Conn[] = [];
  active = 0;
  readonly waiting: (() => void)[] = [];
  session: Buffer | undefined;
  constructor(readonly client: HttpGetClient, readonly endpoint: GetEndpoint) {}

  /** A slot for one more connection in use: true if taken at once, else `wake` is called when one is handed over (FIFO). */
  slot(wake: () => void): boolean {
    if (this.active < this.client.maxSockets) {
      this.active++;
      return true;
    }
    this.waiting.push(wake);
    return false;
  }

  /** A slot is free again: handed to the first waiter (still counted), else counted down. */
  free(): void {
    const next = this.waiting.shift();
    if (next !== undefined) next();
    else this.active--;
  }
}

class Conn {
  readonly scratch = Buffer.allocUnsafe(SCRATCH_BYTES);
  readonly socket: Socket;
  /** The exchange reading from this connection; null while idle. */
  ex: Exchange | null = null;
  /** Served an answer before (a reused connection). */
  used = false;
  /** Counted in its pool's `active`. */
  holdsSlot = true;
  idleTimer: NodeJS.Timeout | undefined;
  connected = false;

  constructor(readonly pool: Pool) {
    const { endpoint, client } = pool;
    // Chosen after every read (and once as the socket is made): the exchange's body while it
    // reads one in place, the scratch buffer otherwise.
    const onread = {
      buffer: (): Uint8Array => this.ex?.readInto() ?? this.scratch,
      callback: (n: number, buf: Uint8Array): boolean => this.#onRead(n, buf),
    };
    if (endpoint.protocol === 'https:') {
      // tls.connect takes net's `onread` (node >= 14.5; missing from @types/node's ConnectionOptions).
      const options: ConnectionOptions & { onread: OnReadOpts } = {
        ...client.tlsOptions,
        host: endpoint.hostname,
        port: endpoint.port ?? 443,
        // SNI and the certificate's name check use the host name; https.request sends no SNI for an address.
        ...(isIP(endpoint.hostname) === 0 ? { servername: endpoint.hostname } : {}),
        ...(pool.session !== undefined ? { session: pool.session } : {}),
        onread,
      };
      this.socket = tlsConnect(options);
      this.socket.on('session', (s: Buffer) => { pool.session = s; });
    } else {
      this.socket = netConnect({ host: endpoint.hostname, port: endpoint.port ?? 80, onread });
    }
    this.socket.setNoDelay(true);
    this.socket.on('connect', () => {
      this.connected = true;
      this.ex?.connected();
    });
    this.socket.on('timeout', () => this.ex?.silent());
    this.socket.on('error', (err) => this.#lost(err));
    this.socket.on('end', () => this.#lost(undefined));
    this.socket.on('close', () => this.#lost(undefined));
  }

  #onRead(n: number, buf: Uint8Array): boolean {
    const ex = this.ex;
    if (ex === null) {
      // Nothing was asked: bytes past the last answer, or unsolicited. Not HTTP we can frame.
      this.destroy();
      return false;
    }
    return ex.onRead(n, buf);
  }

  /** The connection ended or failed: an exchange on it fails; an idle one leaves the pool. */
  #lost(err: Error | undefined): void {
    if (this.ex !== null) this.ex.lost(err);
    else this.destroy();
  }

  destroy(): void {
    if (this.idleTimer !== undefined) clearTimeout(this.idleTimer);
    const i = this.pool.idle.indexOf(this);
    if (i >= 0) this.pool.idle.splice(i, 1);
    this.ex = null;
    if (!this.socket.destroyed) this.socket.destroy();
    if (this.holdsSlot) {
      this.holdsSlot = false;
      this.pool.free();
    }
  }

  /** After a complete, well-framed answer that allows reuse: idle in the pool (or closed if it is full or the client closed). */
  release(): void {
    this.ex = null;
    this.used = true;
    const pool = this.pool;
    if (pool.client.closed || this.socket.destroyed || pool.client.maxIdle === 0) {
      this.destroy();
      return;
    }
    this.socket.setTimeout(0);
    this.socket.unref(); // an idle connection does not keep the process alive
    pool.idle.push(this);
    this.idleTimer = setTimeout(() => this.destroy(), pool.client.idleMs);
    this.idleTimer.unref();
    if (pool.idle.length > pool.client.maxIdle) pool.idle[0]!.destroy();
    // Last: a GET waiting for a slot takes this connection from the pool.
    if (this.holdsSlot) {
      this.holdsSlot = false;
      pool.free();
    }
  }

  /** Taken from the pool for an exchange (the caller holds a slot for it). */
  take(): void {
    if (this.idleTimer !== undefined) clearTimeout(this.idleTimer);
    this.idleTimer = undefined;
    const i = this.pool.idle.indexOf(this);
    if (i >= 0) this.pool.idle.splice(i, 1);
    this.holdsSlot = true;
    this.socket.ref();
  }
}

/** One GET on one connection (or waiting for one). */
class Exchange {
  settled = false;
  conn: Conn | null = null;
  #firstByte: NodeJS.Timeout | undefined;
  /** A new connection's connect limit. */
  #connect: NodeJS.Timeout | undefined;
  /** Any byte of an answer arrived on this connection. */
  #answered = false;
  // The header block so far (copied out of the scratch buffer).
  #head: Buffer | null = null;
  #status = 0;
  #headers: Record<string, string> = {};
  #keepAlive = true;
  #framing: Framing | null = null;
  #success = false;
  // A 2xx body of known length, read in place.
  #out: Buffer | null = null;
  #at = 0;
  #view: Buffer | null = null;
  // Bodies copied out of the scratch buffer (error answers, chunked, until close).
  #chunks: Buffer[] = [];
  #kept = 0;
  #limit = 0;
  #remaining = 0;
  #chunkState: 'size' | 'data' | 'data-end' | 'trailer' = 'size';
  #line = '';
  #paused = false;

  constructor(
    readonly request: Buffer,
    readonly options: GetOptions,
    readonly resolve: (r: GetResponse) => void,
    readonly reject: (err: unknown) => void,
  ) {}

  start(pool: Pool): void {
    const o = this.options;
    this.#firstByte = setTimeout(() => this.fail(timeoutError(`no response headers within ${o.firstByteMs} ms (the first-byte limit)`)), o.firstByteMs);
    o.signal.addEventListener('abort', this.#onAbort, { once: true });
    const wake = (): void => {
      // The slot is ours now (still counted in `active`): give it back if we no longer need it.
      if (this.settled) pool.free();
      else this.#go(pool);
    };
    if (pool.slot(wake)) this.#go(pool);
    else this.#unwait = () => {
      const i = pool.waiting.indexOf(wake);
      if (i >= 0) pool.waiting.splice(i, 1);
    };
  }

  #unwait: (() => void) | null = null;

  /** With a slot: an idle connection (the most recently used), else a new one. */
  #go(pool: Pool): void {
    this.#unwait = null;
    let conn = pool.idle.pop();
    if (conn !== undefined) {
      conn.take();
    } else {
      try {
        conn = new Conn(pool);
      } catch (err) {
        pool.free();
        this.fail(err);
        return;
      }
      const o = this.options;
      this.#connect = setTimeout(() => this.fail(timeoutError(`no connection within ${o.connectMs} ms (the connect limit)`)), o.connectMs);
    }
    this.conn = conn;
    conn.ex = this;
    if (conn.connected) this.connected();
    conn.socket.write(this.request);
  }

  /** The connection is up: the connect limit is done, the silence limit starts (as node's http did). */
  connected(): void {
    clearTimeout(this.#connect);
    this.conn?.socket.setTimeout(this.options.socketMs);
  }

  silent(): void {
    this.fail(timeoutError(`no byte in either direction for ${this.options.socketMs} ms (the socket limit)`));
  }

  readonly #onAbort = (): void => this.fail(this.options.signal.reason);

  /** The buffer the next read goes into: the rest of an in-place body (a slice of it), else null (scratch). */
  readInto(): Buffer | null {
    if (this.#out === null || this.#at >= this.#out.length) return null;
    this.#view = this.#out.subarray(this.#at, Math.min(this.#out.length, this.#at + READ_SLICE));
    return this.#view;
  }

  onRead(n: number, buf: Uint8Array): boolean {
    if (this.settled) return false;
    this.#answered = true;
    try {
      if (this.#out !== null && buf === this.#view) {
        this.#at += n;
        this.#view = null;
        return this.#bodyBytes(n);
      }
      // Into scratch: only valid during this call.
      const bytes = Buffer.from(buf.buffer, buf.byteOffset, n);
      if (this.#out !== null) return this.#bodyBytes(this.#copyIn(bytes));
      if (this.#framing === null) return this.#onHead(bytes);
      return this.#onBodyCopy(bytes);
    } catch (err) {
      this.fail(err);
      return false;
    }
  }

  #onHead(bytes: Buffer): boolean {
    const from = this.#head === null ? 0 : Math.max(0, this.#head.length - 3);
    this.#head = this.#head === null ? Buffer.from(bytes) : Buffer.concat([this.#head, bytes]);
    let head = this.#head;
    let searchFrom = from;
    for (;;) {
      const end = head.indexOf('\r\n\r\n', searchFrom, 'latin1');
      if (end < 0 || end > MAX_HEADER_BYTES) {
        if (head.length > MAX_HEADER_BYTES) {
          throw codedError('HPE_HEADER_OVERFLOW', `the response's header block is larger than ${MAX_HEADER_BYTES} bytes`);
        }
        this.#head = head;
        return true;
      }
      this.#parseHead(head.toString('latin1', 0, end));
      const rest = head.subarray(end + 4);
      if (this.#status >= 100 && this.#status < 200) {
        // An interim answer (100 Continue, 103 Early Hints): the real one follows.
        head = rest;
        searchFrom = 0;
        this.#headers = {};
        continue;
      }
      this.#head = null;
      return this.#startBody(rest);
    }
  }

  #parseHead(text: string): void {
    const lines = text.split('\r\n');
    const m = /^HTTP\/1\.([01]) (\d{3})(?: .*)?$/.exec(lines[0]!);
    if (m === null) throw codedError('HPE_INVALID_CONSTANT', `not an HTTP/1.x status line: ${JSON.stringify(lines[0]!.slice(0, 80))}`);
    this.#status = Number(m[2]);
    const headers: Record<string, string> = {};
    for (let i = 1; i < lines.length; i++) {
      const line = lines[i]!;
      const colon = line.indexOf(':');
      if (colon <= 0 || /[\s]/.test(line.slice(0, colon))) throw codedError('HPE_INVALID_HEADER_TOKEN', `a malformed response header line: ${JSON.stringify(line.slice(0, 80))}`);
      const name = line.slice(0, colon).toLowerCase();
      const value = line.slice(colon + 1).trim();
      headers[name] = headers[name] === undefined ? value : `${headers[name]}, ${value}`;
    }
    this.#headers = headers;
    const tokens = (v: string | undefined): string[] => (v ?? '').toLowerCase().split(',').map((s) => s.trim()).filter((s) => s !== '');
    const connection = tokens(headers.connection);
    this.#keepAlive = !connection.includes('close') && (m[1] === '1' || connection.includes('keep-alive'));
    const te = headers['transfer-encoding'];
    const cl = headers['content-length'];
    let length: number | undefined;
    if (cl !== undefined) {
      const values = new Set(cl.split(',').map((s) => s.trim()));
      const v = values.size === 1 ? [...values][0]! : '';
      if (!/^\d{1,15}$/.test(v)) throw codedError('HPE_INVALID_CONTENT_LENGTH', `an invalid Content-Length: ${JSON.stringify(cl.slice(0, 80))}`);
      length = Number(v);
    }
    if (this.#status === 204 || this.#status === 304 || (this.#status >= 100 && this.#status < 200)) {
      this.#framing = { kind: 'length', length: 0 };
    } else if (te !== undefined) {
      // Transfer-Encoding wins over Content-Length, and such an answer's connection is not reused (RFC 9112 6.3).
      if (cl !== undefined) this.#keepAlive = false;
      this.#framing = tokens(te).at(-1) === 'chunked' ? { kind: 'chunked' } : { kind: 'eof' };
    } else if (length !== undefined) {
      this.#framing = { kind: 'length', length };
    } else {
      this.#framing = { kind: 'eof' };
    }
    if (this.#framing.kind === 'eof') this.#keepAlive = false;
    if (this.#status >= 100 && this.#status < 200) this.#framing = null;
  }

  /** The final answer's headers are in; `rest` is what came with them. */
  #startBody(rest: Buffer): boolean {
    clearTimeout(this.#firstByte);
    const framing = this.#framing!;
    this.#success = this.#status >= 200 && this.#status <= 299;
    if (this.#success) {
      this.options.onBody?.(framing.kind === 'length' ? framing.length : undefined, { destroy: (err) => this.fail(err ?? new Error('the GET was destroyed')) });
      if (this.settled) return false;
    }
    this.#limit = this.#success ? Infinity : MAX_ERROR_BODY;
    if (framing.kind === 'length') {
      if (this.#success) {
        try {
          const into = this.options.into;
          this.#out = into !== undefined && into.length === framing.length ? into : Buffer.allocUnsafe(framing.length);
        } catch {
          throw codedError('HPE_INVALID_CONTENT_LENGTH', `a Content-Length of ${framing.length} bytes, more than this process can hold`);
        }
        return this.#bodyBytes(this.#copyIn(rest));
      }
      this.#remaining = framing.length;
      if (framing.length === 0) return this.#complete();
    }
    return rest.length > 0 ? this.#onBodyCopy(rest) : true;
  }

  /** Body bytes that arrived in scratch (with the headers): copied into the in-place body. */
  #copyIn(bytes: Buffer): number {
    const n = Math.min(bytes.length, this.#out!.length - this.#at);
    bytes.copy(this.#out!, this.#at, 0, n);
    this.#at += n;
    if (bytes.length > n) this.#keepAlive = false; // bytes past the body: no framing we trust for a next answer
    return n;
  }

  /** `n` more bytes of an in-place body arrived. */
  #bodyBytes(n: number): boolean {
    if (this.#at === this.#out!.length) {
      this.options.budget?.spend(n);
      return this.#complete();
    }
    if (n > 0 && this.options.budget !== undefined && !this.options.budget.spend(n)) this.#pause();
    return true;
  }

  /** The turn's budget is spent: the socket stops reading (the rest waits in the kernel) until a later turn. */
  #pause(): void {
    if (this.#paused) return;
    this.#paused = true;
    const socket = this.conn!.socket;
    socket.pause();
    void this.options.budget!.take(0, -1).then(() => {
      this.#paused = false;
      if (!this.settled) socket.resume();
    });
  }

  /** Body bytes read through scratch: error answers, chunked bodies, bodies until the close. */
  #onBodyCopy(bytes: Buffer): boolean {
    const framing = this.#framing!;
    if (framing.kind === 'length') {
      const n = Math.min(bytes.length, this.#remaining);
      this.#keep(bytes.subarray(0, n));
      this.#remaining -= n;
      if (bytes.length > n) this.#keepAlive = false;
      if (this.#remaining === 0) return this.#complete();
      if (this.#kept >= this.#limit) { this.#keepAlive = false; return this.#complete(); }
      return true;
    }
    if (framing.kind === 'eof') {
      this.#keep(bytes);
      if (this.#kept >= this.#limit) return this.#complete();
      return true;
    }
    // chunked: size line CRLF, data, CRLF, ..., 0 CRLF, trailer lines, CRLF
    let i = 0;
    while (i < bytes.length) {
      if (this.#chunkState === 'data') {
        const n = Math.min(bytes.length - i, this.#remaining);
        this.#keep(bytes.subarray(i, i + n));
        i += n;
        this.#remaining -= n;
        if (this.#remaining === 0) this.#chunkState = 'data-end';
        continue;
      }
      // A line (size, the CRLF after data, a trailer line).
      const nl = bytes.indexOf(10, i);
      const end = nl < 0 ? bytes.length : nl + 1;
      this.#line += bytes.toString('latin1', i, end);
      i = end;
      if (this.#line.length > MAX_CHUNK_LINE) throw codedError('HPE_CHUNK_EXTENSIONS_OVERFLOW', 'a chunked body\'s line is too long');
      if (nl < 0) break;
      const line = this.#line.replace(/\r?\n$/, '');
      this.#line = '';
      if (this.#chunkState === 'data-end') {
        if (line !== '') throw codedError('HPE_STRICT', 'a chunk\'s data is not followed by CRLF');
        this.#chunkState = 'size';
      } else if (this.#chunkState === 'size') {
        const m = /^([0-9a-fA-F]{1,12})(?:[ \t]*;.*)?$/.exec(line);
        if (m === null) throw codedError('HPE_INVALID_CHUNK_SIZE', `an invalid chunk size line: ${JSON.stringify(line.slice(0, 80))}`);
        this.#remaining = parseInt(m[1]!, 16);
        this.#chunkState = this.#remaining === 0 ? 'trailer' : 'data';
      } else if (line === '') {
        // The end of the trailer: the body is complete.
        if (i < bytes.length) this.#keepAlive = false;
        return this.#complete();
      }
      if (this.#kept >= this.#limit) { this.#keepAlive = false; return this.#complete(); }
    }
    if (this.#kept >= this.#limit) { this.#keepAlive = false; return this.#complete(); }
    return true;
  }

  #keep(b: Buffer): void {
    if (b.length === 0) return;
    if (this.#success && this.options.budget !== undefined && !this.options.budget.spend(b.length)) this.#pause();
    if (this.#kept >= this.#limit) return;
    const take = b.subarray(0, Math.min(b.length, this.#limit - this.#kept));
    this.#chunks.push(Buffer.from(take));
    this.#kept += take.length;
  }

  /** The connection ended (err undefined) or failed. */
  lost(err: Error | undefined): void {
    if (this.settled) return;
    if (err !== undefined) this.fail(err);
    else if (this.#framing?.kind === 'eof') this.#complete(); // a body that ends with the connection
    else if (!this.#answered) {
      // Nothing of an answer: a kept-alive connection the server closed as we sent, or a server that hung up.
      this.fail(codedError('ECONNRESET', `the connection closed before any answer${this.conn?.used === true ? ' (a kept-alive connection the server had closed)' : ''}`));
    } else {
      this.fail(codedError('ERR_STREAM_PREMATURE_CLOSE', `the connection closed before the whole answer arrived${this.#framing !== null ? ` (HTTP ${this.#status})` : ''}`));
    }
  }

  #complete(): boolean {
    if (this.settled) return false;
    this.settled = true;
    this.#cleanup();
    const conn = this.conn!;
    const body = this.#out ?? (this.#chunks.length === 1 ? this.#chunks[0]! : Buffer.concat(this.#chunks, this.#kept));
    // Only a complete, well-framed answer leaves its connection for the next GET.
    if (this.#keepAlive && this.#framing!.kind !== 'eof') {
      if (this.#paused) conn.socket.resume(); // an idle connection keeps reading: a close or stray bytes destroy it
      conn.release();
    } else {
      conn.destroy();
    }
    this.resolve({ status: this.#status, headers: this.#headers, body });
    return !conn.socket.destroyed;
  }

  fail(err: unknown): void {
    if (this.settled) return;
    this.settled = true;
    this.#cleanup();
    this.#unwait?.();
    this.conn?.destroy();
    this.reject(err);
  }

  #cleanup(): void {
    clearTimeout(this.#firstByte);
    clearTimeout(this.#connect);
    this.options.signal.removeEventListener('abort', this.#onAbort);
    if (this.conn !== null) this.conn.ex = null;
  }
}

export class HttpGetClient {
  readonly maxSockets: number;
  readonly maxIdle: number;
  readonly idleMs: number;
  readonly tlsOptions: Pick<ConnectionOptions, 'ca' | 'rejectUnauthorized'>;
  closed = false;
  readonly #pools = new Map<string, Pool>();

  constructor(opts: HttpGetClientOptions = {}) {
    this.maxSockets = Math.max(1, opts.maxSockets ?? 128);
    this.maxIdle = Math.max(0, opts.maxIdle ?? this.maxSockets);
    this.idleMs = opts.idleMs ?? 4_000;
    this.tlsOptions = opts.tls ?? {};
  }

  /** Idle connections per endpoint (tests). */
  idleCount(endpoint: GetEndpoint): number {
    return this.#pools.get(HttpGetClient.#key(endpoint))?.idle.length ?? 0;
  }

  static #key(e: GetEndpoint): string {
    return `${e.protocol}//[${e.hostname}]:${e.port ?? (e.protocol === 'https:' ? 443 : 80)}`;
  }

  /**
   * GET `path` (already encoded, starting with '/') with `headers` (sent as given, in order;
   * Host added from the endpoint if absent). Resolves with any final answer (2xx or not);
   * rejects on a limit, the signal, a connection failure or an answer that is not valid HTTP.
   */
  get(endpoint: GetEndpoint, path: string, headers: Record<string, string>, options: GetOptions): Promise<GetResponse> {
    if (!/^\/[\x21-\x7e]*$/.test(path)) throw new TypeError(`an invalid request path: ${JSON.stringify(path)}`);
    let text = `GET ${path} HTTP/1.1\r\n`;
    let host = false;
    for (const [k, v] of Object.entries(headers)) {
      if (!/^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/.test(k) || /[\r\n\0]/.test(v)) throw new TypeError(`an invalid request header: ${JSON.stringify(k)}`);
      if (k.toLowerCase() === 'host') host = true;
      text += `${k}: ${v}\r\n`;
    }
    if (!host) {
      const name = endpoint.hostname.includes(':') ? `[${endpoint.hostname}]` : endpoint.hostname;
      text += `host: ${name}${endpoint.port !== undefined ? `:${endpoint.port}` : ''}\r\n`;
    }
    const request = Buffer.from(`${text}\r\n`, 'latin1');
    const key = HttpGetClient.#key(endpoint);
    let pool = this.#pools.get(key);
    if (pool === undefined) this.#pools.set(key, pool = new Pool(this, endpoint));
    const p = pool;
    return new Promise<GetResponse>((resolve, reject) => {
      if (options.signal.aborted) {
        reject(options.signal.reason);
        return;
      }
      new Exchange(request, options, resolve, reject).start(p);
    });
  }

  /** Closes every idle connection; those in use are closed when their GET ends instead of pooled. */
  close(): void {
    this.closed = true;
    for (const pool of this.#pools.values()) {
      for (const c of [...pool.idle]) c.destroy();
    }
  }
}

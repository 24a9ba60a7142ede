/**
 * The NBD listener: accepts connections on TCP or a Unix socket and runs one NbdSession per
 * connection against one ExportProvider. A malformed or vanished client ends only its own
 * session; nothing a client sends can throw out of here.
 */

import * as fs from 'node:fs';
import * as net from 'node:net';
import { InvalidArgumentError, errorMessage } from '../src/errors.js';
import type { Logger } from '../src/log.js';
import type { ExportProvider } from './backend.js';
import { DEFAULT_SESSION_OPTIONS, NbdSession, type SessionOptions } from './session.js';

export type ListenAddress = { host: string; port: number } | { path: string };

export interface NbdServerOptions extends Partial<Omit<SessionOptions, 'log' | 'refuseWith'>> {
  log: Logger;
  /** Connections served at once (handshaking or attached); past it new ones are refused. */
  maxConnections?: number;
}

/**
 * Every connection holds a socket, up to `maxInflightBytes` of request memory and maybe a
 * volume: 512 is far above what one host's clients need (the kernel opens one per `-C`,
 * nbdfuse and nbdcopy at most 4) and keeps a flood of connections from exhausting memory
 * or file descriptors.
 */
export const DEFAULT_MAX_CONNECTIONS = 512;
/**
 * Connections past the limit get a short handshake that explains the refusal; at most this
 * many at once, beyond that they are closed at once (a flood must not cost more than the
 * limit it hits).
 */
const MAX_REFUSING = 64;
const REFUSAL_HANDSHAKE_MS = 5_000;

export class NbdServer {
  private readonly server: net.Server;
  private readonly sessions = new Set<NbdSession>();
  private readonly sessionOpts: SessionOptions;
  private readonly maxConnections: number;
  private refusing = 0;
  private lastRefusalLog = -Infinity;
  private refusedSinceLog = 0;
  private nextConn = 1;
  private socketPath: string | null = null;

  constructor(private readonly provider: ExportProvider, opts: NbdServerOptions) {
    const { maxConnections, ...sessionOpts } = opts;
    this.maxConnections = maxConnections ?? DEFAULT_MAX_CONNECTIONS;
    if (!Number.isInteger(this.maxConnections) || this.maxConnections < 1) {
      throw new InvalidArgumentError(`maximum connections must be a positive integer, got ${this.maxConnections}`);
    }
    this.sessionOpts = { ...DEFAULT_SESSION_OPTIONS, ...sessionOpts };
    // allowHalfOpen: a client that shuts down its write side after its last request (libnbd
    // after DISC, or any client that half-closes with requests in flight) must still get
    // every reply; without it Node ends our side as soon as the client's FIN arrives and the
    // replies are lost. The session ends our side itself once it has answered everything.
    this.server = net.createServer({ noDelay: true, allowHalfOpen: true }, (sock) => this.accept(sock));
    this.server.on('error', (err) => opts.log.error({ err: errorMessage(err) }, 'listener error'));
  }

  get connectionCount(): number { return this.sessions.size; }

  async listen(addr: ListenAddress): Promise<ListenAddress> {
    if ('path' in addr) {
      // A stale socket file from a killed server would make listen fail with EADDRINUSE.
      try { if (fs.statSync(addr.path).isSocket()) fs.unlinkSync(addr.path); } catch { /* absent */ }
      this.socketPath = addr.path;
    }
    await new Promise<void>((resolve, reject) => {
      this.server.once('error', reject);
      const done = (): void => { this.server.off('error', reject); resolve(); };
      if ('path' in addr) this.server.listen(addr.path, done);
      else this.server.listen(addr.port, addr.host, done);
    });
    const a = this.server.address();
    if (a && typeof a === 'object') return { host: a.address, port: a.port };
    return { path: String(a) };
  }

  private accept(sock: net.Socket): void {
    if (this.sessions.size >= this.maxConnections) { this.refuse(sock); return; }
    const log = this.sessionOpts.log.child({ conn: this.nextConn++ });
    sock.setNoDelay(true);
    const session = new NbdSession(sock, this.provider, { ...this.sessionOpts, log });
    this.sessions.add(session);
    log.debug({ peer: sock.remoteAddress ?? 'unix' }, 'connection');
    void session.run().finally(() => {
      this.sessions.delete(session);
      log.debug('connection closed');
    });
  }

  /**
   * A connection past the limit: it never reaches the provider (no open, no lease). It gets
   * the greeting, then NBD_REP_ERR_SHUTDOWN ("the server is unwilling to continue
   * negotiation", so a client knows to try later) to every option with a message that says
   * why. qemu prints the message ("server reported: ... connection limit ..."); libnbd
   * reports ESHUTDOWN ("Cannot send after transport endpoint shutdown") and shows the
   * message only with LIBNBD_DEBUG=1, which is why the server also logs a warning. No reply
   * code says "too many connections"; ERR_SHUTDOWN is the nearest (ERR_POLICY reads as a
   * permission problem). EXPORT_NAME has no error reply, so that client is simply closed.
   */
  private refuse(sock: net.Socket): void {
    this.refusedSinceLog++;
    const now = performance.now();
    if (now - this.lastRefusalLog >= 10_000) {
      this.sessionOpts.log.warn({ limit: this.maxConnections, refused: this.refusedSinceLog }, 'refusing connections: at the connection limit (raise serve --max-connections if this is expected)');
      this.lastRefusalLog = now;
      this.refusedSinceLog = 0;
    }
    if (this.refusing >= MAX_REFUSING) { sock.destroy(); return; }
    this.refusing++;
    const session = new NbdSession(sock, this.provider, {
      ...this.sessionOpts,
      log: this.sessionOpts.log.child({ conn: 'refused' }),
      handshakeTimeoutMs: Math.min(this.sessionOpts.handshakeTimeoutMs, REFUSAL_HANDSHAKE_MS),
      maxOptions: Math.min(this.sessionOpts.maxOptions, 8),
      refuseWith: `server is at its connection limit (${this.maxConnections} connections); try again later or raise baton serve --max-connections`,
    });
    void session.run().finally(() => { this.refusing--; });
  }

  /** Gracefully close the sessions attached to `exportName` (handoff): in-flight requests finish, new ones get ESHUTDOWN. */
  disconnectExport(exportName: string): number {
    let n = 0;
    for (const s of this.sessions) if (s.exportName === exportName) { s.shutdown(); n++; }
    return n;
  }

  /** Stop listening, end every session gracefully (in-flight requests finish), wait for them. */
  async close(): Promise<void> {
    const closed = new Promise<void>((resolve) => this.server.close(() => resolve()));
    for (const s of this.sessions) s.shutdown();
    const deadline = Date.now() + 10_000;
    while (this.sessions.size > 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    await closed;
    if (this.socketPath) { try { fs.unlinkSync(this.socketPath); } catch { /* gone */ } }
  }
}

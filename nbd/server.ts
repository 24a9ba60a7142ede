/**
 * The NBD listener: accepts connections on TCP or a Unix socket and runs one NbdSession per
 * connection against one ExportProvider. A malformed or vanished client ends only its own
 * session; nothing a client sends can throw out of here.
 */

import * as fs from 'node:fs';
import * as net from 'node:net';
import { errorMessage } from '../src/errors.js';
import type { Logger } from '../src/log.js';
import type { ExportProvider } from './backend.js';
import { DEFAULT_SESSION_OPTIONS, NbdSession, type SessionOptions } from './session.js';

export type ListenAddress = { host: string; port: number } | { path: string };

export interface NbdServerOptions extends Partial<Omit<SessionOptions, 'log'>> {
  log: Logger;
}

export class NbdServer {
  private readonly server: net.Server;
  private readonly sessions = new Set<NbdSession>();
  private readonly sessionOpts: SessionOptions;
  private nextConn = 1;
  private socketPath: string | null = null;

  constructor(private readonly provider: ExportProvider, opts: NbdServerOptions) {
    this.sessionOpts = { ...DEFAULT_SESSION_OPTIONS, ...opts };
    this.server = net.createServer({ noDelay: true }, (sock) => this.accept(sock));
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

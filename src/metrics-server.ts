/**
 * The HTTP listener of `serve --metrics`: `/metrics` (Prometheus text, src/metrics.ts),
 * `/healthz` (the process answers) and `/readyz` (the checks an orchestrator waits for before
 * sending clients: the store passed its startup probe, the lease service answers, the NBD
 * listener is up). Anything else is 404.
 *
 * It must never affect NBD serving: it is a separate listener, a failing scrape or probe
 * answers 500/503 to its HTTP client and is logged, and nothing it does can throw into the
 * rest of the process. Only binding it is fatal, at startup, before anything is served: a
 * `--metrics` address that cannot be used is a configuration error to be told at once,
 * not a server running without the metrics it was asked for.
 */

import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import type { Registry } from 'prom-client';
import { BatonError, errorMessage } from './errors.js';
import type { Logger } from './log.js';

/** How long one /readyz check may take before it counts as failed. */
export const READY_CHECK_TIMEOUT_MS = 2000;
/** HTTP connections at once (scrapers and probes; a few are expected). */
const MAX_HTTP_CONNECTIONS = 64;

type Check = { kind: 'flag'; ok: boolean; detail: string } | { kind: 'probe'; run: () => Promise<string | void> };

/**
 * Named readiness checks: a flag set by the serving code (store probed, listening), or a probe
 * run at each /readyz (the lease service). Ready when every check passes.
 */
export class Readiness {
  private readonly checks = new Map<string, Check>();

  /** A check the serving code decides; `detail` says why not (or what), shown in /readyz. */
  set(name: string, ok: boolean, detail = ''): void {
    this.checks.set(name, { kind: 'flag', ok, detail });
  }

  /** A check run at each /readyz: passes if `run` resolves (its string is the detail) within READY_CHECK_TIMEOUT_MS. */
  probe(name: string, run: () => Promise<string | void>): void {
    this.checks.set(name, { kind: 'probe', run });
  }

  async evaluate(timeoutMs = READY_CHECK_TIMEOUT_MS): Promise<{ ready: boolean; checks: Record<string, { ok: boolean; detail: string }> }> {
    const entries = await Promise.all([...this.checks].map(async ([name, c]): Promise<[string, { ok: boolean; detail: string }]> => {
      if (c.kind === 'flag') return [name, { ok: c.ok, detail: c.detail }];
      let timer: NodeJS.Timeout | undefined;
      try {
        const detail = await Promise.race([
          c.run(),
          new Promise<never>((_, reject) => { timer = setTimeout(() => reject(new Error(`no answer within ${timeoutMs} ms`)), timeoutMs); }),
        ]);
        return [name, { ok: true, detail: detail ?? '' }];
      } catch (err) {
        return [name, { ok: false, detail: errorMessage(err) }];
      } finally {
        clearTimeout(timer);
      }
    }));
    // No check at all is not "ready": the serving code registers its checks before it listens.
    return { ready: entries.length > 0 && entries.every(([, r]) => r.ok), checks: Object.fromEntries(entries) };
  }
}

/** `--metrics`: a bare port means loopback (metrics name volumes: not for every network by default). */
export function parseMetricsAddress(v: string): { host: string; port: number } {
  const t = v.trim();
  const m = /^(?:(?:\[([^\]]+)\]|([^:\s]+)):)?(\d{1,5})$/.exec(t);
  const port = m ? Number(m[3]) : NaN;
  if (!m || port > 65535) {
    throw new BatonError('BATON_ERR_INVALID_ARGUMENT', `--metrics must be PORT or HOST:PORT (for example 9464, 127.0.0.1:9464, 0.0.0.0:9464, [::1]:9464), got "${v}"`);
  }
  return { host: m[1] ?? m[2] ?? '127.0.0.1', port };
}

export class MetricsServer {
  private readonly server: http.Server;

  constructor(private readonly registry: Registry, private readonly readiness: Readiness, private readonly log: Logger) {
    this.server = http.createServer((req, res) => {
      this.handle(req, res).catch((err: unknown) => {
        // Only a broken response can get here (handle answers its own failures).
        this.log.warn({ err: errorMessage(err), path: req.url }, 'metrics: request failed');
        res.destroy();
      });
    });
    this.server.maxConnections = MAX_HTTP_CONNECTIONS;
    // A scraper that sends garbage gets its connection closed; nothing is thrown.
    this.server.on('clientError', (_err, sock) => sock.destroy());
  }

  /** Bind; throws a BatonError naming the address and what to do when it cannot. */
  async listen(host: string, port: number): Promise<{ host: string; port: number }> {
    await new Promise<void>((resolve, reject) => {
      const onError = (err: NodeJS.ErrnoException): void => {
        const what = err.code === 'EADDRINUSE' ? 'the address is in use (another process listens there): choose another port'
          : err.code === 'EACCES' ? 'permission denied (ports below 1024 need privileges): choose a port above 1024'
            : err.code === 'EADDRNOTAVAIL' ? 'no interface of this host has that address'
              : errorMessage(err);
        reject(new BatonError('BATON_ERR_INVALID_ARGUMENT', `--metrics ${host.includes(':') ? `[${host}]` : host}:${port}: cannot listen: ${what}`));
      };
      this.server.once('error', onError);
      this.server.listen(port, host, () => {
        this.server.off('error', onError);
        // From now on: logged, never thrown (the NBD side goes on).
        this.server.on('error', (err) => this.log.error({ err: errorMessage(err) }, 'metrics listener error; NBD serving is not affected'));
        resolve();
      });
    });
    const a = this.server.address() as AddressInfo;
    return { host: a.address, port: a.port };
  }

  private async handle(req: http.IncomingMessage, res: http.ServerResponse): Promise<void> {
    const path = (req.url ?? '/').split('?', 1)[0];
    const known = path === '/metrics' || path === '/healthz' || path === '/readyz';
    if (!known) return send(res, 404, 'text/plain; charset=utf-8', 'not found: try /metrics, /healthz or /readyz\n', req.method === 'HEAD');
    if (req.method !== 'GET' && req.method !== 'HEAD') {
      res.setHeader('Allow', 'GET, HEAD');
      return send(res, 405, 'text/plain; charset=utf-8', 'method not allowed\n', false);
    }
    const head = req.method === 'HEAD';
    if (path === '/healthz') return send(res, 200, 'text/plain; charset=utf-8', 'ok\n', head);
    if (path === '/readyz') {
      const r = await this.readiness.evaluate();
      return send(res, r.ready ? 200 : 503, 'application/json', JSON.stringify(r) + '\n', head);
    }
    let body: string;
    try {
      body = await this.registry.metrics();
    } catch (err) {
      this.log.warn({ err: errorMessage(err) }, 'metrics: collecting failed');
      return send(res, 500, 'text/plain; charset=utf-8', `collecting metrics failed: ${errorMessage(err)}\n`, head);
    }
    return send(res, 200, this.registry.contentType, body, head);
  }

  /** Stop listening and drop open connections (keep-alive scrapers would hold close() otherwise). */
  async close(): Promise<void> {
    const closed = new Promise<void>((resolve) => this.server.close(() => resolve()));
    this.server.closeAllConnections();
    await closed;
  }
}

function send(res: http.ServerResponse, status: number, type: string, body: string, head: boolean): void {
  res.statusCode = status;
  res.setHeader('Content-Type', type);
  res.setHeader('Content-Length', Buffer.byteLength(body));
  res.setHeader('Cache-Control', 'no-store');
  res.end(head ? undefined : body);
}

/**
 * Deployment.serve (src/api.ts): an NBD server in this process, what `baton serve` runs. It
 * starts in the order that makes failures cheap and clear: who may connect is decided (and
 * every TLS/authz file read) before the store is touched; metrics listen first (so /readyz
 * says what it waits for); the read cache is made (a bad --cache-dir is reported at start);
 * the store is probed for create-only puts before serving read-write; then NBD listens and
 * background maintenance starts. close() undoes it in reverse: maintenance, NBD (finishing
 * requests), the volumes (flushed, leases given back), the lease manager, metrics.
 */

import { EventEmitter } from 'node:events';
import { monitorEventLoopDelay } from 'node:perf_hooks';
import { DEFAULT_MAX_CONNECTIONS, NbdServer, type ListenAddress } from '../nbd/server.js';
import type { Deployment } from './api.js';
import type { CacheStats } from './cache.js';
import { defaultCacheDir, openCatalog } from './catalog.js';
import { DEFAULT_LISTEN, isLoopbackHost, parseListen } from './config.js';
import { InvalidArgumentError, errorMessage, isBatonError } from './errors.js';
import { VolumeExports, type OnHeld, type VolumeEvent } from './exports.js';
import { openLeaseManager } from './lease/open.js';
import type { Logger } from './log.js';
import { BackgroundMaintenance, DEFAULT_COMPACT_BELOW } from './maintenance.js';
import type { MetricsSources } from './metrics.js';
import { MetricsServer, Readiness } from './metrics-server.js';
import { DEFAULT_RETRY_BUDGET_MS } from './store/open.js';
import { waitForStore } from './store/probe.js';
import { checkServeSecurity, setupServeTls, type ServeSecurityFlags } from './tls-config.js';
import { StoreCatalog } from './volume/catalog.js';
import { DEFAULT_GC_GRACE_MS } from './volume/gc.js';
import { DEFAULT_HYDRATE_CONCURRENCY, type HydrateMode } from './volume/hydrate.js';

export const VERSION = '0.1.0';

/** `baton serve`'s flags, as options (milliseconds and bytes instead of the CLI's units). */
export interface ServeOptions {
  /** TCP `{ host, port }` or `"host:port"`, or a Unix socket `{ path }`. Default 127.0.0.1:10809 (port 0: any free port). */
  listen?: ListenAddress | string;
  /** Export every volume read-only (no lease, no writes). */
  readOnly?: boolean;
  /** Create this volume first if it does not exist. */
  create?: { name: string; size: number };
  /** When another host holds a volume: refuse the attach (default), wait for it, or ask for a handoff. */
  onHeld?: OnHeld;
  /** How long `wait`/`takeover` wait. Default 30 s. */
  heldWaitMs?: number;
  handshakeTimeoutMs?: number;
  maxConnections?: number;
  /** How long a volume stays open after its last client left. Default 5 s. */
  idleGraceMs?: number;
  /** Background compaction and GC of the served volumes (0: never). Default 1 h. */
  gcIntervalMs?: number;
  gcGraceMs?: number;
  compactBelow?: number;
  hydrate?: HydrateMode;
  hydrateConcurrency?: number;
  hydrateMax?: number;
  /** Log process stats at info level this often (0: never, the default). */
  statsIntervalMs?: number;
  /** Serve Prometheus /metrics, /healthz, /readyz on this address. */
  metrics?: { host: string; port: number };
  /** TLS and authorization, as serve's --tls* / --authz / --insecure flags. Default: no TLS (loopback only). */
  security?: Partial<ServeSecurityFlags>;
  /** How long one store operation retries before failing. Default 10 min (a server keeps trying). */
  retryBudgetMs?: number;
  /** Settings of the metrics' baton_info series. */
  version?: string;
  /** Compress new frames (default true); false writes them uncompressed for every volume served (serve --compression off). */
  compression?: boolean;
}

/** The per-volume events of a served volume (src/exports.ts VolumeEvent), by type. */
export interface ServerEvents {
  attached: Extract<VolumeEvent, { type: 'attached' }>;
  detached: Extract<VolumeEvent, { type: 'detached' }>;
  flushed: Extract<VolumeEvent, { type: 'flushed' }>;
  leaseLost: Extract<VolumeEvent, { type: 'leaseLost' }>;
  handedOff: Extract<VolumeEvent, { type: 'handedOff' }>;
  dropped: Extract<VolumeEvent, { type: 'dropped' }>;
}

/** An NBD server running in this process. */
export interface BatonServer {
  /** Where it listens (the port it got, for port 0). */
  readonly address: ListenAddress;
  /** The NBD URI of a volume: nbd://127.0.0.1:10809/NAME, or nbd+unix:///NAME?socket=PATH (nbds with TLS). */
  uri(volume: string): string;
  on<K extends keyof ServerEvents>(event: K, listener: (e: ServerEvents[K]) => void): this;
  off<K extends keyof ServerEvents>(event: K, listener: (e: ServerEvents[K]) => void): this;
  once<K extends keyof ServerEvents>(event: K, listener: (e: ServerEvents[K]) => void): this;
  /**
   * Close a volume nobody is attached to now (flush, close, give its lease back), as its idle
   * grace would, so that it can be renamed or resized at once. LeaseHeldError while clients
   * are attached here.
   */
  release(volume: string): Promise<void>;
  /** Re-read TLS certificates, keys and authz (what SIGHUP does for `baton serve`). */
  reloadTls(): void;
  /** Stop: background maintenance, then NBD (requests finish), then every volume (flushed, leases given back). */
  close(): Promise<void>;
  /** The served volumes (state, connections); for diagnostics and tests. */
  readonly exports: VolumeExports;
}

class Server extends EventEmitter implements BatonServer {
  constructor(
    readonly address: ListenAddress,
    readonly exports: VolumeExports,
    private readonly tlsOn: boolean,
    readonly reloadTls: () => void,
    readonly close: () => Promise<void>,
  ) { super(); }

  release(volume: string): Promise<void> { return this.exports.release(volume); }

  uri(volume: string): string {
    const a = this.address;
    const u = 'path' in a ? `nbd+unix:///${volume}?socket=${a.path}` : `nbd://${a.host.includes(':') ? `[${a.host}]` : a.host}:${a.port}/${volume}`;
    return this.tlsOn ? u.replace(/^nbd/, 'nbds') : u;
  }
}

export async function startServer(d: Deployment, o: ServeOptions): Promise<BatonServer> {
  const log = d.log;
  const flags: ServeSecurityFlags = { tls: 'off', ...o.security };
  const handshakeTimeoutMs = o.handshakeTimeoutMs ?? 30_000;
  // Who may connect is decided, and every TLS/authz file read, before the store is touched
  // (waiting for a store can take long; a typo in --tls-psk should not).
  const addr: ListenAddress = typeof o.listen === 'string' ? parseListen(o.listen) : o.listen ?? parseListen(DEFAULT_LISTEN);
  checkServeSecurity(flags, 'path' in addr ? null : addr.host, isLoopbackHost);
  let provider: VolumeExports | undefined;
  const security = setupServeTls(flags, () => provider!, handshakeTimeoutMs);
  const cacheDir = d.catalogOptions().cacheDir ?? defaultCacheDir();
  const catalog = openCatalog(d.store, d.catalogOptions({ retry: { budgetMs: o.retryBudgetMs ?? DEFAULT_RETRY_BUDGET_MS }, instrument: !!o.metrics, ...(o.compression === false ? { volume: { compress: false } } : {}) }));
  // Metrics first: /healthz answers and /readyz says what it waits for while the store is
  // probed (which waits for as long as the store does not answer). Filled in as things start.
  const sources: MetricsSources = { info: { hostId: d.hostId, store: catalog.description, version: o.version ?? VERSION }, ...(catalog instanceof StoreCatalog ? { store: catalog.store } : {}) };
  const readiness = new Readiness();
  readiness.set('store', false, 'waiting for the store to pass its startup probe');
  readiness.set('listening', false, 'NBD is not listening yet');
  let metricsServer: MetricsServer | null = null;
  if (o.metrics) {
    // prom-client loads only here: every other command (and a serve without --metrics) is spared its start-up (~35 ms).
    const { createMetricsRegistry } = await import('./metrics.js');
    metricsServer = new MetricsServer(createMetricsRegistry(sources), readiness, log);
    const bound = await metricsServer.listen(o.metrics.host, o.metrics.port);
    log.info({ address: bound, paths: ['/metrics', '/healthz', '/readyz'] }, 'metrics listening');
  }
  const undo: (() => Promise<void>)[] = [async () => { await metricsServer?.close(); }];
  const unwind = async (): Promise<void> => { for (const u of undo.splice(0).reverse()) await u().catch(() => {}); };
  try {
    if (catalog instanceof StoreCatalog) {
      await checkCacheDir(catalog, cacheDir);
      sources.cache = await catalog.readCache();
    }
    if ((o.statsIntervalMs ?? 0) > 0) {
      const stop = logProcessStats(o.statsIntervalMs!, log, () => sources.cache?.stats);
      undo.push(async () => stop());
    }
    await probeBeforeServing(catalog, !!o.readOnly, log);
    readiness.set('store', true, o.readOnly || !(catalog instanceof StoreCatalog) ? `${catalog.description} (read-only or plain backend: not probed)` : catalog.description);
    if (o.create) {
      try {
        const v = await catalog.create(o.create.name, o.create.size);
        log.info({ volume: v.name, size: v.size }, 'volume created');
      } catch (err) {
        if (!isBatonError(err, 'BATON_ERR_ALREADY_EXISTS')) throw err;
      }
    }
    // A lease manager of its own: close() closes it with the server.
    const leases = catalog instanceof StoreCatalog && !o.readOnly ? await openLeaseManager({ storeUrl: d.store, ttlMs: d.leaseTtlMs, log, ...(d.redisUrl ? { redis: d.redisUrl } : {}) }) : null;
    if (leases) undo.push(() => leases.close());
    if (leases) readiness.probe('lease', async () => { await leases.ping(); return leases.description; });
    else readiness.set('lease', true, 'no lease (read-only or plain backend)');
    let server: Server | null = null;
    const exports = new VolumeExports(catalog, {
      readOnly: !!o.readOnly, idleGraceMs: o.idleGraceMs ?? 5000, log, requestStats: !!o.metrics,
      hydrate: { mode: o.hydrate ?? 'working-set', concurrency: o.hydrateConcurrency ?? DEFAULT_HYDRATE_CONCURRENCY, ...(o.hydrateMax !== undefined ? { maxBytes: o.hydrateMax } : {}) },
      ...(leases ? { lease: { manager: leases, hostId: d.hostId, onHeld: o.onHeld ?? 'refuse', waitMs: o.heldWaitMs ?? 30_000, address: 'path' in addr ? `unix:${addr.path}` : `${addr.host}:${addr.port}` } } : {}),
      onEvent: (e) => { server?.emit(e.type, e); },
    });
    undo.push(() => exports.close());
    provider = exports;
    const nbd = new NbdServer(exports, {
      log, handshakeTimeoutMs, maxConnections: o.maxConnections ?? DEFAULT_MAX_CONNECTIONS,
      ...(security.tls ? { tls: security.tls } : {}), ...(security.exportsFor ? { exportsFor: security.exportsFor } : {}),
    });
    exports.setDisconnector((name) => nbd.disconnectExport(name));
    const bound = await nbd.listen(addr);
    undo.push(() => nbd.close());
    const maintenance = catalog instanceof StoreCatalog && !o.readOnly
      ? new BackgroundMaintenance(catalog, exports, { intervalMs: o.gcIntervalMs ?? DEFAULT_GC_GRACE_MS, graceMs: o.gcGraceMs ?? DEFAULT_GC_GRACE_MS, compactBelow: o.compactBelow ?? DEFAULT_COMPACT_BELOW, log, ...(leases ? { expiry: { leases, hostId: d.hostId } } : {}) })
      : null;
    maintenance?.start();
    if (maintenance) undo.push(() => maintenance.stop());
    Object.assign(sources, { volumes: exports, nbd, maintenance });
    let closing: Promise<void> | null = null;
    server = new Server(bound, exports, flags.tls !== 'off', () => security.reload(log), () => {
      closing ??= (async () => {
        readiness.set('listening', false, 'shutting down');
        log.info('shutting down: finishing requests and flushing volumes');
        await unwind();
      })();
      return closing;
    });
    const uri = server.uri('NAME');
    log.info({ address: bound, store: catalog.description, uri, hostId: d.hostId, lease: leases?.description ?? 'none (read-only or plain backend)', ...security.describe() }, 'listening');
    if (flags.insecure && !('path' in bound) && !isLoopbackHost(bound.host) && flags.tls !== 'require') {
      log.warn({ address: bound, tls: flags.tls }, '--insecure: serving to the network without requiring TLS; every host that can reach this address may read and write every volume');
    }
    readiness.set('listening', true, uri);
    return server;
  } catch (err) {
    await unwind();
    throw err;
  }
}

/**
 * Make the read cache now: a --cache-dir that cannot hold it (a file, unwritable) is
 * reported at start with what to do, not found out at every attach later.
 */
async function checkCacheDir(catalog: StoreCatalog, dir: string): Promise<void> {
  try {
    await catalog.readCache();
  } catch (err) {
    throw new InvalidArgumentError(`--cache-dir ${dir} cannot hold the read cache (${errorMessage(err)}): name a directory this user may write, or leave the option out (default ${defaultCacheDir()})`);
  }
}

/**
 * Refuse to serve read-write on a store that does not honour create-only puts: fencing would
 * be a lie. While the store does not answer, log that and keep trying (see waitForStore).
 */
async function probeBeforeServing(catalog: unknown, readOnly: boolean, log: Logger): Promise<void> {
  if (readOnly || !(catalog instanceof StoreCatalog)) return;
  const t0 = Date.now();
  await waitForStore(catalog.store, { log });
  log.info({ store: catalog.description, ms: Date.now() - t0 }, 'store honours create-only puts');
}

/**
 * `serve --stats-interval`: every intervalMs one info line `process stats` with this process's
 * memory and the event-loop delay measured since the previous line (that histogram is reset
 * each time, so its p99 and max describe that interval only) and since start. Off by default: the delay monitor
 * wakes the loop every 10 ms, which an idle server should not pay for unasked, and a line a
 * minute from an idle server is noise; turn it on to see why a lease renewal came late.
 * Returns what stops it.
 */
function logProcessStats(intervalMs: number, log: Logger, cacheStats: () => CacheStats | undefined): () => void {
  const resolutionMs = 10;
  // One histogram per interval (reset after each line) and one since start: percentiles of
  // a whole run cannot be computed from per-interval ones.
  const eld = monitorEventLoopDelay({ resolution: resolutionMs });
  const total = monitorEventLoopDelay({ resolution: resolutionMs });
  eld.enable();
  total.enable();
  let cpu = process.cpuUsage();
  let at = performance.now();
  // The histogram holds the time between the monitor's timer ticks; minus the tick interval
  // that is how late the loop ran them (an idle server shows ~0, a 2 s stall ~2000).
  const ms = (ns: number): number => Math.round(Math.max(0, ns / 1e6 - resolutionMs) * 100) / 100;
  const timer = setInterval(() => {
    const m = process.memoryUsage();
    const c = process.cpuUsage(cpu);
    const now = performance.now();
    log.info({
      rss: m.rss, heapUsed: m.heapUsed, heapTotal: m.heapTotal, external: m.external, arrayBuffers: m.arrayBuffers,
      eldP50Ms: ms(eld.percentile(50)), eldP99Ms: ms(eld.percentile(99)), eldMaxMs: ms(eld.max), eldMeanMs: ms(eld.mean),
      eldP99SinceStartMs: ms(total.percentile(99)), eldMaxSinceStartMs: ms(total.max),
      cpuPct: Math.round(((c.user + c.system) / 1000 / (now - at)) * 1000) / 10, intervalMs: Math.round(now - at),
      // The read cache since start: hits and misses in blocks, ranged GETs (reads', readahead's
      // and hydration's) and their bytes.
      ...(cacheStats() ? { cache: { ...cacheStats() } } : {}),
    }, 'process stats');
    eld.reset();
    cpu = process.cpuUsage();
    at = now;
  }, intervalMs);
  timer.unref();
  return () => { clearInterval(timer); eld.disable(); total.disable(); };
}

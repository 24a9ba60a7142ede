#!/usr/bin/env node
/**
 * The `baton` command: a thin commander layer. It parses, validates, builds configuration
 * and calls src/ and nbd/; no storage logic lives here. Logs go to stderr, data (and
 * --json) to stdout. Exit codes: 0 success, 1 failure, 2 usage error.
 */

// The AWS SDK warns on every start that its 2027 releases will need Node 22; the lockfile
// pins a release that supports Node 20, so the warning tells the user nothing actionable.
const emitWarning = process.emitWarning.bind(process);
process.emitWarning = ((warning: string | Error, ...rest: unknown[]) => {
  const name = typeof warning === 'string' ? (typeof rest[0] === 'string' ? rest[0] : (rest[0] as { type?: string } | undefined)?.type) : warning.name;
  if (name === 'NodeVersionSupportWarning') return;
  (emitWarning as (...a: unknown[]) => void)(warning, ...rest);
}) as typeof process.emitWarning;

import { monitorEventLoopDelay } from 'node:perf_hooks';
import { Command, InvalidArgumentError as CommanderInvalidArgument, Option } from 'commander';
import { DEFAULT_MAX_CONNECTIONS, NbdServer, type ListenAddress } from '../nbd/server.js';
import { defaultCacheDir, openCatalog, type CatalogOptions } from '../src/catalog.js';
import type { CacheStats } from '../src/cache.js';
import { DEFAULT_RETRY_BUDGET_MS, INTERACTIVE_RETRY_BUDGET_MS } from '../src/store/open.js';
import { waitForStore } from '../src/store/probe.js';
import { StoreCatalog, type StoreVolumeInfo } from '../src/volume/catalog.js';
import type { Logger } from '../src/log.js';
import { DEFAULT_LISTEN, defaultStoreUrl, isLoopbackHost, isProcessLocalStore, parseListen } from '../src/config.js';
import { checkServeSecurity, setupServeTls, type ServeSecurityFlags } from '../src/tls-config.js';
import { BatonError, InvalidArgumentError, NotFoundError, errorMessage, isBatonError } from '../src/errors.js';
import { LOG_LEVELS, makeLogger } from '../src/log.js';
import { formatSize, formatSizeArg, parseSize } from '../src/size.js';
import { VolumeExports, defaultHostId, type OnHeld } from '../src/exports.js';
import { openLeaseManager } from '../src/lease/open.js';
import { BackgroundMaintenance, DEFAULT_COMPACT_BELOW, compactIdleVolumes, type CompactionReport } from '../src/maintenance.js';
import { DEFAULT_GC_GRACE_MS, collectGarbage } from '../src/volume/gc.js';
import { DEFAULT_HYDRATE_CONCURRENCY, HYDRATE_MODES, type HydrateMode } from '../src/volume/hydrate.js';
import { NbdClient } from '../nbd/client.js';
import { createMetricsRegistry, type MetricsSources } from '../src/metrics.js';
import { MetricsServer, Readiness, parseMetricsAddress } from '../src/metrics-server.js';

const VERSION = '0.1.0';

function sizeArg(v: string): number {
  try { return parseSize(v); } catch (err) { throw new CommanderInvalidArgument(errorMessage(err)); }
}

/** A duration: seconds, or with a unit (500ms, 90s, 10m, 1h). Returns milliseconds. */
function durationArg(v: string): number {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m|h)?$/.exec(v.trim());
  if (!m) throw new CommanderInvalidArgument(`not a duration: ${v} (examples: 90, 90s, 10m, 1h)`);
  const unit = { ms: 1, s: 1000, m: 60_000, h: 3_600_000 }[(m[2] ?? 's') as 'ms' | 's' | 'm' | 'h'];
  return Math.round(Number(m[1]) * unit);
}

/** Milliseconds the way durationArg reads them back (1h, 10m, 90s, 500ms): help shows defaults in the syntax it takes. */
function durationText(ms: number): string {
  if (ms > 0 && ms % 3_600_000 === 0) return `${ms / 3_600_000}h`;
  if (ms > 0 && ms % 60_000 === 0) return `${ms / 60_000}m`;
  if (ms % 1000 === 0) return `${ms / 1000}s`;
  return `${ms}ms`;
}

/** An option taking a duration, with its default shown as it would be typed. */
const durationOption = (flags: string, description: string, defaultMs: number): Option =>
  new Option(flags, description).argParser(durationArg).default(defaultMs, durationText(defaultMs));

const DEFAULT_CACHE_SIZE = 2 * 1024 ** 3;

function fractionArg(v: string): number {
  const n = Number(v);
  if (!Number.isFinite(n) || n < 0 || n > 1) throw new CommanderInvalidArgument(`not a fraction between 0 and 1: ${v}`);
  return n;
}

function positiveIntArg(v: string): number {
  const n = Number(v);
  if (!Number.isInteger(n) || n < 1) throw new CommanderInvalidArgument(`not a positive whole number: ${v}`);
  return n;
}

function secondsArg(v: string): number {
  const n = Number(v);
  if (!Number.isFinite(n) || n < 0) throw new CommanderInvalidArgument(`not a number of seconds: ${v}`);
  return n;
}

const storeOption = (): Option =>
  new Option('--store <url>', 'where volumes live: file:DIR, s3://bucket[/prefix], memory:').default(defaultStoreUrl(), '$BATON_STORE or file:~/.local/share/baton/store');

interface StoreFlags { store: string; endpoint?: string; region?: string; keyFile?: string }

/** The options every command that touches a store takes. */
function withStore(cmd: Command): Command {
  return cmd
    .addOption(storeOption())
    .addOption(new Option('--endpoint <url>', 'S3-compatible endpoint (MinIO, Ceph RGW, R2...); credentials come from the AWS chain').env('BATON_S3_ENDPOINT'))
    .addOption(new Option('--region <region>', 'S3 region').env('AWS_REGION'))
    // Encrypted volumes (issue 16): read when one is created, forked or opened; never a key on the command line.
    .option('--key-file <file>', 'master key of encrypted volumes (32 bytes raw, or 64 hex digits or base64 text); else BATON_KEY_FILE or BATON_KEY from the environment');
}

/**
 * Commands a person waits for give each store operation INTERACTIVE_RETRY_BUDGET_MS, retries
 * included, then fail with a message naming the store and its endpoint; serve chooses its own.
 */
function catalogFor(o: StoreFlags, extra: CatalogOptions = {}) {
  return openCatalog(o.store, { retry: { budgetMs: INTERACTIVE_RETRY_BUDGET_MS }, ...(o.keyFile !== undefined ? { keyFile: o.keyFile } : {}), ...extra, ...(o.endpoint ? { endpoint: o.endpoint } : {}), ...(o.region ? { region: o.region } : {}) });
}

/** Aligned columns for humans (stdout); the first row is the header. */
function printTable(rows: string[][]): void {
  const widths = rows[0]!.map((_, i) => Math.max(...rows.map((r) => r[i]!.length)));
  for (const r of rows) process.stdout.write(r.map((c, i) => c.padEnd(widths[i]!)).join('  ').trimEnd() + '\n');
}

/** A snapshot whose volume was removed says so (a volume now under that name is another one). */
function displayName(v: StoreVolumeInfo): string {
  return v.snapshotOf && v.snapshotOf.volume === null ? `${v.name} (its volume was removed)` : v.name;
}

function printJson(v: unknown): void {
  process.stdout.write(JSON.stringify(v, null, 2) + '\n');
}

function volumeJson(v: StoreVolumeInfo): Record<string, unknown> {
  return {
    name: v.name, kind: v.kind ?? 'volume', size: v.size, createdAt: v.createdAt, storedBytes: v.storedBytes,
    ...(v.parent ? { parent: v.parent } : {}),
    ...(v.snapshotOf ? { snapshotOf: v.snapshotOf } : {}),
    ...(v.writtenBytes !== undefined ? { writtenBytes: v.writtenBytes, exclusiveBytes: v.exclusiveBytes, sharedBytes: v.sharedBytes } : {}),
    ...(v.writtenStoredBytes !== undefined ? { writtenStoredBytes: v.writtenStoredBytes, exclusiveStoredBytes: v.exclusiveStoredBytes, sharedStoredBytes: v.sharedStoredBytes } : {}),
    ...(v.data ? { data: v.data } : {}),
  };
}

/** The engine's catalog, or a clear error for the plain backends. */
function storeCatalog(o: StoreFlags, what: string, extra: CatalogOptions = {}): StoreCatalog {
  const c = catalogFor(o, extra);
  if (!(c instanceof StoreCatalog)) throw new BatonError('BATON_ERR_INVALID_ARGUMENT', `${what} needs an object store (file:DIR, s3://, memory:), not ${o.store}`);
  return c;
}

const program = new Command()
  .name('baton')
  .description('Workspaces for agents as NBD block devices: create volumes, serve them, attach them anywhere.')
  .version(VERSION)
  .showHelpAfterError('(add --help for usage and examples)')
  .configureHelp({ sortSubcommands: true })
  // Set before the subcommands are added, so they inherit it: usage errors exit 2.
  .exitOverride((err) => { process.exit(err.exitCode === 0 ? 0 : 2); })
  .addHelpText('after', `
Examples:
  $ baton create work --size 10G          # a 10 GiB volume in the default store
  $ baton serve                            # serve every volume on 127.0.0.1:10809
  $ nbdinfo nbd://127.0.0.1/work           # look at it with any NBD client
  $ baton ls --json`);

withStore(program.command('serve')
  .description('serve volumes over NBD; the export name is the volume name'))
  .option('--listen <host:port>', 'TCP address to listen on (loopback unless you ask)', DEFAULT_LISTEN)
  .option('--socket <path>', 'listen on a Unix socket instead of TCP')
  .option('--cache-dir <dir>', 'local read cache directory', defaultCacheDir())
  .addOption(new Option('--cache-size <size>', 'local read cache capacity, e.g. 10G').argParser(sizeArg).default(DEFAULT_CACHE_SIZE, formatSizeArg(DEFAULT_CACHE_SIZE)))
  .option('--read-only', 'export every volume read-only')
  .option('--create <name>', 'create this volume first if it does not exist (with --size)')
  .option('--size <size>', 'size for --create, e.g. 10G', sizeArg)
  .addOption(new Option('--redis <url>', 'Redis for the single-writer lease (redis://, rediss://, unix://, redis+sentinel://, redis+cluster://); without it, a lease file on this machine').env('BATON_REDIS_URL'))
  .option('--lease-ttl <seconds>', 'lease time-to-live; a dead host is taken over after this', secondsArg, 5)
  .option('--host-id <id>', 'this host\'s name in leases and handoffs', defaultHostId())
  .addOption(new Option('--on-held <policy>', 'when another host holds a volume: refuse the attach, wait for it, or ask for a handoff').choices(['refuse', 'wait', 'takeover']).default('refuse'))
  .option('--held-wait <seconds>', 'how long --on-held wait|takeover waits', secondsArg, 30)
  .option('--handshake-timeout <seconds>', 'close clients that do not finish the handshake in time', secondsArg, 30)
  .option('--max-connections <n>', 'NBD connections served at once; past it clients are refused with a message', (v: string) => {
    const n = Number(v);
    if (!Number.isInteger(n) || n < 1) throw new CommanderInvalidArgument(`not a positive whole number of connections: ${v}`);
    return n;
  }, DEFAULT_MAX_CONNECTIONS)
  .option('--idle-grace <seconds>', 'keep a volume open this long after its last client leaves', secondsArg, 5)
  .addOption(durationOption('--gc-interval <duration>', 'while serving volumes, compact them and collect garbage this often (0: never)', DEFAULT_GC_GRACE_MS))
  .addOption(durationOption('--gc-grace <duration>', 'garbage collection grace period (see baton gc --help)', DEFAULT_GC_GRACE_MS))
  .option('--compact-below <fraction>', 'rewrite objects of served volumes whose live fraction is below this', fractionArg, DEFAULT_COMPACT_BELOW)
  .addOption(new Option('--hydrate <mode>', 'when this host opens a volume, fetch in the background what its last holder was working on (working-set), that and then everything (all), or nothing (off)').choices([...HYDRATE_MODES]).default('working-set'))
  .option('--hydrate-concurrency <n>', 'hydration GETs in flight per volume (its share of the store\'s bandwidth; guest reads never wait behind them)', positiveIntArg, DEFAULT_HYDRATE_CONCURRENCY)
  .addOption(new Option('--hydrate-max <size>', 'fetch at most this much per volume (default three quarters of --cache-size)').argParser(sizeArg))
  .addOption(durationOption('--stats-interval <duration>', 'log RSS, heap, event-loop delay (p50/p99/max since the last line) and read-cache counters at info level this often (0: never)', 0))
  .addOption(new Option('--compression <on|off>', 'off: store new data uncompressed, for every volume served (it is still framed and checksummed); on: as each volume\'s record says').choices(['on', 'off']).default('on'))
  .option('--metrics <[host:]port>', 'serve Prometheus metrics at /metrics and health at /healthz, /readyz on this address (a bare port listens on 127.0.0.1)', (v: string) => {
    try { return parseMetricsAddress(v); } catch (err) { throw new CommanderInvalidArgument(errorMessage(err)); }
  })
  .option('--log-level <level>', LOG_LEVELS.join(', '), process.env.BATON_LOG_LEVEL ?? 'info')
  .addOption(new Option('--tls <mode>', 'TLS (NBD STARTTLS): off, on (offered; plaintext clients are served too) or require').choices(['off', 'on', 'require']).default('off'))
  .option('--tls-certificates <dir>', 'server certificate directory, nbdkit\'s layout: server-cert.pem, server-key.pem, ca-cert.pem, optional ca-crl.pem')
  .option('--tls-verify-peer', 'require a client certificate signed by ca-cert.pem; its subject CN and subjectAltNames name the client for --authz')
  .option('--tls-psk <file>', 'authenticate clients by pre-shared keys instead of certificates: psktool\'s identity:hexkey lines')
  .option('--authz <file>', 'exports per client identity, lines of IDENTITY PATTERN [PATTERN...] (tenant-a-* is a prefix); needs --tls require with --tls-psk or --tls-verify-peer')
  .option('--insecure', 'allow a non-loopback --listen without --tls require (every host that can reach it may use every volume)')
  .addHelpText('after', `
Metrics (--metrics): /metrics is Prometheus text (baton_* series per volume, store, cache,
GC, and the process's); /healthz answers 200 while the process runs; /readyz answers 200
once the store passed its startup probe, the lease service answers and NBD is listening,
503 with the failing check otherwise. See README.md, "Metrics".

Examples:
  $ baton serve --create work --size 10G
  $ baton serve --socket /run/baton.sock --store file:/var/lib/baton
  $ AWS_PROFILE=ci baton serve --store s3://my-bucket/baton --endpoint http://127.0.0.1:7480
  $ nbd-client -N work 127.0.0.1 10809 /dev/nbd0     # attach with the kernel client
  $ nbdfuse /mnt/work nbd://127.0.0.1/work &         # or as a file through FUSE
  $ baton serve --store s3://b/p --hydrate all --hydrate-concurrency 4 --cache-size 20G
  $ baton serve --metrics 9464                       # metrics on 127.0.0.1:9464
  $ curl -s 127.0.0.1:9464/metrics | grep '^baton_nbd_requests_total'
  $ baton serve --listen 0.0.0.0:10809 --metrics 0.0.0.0:9464 --redis redis://10.0.0.5:6379

Hydration: a volume's holder records which parts of it were read and written lately (its
working set) in its checkpoints. A host that opens the volume (after a takeover, a handoff,
a fork's first attach, a restart) fetches those parts into its read cache in the
background, most recently used first, within --hydrate-max and --hydrate-concurrency; a
host waiting for another to hand a volume over starts while it waits. A file: store needs
none (its objects are read in place). baton status shows its progress.

Serving over a network (TLS is required off loopback; certificates and keys are re-read on SIGHUP):
  $ baton serve --listen 0.0.0.0:10809 --tls require --tls-certificates /etc/baton/pki
  $ nbdinfo 'nbds://server/work?tls-certificates=/etc/baton/client-pki'
  $ baton serve --listen 0.0.0.0:10809 --tls require --tls-certificates /etc/baton/pki \\
        --tls-verify-peer --authz /etc/baton/authz     # authz lines: alice tenant-a-* shared
  $ psktool -u alice -p /etc/baton/keys.psk
  $ baton serve --listen 0.0.0.0:10809 --tls require --tls-psk /etc/baton/keys.psk
  $ nbdinfo 'nbds://alice@server/work?tls-psk-file=/etc/baton/keys.psk'
  $ kill -HUP SERVE_PID                               # after rotating certificates, keys or authz
See README.md, "Serving over a network", for making certificates and the client commands.`)
  .action(async (opts: StoreFlags & LeaseFlags & ServeSecurityFlags & { listen: string; socket?: string; cacheDir: string; cacheSize: number; readOnly?: boolean; create?: string; size?: number; handshakeTimeout: number; maxConnections: number; idleGrace: number; logLevel: string; onHeld: OnHeld; heldWait: number; gcInterval: number; gcGrace: number; compactBelow: number; statsInterval: number; hydrate: HydrateMode; hydrateConcurrency: number; hydrateMax?: number; metrics?: { host: string; port: number }; compression: 'on' | 'off' }) => {
    const log = makeLogger(opts.logLevel);
    // Who may connect is decided, and every TLS/authz file read, before the store is touched
    // (waiting for a store can take long; a typo in --tls-psk should not).
    const addr: ListenAddress = opts.socket ? { path: opts.socket } : parseListen(opts.listen);
    checkServeSecurity(opts, 'path' in addr ? null : addr.host, isLoopbackHost);
    let provider: VolumeExports | undefined;
    const security = setupServeTls(opts, () => provider!, opts.handshakeTimeout * 1000);
    if (opts.size !== undefined && !opts.create) throw new InvalidArgumentError('--size is the size of the volume --create NAME makes; without --create it would do nothing (volumes are made with baton create NAME --size SIZE)');
    const catalog = catalogFor(opts, { log, cacheDir: opts.cacheDir, cacheSize: opts.cacheSize, retry: { budgetMs: DEFAULT_RETRY_BUDGET_MS }, instrument: !!opts.metrics,
      ...(opts.compression === 'off' ? { volume: { compress: false } } : {}),
    });
    // Metrics first: /healthz answers and /readyz says what it waits for while the store is
    // probed (which waits for as long as the store does not answer). Filled in as things start.
    const sources: MetricsSources = { info: { hostId: opts.hostId, store: catalog.description, version: VERSION }, ...(catalog instanceof StoreCatalog ? { store: catalog.store } : {}) };
    const readiness = new Readiness();
    readiness.set('store', false, 'waiting for the store to pass its startup probe');
    readiness.set('listening', false, 'NBD is not listening yet');
    if (opts.metrics) {
      const bound = await new MetricsServer(createMetricsRegistry(sources), readiness, log).listen(opts.metrics.host, opts.metrics.port);
      log.info({ address: bound, paths: ['/metrics', '/healthz', '/readyz'] }, 'metrics listening');
    }
    if (catalog instanceof StoreCatalog) {
      await checkCacheDir(catalog, opts.cacheDir);
      sources.cache = await catalog.readCache();
    }
    if (opts.statsInterval > 0) logProcessStats(opts.statsInterval, log, () => sources.cache?.stats);
    await probeBeforeServing(catalog, !!opts.readOnly, log);
    readiness.set('store', true, opts.readOnly || !(catalog instanceof StoreCatalog) ? `${catalog.description} (read-only or plain backend: not probed)` : catalog.description);
    if (opts.create) {
      if (opts.size === undefined) throw new BatonError('BATON_ERR_INVALID_ARGUMENT', '--create needs --size (for example --size 10G)');
      try {
        const v = await catalog.create(opts.create, opts.size);
        log.info({ volume: v.name, size: v.size }, 'volume created');
      } catch (err) {
        if (!isBatonError(err, 'BATON_ERR_ALREADY_EXISTS')) throw err;
      }
    }
    const leases = catalog instanceof StoreCatalog && !opts.readOnly ? await leaseManagerFor(opts, log) : null;
    if (leases) readiness.probe('lease', async () => { await leases.ping(); return leases.description; });
    else readiness.set('lease', true, 'no lease (read-only or plain backend)');
    const exports = new VolumeExports(catalog, {
      readOnly: !!opts.readOnly, idleGraceMs: opts.idleGrace * 1000, log, requestStats: !!opts.metrics,
      hydrate: { mode: opts.hydrate, concurrency: opts.hydrateConcurrency, ...(opts.hydrateMax !== undefined ? { maxBytes: opts.hydrateMax } : {}) },
      ...(leases ? { lease: { manager: leases, hostId: opts.hostId, onHeld: opts.onHeld, waitMs: opts.heldWait * 1000, address: 'path' in addr ? `unix:${addr.path}` : `${addr.host}:${addr.port}` } } : {}),
    });
    provider = exports;
    const server = new NbdServer(exports, {
      log, handshakeTimeoutMs: opts.handshakeTimeout * 1000, maxConnections: opts.maxConnections,
      ...(security.tls ? { tls: security.tls } : {}), ...(security.exportsFor ? { exportsFor: security.exportsFor } : {}),
    });
    exports.setDisconnector((name) => server.disconnectExport(name));
    const bound = await server.listen(addr);
    const uri = 'path' in bound ? `nbd+unix:///NAME?socket=${bound.path}` : `nbd://${bound.host.includes(':') ? `[${bound.host}]` : bound.host}:${bound.port}/NAME`;
    log.info({ address: bound, store: catalog.description, uri: opts.tls === 'off' ? uri : uri.replace(/^nbd/, 'nbds'), hostId: opts.hostId, lease: leases?.description ?? 'none (read-only or plain backend)', ...security.describe() }, 'listening');
    if (opts.insecure && !('path' in bound) && !isLoopbackHost(bound.host) && opts.tls !== 'require') {
      log.warn({ address: bound, tls: opts.tls }, '--insecure: serving to the network without requiring TLS; every host that can reach this address may read and write every volume');
    }
    const maintenance = catalog instanceof StoreCatalog && !opts.readOnly
      ? new BackgroundMaintenance(catalog, exports, { intervalMs: opts.gcInterval, graceMs: opts.gcGrace, compactBelow: opts.compactBelow, log })
      : null;
    maintenance?.start();
    Object.assign(sources, { volumes: exports, nbd: server, maintenance });
    readiness.set('listening', true, uri);
    let stopping = false;
    const stop = async (signal: string): Promise<void> => {
      if (stopping) return;
      stopping = true;
      readiness.set('listening', false, 'shutting down');
      log.info({ signal }, 'shutting down: finishing requests and flushing volumes');
      await maintenance?.stop();
      await server.close();
      await exports.close();
      await leases?.close();
      process.exit(0);
    };
    process.on('SIGINT', () => void stop('SIGINT'));
    process.on('SIGTERM', () => void stop('SIGTERM'));
    // Certificate, key and authz rotation without dropping clients (without TLS SIGHUP keeps its default: exit).
    if (security.tls) process.on('SIGHUP', () => security.reload(log));
  });

withStore(program.command('create')
  .description('create a volume')
  .argument('<name>', 'volume name (letters, digits, . _ -)'))
  .requiredOption('--size <size>', 'logical size, e.g. 10G, 512M', sizeArg)
  .addOption(new Option('--compression <codec>', 'compress its data (per 32 KiB frame; frames that do not shrink are stored as they are)').choices(['lz4', 'none']).default('lz4'))
  .option('--encrypt', 'encrypt its data at rest (AES-256-GCM) with a data key of its own, wrapped by the master key (--key-file)')
  .addOption(new Option('--data-format <format>', 'framed (checksummed frames) or raw (the layout before frames: no checksums; tests and benchmarks)').choices(['framed', 'raw']).default('framed').hideHelp())
  .option('--json', 'print the new volume as JSON')
  .addHelpText('after', `
Examples:
  $ baton create work --size 10G
  $ baton create scratch --size 512M --store file:/tmp/baton --json
  $ head -c 32 /dev/urandom > ~/.baton.key && chmod 600 ~/.baton.key
  $ baton create secret --size 10G --encrypt --key-file ~/.baton.key

Data is stored in checksummed frames: a damaged or foreign object is an I/O error, never wrong
data. An encrypted volume (and every fork of it: forks get a data key of their own, so forking
needs the key too, from BATON_KEY_FILE or BATON_KEY) is served only by a process given its
master key: baton serve --key-file FILE. Metadata (names, sizes, which ranges were written,
compressed sizes, timing) is not encrypted.`)
  .action(async (name: string, opts: StoreFlags & { size: number; json?: boolean; compression: 'lz4' | 'none'; encrypt?: boolean; dataFormat: 'framed' | 'raw' }) => {
    const v = await catalogFor(opts).create(name, opts.size, { compression: opts.compression, encrypt: !!opts.encrypt, format: opts.dataFormat });
    // memory: and ram: live in this process: the volume is gone as soon as we exit.
    const gone = isProcessLocalStore(opts.store)
      ? `${opts.store} keeps volumes only while the process that made them runs, so ${v.name} is gone now that baton create exits; `
        + `for a volume that lasts use file:DIR or s3://, or make it where it is served: baton serve --store ${opts.store} --create ${v.name} --size ${formatSizeArg(v.size)}`
      : null;
    if (opts.json) printJson({ ...volumeJson(v), ...(gone ? { processLocal: true } : {}) });
    else process.stdout.write(`created volume ${v.name} (${formatSize(v.size)}) in ${opts.store}\n`);
    if (gone) process.stderr.write(`baton: note: ${gone}\n`);
  });

withStore(program.command('ls')
  .description('list volumes'))
  .option('--json', 'print a JSON array')
  .addHelpText('after', '\nExamples:\n  $ baton ls\n  $ baton ls --json | jq -r \'.[].name\'')
  .action(async (opts: StoreFlags & { json?: boolean }) => {
    const c = catalogFor(opts);
    const vols = c instanceof StoreCatalog ? await c.listWithAccounting() : await c.list();
    if (opts.json) { printJson(vols.map(volumeJson)); return; }
    if (vols.length === 0) { process.stdout.write(`no volumes in ${opts.store} (create one: baton create NAME --size 10G)\n`); return; }
    const fmt = (n: number | undefined): string => (n === undefined ? '-' : formatSize(n));
    // WRITTEN is logical (what the map names); in parentheses what it costs in the store per logical byte (compression).
    const written = (v: StoreVolumeInfo): string => (v.writtenBytes && v.writtenStoredBytes !== undefined ? `${fmt(v.writtenBytes)} (${(v.writtenStoredBytes / v.writtenBytes).toFixed(2)})` : fmt(v.writtenBytes));
    printTable([['NAME', 'SIZE', 'STORED', 'WRITTEN', 'EXCLUSIVE', 'SHARED', 'CREATED'], ...vols.map((v: StoreVolumeInfo) => [displayName(v), formatSize(v.size), formatSize(v.storedBytes), written(v), fmt(v.exclusiveBytes), fmt(v.sharedBytes), v.createdAt])]);
  });

withStore(program.command('info')
  .description('show one volume')
  .argument('<name>'))
  .option('--json', 'print JSON')
  .addHelpText('after', '\nExamples:\n  $ baton info work\n  $ baton info work --json')
  .action(async (name: string, opts: StoreFlags & { json?: boolean }) => {
    const c = catalogFor(opts);
    const v: StoreVolumeInfo = c instanceof StoreCatalog ? await c.infoWithAccounting(name) : await c.info(name);
    if (opts.json) { printJson(volumeJson(v)); return; }
    const stored = (n: number | undefined): string => (n === undefined ? '' : ` (${formatSize(n)} stored)`);
    const lines = [
      `name:      ${v.name}${v.kind === 'snapshot' ? ' (snapshot, read-only)' : ''}`,
      ...(v.snapshotOf ? [`of:        ${v.snapshotOf.volume !== null
        ? `volume ${v.snapshotOf.volume}${v.snapshotOf.id ? ` (id ${v.snapshotOf.id})` : ''}`
        : `a removed volume${v.snapshotOf.id ? ` (id ${v.snapshotOf.id})` : ''}, not any volume named ${v.name.slice(0, v.name.indexOf('@'))} now`}`] : []),
      `size:      ${formatSize(v.size)} (${v.size} bytes)`,
      `stored:    ${formatSize(v.storedBytes)} under its own prefix`,
      ...(v.writtenBytes !== undefined ? [`written:   ${formatSize(v.writtenBytes)} mapped${v.writtenBytes > 0 && v.writtenStoredBytes !== undefined ? ` (${formatSize(v.writtenStoredBytes)} stored: ${(v.writtenStoredBytes / v.writtenBytes).toFixed(2)}x)` : stored(v.writtenStoredBytes)}`, `exclusive: ${formatSize(v.exclusiveBytes ?? 0)}${stored(v.exclusiveStoredBytes)} (freed if it is removed)`, `shared:    ${formatSize(v.sharedBytes ?? 0)}${stored(v.sharedStoredBytes)} with forks and snapshots`] : []),
      ...(v.data ? [`data:      ${v.data.format}, compression ${v.data.compression}${v.data.encrypted ? `, encrypted (master key id ${v.data.keyId})` : ''}`] : []),
      ...(v.parent ? [`forked:    from volume id ${v.parent.id} at log record ${v.parent.seq}`] : []),
      `created:   ${v.createdAt}`,
      `store:     ${opts.store}`,
    ];
    process.stdout.write(lines.join('\n') + '\n');
  });

withLease(withStore(program.command('rm')
  .description('remove a volume (or NAME@SNAP) and its data; refused while a host serves it, or while it has snapshots')
  .argument('<name>')))
  .option('--snapshots', 'also remove the volume\'s snapshots (first); without it a volume with snapshots is refused')
  .option('--force', 'remove even if a host is serving it: its lease is broken, so that host notices at its next lease renewal, stops serving the volume (fenced) and disconnects its clients')
  .addHelpText('after', `
A snapshot belongs to the volume it was taken of: removing a volume that has snapshots is
refused unless --snapshots removes them too. Data a fork still maps stays in the store
(garbage collection deletes it once nothing needs it).

Examples:
  $ baton rm scratch
  $ baton rm work@monday
  $ baton rm work --snapshots
  $ baton rm work --redis redis://10.0.0.5:6379`)
  .action(async (name: string, opts: StoreFlags & LeaseFlags & { force?: boolean; snapshots?: boolean }) => {
    const catalog = catalogFor(opts);
    // Snapshots are served read-only, without a lease.
    const leases = name.includes('@') ? null : await leaseManagerFor(opts);
    try {
      const held = leases ? await leases.inspect(name) : null;
      if (held?.holder && !opts.force) throw new BatonError('BATON_ERR_LEASE_HELD', `volume ${name} is being served by ${held.holder}; detach its clients (the lease is given back after --idle-grace) or hand it over, then retry; --force removes it anyway (and breaks that host's lease)`);
      let r;
      try {
        r = catalog instanceof StoreCatalog ? await catalog.remove(name, { snapshots: !!opts.snapshots }) : { ...(await catalog.remove(name)), removedSnapshots: [] };
      } finally {
        // --force: break the lease once the record is gone (also if rm failed after that), not
        // before: the holder, fenced, must find nothing to reopen under that name. Without it,
        // a host serving a removed volume would go on serving its old bytes under that name.
        if (opts.force && leases && await isGone(catalog, name)) {
          const revoked = await leases.revoke(name);
          if (revoked) process.stdout.write(`broke the lease ${held?.holder ? `of ${held.holder} ` : ''}on ${name}: that host notices at its next lease renewal (within ${opts.leaseTtl} s of the lease TTL), stops serving it and disconnects its clients\n`);
        }
      }
      if (r.removedSnapshots.length > 0) process.stdout.write(`removed snapshot${r.removedSnapshots.length > 1 ? 's' : ''} ${r.removedSnapshots.join(', ')}\n`);
      process.stdout.write(r.keptForRelatives
        ? `removed ${name}; its data stays in the store because forks or snapshots still use it\n`
        : `removed ${name}\n`);
    } finally {
      await leases?.close();
    }
  });

/** Is the record of `name` gone (a definite "not found")? */
async function isGone(catalog: { info(name: string): Promise<unknown> }, name: string): Promise<boolean> {
  try {
    await catalog.info(name);
    return false;
  } catch (err) {
    return err instanceof NotFoundError;
  }
}

withStore(program.command('fork')
  .description('fork a volume (or NAME@SNAP) into a new writable volume, in O(1): no data is copied')
  .argument('<src>', 'volume or snapshot to fork')
  .argument('<dst>', 'name of the new volume'))
  .option('--json', 'print the new volume as JSON')
  .addHelpText('after', `
The fork starts at the source's last acknowledged flush, even while the source is served and
being written; it includes every write a FLUSH acknowledged before the fork, and nothing
unflushed. Parent and fork then diverge independently and share unchanged data.

Examples:
  $ baton fork work attempt-1
  $ baton fork work@before-upgrade rollback`)
  .action(async (src: string, dst: string, opts: StoreFlags & { json?: boolean }) => {
    const t0 = performance.now();
    const v = await storeCatalog(opts, 'fork').fork(src, dst);
    if (opts.json) printJson({ ...volumeJson(v), ms: Math.round(performance.now() - t0) });
    else process.stdout.write(`forked ${src} into ${dst} (at log record ${v.parent?.seq ?? 0}) in ${Math.round(performance.now() - t0)} ms\n`);
  });

withStore(program.command('snapshot')
  .description('take a read-only point-in-time snapshot NAME@SNAP (servable read-only, forkable)')
  .argument('<name>', 'volume')
  .argument('<snap>', 'snapshot name'))
  .option('--json', 'print the snapshot as JSON')
  .addHelpText('after', `
Examples:
  $ baton snapshot work before-upgrade
  $ nbdinfo nbd://127.0.0.1/work@before-upgrade      # served read-only
  $ baton fork work@before-upgrade rollback`)
  .action(async (name: string, snap: string, opts: StoreFlags & { json?: boolean }) => {
    const v = await storeCatalog(opts, 'snapshot').snapshot(name, snap);
    if (opts.json) printJson(volumeJson(v));
    else process.stdout.write(`snapshot ${v.name} taken (log record ${v.parent?.seq ?? 0})\n`);
  });

withStore(program.command('diff')
  .description('byte ranges that differ between two volumes or snapshots that share history (from the maps; no data is read)')
  .argument('<a>')
  .argument('<b>'))
  .option('--json', 'print JSON')
  .addHelpText('after', '\nExamples:\n  $ baton diff work attempt-1\n  $ baton diff work@monday work --json')
  .action(async (a: string, b: string, opts: StoreFlags & { json?: boolean }) => {
    const c = storeCatalog(opts, 'diff');
    const [ranges, sharedHistory] = await Promise.all([c.diff(a, b), c.shareHistory(a, b)]);
    const total = ranges.reduce((n, r) => n + r.length, 0);
    if (opts.json) { printJson({ a, b, sharedHistory, differentBytes: total, ranges }); return; }
    for (const r of ranges) process.stdout.write(`${r.offset}\t${r.length}\n`);
    // Without a common ancestor the ranges are just everything either one has written.
    if (!sharedHistory) process.stderr.write(`${a} and ${b} share no history (neither descends from the other or from a common volume): the ranges are everything either of them has written, not changes since a common point\n`);
    process.stderr.write(`${ranges.length} ranges, ${formatSize(total)} differ\n`);
  });

interface LeaseFlags { redis?: string; leaseTtl: number; hostId: string }

/** The lease manager the options name: Redis, or lease files next to a local store. */
function leaseManagerFor(o: StoreFlags & LeaseFlags, log?: Logger) {
  return openLeaseManager({ storeUrl: o.store, ttlMs: o.leaseTtl * 1000, ...(o.redis ? { redis: o.redis } : {}), ...(log ? { log } : {}) });
}

function withLease(cmd: Command): Command {
  return cmd
    .addOption(new Option('--redis <url>', 'Redis holding the leases (default: lease files on this machine)').env('BATON_REDIS_URL'))
    .option('--lease-ttl <seconds>', 'lease time-to-live', secondsArg, 5)
    .option('--host-id <id>', 'this host\'s name in leases', defaultHostId());
}

withLease(withStore(program.command('gc')
  .description('delete objects no volume, fork or snapshot needs any more; with --compact, first rewrite mostly-dead data')))
  .addOption(durationOption('--grace <duration>', 'only objects unreferenced for this long are deleted (at least twice BATON_MAX_OPERATION_MS, which is 60 s unless set)', DEFAULT_GC_GRACE_MS))
  .option('--dry-run', 'report what would be marked and deleted; delete nothing, mark nothing')
  .option('--compact', 'first compact every volume no host is serving (takes its lease, like an attach)')
  .option('--compact-below <fraction>', 'with --compact: rewrite objects whose live fraction is below this', fractionArg, DEFAULT_COMPACT_BELOW)
  .option('--json', 'print JSON')
  .option('--log-level <level>', 'progress on stderr: info, warn, error', process.env.BATON_LOG_LEVEL ?? 'warn')
  .addHelpText('after', `
How it works: each run computes, from the store, every object a volume, fork or snapshot
needs (its map and what recovery reads), marks the unreferenced objects older than --grace,
and deletes the ones an earlier run marked at least --grace ago that are still
unreferenced. So data freed now is deleted by a run at least one grace period later: run
it periodically (baton serve does, see --gc-interval). Several hosts may run it at once.
Each run waits half of BATON_MAX_OPERATION_MS (30 s by default) for forks and snapshots in
creation before it decides anything.

Examples:
  $ baton gc --dry-run
  $ baton gc --compact --redis redis://10.0.0.5:6379
  $ baton gc --grace 2h --json`)
  .action(async (opts: StoreFlags & LeaseFlags & { grace: number; dryRun?: boolean; compact?: boolean; compactBelow: number; json?: boolean; logLevel: string }) => {
    const log = makeLogger(opts.logLevel);
    const catalog = storeCatalog(opts, 'gc', { log });
    let compacted: CompactionReport[] = [];
    if (opts.compact && !opts.dryRun) {
      const leases = await leaseManagerFor(opts, log);
      try {
        const exports = new VolumeExports(catalog, { readOnly: false, idleGraceMs: 0, log, lease: { manager: leases, hostId: opts.hostId, onHeld: 'refuse', waitMs: 0 } });
        compacted = await compactIdleVolumes(catalog, exports, { below: opts.compactBelow, log });
      } finally {
        await leases.close();
      }
    }
    const r = await collectGarbage(catalog, { graceMs: opts.grace, dryRun: !!opts.dryRun, log });
    if (opts.json) { printJson({ ...r, compacted }); return; }
    for (const c of compacted) {
      process.stdout.write(c.result
        ? `compacted ${c.name}: rewrote ${formatSize(c.result.rewrittenBytes)} live of ${c.result.objects} objects (${formatSize(c.result.objectBytes)})\n`
        : `not compacted ${c.name}: ${c.skipped}\n`);
    }
    process.stdout.write([
      `${r.records} volumes and snapshots (${r.reusedRecords} unchanged since the last run, not read again); ${r.objects} objects (${formatSize(r.storedBytes)}) in the store, ${r.referencedObjects} (${formatSize(r.referencedBytes)}) referenced`,
      `${r.dryRun ? 'would delete' : 'deleted'} ${r.deletedObjects} objects (${formatSize(r.deletedBytes)}) marked by earlier runs${r.failedDeletes ? `; ${r.failedDeletes} deletes failed (a later run retries)` : ''}`,
      `${r.dryRun ? 'would mark' : 'marked'} ${r.markedObjects} unreferenced objects (${formatSize(r.markedBytes)}): a run ${formatDuration(r.graceMs)} or more from now deletes them if still unreferenced`,
      ...(r.youngUnreferenced ? [`${r.youngUnreferenced} unreferenced objects are younger than the grace period: left alone`] : []),
      ...(r.awaitingMarkAge ? [`${r.awaitingMarkAge} unreferenced objects are named by a younger mark (an earlier run, or another host's): a later run deletes them`] : []),
    ].join('\n') + '\n');
  });

function formatDuration(ms: number): string {
  if (ms % 3_600_000 === 0) return `${ms / 3_600_000} h`;
  if (ms % 60_000 === 0) return `${ms / 60_000} min`;
  return `${ms / 1000} s`;
}

withLease(withStore(program.command('handoff')
  .description('ask the host serving a volume to hand it to another host (flush, release, disconnect its clients)')
  .argument('<name>')))
  .requiredOption('--to <host-id>', 'the host that takes over (its --host-id)')
  .option('--wait <seconds>', 'wait until the volume is released for the new host', secondsArg, 10)
  .addHelpText('after', `
Examples:
  $ baton handoff work --to host-b --redis redis://10.0.0.5:6379
  # then attach on host-b: nbd-client -N work host-b 10809 /dev/nbd0`)
  .action(async (name: string, opts: StoreFlags & LeaseFlags & { to: string; wait: number }) => {
    const leases = await leaseManagerFor(opts);
    try {
      const t0 = performance.now();
      await leases.requestHandoff(name, opts.to);
      const deadline = Date.now() + opts.wait * 1000;
      for (;;) {
        const l = await leases.inspect(name);
        // Done once it is free, reserved for the new host, or already taken by it.
        if (!l || !l.holder || l.reservedFor === opts.to || l.holder === opts.to) break;
        if (Date.now() > deadline) throw new BatonError('BATON_ERR_TIMEOUT', `${l.holder} did not release ${name} within ${opts.wait} s; it may be flushing a lot of data, or unable to reach the store (see its log)`);
        await new Promise((r) => setTimeout(r, 20));
      }
      process.stdout.write(`volume ${name} released for ${opts.to} in ${Math.round(performance.now() - t0)} ms; attach it there\n`);
    } finally {
      await leases.close();
    }
  });

withStore(program.command('prefetch')
  .description('warm a serving host\'s read cache with a volume\'s working set (or all of it), with progress')
  .argument('<name>', 'volume (or NAME@SNAP) to warm'))
  .option('--socket <path>', 'the server\'s Unix socket (as given to baton serve --socket)')
  .option('--listen <host:port>', 'the server\'s TCP address (as given to baton serve --listen)', DEFAULT_LISTEN)
  .option('--all', 'every byte the volume holds, the working set first (default: the working set only)')
  .option('--concurrency <n>', 'CACHE requests in flight', positiveIntArg, 8)
  .option('--json', 'progress as JSON lines (also the default when stderr is not a terminal)')
  .addHelpText('after', `
The ranges come from the volume's newest checkpoint and log in the store (its working set:
what its holder read and wrote lately, most recently used first); the server named by
--socket/--listen is asked to fetch them into its read cache with NBD CACHE requests. The
server attaches the volume as it would for any client (its lease and --on-held policy
apply). Progress goes to stderr: a bar on a terminal, JSON lines otherwise (or with --json):
{"volume","doneBytes","totalBytes","bytesPerSecond","etaSeconds","elapsedMs","done"}.

Examples:
  $ baton prefetch work                                # the working set, via 127.0.0.1:10809
  $ baton prefetch work --all --socket /run/baton.sock
  $ baton prefetch work --json --store s3://b/p --endpoint http://10.0.0.5:7480`)
  .action(async (name: string, opts: StoreFlags & { socket?: string; listen: string; all?: boolean; concurrency: number; json?: boolean }) => {
    const catalog = storeCatalog(opts, 'prefetch');
    const view = await catalog.loadMap(name);
    let ranges: { offset: number; length: number }[];
    try {
      ranges = view.hydrationPlan(opts.all ? 'all' : 'working-set');
    } finally {
      await view.close();
    }
    // CACHE requests of at most 4 MiB: the server warms each one piece at a time, so requests
    // in flight are what makes its GETs parallel.
    const PIECE = 4 * 1024 * 1024;
    const pieces: { offset: number; length: number }[] = [];
    for (const r of ranges) for (let o = r.offset; o < r.offset + r.length; o += PIECE) pieces.push({ offset: o, length: Math.min(PIECE, r.offset + r.length - o) });
    const total = pieces.reduce((n, p) => n + p.length, 0);
    const progress = new Progress(name, total, opts.json || !process.stderr.isTTY);
    const addr: ListenAddress = opts.socket ? { path: opts.socket } : parseListen(opts.listen);
    const client = await NbdClient.connect(addr, name);
    try {
      progress.start();
      let next = 0;
      await Promise.all(Array.from({ length: Math.min(opts.concurrency, pieces.length) }, async () => {
        while (next < pieces.length) {
          const p = pieces[next++]!;
          await client.cache(p.offset, p.length);
          progress.add(p.length);
        }
      }));
      progress.finish();
    } finally {
      progress.stop();
      await client.close();
    }
  });

/**
 * Progress of `baton prefetch` on stderr: a bar redrawn in place with \r on a terminal (bytes,
 * rate, ETA), or a JSON line per second and one at the end.
 */
class Progress {
  private done = 0;
  private t0 = 0;
  private timer: NodeJS.Timeout | null = null;
  constructor(private readonly volume: string, private readonly total: number, private readonly json: boolean) {}

  start(): void {
    this.t0 = performance.now();
    this.timer = setInterval(() => this.draw(false), this.json ? 1000 : 200);
    this.draw(false);
  }

  add(n: number): void { this.done += n; }

  finish(): void { this.draw(true); }

  stop(): void { if (this.timer) clearInterval(this.timer); this.timer = null; }

  private draw(last: boolean): void {
    const ms = performance.now() - this.t0;
    const rate = ms > 0 ? this.done / (ms / 1000) : 0;
    const eta = rate > 0 ? (this.total - this.done) / rate : null;
    if (this.json) {
      process.stderr.write(JSON.stringify({ volume: this.volume, doneBytes: this.done, totalBytes: this.total, bytesPerSecond: Math.round(rate), etaSeconds: eta === null ? null : Math.round(eta * 10) / 10, elapsedMs: Math.round(ms), done: last }) + '\n');
      return;
    }
    const frac = this.total > 0 ? this.done / this.total : 1;
    const width = 30;
    const filled = Math.round(frac * width);
    const bar = '#'.repeat(filled) + '.'.repeat(width - filled);
    const etaText = last ? `in ${(ms / 1000).toFixed(1)}s` : eta === null ? 'ETA -' : `ETA ${Math.ceil(eta)}s`;
    process.stderr.write(`\r${this.volume} [${bar}] ${(frac * 100).toFixed(0).padStart(3)}% ${formatSize(this.done)}/${formatSize(this.total)} ${formatSize(Math.round(rate))}/s ${etaText}\x1b[K${last ? '\n' : ''}`);
  }
}

/** `baton status`'s HYDRATION column: "done 212M (working-set)", "running 85M/212M", "-". */
function hydrationText(h: { mode: string; state: string; fetchedBytes: number; plannedBytes: number; planned: boolean } | undefined): string {
  if (!h) return '-';
  if (h.state === 'done') return `done ${formatSize(h.fetchedBytes)} (${h.mode})`;
  if (h.state === 'stopped') return `stopped at ${formatSize(h.fetchedBytes)}`;
  return `${h.state} ${formatSize(h.fetchedBytes)}/${h.planned ? '' : '≥'}${formatSize(h.plannedBytes)} (${h.mode})`;
}

withLease(withStore(program.command('status')
  .description('show who serves each volume: holder, lease token, TTL left, dirty bytes, last flush, hydration')))
  .option('--json', 'print JSON')
  .addHelpText('after', '\nExamples:\n  $ baton status --redis redis://127.0.0.1:6379\n  $ baton status --json')
  .action(async (opts: StoreFlags & LeaseFlags & { json?: boolean }) => {
    const leases = await leaseManagerFor(opts);
    try {
      const all = await leases.list();
      if (opts.json) { printJson(all); return; }
      if (all.length === 0) { process.stdout.write('no volume is being served\n'); return; }
      printTable([['VOLUME', 'HOLDER', 'TOKEN', 'TTL', 'DIRTY', 'LAST FLUSH', 'HYDRATION', 'ADDRESS'], ...all.map((l) => [
        l.volume, l.holder || (l.reservedFor ? `(reserved for ${l.reservedFor})` : '-'), String(l.token), `${(l.ttlMs / 1000).toFixed(1)}s`,
        l.status ? formatSize(l.status.dirtyBytes) : '-', l.status?.lastFlushAt ?? '-', hydrationText(l.status?.hydration), l.status?.address ?? '-',
      ])]);
    } finally {
      await leases.close();
    }
  });

/**
 * `serve --stats-interval`: every intervalMs one info line `process stats` with this process's
 * memory and the event-loop delay measured since the previous line (that histogram is reset
 * each time, so its p99 and max describe that interval only) and since start. Off by default: the delay monitor
 * wakes the loop every 10 ms, which an idle server should not pay for unasked, and a line a
 * minute from an idle server is noise; turn it on to see why a lease renewal came late.
 */
function logProcessStats(intervalMs: number, log: Logger, cacheStats: () => CacheStats | undefined): void {
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

try {
  await program.parseAsync();
} catch (err) {
  if (err instanceof BatonError) {
    process.stderr.write(`baton: ${err.message}\n`);
    process.exit(err.code === 'BATON_ERR_INVALID_ARGUMENT' ? 2 : 1);
  }
  process.stderr.write(`baton: ${errorMessage(err)}\n`);
  process.exit(1);
}

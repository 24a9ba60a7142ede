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

import { Command, InvalidArgumentError as CommanderInvalidArgument, Option } from 'commander';
import { DEFAULT_MAX_CONNECTIONS } from '../nbd/server.js';
import { openDeployment, type Deployment, type Progress as ApiProgress } from '../src/api.js';
import { VERSION } from '../src/api-serve.js';
import { defaultCacheDir } from '../src/catalog.js';
import type { StoreVolumeInfo } from '../src/volume/catalog.js';
import { DEFAULT_LISTEN, defaultStoreUrl, isProcessLocalStore, parseListen } from '../src/config.js';
import type { ServeSecurityFlags } from '../src/tls-config.js';
import { BatonError, errorMessage } from '../src/errors.js';
import { LOG_LEVELS, makeLogger } from '../src/log.js';
import { formatSize, formatSizeArg, parseSize } from '../src/size.js';
import { defaultHostId, type OnHeld } from '../src/exports.js';
import { DEFAULT_COMPACT_BELOW } from '../src/maintenance.js';
import { DEFAULT_GC_GRACE_MS } from '../src/volume/gc.js';
import { DEFAULT_HYDRATE_CONCURRENCY, HYDRATE_MODES, type HydrateMode } from '../src/volume/hydrate.js';
import { parseMetricsAddress } from '../src/metrics-server.js';
import { Progress } from './progress.js';

function sizeArg(v: string): number {
  try { return parseSize(v); } catch (err) { throw new CommanderInvalidArgument(errorMessage(err)); }
}

/** An expiry: a duration with a unit (24h, 90m, 3600s; a bare number is seconds), in milliseconds. */
function expiryArg(v: string): number {
  const m = /^(\d+(?:\.\d+)?)(s|m|h|d)?$/.exec(v.trim());
  if (!m || Number(m[1]) <= 0) throw new CommanderInvalidArgument(`not a duration: ${v} (examples: 24h, 90m, 7d)`);
  return Math.round(Number(m[1]) * { s: 1000, m: 60_000, h: 3_600_000, d: 86_400_000 }[(m[2] ?? 's') as 's' | 'm' | 'h' | 'd']);
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
 * The API deployment the flags name (src/api.ts: commands a person waits for give each store
 * operation 30 s, retries included, then fail naming the store and its endpoint). Closed when
 * the command is done.
 */
async function deploymentFor(o: StoreFlags & Partial<LeaseFlags>, log?: string): Promise<Deployment> {
  const d = await openDeployment({
    store: o.store, ...(o.endpoint ? { endpoint: o.endpoint } : {}), ...(o.region ? { region: o.region } : {}),
    ...(o.redis ? { redis: o.redis } : {}), ...(o.hostId ? { hostId: o.hostId } : {}), ...(o.leaseTtl !== undefined ? { leaseTtlMs: o.leaseTtl * 1000 } : {}),
    ...(log ? { log: makeLogger(log) } : {}), ...(o.keyFile !== undefined ? { keyFile: o.keyFile } : {}),
  });
  opened.push(d);
  return d;
}
const opened: Deployment[] = [];

/** The keys of `o` among `keys` that are set (exactOptionalPropertyTypes: no undefined values). */
function pick<T extends object, K extends keyof T>(o: T, keys: K[]): Partial<Pick<T, K>> {
  const out: Partial<Pick<T, K>> = {};
  for (const k of keys) if (o[k] !== undefined) out[k] = o[k];
  return out;
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
    ...(v.expiresAt ? { expiresAt: v.expiresAt } : {}),
    ...(v.writtenBytes !== undefined ? { writtenBytes: v.writtenBytes, exclusiveBytes: v.exclusiveBytes, sharedBytes: v.sharedBytes } : {}),
    ...(v.writtenStoredBytes !== undefined ? { writtenStoredBytes: v.writtenStoredBytes, exclusiveStoredBytes: v.exclusiveStoredBytes, sharedStoredBytes: v.sharedStoredBytes } : {}),
    ...(v.data ? { data: v.data } : {}),
  };
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
  .addOption(new Option('--cache-size <size>', 'local read cache capacity, e.g. 10G (at least 4M: 16 blocks of 256 KiB; less is raised to that)').argParser(sizeArg).default(DEFAULT_CACHE_SIZE, formatSizeArg(DEFAULT_CACHE_SIZE)))
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
    if (opts.size !== undefined && !opts.create) throw new BatonError('BATON_ERR_INVALID_ARGUMENT', '--size is the size of the volume --create NAME makes; without --create it would do nothing (volumes are made with baton create NAME --size SIZE)');
    if (opts.create && opts.size === undefined) throw new BatonError('BATON_ERR_INVALID_ARGUMENT', '--create needs --size (for example --size 10G)');
    const d = await openDeployment({
      store: opts.store, ...(opts.endpoint ? { endpoint: opts.endpoint } : {}), ...(opts.region ? { region: opts.region } : {}),
      ...(opts.redis ? { redis: opts.redis } : {}), hostId: opts.hostId, leaseTtlMs: opts.leaseTtl * 1000,
      cacheDir: opts.cacheDir, cacheSize: opts.cacheSize, log: makeLogger(opts.logLevel), ...(opts.keyFile !== undefined ? { keyFile: opts.keyFile } : {}),
    });
    const server = await d.serve({
      listen: opts.socket ? { path: opts.socket } : opts.listen, readOnly: !!opts.readOnly,
      ...(opts.create ? { create: { name: opts.create, size: opts.size! } } : {}),
      onHeld: opts.onHeld, heldWaitMs: opts.heldWait * 1000, handshakeTimeoutMs: opts.handshakeTimeout * 1000, maxConnections: opts.maxConnections,
      idleGraceMs: opts.idleGrace * 1000, gcIntervalMs: opts.gcInterval, gcGraceMs: opts.gcGrace, compactBelow: opts.compactBelow,
      hydrate: opts.hydrate, hydrateConcurrency: opts.hydrateConcurrency, ...(opts.hydrateMax !== undefined ? { hydrateMax: opts.hydrateMax } : {}),
      statsIntervalMs: opts.statsInterval, ...(opts.metrics ? { metrics: opts.metrics } : {}), compression: opts.compression !== 'off',
      security: { tls: opts.tls, ...pick(opts, ['tlsCertificates', 'tlsPsk', 'tlsVerifyPeer', 'authz', 'insecure']) },
    });
    let stopping = false;
    const stop = async (signal: string): Promise<void> => {
      if (stopping) return;
      stopping = true;
      d.log.info({ signal }, 'received a signal: stopping');
      await server.close();
      await d.close();
      process.exit(0);
    };
    process.on('SIGINT', () => void stop('SIGINT'));
    process.on('SIGTERM', () => void stop('SIGTERM'));
    // Certificate, key and authz rotation without dropping clients (without TLS SIGHUP keeps its default: exit).
    if (opts.tls !== 'off') process.on('SIGHUP', () => server.reloadTls());
  });

withStore(program.command('create')
  .description('create a volume')
  .argument('<name>', 'volume name (letters, digits, . _ -)'))
  .requiredOption('--size <size>', 'logical size, e.g. 10G, 512M', sizeArg)
  .addOption(new Option('--compression <codec>', 'compress its data (per 32 KiB frame; frames that do not shrink are stored as they are)').choices(['lz4', 'none']).default('lz4'))
  .option('--encrypt', 'encrypt its data at rest (AES-256-GCM) with a data key of its own, wrapped by the master key (--key-file)')
  .addOption(new Option('--data-format <format>', 'framed (checksummed frames) or raw (the layout before frames: no checksums; tests and benchmarks)').choices(['framed', 'raw']).default('framed').hideHelp())
  .option('--expires <duration>', 'remove it this long from now (baton gc, or serve\'s background pass, removes it once nobody serves it): 24h, 90m', expiryArg)
  .option('--json', 'print the new volume as JSON')
  .addHelpText('after', `
Examples:
  $ baton create work --size 10G
  $ baton create scratch --size 512M --expires 24h
  $ baton create scratch --size 512M --store file:/tmp/baton --json
  $ head -c 32 /dev/urandom > ~/.baton.key && chmod 600 ~/.baton.key
  $ baton create secret --size 10G --encrypt --key-file ~/.baton.key

Data is stored in checksummed frames: a damaged or foreign object is an I/O error, never wrong
data. An encrypted volume (and every fork of it: forks get a data key of their own, so forking
needs the key too, from BATON_KEY_FILE or BATON_KEY) is served only by a process given its
master key: baton serve --key-file FILE. Metadata (names, sizes, which ranges were written,
compressed sizes, timing) is not encrypted.`)
  .action(async (name: string, opts: StoreFlags & { size: number; expires?: number; json?: boolean; compression: 'lz4' | 'none'; encrypt?: boolean; dataFormat: 'framed' | 'raw' }) => {
    const v = await (await deploymentFor(opts)).create(name, { size: opts.size, ...(opts.expires !== undefined ? { expiresInMs: opts.expires } : {}), compression: opts.compression, encrypt: !!opts.encrypt, dataFormat: opts.dataFormat });
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
    const vols = await (await deploymentFor(opts)).list();
    if (opts.json) { printJson(vols.map(volumeJson)); return; }
    if (vols.length === 0) { process.stdout.write(`no volumes in ${opts.store} (create one: baton create NAME --size 10G)\n`); return; }
    const fmt = (n: number | undefined): string => (n === undefined ? '-' : formatSize(n));
    // WRITTEN is logical (what the map names); in parentheses what it costs in the store per logical byte (compression).
    const written = (v: StoreVolumeInfo): string => (v.writtenBytes && v.writtenStoredBytes !== undefined ? `${fmt(v.writtenBytes)} (${(v.writtenStoredBytes / v.writtenBytes).toFixed(2)})` : fmt(v.writtenBytes));
    printTable([['NAME', 'SIZE', 'STORED', 'WRITTEN', 'EXCLUSIVE', 'SHARED', 'CREATED', 'EXPIRES'], ...vols.map((v: StoreVolumeInfo) => [displayName(v), formatSize(v.size), formatSize(v.storedBytes), written(v), fmt(v.exclusiveBytes), fmt(v.sharedBytes), v.createdAt, v.expiresAt ?? '-'])]);
  });

withStore(program.command('info')
  .description('show one volume')
  .argument('<name>'))
  .option('--json', 'print JSON')
  .addHelpText('after', '\nExamples:\n  $ baton info work\n  $ baton info work --json')
  .action(async (name: string, opts: StoreFlags & { json?: boolean }) => {
    const v = await (await deploymentFor(opts)).info(name);
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
      ...(v.expiresAt ? [`expires:   ${v.expiresAt} (baton gc removes it then unless a host serves it; baton expire ${v.name} --never keeps it)`] : []),
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
    const d = await deploymentFor(opts);
    const r = await d.rm(name, { snapshots: !!opts.snapshots, force: !!opts.force });
    if (r.revokedLease) process.stdout.write(`broke the lease ${r.brokeLeaseOf ? `of ${r.brokeLeaseOf} ` : ''}on ${name}: that host notices at its next lease renewal (within ${opts.leaseTtl} s of the lease TTL), stops serving it and disconnects its clients\n`);
    if (r.removedSnapshots.length > 0) process.stdout.write(`removed snapshot${r.removedSnapshots.length > 1 ? 's' : ''} ${r.removedSnapshots.join(', ')}\n`);
    process.stdout.write(r.keptForRelatives
      ? `removed ${name}; its data stays in the store because forks or snapshots still use it\n`
      : `removed ${name}\n`);
  });

withStore(program.command('fork')
  .description('fork a volume (or NAME@SNAP) into a new writable volume, in O(1): no data is copied')
  .argument('<src>', 'volume or snapshot to fork')
  .argument('<dst>', 'name of the new volume'))
  .option('--expires <duration>', 'the fork is removed this long from now unless a host serves it then (an abandoned attempt): 24h, 90m', expiryArg)
  .option('--json', 'print the new volume as JSON')
  .addHelpText('after', `
The fork starts at the source's last acknowledged flush, even while the source is served and
being written; it includes every write a FLUSH acknowledged before the fork, and nothing
unflushed. Parent and fork then diverge independently and share unchanged data.

Examples:
  $ baton fork work attempt-1
  $ baton fork work attempt-2 --expires 24h           # gone tomorrow unless kept (baton expire attempt-2 --never)
  $ baton fork work@before-upgrade rollback`)
  .action(async (src: string, dst: string, opts: StoreFlags & { expires?: number; json?: boolean }) => {
    const t0 = performance.now();
    const v = await (await deploymentFor(opts)).fork(src, dst, opts.expires !== undefined ? { expiresInMs: opts.expires } : {});
    if (opts.json) printJson({ ...volumeJson(v), ms: Math.round(performance.now() - t0) });
    else process.stdout.write(`forked ${src} into ${dst} (at log record ${v.parent?.seq ?? 0}) in ${Math.round(performance.now() - t0)} ms\n`);
  });

withLease(withStore(program.command('rename')
  .description('give a volume another name; with --replace, make it THE volume of that name (promote an attempt)')
  .argument('<from>', 'volume to rename')
  .argument('<to>', 'its new name')))
  .option('--replace', 'if <to> exists, remove it and put <from> in its place (its data stays while forks or snapshots use it)')
  .option('--force', 'with --replace: even if a host serves <to>: its lease is broken, it drops the old volume like a removed one and disconnects its clients')
  .option('--json', 'print the result as JSON')
  .addHelpText('after', `
Both names are leased while the rename runs, as an attach would lease them: a served <from>
is refused (detach its clients or hand it over first), and so is a served <to> unless
--force. Renaming onto an existing name is refused without --replace. Nobody ever sees a
mix of the two volumes: each name names one whole volume at every moment, or (for a moment
during --replace) none. The renamed volume is an O(1) fork of <from> under the new name (it
gets a new id; no data is copied). Snapshots are named after their volume: a volume with
snapshots is not renamed (remove them, or fork instead). See docs/rfc-lifecycle.md.

Examples:
  $ baton rename scratch notes
  $ baton rename try-2 work --replace              # the attempt that worked becomes the workspace
  $ baton rename try-2 work --replace --force --redis redis://10.0.0.5:6379`)
  .action(async (from: string, to: string, opts: StoreFlags & LeaseFlags & { replace?: boolean; force?: boolean; json?: boolean }) => {
    if (opts.force && !opts.replace) throw new BatonError('BATON_ERR_INVALID_ARGUMENT', '--force only makes sense with --replace (it breaks the lease of the host serving the volume being replaced)');
    const r = await (await deploymentFor(opts)).rename(from, to, { replace: !!opts.replace, force: !!opts.force });
    if (opts.json) { printJson(r); return; }
    if (r.expiresAt) process.stderr.write(`baton: note: ${to} expires at ${r.expiresAt}, as ${from} did; keep it with: baton expire ${to} --never\n`);
    if (r.replaced?.brokeLeaseOf) process.stdout.write(`broke the lease of ${r.replaced.brokeLeaseOf} on ${to}: it drops the old ${to} and disconnects its clients; they reattach to the new one\n`);
    process.stdout.write(r.replaced
      ? `replaced ${to} with ${from}${r.replaced.keptForRelatives ? `; the old ${to}'s data stays in the store because forks or snapshots still use it` : ''}\n`
      : `renamed ${from} to ${to}\n`);
  });

withLease(withStore(program.command('resize')
  .description('change a volume\'s size: grow it (also while it is served), or shrink it with --shrink')
  .argument('<name>')))
  .requiredOption('--size <size>', 'the new size, e.g. 20G', sizeArg)
  .option('--shrink', 'allow a smaller size: refused while a host serves the volume, and while data is mapped past the new end')
  .option('--json', 'print the result as JSON')
  .addHelpText('after', `
Growing needs nothing else: a host serving the volume gives the new size to connections that
attach from then on (a connection keeps the size it attached with). A kernel client sees it
after reconnecting (nbd-client -d /dev/nbd0, then attach again; or, where the kernel and
nbd-client support it, nbd-client's resize); then grow the filesystem: resize2fs /dev/nbd0.
Shrinking is refused unless nothing is mapped past the new end: shrink the filesystem first
(resize2fs DEVICE SIZE) and trim the rest (fstrim, blkdiscard).

Examples:
  $ baton resize work --size 20G
  $ baton resize scratch --size 1G --shrink`)
  .action(async (name: string, opts: StoreFlags & LeaseFlags & { size: number; shrink?: boolean; json?: boolean }) => {
    const r = await (await deploymentFor(opts)).resize(name, { size: opts.size, shrink: !!opts.shrink });
    if (opts.json) { printJson(r); return; }
    process.stdout.write(r.from === r.to
      ? `${name} is already ${formatSize(r.to)}\n`
      : `resized ${name} from ${formatSize(r.from)} to ${formatSize(r.to)}${r.to > r.from ? '; clients that attach from now on see the new size (reconnect a kernel client, then resize2fs)' : ''}\n`);
  });

withStore(program.command('expire')
  .description('set when a volume expires (baton gc removes it then, unless a host serves it), or keep it for good')
  .argument('<name>'))
  .option('--in <duration>', 'expire this long from now: 24h, 90m, 7d', expiryArg)
  .option('--never', 'never expire (clears the expiry)')
  .addHelpText('after', `
Examples:
  $ baton expire try-2 --never        # the attempt that worked: keep it
  $ baton expire scratch --in 2h`)
  .action(async (name: string, opts: StoreFlags & { in?: number; never?: boolean }) => {
    if ((opts.in === undefined) === !opts.never) throw new BatonError('BATON_ERR_INVALID_ARGUMENT', 'give either --in DURATION or --never');
    const r = await (await deploymentFor(opts)).expire(name, opts.never ? { never: true } : { inMs: opts.in! });
    process.stdout.write(r.expiresAt ? `${name} expires at ${r.expiresAt}\n` : `${name} never expires\n`);
  });

withLease(withStore(program.command('import')
  .description('make a new volume from a disk image: raw, or qcow2 and other formats through qemu-img; only non-zero data is written')
  .argument('<name>', 'the new volume')
  .argument('<file>', 'the image')))
  .option('--format <format>', 'the image\'s format (default: what qemu-img detects; raw without qemu-img)')
  .option('--size <size>', 'the volume\'s size (default: the image\'s, rounded up to 4 KiB)', sizeArg)
  .option('--expires <duration>', 'the new volume expires this long from now: 24h, 90m', expiryArg)
  .option('--json', 'progress as JSON lines on stderr (also the default when stderr is not a terminal), the result as JSON on stdout')
  .addHelpText('after', `
A raw image is read in 1 MiB pieces; pieces that are all zeroes are skipped (a new volume
reads as zeroes), so a sparse image costs only its data. Other formats are converted to a
sparse raw file next to the image by qemu-img first. A failed import removes the volume.
Progress on stderr: a bar on a terminal, JSON lines otherwise:
{"volume","doneBytes","totalBytes","bytesPerSecond","etaSeconds","elapsedMs","done"}.

Examples:
  $ baton import base debian-12.raw
  $ baton import base debian-12-genericcloud-amd64.qcow2 --size 20G
  $ baton import base disk.img --json 2>progress.jsonl`)
  .action(async (name: string, file: string, opts: StoreFlags & LeaseFlags & { format?: string; size?: number; expires?: number; json?: boolean }) => {
    const progress = new Progress(name, opts.json || !process.stderr.isTTY);
    try {
      const r = await (await deploymentFor(opts)).importImage(name, file, {
        ...(opts.format ? { format: opts.format } : {}), ...(opts.size !== undefined ? { size: opts.size } : {}), ...(opts.expires !== undefined ? { expiresInMs: opts.expires } : {}),
        onProgress: (p: ApiProgress) => progress.update(p),
      });
      if (opts.json) { printJson(r); return; }
      process.stdout.write(`imported ${file} (${r.format}, ${formatSize(r.imageBytes)}) into ${name} (${formatSize(r.size)}): ${formatSize(r.writtenBytes)} of data written in ${(r.ms / 1000).toFixed(1)} s\n`);
    } finally {
      progress.stop();
    }
  });

withStore(program.command('export')
  .description('write a volume (or NAME@SNAP) as of its last flush to a disk image: sparse raw, or qcow2 through qemu-img')
  .argument('<name>')
  .argument('<file>'))
  .addOption(new Option('--format <format>', 'the image format').choices(['raw', 'qcow2']).default('raw'))
  .option('--force', 'overwrite FILE if it exists')
  .option('--json', 'progress as JSON lines on stderr (also the default when stderr is not a terminal), the result as JSON on stdout')
  .addHelpText('after', `
Reads the volume read-only (no lease: it may be served meanwhile; what is exported is its
last acknowledged flush). Only mapped ranges are written, so holes stay holes.

Examples:
  $ baton export work work.raw
  $ baton export work@before before.qcow2 --format qcow2`)
  .action(async (name: string, file: string, opts: StoreFlags & { format: 'raw' | 'qcow2'; force?: boolean; json?: boolean }) => {
    const progress = new Progress(name, opts.json || !process.stderr.isTTY);
    try {
      const r = await (await deploymentFor(opts)).exportImage(name, file, { format: opts.format, overwrite: !!opts.force, onProgress: (p: ApiProgress) => progress.update(p) });
      if (opts.json) { printJson(r); return; }
      process.stdout.write(`exported ${name} (${formatSize(r.size)}) to ${file} (${r.format}): ${formatSize(r.writtenBytes)} of data in ${(r.ms / 1000).toFixed(1)} s\n`);
    } finally {
      progress.stop();
    }
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
    const v = await (await deploymentFor(opts)).snapshot(name, snap);
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
    const { ranges, sharedHistory, differentBytes: total } = await (await deploymentFor(opts)).diff(a, b);
    if (opts.json) { printJson({ a, b, sharedHistory, differentBytes: total, ranges }); return; }
    for (const r of ranges) process.stdout.write(`${r.offset}\t${r.length}\n`);
    // Without a common ancestor the ranges are just everything either one has written.
    if (!sharedHistory) process.stderr.write(`${a} and ${b} share no history (neither descends from the other or from a common volume): the ranges are everything either of them has written, not changes since a common point\n`);
    process.stderr.write(`${ranges.length} ranges, ${formatSize(total)} differ\n`);
  });

interface LeaseFlags { redis?: string; leaseTtl: number; hostId: string }

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
    const { compacted, ...r } = await (await deploymentFor(opts, opts.logLevel)).gc({ graceMs: opts.grace, dryRun: !!opts.dryRun, compact: !!opts.compact, compactBelow: opts.compactBelow });
    if (opts.json) { printJson({ ...r, compacted }); return; }
    for (const e of r.expired) {
      process.stdout.write(e.removed
        ? `removed expired ${e.name} (expired ${e.expiresAt})${e.keptForRelatives ? '; its data stays because forks or snapshots use it' : ''}\n`
        : `expired ${e.name} (${e.expiresAt}) not removed: ${e.skipped}\n`);
    }
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
    const { ms } = await (await deploymentFor(opts)).handoff(name, opts.to, { waitMs: opts.wait * 1000 });
    process.stdout.write(`volume ${name} released for ${opts.to} in ${ms} ms; attach it there\n`);
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
    const progress = new Progress(name, opts.json || !process.stderr.isTTY);
    try {
      await (await deploymentFor(opts)).prefetch(name, {
        address: opts.socket ? { path: opts.socket } : parseListen(opts.listen), all: !!opts.all, concurrency: opts.concurrency,
        onProgress: (p: ApiProgress) => progress.update(p),
      });
    } finally {
      progress.stop();
    }
  });

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
    {
      const all = await (await deploymentFor(opts)).status();
      if (opts.json) { printJson(all); return; }
      if (all.length === 0) { process.stdout.write('no volume is being served\n'); return; }
      printTable([['VOLUME', 'HOLDER', 'TOKEN', 'TTL', 'DIRTY', 'LAST FLUSH', 'HYDRATION', 'ADDRESS'], ...all.map((l) => [
        l.volume, l.holder || (l.reservedFor ? `(reserved for ${l.reservedFor})` : '-'), String(l.token), `${(l.ttlMs / 1000).toFixed(1)}s`,
        l.status ? formatSize(l.status.dirtyBytes) : '-', l.status?.lastFlushAt ?? '-', hydrationText(l.status?.hydration), l.status?.address ?? '-',
      ])]);
    }
  });

try {
  await program.parseAsync();
  // serve keeps running (its signals end it); every other command is done: let go of leases.
  for (const d of opened.splice(0)) await d.close();
} catch (err) {
  if (err instanceof BatonError) {
    process.stderr.write(`baton: ${err.message}\n`);
    process.exit(err.code === 'BATON_ERR_INVALID_ARGUMENT' ? 2 : 1);
  }
  process.stderr.write(`baton: ${errorMessage(err)}\n`);
  process.exit(1);
}

/**
 * NBD throughput benchmark: each baton store against its natural peer, same clients, same
 * machine, same run, all on Unix sockets:
 *   - `--store ram:` (a plain sparse-memory backend: the NBD layer and Node alone) against
 *     `nbdkit memory`;
 *   - `--store file:` (the volume engine over the embedded local-directory store, FLUSH
 *     durable: fdatasync) against `nbdkit file` on a file in the same directory (same disk,
 *     FLUSH = fdatasync);
 *   - `--store memory:` (the volume engine over an in-memory object store) against
 *     `nbdkit memory`, when asked for;
 * plus the local disk (a file in the temp dir) as a point of reference for the clients.
 *
 * Per server, in this order (so reads hit written data):
 *   1. nbdcopy --flush RANDOM_FILE URI          sequential write of SIZE, incl. the final FLUSH
 *   2. nbdcopy URI null:                         sequential read of SIZE
 *   3. fio 4k randread  QD32 (nbd engine)        IOPS, latency p50/p99
 *   4. fio 4k randwrite QD32                     IOPS, latency p50/p99
 *   5. fio 4k randwrite QD1 --fsync=1            write+flush pairs/s, flush latency p50/p99
 * Each server is started fresh for its pass and stopped after it; with REPEAT > 1 the
 * server order alternates and the tables show medians.
 *
 * Knobs (environment): SIZE (1G), RUNTIME (fio seconds, 10), REPEAT (1), BATON_STORES
 * (`ram:,file:`), LOCAL (1: also measure the local disk), PROFILE (0: 1 runs baton under
 * `node --cpu-prof` and lists the hottest functions; the numbers of such a run are not
 * comparable), METRICS (0: 1 also measures every baton store with `serve --metrics`, scraped
 * once a second as Prometheus would, next to the same store without, in the same run: issue
 * 14's overhead bound), WARM (1: before each server's sequential write and random write, 1.5x
 * and 1x SIZE of memory is freed just before, so every server starts the step with the same
 * memory; lib.ts freeMemoryBefore), PEERS (1: 0 leaves the nbdkit peers out), TLS (0: 1 also measures
 * every server over TLS, next to itself in plaintext: `baton serve --tls require
 * --tls-certificates DIR` against `nbdkit --tls=require --tls-certificates=DIR`, the same
 * certificates made for the run, the same clients).
 *
 * Over TLS, nbdcopy gets the CA with `tls-certificates=` in its URI and verifies the server;
 * fio's nbd engine cannot (libnbd refuses URI parameters naming local files unless the
 * program allows them, and fio does not), so fio connects with `nbds+unix://` alone, which
 * libnbd 1.14 encrypts without verifying the server over a Unix socket. Encryption is the
 * same either way; only the check of the server's certificate at connect time differs, and
 * it is the same for both servers. No client certificates (--tls-verify-peer) for the same
 * reason: fio could not present one.
 * Results: bench/results/nbd-throughput.md (tables) and .json (everything, incl. raw fio jobs
 * and the goal rows); with PROFILE=1 nbd-throughput-profile.md/.json, with METRICS=1
 * nbd-throughput-metrics.md/.json, with TLS=1 nbd-throughput-tls.md/.json instead.
 */

import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { formatSize } from '../src/size.js';
import { makeCa, makeClientDir, makeServerDir } from '../test/helpers/tls-pki.js';
import {
  RESULTS_DIR, envFlag, envNumber, envSize, fmt, fmtRatio, freeMemoryBefore, has, machineInfo, makeRandomFile, makeTempDir,
  goalsTable, markdownTable, median, ratio, ratioGoal, runFio, runNbdcopy, shellQuote, startBaton, startNbdkit, summarizeCpuProfile,
  writeResults, freeTcpPort, startMetricsScraper, type FioJob, type GoalRow, type ProfileEntry, type ScrapeRecord, type Scraper, type Server,
} from './lib.js';

const SIZE = envSize('SIZE', '1G');
const RUNTIME = envNumber('RUNTIME', 10);
const REPEAT = Math.max(1, Math.floor(envNumber('REPEAT', 1)));
const LOCAL = envFlag('LOCAL', true);
const PROFILE = envFlag('PROFILE', false);
const WARM = envFlag('WARM', true);
const WITH_METRICS = envFlag('METRICS', false);
const PEERS = envFlag('PEERS', true);
/** How often the bench scrapes /metrics of a `+metrics` target (Prometheus's default is 15 s: this is 15 times as often). */
const SCRAPE_EVERY_MS = 1000;
/** Issue 14: metrics on may cost at most this much of fio 4k random I/O (on ÷ off ≥ it). */
const METRICS_MIN_RATIO = 0.97;
const VOLUME = 'bench';
const BATON_STORES = (process.env.BATON_STORES || 'ram:,file:').split(',').map((x) => x.trim()).filter(Boolean);
const TLS = envFlag('TLS', false);

/** What one pass runs against. `id` names the column ("baton file:", "nbdkit file", "local"). */
interface Target {
  id: string;
  kind: 'baton' | 'nbdkit' | 'local';
  /** baton: its --store; nbdkit: its plugin (memory or file). */
  store?: string;
  /** baton with `serve --metrics`, scraped every SCRAPE_EVERY_MS while measured. */
  metrics?: boolean;
  /** Served with --tls require (TLS=1); its id ends in " +TLS". */
  tls?: boolean;
}

/** The nbdkit target a baton target is measured against: the same plugin job, TLS or not. */
function peerId(t: Target): string {
  return `nbdkit ${peerPlugin(t.store!)}${t.tls ? ' +TLS' : ''}`;
}

/** The natural peer of a baton store: nbdkit's plugin that does the same job. */
function peerPlugin(store: string): 'memory' | 'file' {
  return store.startsWith('file:') || store.startsWith('raw:') ? 'file' : 'memory';
}

/** The issue's goals per store (baton ÷ its peer, throughput rows). */
const STORE_GOALS: Record<string, { metric: string; min: number }[]> = {
  'ram:': [{ metric: 'seq_write', min: 0.8 }, { metric: 'seq_read', min: 0.8 }],
  'file:': [{ metric: 'seq_write', min: 0.8 }, { metric: 'seq_read', min: 0.8 }, { metric: 'randread_iops', min: 0.7 }, { metric: 'randwrite_iops', min: 0.7 }],
};
/** Issue 14: over TLS, at least 0.8x nbdkit --tls=require's throughput (any store, against its TLS peer). */
const TLS_GOALS: { metric: string; min: number }[] = [{ metric: 'seq_write', min: 0.8 }, { metric: 'seq_read', min: 0.8 }];

interface Metric {
  id: string;
  label: string;
  unit: string;
  better: 'higher' | 'lower';
}

const METRICS: Metric[] = [
  { id: 'seq_write', label: 'nbdcopy sequential write (--flush)', unit: 'MiB/s', better: 'higher' },
  { id: 'seq_read', label: 'nbdcopy sequential read → null:', unit: 'MiB/s', better: 'higher' },
  { id: 'randread_iops', label: 'fio 4k randread QD32', unit: 'IOPS', better: 'higher' },
  { id: 'randread_p50', label: 'fio 4k randread QD32 latency p50', unit: 'µs', better: 'lower' },
  { id: 'randread_p99', label: 'fio 4k randread QD32 latency p99', unit: 'µs', better: 'lower' },
  { id: 'randwrite_iops', label: 'fio 4k randwrite QD32', unit: 'IOPS', better: 'higher' },
  { id: 'randwrite_p50', label: 'fio 4k randwrite QD32 latency p50', unit: 'µs', better: 'lower' },
  { id: 'randwrite_p99', label: 'fio 4k randwrite QD32 latency p99', unit: 'µs', better: 'lower' },
  { id: 'fsync_iops', label: 'fio 4k randwrite QD1 --fsync=1 (write+flush pairs)', unit: 'IOPS', better: 'higher' },
  { id: 'flush_p50', label: 'fio --fsync=1 flush latency p50', unit: 'µs', better: 'lower' },
  { id: 'flush_p99', label: 'fio --fsync=1 flush latency p99', unit: 'µs', better: 'lower' },
];

const STEP_NAMES = ['seq_write', 'seq_read', 'randread', 'randwrite', 'fsync'];

interface StepRecord {
  step: string;
  argv: string[];
  values: Record<string, number>;
  /** CPU seconds the server used during the step (null for local). */
  serverCpuS: number | null;
  wallS: number;
  error?: string;
  /** fio's job object. */
  fio?: Record<string, unknown>;
}

interface RunRecord {
  target: string;
  repeat: number;
  /** Load average (1, 5, 15 min) when this pass started. */
  loadavg: number[];
  scrape?: ScrapeRecord;
  serverArgv: string[] | null;
  steps: StepRecord[];
  /** baton over TLS: protocol and cipher of each TLS session, from its log. */
  tlsSessions?: { protocol: string; cipher: string }[];
  profileTop?: ProfileEntry[];
  profileFile?: string;
}

interface StepDef {
  step: string;
  run(): Promise<{ argv: string[]; values: Record<string, number>; fio?: Record<string, unknown> }>;
}

function fioJob(base: Omit<FioJob, 'runtime' | 'size'>): FioJob {
  return { runtime: RUNTIME, size: SIZE, ...base };
}

/**
 * The five steps against one target: an NBD URI (engine nbd) or a local file (libaio / psync).
 * `fioUri` is the URI for fio when it must differ from nbdcopy's (TLS: no tls-certificates=).
 */
function steps(src: string, target: { uri: string; fioUri?: string } | { file: string }, workDir: string): StepDef[] {
  const dst = 'uri' in target ? target.uri : target.file;
  const io = (qd: number): Pick<FioJob, 'ioengine' | 'uri' | 'filename'> =>
    'uri' in target ? { ioengine: 'nbd', uri: target.fioUri ?? target.uri } : { ioengine: qd > 1 ? 'libaio' : 'psync', filename: target.file };
  return [
    {
      step: 'seq_write',
      run: async () => {
        // The same memory for every server's write (lib.ts freeMemoryBefore says why).
        if (WARM) freeMemoryBefore(workDir, SIZE + SIZE / 2);
        const r = await runNbdcopy(src, dst, SIZE, { flush: true });
        return { argv: r.argv, values: { seq_write: r.mibPerSec } };
      },
    },
    {
      step: 'seq_read',
      run: async () => {
        const r = await runNbdcopy(dst, 'null:', SIZE);
        return { argv: r.argv, values: { seq_read: r.mibPerSec } };
      },
    },
    {
      step: 'randread',
      run: async () => {
        const r = await runFio(fioJob({ name: 'randread', rw: 'randread', bs: '4k', iodepth: 32, ...io(32) }), workDir);
        return { argv: r.argv, fio: r.raw, values: { randread_iops: r.iops, randread_p50: r.latUs.p50, randread_p99: r.latUs.p99 } };
      },
    },
    {
      step: 'randwrite',
      run: async () => {
        if (WARM) freeMemoryBefore(workDir, SIZE);
        const r = await runFio(fioJob({ name: 'randwrite', rw: 'randwrite', bs: '4k', iodepth: 32, ...io(32) }), workDir);
        return { argv: r.argv, fio: r.raw, values: { randwrite_iops: r.iops, randwrite_p50: r.latUs.p50, randwrite_p99: r.latUs.p99 } };
      },
    },
    {
      step: 'fsync',
      run: async () => {
        const r = await runFio(fioJob({ name: 'fsync', rw: 'randwrite', bs: '4k', iodepth: 1, fsync: 1, ...io(1) }), workDir);
        return {
          argv: r.argv, fio: r.raw,
          values: { fsync_iops: r.iops, flush_p50: r.syncUs?.p50 ?? NaN, flush_p99: r.syncUs?.p99 ?? NaN, fsync_write_p50: r.latUs.p50 },
        };
      },
    },
  ];
}

async function runSteps(defs: StepDef[], server: Server | null, log: (s: string) => void): Promise<StepRecord[]> {
  const out: StepRecord[] = [];
  for (const d of defs) {
    const rec: StepRecord = { step: d.step, argv: [], values: {}, serverCpuS: null, wallS: NaN };
    const cpu0 = server ? server.cpuSeconds() : NaN;
    const t0 = Date.now();
    try {
      if (server && !server.alive()) throw new Error(`${server.kind} is no longer running (${server.status()})${server.stderr() ? ':\n' + server.stderr().slice(-2000) : ''}`);
      const r = await d.run();
      rec.argv = r.argv;
      rec.values = r.values;
      if (r.fio) rec.fio = r.fio;
    } catch (e) {
      rec.error = (e as Error).message;
      log(`    ${d.step}: ERROR ${rec.error}`);
    }
    rec.wallS = (Date.now() - t0) / 1000;
    if (server) rec.serverCpuS = server.cpuSeconds() - cpu0;
    if (!rec.error) {
      log(`    ${d.step}: ${Object.entries(rec.values).map(([k, v]) => `${k}=${fmt(v)}`).join(' ')}` +
        (rec.serverCpuS !== null ? ` (server cpu ${rec.serverCpuS.toFixed(2)} s in ${rec.wallS.toFixed(1)} s)` : ''));
    }
    out.push(rec);
  }
  return out;
}

/** An empty sparse file of `size` bytes (nbdkit file's image); returns its path. */
function makeSparseFile(p: string, size: number): string {
  fs.closeSync(fs.openSync(p, 'w'));
  fs.truncateSync(p, size);
  return p;
}

/**
 * The newest main-thread profile in `dir`: node names them CPU.DATE.TIME.PID.THREAD.SEQ.cpuprofile,
 * THREAD 0 for the main thread (a worker thread, such as the memory backend's, writes its own).
 */
function newestProfile(dir: string, since: number): string | undefined {
  if (!fs.existsSync(dir)) return undefined;
  return fs.readdirSync(dir)
    .filter((f) => /\.0\.\d+\.cpuprofile$/.test(f))
    .map((f) => path.join(dir, f))
    .filter((f) => fs.statSync(f).mtimeMs >= since)
    .sort((a, b) => fs.statSync(b).mtimeMs - fs.statSync(a).mtimeMs)[0];
}

async function main(): Promise<void> {
  const log = (s: string): void => { process.stderr.write(s + '\n'); };
  for (const tool of ['nbdcopy', 'fio']) {
    if (!has(tool)) throw new Error(`${tool} is not installed (Debian: apt-get install ${tool === 'fio' ? 'fio' : 'libnbd-bin'})`);
  }
  const haveNbdkit = has('nbdkit');
  if (!haveNbdkit) log('nbdkit is not installed: no peer columns, no ratios (Debian: apt-get install nbdkit)');

  // Each baton store (and with METRICS the same with --metrics), then its peer right after it (once per plugin).
  const nbdTargets: Target[] = [];
  for (const tls of TLS ? [false, true] : [false]) {
    const sfx = tls ? ' +TLS' : '';
    for (const store of BATON_STORES) {
      nbdTargets.push({ id: `baton ${store}${sfx}`, kind: 'baton', store, tls });
      if (WITH_METRICS && !tls) nbdTargets.push({ id: `baton ${store} +metrics`, kind: 'baton', store, metrics: true });
      const plugin = peerPlugin(store);
      if (haveNbdkit && PEERS && !nbdTargets.some((t) => t.kind === 'nbdkit' && t.store === plugin && !!t.tls === tls)) nbdTargets.push({ id: `nbdkit ${plugin}${sfx}`, kind: 'nbdkit', store: plugin, tls });
    }
  }

  const machine = machineInfo();
  const started = Date.now();
  log(`nbd-throughput: SIZE=${formatSize(SIZE)} RUNTIME=${RUNTIME}s REPEAT=${REPEAT} BATON_STORES=${BATON_STORES.join(',')} LOCAL=${LOCAL ? 1 : 0} PROFILE=${PROFILE ? 1 : 0} METRICS=${WITH_METRICS ? 1 : 0} PEERS=${PEERS ? 1 : 0} TLS=${TLS ? 1 : 0} WARM=${WARM ? 1 : 0}; ${machine.nproc} cores, node ${machine.node}, load ${machine.loadavgAtStart.join(' ')}`);

  const work = makeTempDir('baton-bench-');
  // TLS=1: one CA, the server's directory in nbdkit's layout (both servers read it) and the
  // client's CA for nbdcopy, made for this run with openssl.
  const pki = TLS ? (() => {
    const ca = makeCa(path.join(work, 'pki', 'ca'));
    return { server: makeServerDir(ca, path.join(work, 'pki', 'server')), client: makeClientDir(ca, ca, path.join(work, 'pki', 'client'), 'bench') };
  })() : null;
  const rnd = makeRandomFile(SIZE);
  log(`  random source: ${rnd.path} (${rnd.onTmpfs ? 'tmpfs' : 'temp dir'}), generated in ${rnd.seconds.toFixed(1)} s`);
  const localFile = path.join(work, 'local.img');
  const profDir = path.join(RESULTS_DIR, 'cpu-profiles.raw');

  const runs: RunRecord[] = [];
  for (let rep = 0; rep < REPEAT; rep++) {
    // Alternate the server order between repeats so drift in machine load does not favour one.
    const order = rep % 2 === 0 ? [...nbdTargets] : [...nbdTargets].reverse();
    if (LOCAL) order.push({ id: 'local', kind: 'local' });
    for (const target of order) {
      log(`  [${rep + 1}/${REPEAT}] ${target.id}`);
      const rec: RunRecord = { target: target.id, repeat: rep, loadavg: os.loadavg().map((x) => Math.round(x * 100) / 100), serverArgv: null, steps: [] };
      if (target.kind === 'local') {
        rec.steps = await runSteps(steps(rnd.path, { file: localFile }, work), null, log);
        fs.rmSync(localFile, { force: true });
      } else {
        const dir = makeTempDir(`baton-bench-${target.kind}-`);
        const since = Date.now();
        let server: Server | null = null;
        let scraper: Scraper | null = null;
        try {
          const metricsPort = target.metrics ? await freeTcpPort() : 0;
          const tlsArgs = target.tls && pki
            ? (target.kind === 'baton' ? ['--tls', 'require', '--tls-certificates', pki.server] : ['--tls=require', `--tls-certificates=${pki.server}`])
            : [];
          const extraArgs = [...tlsArgs, ...(target.metrics ? ['--metrics', `127.0.0.1:${metricsPort}`] : [])];
          server = target.kind === 'baton'
            // At info level a TLS baton logs one line per connection (protocol, cipher): kept for the report.
            ? await startBaton({ dir, volume: VOLUME, size: SIZE, store: target.store ?? 'memory:', extraArgs, ...(target.tls ? { logLevel: 'info' } : {}), ...(PROFILE ? { nodeArgs: ['--cpu-prof', `--cpu-prof-dir=${profDir}`] } : {}) })
            : await startNbdkit({ dir, extraArgs: tlsArgs, plugin: target.store === 'file' ? ['file', makeSparseFile(path.join(dir, 'nbdkit.img'), SIZE)] : ['memory', String(SIZE)] });
          rec.serverArgv = server.argv;
          if (target.metrics) scraper = startMetricsScraper(metricsPort, SCRAPE_EVERY_MS);
          const uri = target.tls ? server.uri.replace(/^nbd\+unix:/, 'nbds+unix:') : server.uri;
          const nbdTarget = target.tls && pki ? { uri: `${uri}&tls-certificates=${pki.client}`, fioUri: uri } : { uri };
          rec.steps = await runSteps(steps(rnd.path, nbdTarget, dir), server, log);
          if (scraper) {
            rec.scrape = await scraper.stop();
            log(`    /metrics: ${rec.scrape.scrapes} scrapes (${rec.scrape.errors} failed), p50 ${fmt(rec.scrape.msP50)} ms, max ${fmt(rec.scrape.msMax)} ms, ${rec.scrape.bytes} bytes, ${rec.scrape.requestsCounted} NBD requests counted`);
            if (rec.scrape.errors > 0 || rec.scrape.requestsCounted === 0) throw new Error(`the metrics of this pass are not live: ${JSON.stringify(rec.scrape)}`);
          }
          if (target.tls && target.kind === 'baton') {
            rec.tlsSessions = server.stderr().split('\n').filter((l) => l.includes('"TLS session established"'))
              .map((l) => JSON.parse(l) as { protocol: string; cipher: string }).map((l) => ({ protocol: l.protocol, cipher: l.cipher }));
          }
        } catch (e) {
          rec.steps.push({ step: 'start', argv: [], values: {}, serverCpuS: null, wallS: 0, error: (e as Error).message });
          log(`    ERROR ${(e as Error).message}`);
        } finally {
          if (scraper && !rec.scrape) await scraper.stop().catch(() => {});
          await server?.stop();
        }
        if (PROFILE && target.kind === 'baton') {
          const f = newestProfile(profDir, since);
          if (f) { rec.profileFile = path.relative(process.cwd(), f); rec.profileTop = summarizeCpuProfile(f, 20); }
        }
      }
      runs.push(rec);
    }
  }

  const finished = Date.now();
  const targets = [...nbdTargets, ...(LOCAL ? [{ id: 'local', kind: 'local' } as Target] : [])];
  const report = render(machine, targets, runs, rnd, work, localFile, (finished - started) / 1000);
  const json = {
    benchmark: 'nbd-throughput',
    knobs: { SIZE, RUNTIME, REPEAT, BATON_STORES, LOCAL, PROFILE, METRICS: WITH_METRICS, PEERS, SCRAPE_EVERY_MS, TLS, WARM },
    machine,
    loadavgAtEnd: os.loadavg(),
    durationS: (finished - started) / 1000,
    randomFile: { onTmpfs: rnd.onTmpfs, generateS: rnd.seconds },
    metrics: METRICS,
    summary: Object.fromEntries(targets.map((t) => [t.id, summarize(runs, t.id)])),
    goals: PROFILE ? [] : goalRows(targets, runs),
    runs,
  };
  // A profiled run's numbers are not comparable: keep them apart from the reference table.
  // A profiled run's, a metrics run's and a TLS run's numbers go to files of their own (the reference table stays).
  const written = writeResults(PROFILE ? 'nbd-throughput-profile' : WITH_METRICS ? 'nbd-throughput-metrics' : TLS ? 'nbd-throughput-tls' : 'nbd-throughput', report, json);
  process.stdout.write(report);
  log(`\nwrote ${path.relative(process.cwd(), written.md)} and ${path.relative(process.cwd(), written.json)} in ${((finished - started) / 1000).toFixed(0)} s`);
  if (runs.some((r) => r.steps.some((s) => s.error))) process.exitCode = 1;
}

/** Median of each metric (and of server CPU per step, as `cpu_STEP`) over the repeats of one target. */
function summarize(runs: RunRecord[], target: string): Record<string, number> {
  const mine = runs.filter((r) => r.target === target);
  const out: Record<string, number> = {};
  const ids = new Set(mine.flatMap((r) => r.steps.flatMap((s) => Object.keys(s.values))));
  for (const id of ids) out[id] = median(mine.flatMap((r) => r.steps.map((s) => s.values[id] ?? NaN)));
  for (const st of STEP_NAMES) {
    out[`cpu_${st}`] = median(mine.flatMap((r) => r.steps.filter((s) => s.step === st).map((s) => s.serverCpuS ?? NaN)));
  }
  return out;
}

/** The goal rows of this run: each store's goals against its peer (medians). */
function goalRows(targets: Target[], runs: RunRecord[]): GoalRow[] {
  const rows: GoalRow[] = [];
  for (const t of targets.filter((x) => x.kind === 'baton' && x.metrics)) {
    const on = summarize(runs, t.id);
    const off = summarize(runs, `baton ${t.store}`);
    for (const id of ['randread_iops', 'randwrite_iops'] as const) {
      const m = METRICS.find((x) => x.id === id)!;
      rows.push(ratioGoal(`\`${t.store}\` serve --metrics on vs off: ${m.label}`, on[id], 'metrics off', off[id], m.unit, METRICS_MIN_RATIO));
    }
  }
  for (const t of targets.filter((x) => x.kind === 'baton' && !x.metrics && PEERS)) {
    const peerName = peerId(t);
    const mine = summarize(runs, t.id);
    const peer = summarize(runs, peerName);
    const key = t.store!.startsWith('file:') ? 'file:' : t.store!.startsWith('ram:') ? 'ram:' : t.store!;
    for (const g of t.tls ? TLS_GOALS : STORE_GOALS[key] ?? []) {
      const m = METRICS.find((x) => x.id === g.metric)!;
      rows.push(ratioGoal(`\`${t.store}\`${t.tls ? ' over TLS' : ''} vs ${peerName}: ${m.label}`, mine[m.id], peerName, peer[m.id], m.unit, g.min));
    }
  }
  return rows;
}

function render(m: ReturnType<typeof machineInfo>, targets: Target[], runs: RunRecord[], rnd: { path: string; onTmpfs: boolean }, work: string, localFile: string, durationS: number): string {
  const sum = new Map(targets.map((t) => [t.id, summarize(runs, t.id)]));
  const batons = targets.filter((t) => t.kind === 'baton' && !t.metrics);
  const local = sum.get('local') ?? {};
  const L: string[] = [];
  L.push('# NBD throughput: each baton store against its nbdkit peer\n');
  L.push(`${m.date.slice(0, 16).replace('T', ' ')} UTC on \`${m.hostname}\`: ${m.nproc} cores (${m.cpuModel}), ${m.memTotalGiB} GiB RAM, ${m.kernel}, load average at start ${m.loadavgAtStart.join(' ')}.`);
  L.push(`node ${m.node}; ${m.nbdkit ?? 'nbdkit missing'}; ${m.nbdcopy ?? 'nbdcopy missing'}; ${m.fio ?? 'fio missing'}; baton ${m.batonCommit ?? '?'} (working tree as built).`);
  L.push(`SIZE=${formatSize(SIZE)}, RUNTIME=${RUNTIME} s, REPEAT=${REPEAT}${REPEAT > 1 ? ' (medians; server order alternates)' : ''}, BATON_STORES=${BATON_STORES.join(',')}${TLS ? ', TLS=1' : ''}${WARM ? ', WARM=1 (memory freed just before each sequential and random write: lib.ts freeMemoryBefore)' : ', WARM=0'}${PROFILE ? ', **PROFILE=1: baton ran under --cpu-prof, its numbers are not comparable**' : ''}; whole run ${durationS.toFixed(0)} s.`);
  L.push(`Random source file on ${rnd.onTmpfs ? 'tmpfs (/dev/shm)' : 'the temp dir'}; baton's \`file:\` store, nbdkit file's image and the local reference file on ${m.tmpdir} (${m.tmpdirFs ?? '?'}).\n`);

  L.push(`## Goals (issue 11${WITH_METRICS ? '; issue 14: metrics on vs off' : ''}${TLS ? '; issue 14 over TLS' : ''}), this run\n`);
  L.push(goalsTable(goalRows(targets, runs)));

  for (const b of batons) {
    const peerName = peerId(b);
    const mine = sum.get(b.id) ?? {};
    const peer = sum.get(peerName) ?? {};
    // Over TLS, also the same server in plaintext from this run: what TLS costs each of them.
    const plain = b.tls ? sum.get(`baton ${b.store}`) ?? {} : null;
    const peerPlain = b.tls ? sum.get(peerName.replace(/ \+TLS$/, '')) ?? {} : null;
    L.push(`## \`${b.store}\`${b.tls ? ' over TLS' : ''} against \`${peerName}\`\n`);
    if (b.tls) {
      const ciphers = [...new Set(runs.filter((r) => r.target === b.id).flatMap((r) => (r.tlsSessions ?? []).map((x) => `${x.protocol} ${x.cipher}`)))];
      L.push(`baton's TLS sessions: ${ciphers.join(', ') || '?'} (from its log). nbdkit (GnuTLS) logs no cipher without -v; with Debian 12's GnuTLS on both ends it is TLS 1.3 with the client's first choice, TLS_AES_256_GCM_SHA384.\n`);
    }
    const headers = ['metric', b.id, peerName, `${b.id} / ${peerName}`, ...(plain ? [`baton ${b.store}`, 'baton TLS / plain', peerName.replace(/ \+TLS$/, ''), 'nbdkit TLS / plain'] : []), ...(LOCAL ? ['local'] : [])];
    const rows = METRICS.map((mt) => [
      `${mt.label}, ${mt.unit} ${mt.better === 'higher' ? '↑' : '↓'}`, fmt(mine[mt.id]), fmt(peer[mt.id]), fmtRatio(ratio(mine[mt.id], peer[mt.id])),
      ...(plain && peerPlain ? [fmt(plain[mt.id]), fmtRatio(ratio(mine[mt.id], plain[mt.id])), fmt(peerPlain[mt.id]), fmtRatio(ratio(peer[mt.id], peerPlain[mt.id]))] : []),
      ...(LOCAL ? [fmt(local[mt.id])] : []),
    ]);
    L.push(markdownTable(headers, rows, ['l', ...headers.slice(1).map(() => 'r' as const)]));
  }
  L.push('How to read it: ↑ = higher is better (MiB/s, IOPS), ↓ = lower is better (latency, µs). Every ratio column is');
  L.push('baton ÷ its peer, so on ↑ rows > 1 means baton is faster, and on ↓ (latency) rows < 1 means baton is faster');
  L.push('(> 1: baton slower). Latency is fio total latency (submission + completion) per 4 KiB I/O; flush latency is');
  L.push('the FLUSH round trip alone. `ram:` and `nbdkit memory` hold data in memory and their FLUSH does nothing: that');
  L.push('pair isolates the NBD layer. `file:` is baton\'s volume engine over the embedded local-directory store, whose');
  L.push('FLUSH returns once the data is fdatasync\'ed into the store\'s files; `nbdkit file` writes into one image file');
  L.push('and its FLUSH is fdatasync: the same promise, on the same disk. "local" is the same clients against a file in');
  L.push('the temp dir: nbdcopy to/from the file (the read is served from the page cache), fio with libaio (QD32)');
  L.push('or psync (QD1 + fsync), O_DIRECT; it shows what the machine and clients can do and is not a target.\n');

  for (const on of targets.filter((t) => t.metrics)) {
    const offId = `baton ${on.store}`;
    const a = sum.get(offId) ?? {};
    const b = sum.get(on.id) ?? {};
    L.push(`## \`${on.store}\`: \`serve --metrics\` on vs off (issue 14)\n`);
    L.push(`\`${on.id}\` is \`${offId}\` with \`--metrics 127.0.0.1:PORT\` and /metrics scraped every ${SCRAPE_EVERY_MS / 1000} s while measured (Prometheus's default interval is 15 s);`);
    L.push(`the two are measured one after the other in every pass. On ↑ rows a ratio below 1 is what metrics cost; the goal is ≥ ${METRICS_MIN_RATIO} on fio's 4k random I/O.\n`);
    const rows = METRICS.map((mt) => [`${mt.label}, ${mt.unit} ${mt.better === 'higher' ? '↑' : '↓'}`, fmt(a[mt.id]), fmt(b[mt.id]), fmtRatio(ratio(b[mt.id], a[mt.id]))]);
    rows.push(...STEP_NAMES.map((st) => [`server CPU s, ${st} ↓`, fmt(a[`cpu_${st}`]), fmt(b[`cpu_${st}`]), fmtRatio(ratio(b[`cpu_${st}`], a[`cpu_${st}`]))]));
    // Server CPU per I/O is steadier than IOPS on a shared machine (a pass slowed by another
    // process's load does fewer I/Os, each costing about the same).
    for (const [st, id] of [['randread', 'randread_iops'], ['randwrite', 'randwrite_iops']] as const) {
      const per = (t: string): number => median(runs.filter((r) => r.target === t).map((r) => {
        const s = r.steps.find((x) => x.step === st);
        const iops = s?.values[id];
        return s?.serverCpuS != null && iops ? (s.serverCpuS * 1e6) / (iops * RUNTIME) : NaN;
      }));
      rows.push([`server CPU µs per I/O, fio 4k ${st} ↓`, fmt(per(offId)), fmt(per(on.id)), fmtRatio(ratio(per(on.id), per(offId)))]);
    }
    L.push(markdownTable(['metric', offId, on.id, 'on / off'], rows, ['l', 'r', 'r', 'r']));
    // Each pass's on ÷ off (the two ran back to back): drift in the machine's load moves both.
    const paired = (id: string): string => runs.filter((r) => r.target === on.id).map((r) => {
      const off = runs.find((x) => x.target === offId && x.repeat === r.repeat);
      const v = (rr: RunRecord | undefined): number => rr?.steps.map((st) => st.values[id]).find((x) => x !== undefined) ?? NaN;
      return fmtRatio(ratio(v(r), v(off)));
    }).join(', ');
    L.push(`Per pass, on ÷ off: fio 4k randread ${paired('randread_iops')}; randwrite ${paired('randwrite_iops')}; write+flush ${paired('fsync_iops')}.\n`);
    const sc = runs.filter((r) => r.target === on.id && r.scrape).map((r) => r.scrape!);
    if (sc.length) {
      L.push(`Scrapes per pass: ${sc.map((x) => x.scrapes).join(', ')} (failed: ${sc.reduce((n, x) => n + x.errors, 0)}); time per scrape p50 ${sc.map((x) => fmt(x.msP50)).join(', ')} ms, max ${sc.map((x) => fmt(x.msMax)).join(', ')} ms; ${sc[0]!.bytes} bytes per answer; NBD requests the last scrape counted: ${sc.map((x) => x.requestsCounted).join(', ')}.\n`);
    }
  }
  L.push('Load average (1 min) at the start of each pass: ' + runs.filter((r) => r.target !== 'local').map((r) => `${r.target} #${r.repeat + 1}: ${r.loadavg[0]}`).join('; ') + '.\n');

  const cpuRows = STEP_NAMES.map((st) => [st, ...targets.filter((t) => t.kind !== 'local').map((t) => fmt(sum.get(t.id)?.[`cpu_${st}`]))]);
  L.push('## Server CPU time per step\n');
  L.push('user + system CPU seconds the server process used during each step (all threads, from /proc/PID/stat).');
  L.push(`Client and server share the ${m.nproc} cores, so CPU a server burns is taken from the client too.\n`);
  const cpuHeaders = ['step', ...targets.filter((t) => t.kind !== 'local').map((t) => `${t.id} CPU s`)];
  L.push(markdownTable(cpuHeaders, cpuRows, ['l', ...cpuHeaders.slice(1).map(() => 'r' as const)]));

  for (const prof of runs.filter((r) => r.profileTop && r.repeat === 0)) {
    L.push(`## ${prof.target}: CPU profile (self time, whole server lifetime)\n`);
    L.push(`From \`${prof.profileFile}\` (\`node --cpu-prof\`).\n`);
    L.push(markdownTable(['function', 'where', 'self ms', 'self %'],
      prof.profileTop!.map((e) => [e.fn, e.where, fmt(e.selfMs), e.selfPct.toFixed(1)]), ['l', 'l', 'r', 'r']));
  }

  const errors = runs.flatMap((r) => r.steps.filter((x) => x.error).map((x) => `- ${r.target} ${x.step}: ${x.error!.split('\n')[0]}`));
  if (errors.length) L.push('## Errors\n\n' + errors.join('\n') + '\n');

  // Commands, with temp paths replaced by names (double quotes, so they paste into a shell).
  const tmpDirs = [work, ...runs.map((r) => {
    const sock = r.serverArgv?.[r.serverArgv.indexOf(r.serverArgv.includes('--socket') ? '--socket' : '-U') + 1];
    return sock ? path.dirname(sock) : null;
  }).filter((d): d is string => d !== null)];
  const redact = (argv: string[]): string => {
    let t = shellQuote(argv).split(rnd.path).join('$SRC').split(localFile).join('$LOCAL');
    for (const d of tmpDirs) t = t.split(d).join('$TMP');
    return t.replace(/\$TMP\/fio-[^ ]+\.json/g, '$TMP/fio.json')
      .replace(/'([^']*)'/g, '"$1"')
      .split(process.execPath).join('node')
      .replace(/[^ ]*\/dist\/cli\/bin\.cjs/, 'dist/cli/bin.cjs');
  };
  L.push('## Commands\n');
  L.push(`$SRC = ${formatSize(SIZE)} of random bytes (${rnd.onTmpfs ? '/dev/shm' : m.tmpdir}), $TMP = a private temp dir (Unix sockets; for baton also BATON_HOME=$TMP/home and BATON_CACHE_DIR=$TMP/cache), $LOCAL = $TMP/local.img on ${m.tmpdir}.`);
  L.push('Every server is started fresh per pass and stopped after it. SIZE is given in bytes.\n');
  L.push('```sh');
  for (const t of targets) {
    const r = runs.find((x) => x.target === t.id);
    if (!r) continue;
    L.push(`# ${t.id}`);
    if (r.serverArgv) L.push(`${redact(r.serverArgv)} &`);
    for (const st of r.steps) if (st.argv.length) L.push(redact(st.argv));
    L.push('');
  }
  L.push('```\n');
  L.push(`nbdcopy runs with its defaults: --connections = min(4, threads) = ${Math.min(4, m.nproc)} on this machine (every server here`);
  L.push('advertises CAN_MULTI_CONN), 64 requests of 256 KiB in flight per connection. fio\'s nbd engine uses one');
  L.push('connection per job (numjobs=1).');
  return L.join('\n') + '\n';
}

main().catch((e: unknown) => {
  process.stderr.write(`nbd-throughput: ${(e as Error).stack ?? String(e)}\n`);
  process.exit(1);
});

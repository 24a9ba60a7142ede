/**
 * The object-store volume against a real S3 server: baton on Ceph radosgw (scripts/rgw.sh,
 * loopback, memstore), with and without BATON_FAULTS added latency. Four measurements, one run:
 *
 *   1. flush    fio --ioengine=nbd --rw=randwrite --bs=4k --iodepth=1 --fsync=1 (time-bounded):
 *               FLUSH latency p50/p99 (fio's `sync` latency), and what each flush costs in store
 *               requests (radosgw's own counters and access log) and objects (bucket listing).
 *   2. npm      `npm ci` (offline, ~40 local tarball deps of ~100 small files each) + `sync -f`,
 *               and `git clone file://` + `sync -f`, on ext4 over baton+RGW (nbdfuse + loop),
 *               over `nbdkit memory` through the same nbdfuse + loop path, and in a local directory.
 *   3. cold     cold attach on a "new host": a 10 GiB ext4 made and filled through server A; A
 *               stopped; server B with an empty cache: time to the first READ answered, time and
 *               bytes fetched from the store to mount the ext4, then to read the files back.
 *   4. puts     nbdcopy --flush 1 GiB of random data into a volume: PUTs (and objects) per GiB.
 *
 * Store requests are counted at the server (radosgw `perf dump` over its admin socket, plus its
 * access log for the breakdown by key kind); nothing in baton is instrumented.
 *
 * Knobs (environment): STEPS (flush,npm,cold,puts), FLUSH_RUNTIME (fio seconds, 20),
 * LATENCY_MS (20), FS_SIZE (volume for npm/git, 4G), COLD_SIZE (10G), COPY_SIZE (1G),
 * NPM_PACKAGES (40), NPM_FILES (files per package, 100), NPM_PASSES (2), PROFILE_DIR (CPU profiles
 * of every baton server, by server name).
 * Results: bench/results/volume.md (tables) and volume.json (everything, incl. commands).
 */

import { createHash, randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import * as http from 'node:http';
import { CreateBucketCommand, ListObjectsV2Command, PutBucketAclCommand, S3Client } from '@aws-sdk/client-s3';
import { errorMessage } from '../src/errors.js';
import { formatSize } from '../src/size.js';
import { openStore } from '../src/store/open.js';
import {
  MiB, RESULTS_DIR, attachExt4, childrenCpuSeconds, diffCounters, selfCpuSeconds, envNumber, envSize, fmt, fmtRatio, goalsTable, has, limitGoal, machineInfo, makeRandomFile, makeTempDir,
  ratioGoal, slowdownGoal, type GoalRow,
  markdownTable, nbdReadOnce, quantile, startStallProbe, ratio, runCommand, runFio, runNbdcopy, shellQuote, startBaton, startNbdkit, startRgw,
  writeResults, type CommandResult, type Ext4Stack, type RgwCounters, type RgwRequest, type RgwServer, type Server,
} from './lib.js';

const GiB = 1024 * MiB;
const STEPS = new Set((process.env.STEPS || 'flush,npm,cold,puts,stream').split(',').map((s) => s.trim()).filter(Boolean));
const FLUSH_RUNTIME = envNumber('FLUSH_RUNTIME', 20);
const LATENCY_MS = envNumber('LATENCY_MS', 20);
const FS_SIZE = envSize('FS_SIZE', '4G');
const COLD_SIZE = envSize('COLD_SIZE', '10G');
const COPY_SIZE = envSize('COPY_SIZE', '1G');
const NPM_PACKAGES = Math.max(1, Math.floor(envNumber('NPM_PACKAGES', 40)));
const NPM_FILES = Math.max(1, Math.floor(envNumber('NPM_FILES', 100)));
const NPM_PASSES = Math.max(1, Math.floor(envNumber('NPM_PASSES', 2)));
const BUCKET = 'bench';
/** Set: every baton server writes a V8 CPU profile (node --cpu-prof) to PROFILE_DIR/<server name>/ when it stops. */
const PROFILE_DIR = process.env.PROFILE_DIR ? path.resolve(process.env.PROFILE_DIR) : '';

const log = (s: string): void => { process.stderr.write(s + '\n'); };
const since = (t: number): number => (performance.now() - t) / 1000;

// ------------------------------------------------------------------ store accounting

/** What a request was about, from its path: /BUCKET/PREFIX/vol/<id>/log/... → "PUT log". */
function classify(r: RgwRequest): string {
  if (r.method === 'GET' && /list-type=|[?&]prefix=/.test(r.query)) return 'LIST';
  const p = r.path;
  let kind = 'other';
  if (/\/vol\/[^/]+\/log\//.test(p)) kind = 'log';
  else if (/\/vol\/[^/]+\/seg\//.test(p)) kind = 'segment';
  else if (/\/vol\/[^/]+\/checkpoint\//.test(p)) kind = 'checkpoint';
  else if (/\/volumes\//.test(p)) kind = 'volume record';
  else if (/\/_probe\//.test(p)) kind = 'probe';
  return `${r.method} ${kind}`;
}

interface Breakdown { [kind: string]: { n: number; bytes: number } }

function breakdown(reqs: RgwRequest[]): Breakdown {
  const out: Breakdown = {};
  for (const r of reqs) {
    const k = classify(r);
    const e = (out[k] ??= { n: 0, bytes: 0 });
    e.n++;
    e.bytes += r.bytes;
  }
  return out;
}

const count = (b: Breakdown, k: string): number => b[k]?.n ?? 0;

function fmtBreakdown(b: Breakdown): string {
  return Object.entries(b).sort((x, y) => y[1].n - x[1].n)
    .map(([k, v]) => `${k} ${v.n}${v.bytes ? ` (${formatSize(v.bytes)})` : ''}`).join(', ');
}

interface Window {
  counters: RgwCounters;
  requests: RgwRequest[];
  breakdown: Breakdown;
}

/** Run `fn` and report what radosgw saw meanwhile (counters delta, the logged requests). */
async function storeWindow<T>(rgw: RgwServer, fn: () => Promise<T>): Promise<{ value: T } & Window> {
  const c0 = await rgw.counters();
  const mark = rgw.logMark();
  const value = await fn();
  const counters = diffCounters(await rgw.counters(), c0);
  const requests = await rgw.requestsSince(mark, counters.req);
  if (requests.length !== counters.req) log(`  note: radosgw logged ${requests.length} requests, its counter says ${counters.req}`);
  return { value, counters, requests, breakdown: breakdown(requests) };
}

let s3: S3Client;

async function listPrefix(prefix: string): Promise<{ objects: number; bytes: number; keys: string[] }> {
  const keys: string[] = [];
  let bytes = 0;
  let token: string | undefined;
  do {
    const r = await s3.send(new ListObjectsV2Command({ Bucket: BUCKET, Prefix: prefix, ...(token ? { ContinuationToken: token } : {}) }));
    for (const o of r.Contents ?? []) { keys.push(o.Key ?? ''); bytes += o.Size ?? 0; }
    token = r.IsTruncated ? r.NextContinuationToken : undefined;
  } while (token);
  return { objects: keys.length, bytes, keys };
}

function kindsOf(keys: string[]): Record<string, number> {
  const out: Record<string, number> = {};
  for (const k of keys) {
    const kind = /\/vol\/[^/]+\/(log|seg|checkpoint)\//.exec(k)?.[1] ?? (/\/volumes\//.test(k) ? 'volume record' : 'other');
    out[kind] = (out[kind] ?? 0) + 1;
  }
  return out;
}

// ------------------------------------------------------------------ baton on radosgw

interface BatonOnRgw { server: Server; logFile: string; cacheDir: string }

/** baton's logs are kept (git-ignored) in results/volume-logs.raw/ for a look after the run. */
const LOG_KEEP_DIR = path.join(RESULTS_DIR, 'volume-logs.raw');
const batonLogs: string[] = [];

function keepLogs(): void {
  fs.rmSync(LOG_KEEP_DIR, { recursive: true, force: true });
  fs.mkdirSync(LOG_KEEP_DIR, { recursive: true });
  for (const f of batonLogs) {
    try { fs.copyFileSync(f, path.join(LOG_KEEP_DIR, `${path.basename(path.dirname(f))}.log`)); } catch { /* not written */ }
  }
}

let rgw: RgwServer;
let work: string;
const commands: { step: string; argv: string[] }[] = [];

function note(step: string, argv: string[]): void { commands.push({ step, argv }); }

async function startBatonRgw(step: string, name: string, prefix: string, volume: string, size: number, o: { latencyMs?: number; create?: boolean; extraArgs?: string[] } = {}): Promise<BatonOnRgw> {
  const dir = path.join(work, name);
  fs.mkdirSync(dir, { recursive: true });
  const cacheDir = path.join(dir, 'cache');
  const logFile = path.join(dir, 'baton.log');
  batonLogs.push(logFile);
  const server = await startBaton({
    dir, volume, size, store: `s3://${BUCKET}/${prefix}`, create: o.create ?? true, logLevel: 'debug', logFile,
    nodeArgs: PROFILE_DIR ? ['--cpu-prof', '--cpu-prof-dir', path.join(PROFILE_DIR, name)] : [],
    // --idle-grace: the volume stays open between clients (no close + re-open between steps).
    extraArgs: ['--endpoint', rgw.endpoint, '--cache-dir', cacheDir, '--idle-grace', '600', ...(o.extraArgs ?? [])],
    env: { ...rgw.env, ...(o.latencyMs ? { BATON_FAULTS: JSON.stringify({ latencyMs: o.latencyMs }) } : {}) },
  });
  note(step, server.argv);
  return { server, logFile, cacheDir };
}

interface Commit { seq: number; segments: number; inline: number; extents: number; time: number }

/** baton's log: 'takeover record committed' lines (one create-only log PUT when a writer opens the volume). */
function takeoversIn(logFile: string, fromOffset = 0): number {
  return fs.readFileSync(logFile, 'utf8').slice(fromOffset).split('\n').filter((l) => l.includes('"takeover record committed"')).length;
}

/** Epoch ms of the first log line with this message, or NaN. */
function logTime(logFile: string, msg: string): number {
  for (const line of fs.readFileSync(logFile, 'utf8').split('\n')) {
    if (!line.includes(`"${msg}"`)) continue;
    try { return (JSON.parse(line) as { time: number }).time; } catch { /* not JSON */ }
  }
  return NaN;
}

/** baton's debug log: one 'committed' line per commit (engine: src/volume/volume.ts). */
function commitsIn(logFile: string, fromOffset = 0): Commit[] {
  const text = fs.readFileSync(logFile, 'utf8').slice(fromOffset);
  const out: Commit[] = [];
  for (const line of text.split('\n')) {
    if (!line.includes('"committed"')) continue;
    try {
      const j = JSON.parse(line) as { msg?: string } & Commit;
      if (j.msg === 'committed') out.push({ seq: j.seq, segments: j.segments, inline: j.inline, extents: j.extents, time: j.time });
    } catch { /* not JSON */ }
  }
  return out;
}

const fileSize = (f: string): number => { try { return fs.statSync(f).size; } catch { return 0; } };

// ------------------------------------------------------------------ 1. flush latency

interface RoundTrip { n: number; p50: number; p99: number; cpuMsPerPut: number }

const RTT_PUTS = 100;

async function timePuts(put: (i: number) => Promise<void>): Promise<RoundTrip> {
  for (let i = 0; i < 10; i++) await put(-1 - i); // warm: connections, SDK code paths
  const lat: number[] = [];
  const cpu0 = process.cpuUsage();
  for (let i = 0; i < RTT_PUTS; i++) {
    const t = performance.now();
    await put(i);
    lat.push(performance.now() - t);
  }
  const cpu = process.cpuUsage(cpu0);
  return { n: RTT_PUTS, p50: quantile(lat, 0.5), p99: quantile(lat, 0.99), cpuMsPerPut: (cpu.user + cpu.system) / 1000 / RTT_PUTS };
}

/**
 * The store round trip a small commit is made of, measured from this (otherwise idle) Node
 * process: a 4.2 KiB create-only PUT with metadata through baton's own store stack (openStore:
 * S3ObjectStore + retry layer, + FaultyObjectStore with BATON_FAULTS latency), and, as the floor,
 * the same bytes as a bare node:http PUT (no SDK, no signing) into a public-write bucket.
 */
async function storeRoundTrip(latencyMs: number): Promise<{ baton: RoundTrip; rawHttp: RoundTrip | null }> {
  const body = randomBytes(4300);
  const st = openStore(`s3://${BUCKET}/rtt-${latencyMs}ms`, {
    endpoint: rgw.endpoint,
    credentials: { accessKeyId: rgw.env.AWS_ACCESS_KEY_ID!, secretAccessKey: rgw.env.AWS_SECRET_ACCESS_KEY! },
    ...(latencyMs > 0 ? { faults: { latencyMs } } : {}),
  });
  let baton: RoundTrip;
  try {
    baton = await timePuts((i) => st.put(`k${i}`, body, { ifNoneMatch: true, metadata: { 'baton-put-id': randomBytes(8).toString('hex') } }));
  } finally {
    await st.close();
  }
  if (latencyMs > 0) return { baton, rawHttp: null };
  const pub = `${BUCKET}-public`;
  await s3.send(new CreateBucketCommand({ Bucket: pub }));
  await s3.send(new PutBucketAclCommand({ Bucket: pub, ACL: 'public-read-write' }));
  const agent = new http.Agent({ keepAlive: true, maxSockets: 4 });
  try {
    const rawHttp = await timePuts((i) => new Promise<void>((resolve, reject) => {
      const req = http.request(`${rgw.endpoint}/${pub}/k${i}`, { method: 'PUT', agent, headers: { 'content-length': body.length, 'if-none-match': '*' } }, (res) => {
        res.resume();
        res.on('end', () => ((res.statusCode ?? 500) < 300 || i < 0 ? resolve() : reject(new Error(`raw PUT: HTTP ${res.statusCode}`))));
      });
      req.on('error', reject);
      req.end(body);
    }));
    return { baton, rawHttp };
  } finally {
    agent.destroy();
  }
}

interface FlushResult {
  label: string;
  latencyMs: number;
  argv: string[];
  flushes: number;
  writes: number;
  seconds: number;
  syncMs: { p50: number; p90: number; p99: number; p999: number; max: number; mean: number };
  writeMsP50: number;
  commits: number;
  commitsWithSegments: number;
  /** Takeover records written when the volume was opened (a log PUT that is not a commit). */
  takeovers: number;
  store: Window;
  /** PUTs of log records and segments (the commit path, takeover records not counted) per flush. */
  commitPutsPerFlush: number;
  allRequestsPerFlush: number;
  objectsCreated: number;
  objectKinds: Record<string, number>;
  rgwLogPutMs: { p50: number; p99: number; mean: number };
  roundTrip: { baton: RoundTrip; rawHttp: RoundTrip | null } | null;
  fio: Record<string, unknown>;
}

async function flushStep(label: string, latencyMs: number): Promise<FlushResult> {
  const prefix = `flush-${latencyMs}ms`;
  const b = await startBatonRgw('flush', `flush-${latencyMs}`, prefix, 'flush', GiB, { latencyMs });
  try {
    const before = await listPrefix(`${prefix}/`);
    const logOff = fileSize(b.logFile);
    const w = await storeWindow(rgw, async () => {
      const r = await runFio({
        name: `flush-${latencyMs}`, rw: 'randwrite', bs: '4k', iodepth: 1, fsync: 1, runtime: FLUSH_RUNTIME, size: GiB,
        ioengine: 'nbd', uri: b.server.uri,
      }, work);
      // Stopping the server inside the window: a background checkpoint started by the last commits lands before we count.
      await b.server.stop();
      return r;
    });
    const after = await listPrefix(`${prefix}/`);
    const fio = w.value;
    const job = fio.raw as { sync?: { total_ios?: number; lat_ns?: { percentile?: Record<string, number>; max?: number; mean?: number } }; write?: { total_ios?: number }; job_runtime?: number };
    const sp = job.sync?.lat_ns?.percentile ?? {};
    const flushes = job.sync?.total_ios ?? 0;
    const commits = commitsIn(b.logFile, logOff);
    const takeovers = takeoversIn(b.logFile, logOff);
    const commitPuts = count(w.breakdown, 'PUT log') + count(w.breakdown, 'PUT segment') - takeovers;
    const beforeSet = new Set(before.keys);
    const created = after.keys.filter((k) => !beforeSet.has(k));
    const logPutLat = w.requests.filter((r) => classify(r) === 'PUT log').map((r) => r.latencyMs);
    const res: FlushResult = {
      label, latencyMs, argv: fio.argv, flushes, writes: job.write?.total_ios ?? 0, seconds: (job.job_runtime ?? NaN) / 1000,
      syncMs: {
        p50: (sp['50.000000'] ?? NaN) / 1e6, p90: (sp['90.000000'] ?? NaN) / 1e6, p99: (sp['99.000000'] ?? NaN) / 1e6,
        p999: (sp['99.900000'] ?? NaN) / 1e6, max: (job.sync?.lat_ns?.max ?? NaN) / 1e6, mean: (job.sync?.lat_ns?.mean ?? NaN) / 1e6,
      },
      writeMsP50: fio.latUs.p50 / 1000,
      commits: commits.length,
      commitsWithSegments: commits.filter((c) => c.segments > 0).length,
      takeovers,
      store: w,
      commitPutsPerFlush: commitPuts / flushes,
      allRequestsPerFlush: w.counters.req / flushes,
      objectsCreated: created.length,
      objectKinds: kindsOf(created),
      rgwLogPutMs: { p50: quantile(logPutLat, 0.5), p99: quantile(logPutLat, 0.99), mean: logPutLat.reduce((a, x) => a + x, 0) / (logPutLat.length || 1) },
      roundTrip: null,
      fio: fio.raw,
    };
    // After fio and with baton stopped, so the two do not compete for the cores.
    try { res.roundTrip = await storeRoundTrip(latencyMs); } catch (e) { log(`  store round trip: ERROR ${(e as Error).message}`); }
    log(`  ${label}: ${flushes} flushes, flush p50 ${fmt(res.syncMs.p50)} ms p99 ${fmt(res.syncMs.p99)} ms; ${commits.length} commits; ` +
      `store ${w.counters.req} requests (${fmtBreakdown(w.breakdown)}); ${created.length} new objects` +
      (res.roundTrip ? `; bare store PUT p50 ${fmt(res.roundTrip.baton.p50)} ms (${fmt(res.roundTrip.baton.cpuMsPerPut)} ms CPU)` +
        (res.roundTrip.rawHttp ? `, raw http PUT p50 ${fmt(res.roundTrip.rawHttp.p50)} ms (${fmt(res.roundTrip.rawHttp.cpuMsPerPut)} ms CPU)` : '') : ''));
    return res;
  } finally {
    await b.server.stop();
  }
}

// ------------------------------------------------------------------ 2. npm ci / git clone

interface NpmProject { proj: string; repo: string; files: number; packages: number; tarballBytes: number; repoFiles: number; setupSeconds: number }

/** ~NPM_PACKAGES packages of NPM_FILES small files, packed by `npm pack`, a lockfile by npm itself; a git repo of the same sources. */
async function makeNpmProject(base: string): Promise<NpmProject> {
  const t0 = performance.now();
  const src = path.join(base, 'packages');
  const proj = path.join(base, 'proj');
  const vendor = path.join(proj, 'vendor');
  fs.mkdirSync(vendor, { recursive: true });
  let files = 0;
  for (let p = 0; p < NPM_PACKAGES; p++) {
    const d = path.join(src, `pkg${p}`);
    fs.mkdirSync(d, { recursive: true });
    fs.writeFileSync(path.join(d, 'package.json'), JSON.stringify({ name: `bench-pkg-${p}`, version: '1.0.0', main: 'index.js', license: 'MIT' }, null, 2) + '\n');
    fs.writeFileSync(path.join(d, 'index.js'), `module.exports = require('./lib/m0/f0.js');\n`);
    files += 2;
    for (let f = 0; f < NPM_FILES; f++) {
      const sub = path.join(d, 'lib', `m${f % 10}`);
      fs.mkdirSync(sub, { recursive: true });
      // 200 B .. 4 KB of source-like text (base64: compresses a little, like real code).
      const n = 200 + ((p * 131 + f * 37) % 3800);
      fs.writeFileSync(path.join(sub, `f${f}.js`), `// ${randomBytes(Math.ceil(n * 0.75)).toString('base64').slice(0, n)}\nmodule.exports = ${f};\n`);
      files++;
    }
  }
  const pkgDirs = fs.readdirSync(src).map((d) => path.join(src, d));
  const npmEnv = { ...process.env, npm_config_update_notifier: 'false', npm_config_fund: 'false', npm_config_audit: 'false' };
  await runCommand(['npm', 'pack', '--silent', '--pack-destination', vendor, ...pkgDirs], { cwd: vendor, env: npmEnv, timeoutMs: 300_000 });
  const deps: Record<string, string> = {};
  let tarballBytes = 0;
  for (const f of fs.readdirSync(vendor)) {
    const m = /^(bench-pkg-\d+)-1\.0\.0\.tgz$/.exec(f);
    if (m) { deps[m[1]!] = `file:vendor/${f}`; tarballBytes += fs.statSync(path.join(vendor, f)).size; }
  }
  if (Object.keys(deps).length !== NPM_PACKAGES) throw new Error(`npm pack made ${Object.keys(deps).length} tarballs, expected ${NPM_PACKAGES}`);
  fs.writeFileSync(path.join(proj, 'package.json'), JSON.stringify({ name: 'bench-app', version: '1.0.0', private: true, dependencies: deps }, null, 2) + '\n');
  await runCommand(['npm', 'install', '--package-lock-only', ...npmOfflineArgs(path.join(base, 'npm-cache-lock'))], { cwd: proj, env: npmEnv, timeoutMs: 300_000 });

  // A git repository of the package sources, two commits.
  const repo = path.join(base, 'repo');
  fs.cpSync(src, repo, { recursive: true });
  const git = (args: string[]): Promise<CommandResult> => runCommand(['git', '-c', 'user.name=bench', '-c', 'user.email=bench@localhost', '-c', 'init.defaultBranch=main', ...args], { cwd: repo });
  await git(['init', '-q']);
  await git(['add', '-A']);
  await git(['commit', '-q', '-m', 'packages']);
  for (let p = 0; p < NPM_PACKAGES; p += 4) fs.appendFileSync(path.join(repo, `pkg${p}`, 'index.js'), `// change ${p}\n`);
  await git(['commit', '-q', '-a', '-m', 'changes']);
  return { proj, repo, files, packages: NPM_PACKAGES, tarballBytes, repoFiles: files, setupSeconds: since(t0) };
}

function npmOfflineArgs(cache: string): string[] {
  // --registry points at a port nothing listens on: any registry request would fail at once.
  return ['--offline', '--no-audit', '--no-fund', '--no-update-notifier', '--loglevel=error', '--registry=http://127.0.0.1:9/', `--cache=${cache}`];
}

function countFiles(dir: string): number {
  let n = 0;
  for (const e of fs.readdirSync(dir, { withFileTypes: true })) {
    if (e.isDirectory()) n += countFiles(path.join(dir, e.name));
    else if (e.isFile()) n++;
  }
  return n;
}

interface FsRun {
  target: string;
  pass: number;
  setup: Record<string, number>;
  npmCiS: number;
  npmSyncS: number;
  gitCloneS: number;
  gitSyncS: number;
  nodeModulesFiles: number;
  cloneFiles: number;
  argv: { npm: string[]; sync: string[]; git: string[] };
  store?: { npm: Window; git: Window; commitsNpm: number; commitsGit: number };
  error?: string;
}

async function fsWorkload(target: string, pass: number, root: string, project: NpmProject, b: BatonOnRgw | null): Promise<FsRun> {
  const app = path.join(root, 'app');
  fs.cpSync(project.proj, app, { recursive: true });
  await runCommand(['sync', '-f', root]);
  const npmEnv = { ...process.env, npm_config_update_notifier: 'false' };
  const npmArgv = ['npm', 'ci', ...npmOfflineArgs(path.join(work, `npm-cache-${target.replace(/\W+/g, '-')}-${pass}`))];
  const syncArgv = ['sync', '-f', root];
  const gitArgv = ['git', 'clone', '-q', `file://${project.repo}`, path.join(root, 'clone')];
  const run = async (argv: string[], cwd?: string): Promise<number> =>
    (await runCommand(argv, { timeoutMs: 600_000, env: npmEnv, ...(cwd ? { cwd } : {}) })).seconds;
  const measure = async <T>(fn: () => Promise<T>): Promise<{ value: T; w: Window | null; commits: number }> => {
    if (!b) return { value: await fn(), w: null, commits: 0 };
    const off = fileSize(b.logFile);
    const w = await storeWindow(rgw, fn);
    return { value: w.value, w, commits: commitsIn(b.logFile, off).length };
  };
  const npm = await measure(async () => ({ ci: await run(npmArgv, app), sync: await run(syncArgv) }));
  const git = await measure(async () => ({ clone: await run(gitArgv), sync: await run(syncArgv) }));
  const res: FsRun = {
    target, pass, setup: {}, npmCiS: npm.value.ci, npmSyncS: npm.value.sync, gitCloneS: git.value.clone, gitSyncS: git.value.sync,
    nodeModulesFiles: countFiles(path.join(app, 'node_modules')), cloneFiles: countFiles(path.join(root, 'clone')) ,
    argv: { npm: npmArgv, sync: syncArgv, git: gitArgv },
    ...(npm.w && git.w ? { store: { npm: npm.w, git: git.w, commitsNpm: npm.commits, commitsGit: git.commits } } : {}),
  };
  log(`  ${target} (pass ${pass + 1}): npm ci ${res.npmCiS.toFixed(2)} s + sync ${res.npmSyncS.toFixed(2)} s (${res.nodeModulesFiles} files); ` +
    `git clone ${res.gitCloneS.toFixed(2)} s + sync ${res.gitSyncS.toFixed(2)} s` +
    (res.store ? `; store during npm: ${res.store.npm.counters.req} requests, ${res.store.commitsNpm} commits, ${formatSize(res.store.npm.counters.putBytes)} put` : ''));
  return res;
}

async function npmStep(project: NpmProject): Promise<FsRun[]> {
  const out: FsRun[] = [];
  const guard = async (target: string, pass: number, fn: () => Promise<FsRun>): Promise<void> => {
    try { out.push(await fn()); } catch (e) {
      log(`  ${target} (pass ${pass + 1}): ERROR ${(e as Error).message}`);
      out.push({ target, pass, setup: {}, npmCiS: NaN, npmSyncS: NaN, gitCloneS: NaN, gitSyncS: NaN, nodeModulesFiles: 0, cloneFiles: 0, argv: { npm: [], sync: [], git: [] }, error: (e as Error).message });
    }
  };
  const withExt4 = async (target: string, pass: number, uri: string, dir: string, b: BatonOnRgw | null): Promise<FsRun> => {
    let stack: Ext4Stack | null = null;
    try {
      stack = await attachExt4(uri, dir, { mkfs: true });
      const r = await fsWorkload(target, pass, stack.mnt, project, b);
      r.setup = { ...stack.seconds };
      const t = performance.now();
      await stack.teardown();
      r.setup.teardown = since(t);
      return r;
    } finally {
      await stack?.teardown().catch(() => {});
    }
  };
  const targets: Record<string, (pass: number) => Promise<FsRun>> = {
    local: async (pass) => {
      const dir = path.join(work, `local-fs-${pass}`);
      fs.mkdirSync(dir, { recursive: true });
      return fsWorkload('local', pass, dir, project, null);
    },
    nbdkit: async (pass) => {
      const dir = path.join(work, `nbdkit-${pass}`);
      fs.mkdirSync(dir, { recursive: true });
      const k = await startNbdkit({ dir, plugin: ['memory', String(FS_SIZE)] });
      note('npm', k.argv);
      try { return await withExt4('nbdkit', pass, k.uri, dir, null); } finally { await k.stop(); }
    },
    baton: async (pass) => {
      const b = await startBatonRgw('npm', `npm-baton-${pass}`, `npm-${pass}`, 'npm', FS_SIZE);
      try { return await withExt4('baton', pass, b.server.uri, path.join(work, `npm-baton-${pass}`), b); } finally { await b.server.stop(); }
    },
  };

  // Warm-up (not measured): npm's own code into the page cache, so the first target is not penalized.
  {
    const warm = path.join(work, 'npm-warmup');
    fs.cpSync(project.proj, warm, { recursive: true });
    await runCommand(['npm', 'ci', ...npmOfflineArgs(path.join(work, 'npm-cache-warmup'))], { cwd: warm, timeoutMs: 600_000 });
    fs.rmSync(warm, { recursive: true, force: true });
  }
  // Passes alternate the order (baton first, then last), so neither side gets the warmer machine every time.
  const order = ['baton', ...(has('nbdkit') ? ['nbdkit'] : []), 'local'];
  for (let pass = 0; pass < NPM_PASSES; pass++) {
    for (const t of pass % 2 === 0 ? order : [...order].reverse()) await guard(t, pass, () => targets[t]!(pass));
  }
  return out;
}

/** Means over the passes that did not fail (the table), per target. */
function npmMeans(runs: FsRun[], target: string): (FsRun & { passes: number }) | null {
  const ok = runs.filter((r) => r.target === target && !r.error);
  if (ok.length === 0) return null;
  const mean = (f: (r: FsRun) => number): number => ok.reduce((a, r) => a + f(r), 0) / ok.length;
  return {
    ...ok[0]!, passes: ok.length, npmCiS: mean((r) => r.npmCiS), npmSyncS: mean((r) => r.npmSyncS),
    gitCloneS: mean((r) => r.gitCloneS), gitSyncS: mean((r) => r.gitSyncS),
  };
}

// ------------------------------------------------------------------ 3. cold attach

interface ColdB {
  label: string;
  latencyMs: number;
  /** From baton's own log ('listening', 'volume recovered'), s after spawning B. */
  batonListenS: number;
  batonRecoveredS: number;
  listenS: number;
  goS: number;
  firstReadS: number;
  firstReadOk: boolean;
  toFirstRead: Window;
  mountStepS: number;
  mountedS: number;
  toMount: Window;
  mountSetup: Record<string, number>;
  readBack: Window;
  readBackS: number;
  readBackOk: boolean;
  all: Breakdown;
}

interface ColdResult {
  size: number;
  a: { mkfsS: number; writeS: number; files: number; bytes: number; store: Window };
  b: ColdB[];
}

async function coldStep(): Promise<ColdResult> {
  const prefix = 'cold';
  const vol = 'cold';
  // ---- server A: make the filesystem and some files
  const files = new Map<string, string>();
  let aWindow: Window;
  let mkfsS = NaN;
  let writeS = NaN;
  let dataBytes = 0;
  {
    const aDir = path.join(work, 'cold-a');
    const a = await startBatonRgw('cold', 'cold-a', prefix, vol, COLD_SIZE);
    let stack: Ext4Stack | null = null;
    try {
      aWindow = await storeWindow(rgw, async () => {
        stack = await attachExt4(a.server.uri, aDir, { mkfs: true });
        mkfsS = stack.seconds.mkfs ?? NaN;
        const t = performance.now();
        // 8 directories of 25 files, 4 KiB .. 128 KiB of random bytes, plus a copy of this repo's src/.
        for (let d = 0; d < 8; d++) {
          const dir = path.join(stack.mnt, `dir${d}`);
          fs.mkdirSync(dir);
          for (let f = 0; f < 25; f++) {
            const data = randomBytes(4096 * (1 + ((d * 25 + f) * 7) % 32));
            const rel = path.join(`dir${d}`, `file${f}.bin`);
            fs.writeFileSync(path.join(stack.mnt, rel), data);
            files.set(rel, createHash('sha256').update(data).digest('hex'));
            dataBytes += data.length;
          }
        }
        await runCommand(['sync', '-f', stack.mnt]);
        writeS = since(t);
        await stack.teardown();
        await a.server.stop();
        return null;
      });
    } finally {
      await (stack as Ext4Stack | null)?.teardown().catch(() => {});
      await a.server.stop();
    }
  }
  log(`  A: mkfs ${mkfsS.toFixed(2)} s, wrote ${files.size} files (${formatSize(dataBytes)}) + sync ${writeS.toFixed(2)} s; store: ${aWindow.counters.put} PUTs, ${formatSize(aWindow.counters.putBytes)}`);

  // ---- server B (a "new host": own, empty cache dir), once on plain RGW and once with added latency
  const out: ColdB[] = [];
  for (const [label, latencyMs] of [['RGW', 0], [`RGW +${LATENCY_MS} ms`, LATENCY_MS]] as const) {
    if (label !== 'RGW' && LATENCY_MS <= 0) continue;
    const name = `cold-b-${latencyMs}`;
    const bDir = path.join(work, name);
    fs.mkdirSync(bDir, { recursive: true });
    const socket = path.join(bDir, 'baton.sock');
    const c0 = await rgw.counters();
    const mark0 = rgw.logMark();
    const t0 = performance.now();
    const t0Epoch = Date.now();
    let server: Server | null = null;
    let stack: Ext4Stack | null = null;
    try {
      const started = startBatonRgw('cold', name, prefix, vol, COLD_SIZE, { latencyMs, create: false });
      const [b, fr] = await Promise.all([started, nbdReadOnce(socket, vol, 0, 4096)]);
      server = b.server;
      const c1 = await rgw.counters();
      // ext4: the primary superblock is at byte 1024, magic 0xEF53 at offset 56 in it.
      const firstReadOk = fr.data.readUInt16LE(1024 + 56) === 0xef53;
      const tm = performance.now();
      stack = await attachExt4(b.server.uri, bDir, { mkfs: false });
      const mountStepS = since(tm);
      const mountedS = since(t0);
      const c2 = await rgw.counters();
      const tr = performance.now();
      let ok = true;
      for (const [rel, sum] of files) {
        if (createHash('sha256').update(fs.readFileSync(path.join(stack.mnt, rel))).digest('hex') !== sum) ok = false;
      }
      const readBackS = since(tr);
      const c3 = await rgw.counters();
      await stack.teardown();
      await b.server.stop();
      const c4 = await rgw.counters();
      const all = await rgw.requestsSince(mark0, c4.req - c0.req);
      // Split the logged requests at the counter boundaries (the log is in completion order).
      const n1 = c1.req - c0.req;
      const n2 = c2.req - c0.req;
      const n3 = c3.req - c0.req;
      const win = (from: RgwCounters, to: RgwCounters, reqs: RgwRequest[]): Window => ({ counters: diffCounters(to, from), requests: reqs, breakdown: breakdown(reqs) });
      const r: ColdB = {
        label, latencyMs,
        batonListenS: (logTime(b.logFile, 'listening') - t0Epoch) / 1000, batonRecoveredS: (logTime(b.logFile, 'volume recovered') - t0Epoch) / 1000,
        listenS: (fr.connectedAt - t0) / 1000, goS: (fr.goAt - t0) / 1000, firstReadS: (fr.readAt - t0) / 1000, firstReadOk,
        toFirstRead: win(c0, c1, all.slice(0, n1)),
        mountStepS, mountedS, toMount: win(c0, c2, all.slice(0, n2)), mountSetup: { ...stack.seconds },
        readBack: win(c2, c3, all.slice(n2, n3)), readBackS, readBackOk: ok,
        all: breakdown(all),
      };
      out.push(r);
      log(`  B (${label}): listening ${fmt(r.listenS * 1000)} ms, first READ ${fmt(r.firstReadS * 1000)} ms (${formatSize(r.toFirstRead.counters.getBytes)} in ${r.toFirstRead.counters.get} GETs), ` +
        `mounted ${fmt(r.mountedS * 1000)} ms after start (${formatSize(r.toMount.counters.getBytes)} fetched, ${r.toMount.counters.get} GETs, ${r.toMount.counters.req} requests); ` +
        `read back ${files.size} files ${ok ? 'OK' : 'MISMATCH'} in ${r.readBackS.toFixed(2)} s (${formatSize(r.readBack.counters.getBytes)} more)`);
    } finally {
      await (stack as Ext4Stack | null)?.teardown().catch(() => {});
      await (server as Server | null)?.stop();
    }
  }
  return { size: COLD_SIZE, a: { mkfsS, writeS, files: files.size, bytes: dataBytes, store: aWindow! }, b: out };
}

// ------------------------------------------------------------------ 4. PUTs per GiB

interface PutsAttempt {
  label: string;
  extraArgs: string[];
  argv: string[];
  error: string | null;
  /** baton fenced itself because its lease was not renewed in time. */
  leaseLost: boolean;
  seconds: number;
  mibPerSec: number;
  store: Window;
  commits: number;
  objectsCreated: number;
  objectKinds: Record<string, number>;
  putsPerGiB: number;
  objectsPerGiB: number;
  rgwSegPutMs: { p50: number; p99: number };
  /** CPU seconds during the copy: radosgw's daemons, the baton server, nbdcopy. */
  cpu: CpuSplit;
  /** Latency of 4 KiB READs of a never-written block, one every 50 ms on their own connection, during the copy. */
  stallMs: { n: number; p50: number; p99: number; max: number };
  warnings: string[];
}

interface PutsResult { bytes: number; attempts: PutsAttempt[] }

async function putsAttempt(label: string, name: string, src: string, extraArgs: string[]): Promise<PutsAttempt> {
  const prefix = name;
  // 64 MiB past what is copied is never written: the stall probe reads there (a hole: no store, no disk).
  const size = COPY_SIZE + 64 * MiB;
  const bb = await startBatonRgw('puts', name, prefix, 'copy', size, { extraArgs });
  try {
    const before = await listPrefix(`${prefix}/`);
    const off = fileSize(bb.logFile);
    const probe = await startStallProbe(bb.server.socket, 'copy', COPY_SIZE + 32 * MiB);
    let error: string | null = null;
    let argv: string[] = [];
    let seconds = NaN;
    let stall: number[] = [];
    const cpu0 = cpuNow(bb.server);
    let cpu: CpuSplit = { rgw: NaN, baton: NaN, client: NaN };
    const w = await storeWindow(rgw, async () => {
      const t = performance.now();
      try {
        const r = await runNbdcopy(src, bb.server.uri, COPY_SIZE, { flush: true });
        cpu = cpuSince(cpu0, bb.server);
        argv = r.argv;
      } catch (e) {
        error = (e as Error).message;
        argv = (e as { result?: { argv: string[] } }).result?.argv ?? [];
      }
      seconds = since(t);
      stall = await probe.stop();
      await bb.server.stop();
      return null;
    });
    const after = await listPrefix(`${prefix}/`);
    const beforeSet = new Set(before.keys);
    const created = after.keys.filter((k) => !beforeSet.has(k));
    const segLat = w.requests.filter((r) => classify(r) === 'PUT segment').map((r) => r.latencyMs);
    const gib = COPY_SIZE / GiB;
    const logText = fs.readFileSync(bb.logFile, 'utf8').slice(off);
    const warnings = logText.split('\n').filter((l) => /"level":(40|50)/.test(l)).map((l) => {
      try { const j = JSON.parse(l) as { msg: string; reason?: string; err?: string }; return `${j.msg}${j.reason ? `: ${j.reason}` : j.err ? `: ${j.err}` : ''}`; } catch { return l; }
    });
    const res: PutsAttempt = {
      label, extraArgs, argv, error: error === null ? null : String(error).split('\n').slice(0, 2).join(' '),
      leaseLost: /lease lost/.test(logText), seconds, mibPerSec: COPY_SIZE / MiB / seconds, store: w,
      commits: commitsIn(bb.logFile, off).length, objectsCreated: created.length, objectKinds: kindsOf(created),
      putsPerGiB: w.counters.put / gib, objectsPerGiB: created.length / gib,
      rgwSegPutMs: { p50: quantile(segLat, 0.5), p99: quantile(segLat, 0.99) }, cpu,
      stallMs: { n: stall.length, p50: quantile(stall, 0.5), p99: quantile(stall, 0.99), max: stall.length ? Math.max(...stall) : NaN },
      warnings: [...new Set(warnings)],
    };
    if (argv.length) note('puts', argv);
    log(`  ${label}: nbdcopy ${formatSize(COPY_SIZE)} ${error ? `FAILED after ${seconds.toFixed(1)} s (${res.error})` : `${seconds.toFixed(2)} s (${fmt(res.mibPerSec)} MiB/s)`}; ` +
      `${w.counters.put} PUTs (${fmtBreakdown(w.breakdown)}); ${created.length} new objects; ${fmt(res.putsPerGiB)} PUTs/GiB; ` +
      `probe READ p50 ${fmt(res.stallMs.p50)} ms, max ${fmt(res.stallMs.max)} ms${res.warnings.length ? `; baton warned: ${res.warnings.join(' | ')}` : ''}`);
    return res;
  } finally {
    await bb.server.stop();
  }
}

async function putsStep(): Promise<PutsResult> {
  const rnd = makeRandomFile(COPY_SIZE, 'baton-bench-vol-src-');
  try {
    const attempts = [await putsAttempt('defaults', 'copy', rnd.path, [])];
    if (attempts[0]!.error) {
      // What a user gets failed; measure the PUTs anyway with a lease that tolerates longer stalls.
      log('  the copy failed with the default settings; again with --lease-ttl 30 to count the PUTs of a complete copy');
      attempts.push(await putsAttempt('--lease-ttl 30', 'copy-ttl30', rnd.path, ['--lease-ttl', '30']));
    }
    return { bytes: COPY_SIZE, attempts };
  } finally {
    fs.rmSync(path.dirname(rnd.path), { recursive: true, force: true });
  }
}

// ------------------------------------------------------------------ 5. streaming against the store's own bandwidth

/** Concurrency of the store-bandwidth peers: baton's parallel segment uploads per commit (Volume uploadConcurrency). */
const STREAM_CONCURRENCY = 16;
const STREAM_OBJECT = 8 * MiB;

interface StreamResult {
  bytes: number;
  concurrency: number;
  /** 8 MiB create-only PUTs through openStore (baton's own store code), this concurrency. */
  storePutMiBps: number;
  /** 8 MiB ranged GETs of those objects, same store code and concurrency. */
  storeGetMiBps: number;
  /** The `puts` step's nbdcopy --flush into a volume (same radosgw, same run). */
  volumeWriteMiBps: number | null;
  /** nbdcopy URI null: of that volume from a new server with an empty cache. */
  coldRead: { argv: string[]; seconds: number; mibPerSec: number; store: Window; cpu: CpuSplit } | null;
  /** CPU seconds of the store's own PUTs and GETs (client: this bench process, through openStore). */
  storePutCpu: CpuSplit;
  storeGetCpu: CpuSplit;
  error: string | null;
}

/**
 * Where the CPU went during a step, in seconds: radosgw's daemons, the baton server, and the
 * client (nbdcopy, or this process for the store's own requests). On a machine whose cores
 * the store shares with baton and the client, their sum per GiB bounds the bandwidth.
 */
interface CpuSplit { rgw: number; baton: number; client: number }

function cpuNow(server?: Server): CpuSplit {
  return { rgw: rgw.cpuSeconds(), baton: server ? server.cpuSeconds() : 0, client: childrenCpuSeconds() };
}
function cpuSince(c0: CpuSplit, server?: Server): CpuSplit {
  const c = cpuNow(server);
  return { rgw: c.rgw - c0.rgw, baton: c.baton - c0.baton, client: c.client - c0.client };
}

/**
 * What the store itself takes and gives, through the same store code baton uses (openStore:
 * the AWS SDK client, the settings check, retries), measured in this run right before baton
 * reads the `puts` step's volume back cold: the peers of the S3 goals.
 */
async function streamStep(puts: PutsResult | undefined): Promise<StreamResult> {
  const bytes = COPY_SIZE;
  const n = Math.max(1, Math.round(bytes / STREAM_OBJECT));
  const st = openStore(`s3://${BUCKET}/stream-peer`, {
    endpoint: rgw.endpoint,
    credentials: { accessKeyId: rgw.env.AWS_ACCESS_KEY_ID!, secretAccessKey: rgw.env.AWS_SECRET_ACCESS_KEY! },
  });
  const bodies = Array.from({ length: 4 }, () => randomBytes(STREAM_OBJECT));
  const pool = async (fn: (i: number) => Promise<void>): Promise<number> => {
    let next = 0;
    const t = performance.now();
    await Promise.all(Array.from({ length: STREAM_CONCURRENCY }, async () => { while (next < n) await fn(next++); }));
    return since(t);
  };
  let putS: number;
  let getS: number;
  let storePutCpu!: CpuSplit;
  let storeGetCpu!: CpuSplit;
  try {
    await st.put('warm', bodies[0]!.subarray(0, 4096)); // connections and the settings check, not measured
    let r0 = rgw.cpuSeconds(); let c0 = selfCpuSeconds();
    putS = await pool((i) => st.put(`o${i}`, bodies[i % bodies.length]!, { ifNoneMatch: true }));
    storePutCpu = { rgw: rgw.cpuSeconds() - r0, baton: 0, client: selfCpuSeconds() - c0 };
    r0 = rgw.cpuSeconds(); c0 = selfCpuSeconds();
    getS = await pool(async (i) => { await st.get(`o${i}`, { offset: 0, length: STREAM_OBJECT }); });
    storeGetCpu = { rgw: rgw.cpuSeconds() - r0, baton: 0, client: selfCpuSeconds() - c0 };
  } finally {
    await st.close();
  }
  const res: StreamResult = {
    bytes, concurrency: STREAM_CONCURRENCY, storePutMiBps: (n * STREAM_OBJECT) / MiB / putS, storeGetMiBps: (n * STREAM_OBJECT) / MiB / getS,
    volumeWriteMiBps: null, coldRead: null, storePutCpu, storeGetCpu, error: null,
  };
  log(`  store itself (${n} × 8 MiB, ${STREAM_CONCURRENCY} at a time): create-only PUT ${fmt(res.storePutMiBps)} MiB/s, ranged GET ${fmt(res.storeGetMiBps)} MiB/s`);
  const copy = puts?.attempts.find((a) => !a.error);
  if (!copy) { res.error = 'the puts step wrote no volume to read back'; return res; }
  res.volumeWriteMiBps = copy.mibPerSec;
  // A new host: new process, empty cache, the same volume the puts step wrote.
  const prefix = copy.label === 'defaults' ? 'copy' : 'copy-ttl30';
  const b = await startBatonRgw('stream', 'cold-read', prefix, 'copy', COPY_SIZE + 64 * MiB, { create: false });
  try {
    let argv: string[] = [];
    let seconds = NaN;
    const cpu0 = cpuNow(b.server);
    let cpu: CpuSplit = { rgw: NaN, baton: NaN, client: NaN };
    const w = await storeWindow(rgw, async () => {
      const r = await runNbdcopy(b.server.uri, 'null:', COPY_SIZE);
      cpu = cpuSince(cpu0, b.server);
      argv = r.argv;
      seconds = r.seconds;
      return null;
    });
    note('stream', argv);
    // COPY_SIZE over the time of reading all of it plus the 64 MiB hole after it: slightly low, never high.
    res.coldRead = { argv, seconds, mibPerSec: COPY_SIZE / MiB / seconds, store: w, cpu };
    log(`  cold sequential read on a new host: ${seconds.toFixed(2)} s (${fmt(res.coldRead.mibPerSec)} MiB/s), ${w.counters.get} GETs, ${formatSize(w.counters.getBytes)}`);
  } catch (err) {
    // Say why the server let the client down (its warnings and errors), not only that it did.
    const said = fs.readFileSync(b.logFile, 'utf8').split('\n').filter((l) => /"level":(40|50|60)/.test(l)).slice(0, 5);
    throw new Error(`${errorMessage(err)}${said.length > 0 ? `\nthe server logged:\n${said.join('\n')}` : '\n(the server logged no warning or error)'}`);
  } finally {
    await b.server.stop();
  }
  return res;
}

// ------------------------------------------------------------------ goals (issue 11)

function goalRows(r: Report): GoalRow[] {
  const rows: GoalRow[] = [];
  const st = r.stream;
  if (st) {
    rows.push(ratioGoal(`S3 (radosgw): sequential write into a volume (nbdcopy --flush ${formatSize(st.bytes)}) vs 8 MiB create-only PUTs, ${st.concurrency} at a time`,
      st.volumeWriteMiBps ?? undefined, 'store PUT', st.storePutMiBps, 'MiB/s', 0.8));
    rows.push(ratioGoal(`S3 (radosgw): cold sequential read on a new host vs 8 MiB ranged GETs, ${st.concurrency} at a time`,
      st.coldRead?.mibPerSec, 'store GET', st.storeGetMiBps, 'MiB/s', 0.8));
  }
  const slow = r.flush?.find((f) => f.latencyMs > 0);
  if (slow) {
    rows.push(limitGoal(`FLUSH latency p50 with +${slow.latencyMs} ms per store request (radosgw)`, slow.syncMs.p50, 'ms', '≤', 22));
    rows.push(limitGoal(`FLUSH latency p99 with +${slow.latencyMs} ms per store request (radosgw)`, slow.syncMs.p99, 'ms', '≤', 45));
    rows.push(limitGoal('store PUTs on the commit path of a small flush', slow.commitPutsPerFlush, 'PUTs', '≤', 1));
  }
  const probe = r.puts?.attempts[0];
  if (probe) {
    rows.push(limitGoal(`no stalls: 4 KiB READ every 50 ms during nbdcopy --flush ${formatSize(r.puts!.bytes)} into radosgw, p99`, probe.stallMs.p99, 'ms', '≤', 20));
    rows.push(limitGoal('no stalls: the same READs, max', probe.stallMs.max, 'ms', '≤', 100));
  }
  if (r.npm) {
    const b = npmMeans(r.npm, 'baton');
    const k = npmMeans(r.npm, 'nbdkit');
    rows.push(slowdownGoal('`npm ci` + sync on ext4 over baton+radosgw vs nbdkit memory (same path)', b ? b.npmCiS + b.npmSyncS : undefined, 'nbdkit memory', k ? k.npmCiS + k.npmSyncS : undefined, 1.2));
    rows.push(slowdownGoal('`git clone` + sync on ext4 over baton+radosgw vs nbdkit memory', b ? b.gitCloneS + b.gitSyncS : undefined, 'nbdkit memory', k ? k.gitCloneS + k.gitSyncS : undefined, 1.2));
  }
  return rows;
}

// ------------------------------------------------------------------ report

const ok = (cond: boolean | null): string => (cond === null ? '?' : cond ? '✓' : '✗');
const ms = (s: number): string => fmt(s * 1000);

interface Report {
  machine: ReturnType<typeof machineInfo>;
  loadavgAtEnd: number[];
  durationS: number;
  rgwStartS: number;
  knobs: Record<string, unknown>;
  flush?: FlushResult[] | undefined;
  npmProject?: NpmProject;
  npm?: FsRun[] | undefined;
  cold?: ColdResult | undefined;
  puts?: PutsResult | undefined;
  stream?: StreamResult | undefined;
  goals?: GoalRow[];
  errors: { step: string; error: string }[];
  commands: { step: string; argv: string[] }[];
  tools: Record<string, string | null>;
}

function render(r: Report): string {
  const m = r.machine;
  const L: string[] = [];
  L.push('# baton volume on a real S3 server (Ceph radosgw, loopback)\n');
  L.push(`${m.date.slice(0, 16).replace('T', ' ')} UTC on \`${m.hostname}\`: ${m.nproc} cores (${m.cpuModel}), ${m.memTotalGiB} GiB RAM, ${m.kernel}; ` +
    `**load average ${m.loadavgAtStart.join(' ')} at start, ${r.loadavgAtEnd.join(' ')} at end** (shared machine: compare ratios within this run).`);
  L.push(`node ${m.node}; ${m.fio ?? 'fio ?'}; ${m.nbdkit ?? 'nbdkit ?'}; ${m.nbdcopy ?? 'nbdcopy ?'}; ${r.tools.radosgw ?? 'radosgw ?'}; npm ${r.tools.npm ?? '?'}; ${r.tools.git ?? ''}; baton ${m.batonCommit ?? '?'} (working tree as built).`);
  L.push(`radosgw: scripts/rgw.sh (one memstore OSD, all in RAM, started in ${r.rgwStartS.toFixed(1)} s). Whole run ${r.durationS.toFixed(0)} s. ` +
    `Knobs: ${Object.entries(r.knobs).map(([k, v]) => `${k}=${String(v)}`).join(', ')}.\n`);
  L.push('Store requests are counted by radosgw itself (`perf dump` counters over its admin socket; the access log for the');
  L.push('breakdown by key kind: `log` = commit records, `segment` = 8 MiB data segments, `checkpoint` = extent-map');
  L.push('snapshots, `volume record` = volumes/NAME, `LIST` = ListObjectsV2); objects created from listing the prefix before and after.\n');
  if (r.goals?.length) {
    L.push('## Goals (issue 11), this run\n');
    L.push(goalsTable(r.goals));
    if (r.stream) {
      const st = r.stream;
      const copy = r.puts?.attempts.find((a) => !a.error);
      const gib = st.bytes / GiB;
      const cores = os.cpus().length;
      const cpuRow = (what: string, c: CpuSplit | undefined, client: string): string[] => {
        if (!c) return [what, '', '', '', '', ''];
        const total = c.rgw + c.baton + c.client;
        return [what, fmt(c.rgw / gib), c.baton ? fmt(c.baton / gib) : '–', `${fmt(c.client / gib)} (${client})`, fmt(total / gib), fmt((cores * 1024) / (total / gib))];
      };
      L.push(`Where the CPU went (seconds per GiB; all of it shares this machine's ${cores} cores, so the last column is the most any step could reach if the CPU were the only limit):\n`);
      L.push(markdownTable(['step', 'radosgw', 'baton', 'client', 'total', `CPU-bound ceiling, MiB/s`], [
        cpuRow('store PUTs (8 MiB, 16 at a time)', st.storePutCpu, 'store code'),
        cpuRow('volume write (nbdcopy --flush)', copy?.cpu, 'nbdcopy'),
        cpuRow('store ranged GETs (8 MiB, 16 at a time)', st.storeGetCpu, 'store code'),
        cpuRow('cold sequential read (nbdcopy → null:)', st.coldRead?.cpu, 'nbdcopy'),
      ]));
      L.push('');
      L.push(`The store's own bandwidth is measured through baton's store code (openStore: AWS SDK, settings check, retries): ${Math.round(r.stream.bytes / STREAM_OBJECT)} objects of 8 MiB, ${r.stream.concurrency} requests at a time (baton's parallel segment uploads per commit), create-only PUTs, then ranged GETs of them. The volume write is the \`puts\` step's copy; the cold read is \`nbdcopy URI null:\` of that volume from a new \`baton serve\` with an empty cache (its time includes the 64 MiB hole after the copied data).\n`);
    }
  }

  // ---- summary against the goals
  const sum: string[][] = [];
  const f20 = r.flush?.find((x) => x.latencyMs === LATENCY_MS && LATENCY_MS > 0);
  if (f20) {
    sum.push([`FLUSH p50 with +${LATENCY_MS} ms per store request`, `${fmt(f20.syncMs.p50)} ms`, '≤ 25 ms', ok(f20.syncMs.p50 <= 25)]);
    sum.push([`FLUSH p99 with +${LATENCY_MS} ms per store request`, `${fmt(f20.syncMs.p99)} ms`, '≤ 60 ms', ok(f20.syncMs.p99 <= 60)]);
  }
  for (const f of r.flush ?? []) {
    sum.push([`store requests on the commit path per small flush (${f.label})`, fmt(f.commitPutsPerFlush), '1', ok(Math.abs(f.commitPutsPerFlush - 1) < 0.02 && f.commitsWithSegments === 0)]);
  }
  const npmB = r.npm ? npmMeans(r.npm, 'baton') : null;
  const npmK = r.npm ? npmMeans(r.npm, 'nbdkit') : null;
  const npmL = r.npm ? npmMeans(r.npm, 'local') : null;
  if (npmB) {
    const tb = npmB.npmCiS + npmB.npmSyncS;
    if (npmK) { const q = ratio(tb, npmK.npmCiS + npmK.npmSyncS); sum.push(['npm ci + sync, baton+RGW ÷ nbdkit memory', fmtRatio(q), '≤ 1.2×', ok(Number.isFinite(q) ? q <= 1.2 : null)]); }
    if (npmL) { const q = ratio(tb, npmL.npmCiS + npmL.npmSyncS); sum.push(['npm ci + sync, baton+RGW ÷ local disk', fmtRatio(q), '≤ 1.5×', ok(Number.isFinite(q) ? q <= 1.5 : null)]); }
  }
  for (const b of r.cold?.b ?? []) {
    sum.push([`fetched from the store to mount a ${formatSize(r.cold!.size)} ext4, new host (${b.label})`, formatSize(b.toMount.counters.getBytes), '≤ 16 MiB', ok(b.toMount.counters.getBytes <= 16 * MiB)]);
  }
  for (const a of r.puts?.attempts ?? []) {
    const lbl = `PUTs per GiB written (nbdcopy --flush ${formatSize(r.puts!.bytes)}, ${a.label})`;
    if (a.error) sum.push([lbl, `copy failed${a.leaseLost ? ' (lease lost)' : ''}: ${fmt(a.store.counters.put)} PUTs until then`, '≤ 300', '✗']);
    else sum.push([lbl, fmt(a.putsPerGiB), '≤ 300', ok(a.putsPerGiB <= 300)]);
  }
  L.push('## Goals\n');
  L.push(markdownTable(['measure', 'this run', 'goal', ''], sum, ['l', 'r', 'l', 'l']));

  // ---- 1. flush
  if (r.flush?.length) {
    L.push('## 1. FLUSH latency and store requests per flush\n');
    L.push(`fio's nbd engine, 4 KiB random writes at QD1, a FLUSH after every write (\`--fsync=1\`), ${FLUSH_RUNTIME} s, on a fresh 1 GiB volume;`);
    L.push('latency is fio\'s `sync` latency (the FLUSH command alone). "+N ms": `BATON_FAULTS={"latencyMs":N}` in baton, N ms added');
    L.push('to every store request before it is sent. radosgw PUT latency is its own (access log; its clock has ~4 ms granularity).');
    L.push(`"Bare store PUT": after fio, ${RTT_PUTS} sequential 4.2 KiB create-only PUTs from the harness process through baton's own store stack`);
    L.push('(`openStore`: S3ObjectStore, its PUTs signed by baton and sent with node:http, + retry layer, + the fault layer), and the same body as a plain `node:http` PUT (keep-alive,');
    L.push('unsigned, into a public-write bucket): the floor a Node client can reach against this radosgw. Measured minutes apart from');
    L.push('the flushes on a noisy machine, so compare them with care; the CPU per PUT is the steadier number.\n');
    const cols = r.flush;
    const rows: [string, (f: FlushResult) => string][] = [
      ['write+flush pairs', (f) => `${f.flushes} in ${fmt(f.seconds)} s`],
      ['FLUSH latency p50, ms', (f) => fmt(f.syncMs.p50)],
      ['FLUSH latency p90, ms', (f) => fmt(f.syncMs.p90)],
      ['FLUSH latency p99, ms', (f) => fmt(f.syncMs.p99)],
      ['FLUSH latency p99.9 / max, ms', (f) => `${fmt(f.syncMs.p999)} / ${fmt(f.syncMs.max)}`],
      ['4 KiB WRITE latency p50, ms (buffered in memory)', (f) => fmt(f.writeMsP50)],
      ['radosgw PUT (log record) latency p50 / p99, ms (radosgw\'s own)', (f) => `${fmt(f.rgwLogPutMs.p50)} / ${fmt(f.rgwLogPutMs.p99)}`],
      [`bare 4 KiB store PUT through baton\'s store stack, p50 / p99, ms`, (f) => (f.roundTrip ? `${fmt(f.roundTrip.baton.p50)} / ${fmt(f.roundTrip.baton.p99)}` : '–')],
      ['… client CPU per PUT, ms', (f) => (f.roundTrip ? fmt(f.roundTrip.baton.cpuMsPerPut) : '–')],
      ['bare 4 KiB PUT with node:http (no SDK, unsigned), p50 / p99 / CPU, ms', (f) => (f.roundTrip?.rawHttp ? `${fmt(f.roundTrip.rawHttp.p50)} / ${fmt(f.roundTrip.rawHttp.p99)} / ${fmt(f.roundTrip.rawHttp.cpuMsPerPut)}` : '–')],
      ['commits (baton log) per flush', (f) => fmt(f.commits / f.flushes)],
      ['commits that uploaded a segment first', (f) => String(f.commitsWithSegments)],
      ['commit-path PUTs (log + segment) per flush', (f) => `${fmt(f.commitPutsPerFlush)} (not counting ${f.takeovers} takeover record${f.takeovers === 1 ? '' : 's'} at open)`],
      ['all store requests per flush (incl. checkpoints, connect)', (f) => fmt(f.allRequestsPerFlush)],
      ['store requests, by kind', (f) => fmtBreakdown(f.store.breakdown)],
      ['objects created (listing), by kind', (f) => `${f.objectsCreated}: ${Object.entries(f.objectKinds).map(([k, v]) => `${k} ${v}`).join(', ')}`],
      ['bytes PUT per flush', (f) => formatSize(f.store.counters.putBytes / f.flushes)],
    ];
    L.push(markdownTable(['', ...cols.map((f) => `baton on ${f.label}`)], rows.map(([label, g]) => [label, ...cols.map(g)]), ['l', ...cols.map(() => 'r' as const)]));
  }

  // ---- 2. npm
  if (r.npm?.length && r.npmProject) {
    const p = r.npmProject;
    L.push('## 2. npm ci and git clone on ext4\n');
    L.push(`An offline npm project: ${p.packages} local tarball dependencies (\`file:vendor/*.tgz\`, made by \`npm pack\`, ${formatSize(p.tarballBytes)}), ` +
      `${p.files} small files in all (200 B – 4 KB), lockfile written by npm; \`npm ci --offline\` with an unreachable registry and a fresh cache on local disk.`);
    L.push(`\`git clone file://\` of a local repository of the same ${p.repoFiles} files (2 commits). Each followed by \`sync -f\` (syncfs) of the target filesystem.`);
    L.push(`baton+RGW and nbdkit: ext4 (\`mkfs.ext4 -q -F\`, ${formatSize(FS_SIZE)}) on nbdfuse + loop, the same path for both; local: a directory in ${m.tmpdir} (${m.tmpdirFs ?? '?'}).`);
    L.push(`Every target fresh (new volume / nbdkit / directory) in each of ${NPM_PASSES} passes, the order alternating (baton first, then last), after one unmeasured \`npm ci\` to warm the page cache; the table shows the mean over the passes, the last rows every pass.\n`);
    const tg = ['baton', 'nbdkit', 'local'].map((t) => npmMeans(r.npm!, t)).filter((x): x is FsRun & { passes: number } => !!x);
    const name = (t: string): string => (t === 'baton' ? 'baton + RGW' : t === 'nbdkit' ? 'nbdkit memory' : 'local disk');
    const val = (f: (x: FsRun) => number): string[] => {
      const v = tg.map(f);
      const b = npmB ? f(npmB) : NaN;
      return [...v.map((x) => fmt(x)), fmtRatio(ratio(b, npmK ? f(npmK) : NaN)), fmtRatio(ratio(b, npmL ? f(npmL) : NaN))];
    };
    const rows = [
      ['npm ci, s', ...val((x) => x.npmCiS)],
      ['sync after npm ci, s', ...val((x) => x.npmSyncS)],
      ['**npm ci + sync, s**', ...val((x) => x.npmCiS + x.npmSyncS)],
      ['git clone, s', ...val((x) => x.gitCloneS)],
      ['sync after git clone, s', ...val((x) => x.gitSyncS)],
      ['**git clone + sync, s**', ...val((x) => x.gitCloneS + x.gitSyncS)],
      ['files in node_modules / in the clone', ...tg.map((x) => `${x.nodeModulesFiles} / ${x.cloneFiles}`), '', ''],
      ['npm ci + sync per pass, s', ...tg.map((x) => r.npm!.filter((y) => y.target === x.target).map((y) => fmt(y.npmCiS + y.npmSyncS)).join(', ')), '', ''],
      ['git clone + sync per pass, s', ...tg.map((x) => r.npm!.filter((y) => y.target === x.target).map((y) => fmt(y.gitCloneS + y.gitSyncS)).join(', ')), '', ''],
    ];
    L.push(markdownTable(['', ...tg.map((x) => name(x.target)), 'baton ÷ nbdkit', 'baton ÷ local'], rows, ['l', ...tg.map(() => 'r' as const), 'r', 'r']));
    if (npmB?.store) {
      const s = npmB.store;
      L.push(`Store traffic of baton meanwhile (pass ${npmB.pass + 1}): npm ci + sync ${s.npm.counters.req} requests (${fmtBreakdown(s.npm.breakdown)}), ${s.commitsNpm} commits, ${formatSize(s.npm.counters.putBytes)} PUT; ` +
        `git clone + sync ${s.git.counters.req} requests (${fmtBreakdown(s.git.breakdown)}), ${s.commitsGit} commits, ${formatSize(s.git.counters.putBytes)} PUT.`);
      L.push(`Setup (not timed above): ${tg.filter((x) => x.setup.mkfs !== undefined).map((x) => `${name(x.target)} mkfs ${fmt(x.setup.mkfs)} s, mount ${fmt(x.setup.mount)} s, umount+detach ${fmt(x.setup.teardown)} s`).join('; ')}.\n`);
    }
    for (const x of r.npm.filter((y) => y.error)) L.push(`**${name(x.target)} failed (pass ${x.pass + 1})**: ${x.error!.split('\n')[0]}\n`);
  }

  // ---- 3. cold
  if (r.cold) {
    const c = r.cold;
    L.push('## 3. Cold attach on a new host\n');
    L.push(`Server A: a ${formatSize(c.size)} volume, \`mkfs.ext4\` (${fmt(c.a.mkfsS)} s), mount, ${c.a.files} files (${formatSize(c.a.bytes)} of random data in 8 directories) + \`sync -f\` ` +
      `(${fmt(c.a.writeS)} s), umount, A stopped (${c.a.store.counters.put} PUTs, ${formatSize(c.a.store.counters.putBytes)} in all, ${fmtBreakdown(c.a.store.breakdown)}).`);
    L.push('Server B: a new process with a new, empty `--cache-dir`; timed from spawning it. First READ: a minimal NBD client connects');
    L.push('(retrying every 5 ms until B listens), OPT_GO, READ 4 KiB at offset 0 (checked: it holds the ext4 superblock magic).');
    L.push('Then nbdfuse + losetup + `mount` (rw) of the ext4, then every file read back and its SHA-256 checked. Bytes fetched = radosgw\'s');
    L.push('`get_b` counter (object GET bodies); requests = every request radosgw answered, from B\'s start.\n');
    const rows: [string, (b: ColdB) => string][] = [
      ['B listening (store probe done), ms after start: baton\'s log / client connected', (b) => `${ms(b.batonListenS)} / ${ms(b.listenS)}`],
      ['volume recovered (baton\'s log), ms after start', (b) => ms(b.batonRecoveredS)],
      ['handshake done (volume opened: record, checkpoint, log replay), ms', (b) => ms(b.goS)],
      ['**first 4 KiB READ answered, ms after start**', (b) => `${ms(b.firstReadS)}${b.firstReadOk ? '' : ' (wrong data!)'}`],
      ['store requests / GETs / bytes fetched until then', (b) => `${b.toFirstRead.counters.req} / ${b.toFirstRead.counters.get} / ${formatSize(b.toFirstRead.counters.getBytes)}`],
      ['nbdfuse + losetup + mount, s', (b) => `${fmt(b.mountStepS)} (nbdfuse ${fmt(b.mountSetup.nbdfuse)}, losetup ${fmt(b.mountSetup.losetup)}, mount ${fmt(b.mountSetup.mount)})`],
      ['**ext4 mounted, s after start**', (b) => fmt(b.mountedS)],
      ['**bytes fetched from the store, start → mounted**', (b) => formatSize(b.toMount.counters.getBytes)],
      ['store requests, start → mounted', (b) => `${b.toMount.counters.req}: ${fmtBreakdown(b.toMount.breakdown)}`],
      [`read back all ${c.a.files} files (${formatSize(c.a.bytes)}), s`, (b) => `${fmt(b.readBackS)} ${b.readBackOk ? '(checksums OK)' : '(MISMATCH)'}`],
      ['bytes fetched for that', (b) => `${formatSize(b.readBack.counters.getBytes)} in ${b.readBack.counters.get} GETs`],
    ];
    L.push(markdownTable(['', ...c.b.map((b) => `server B on ${b.label}`)], rows.map(([label, g]) => [label, ...c.b.map(g)]), ['l', ...c.b.map(() => 'r' as const)]));
  }

  // ---- 4. puts
  if (r.puts) {
    const p = r.puts;
    const at = p.attempts;
    L.push('## 4. PUTs per GiB written\n');
    L.push(`\`nbdcopy --flush\` of ${formatSize(p.bytes)} of random bytes (from /dev/shm) into a fresh volume on RGW (64 MiB larger than the copy); counted until`);
    L.push('the server has stopped (so background checkpoints are included). Meanwhile a probe client READs 4 KiB of the never-written');
    L.push('tail every 50 ms on its own connection: a hole, so no store or disk access; its latency is how long baton leaves a trivial');
    L.push('request waiting while it works (its event-loop stalls). If the copy fails with the defaults, it is repeated with a longer lease TTL.\n');
    const rows: [string, (a: PutsAttempt) => string][] = [
      ['result', (a) => (a.error ? `**FAILED** after ${fmt(a.seconds)} s: ${a.error}` : 'complete')],
      ['time, s (MiB/s)', (a) => (a.error ? `${fmt(a.seconds)} (failed)` : `${fmt(a.seconds)} (${fmt(a.mibPerSec)})`)],
      ['PUTs (radosgw counter)', (a) => `${a.store.counters.put} (${formatSize(a.store.counters.putBytes)})`],
      ['… by kind (all requests)', (a) => fmtBreakdown(a.store.breakdown)],
      ['commits (baton log)', (a) => String(a.commits)],
      ['**PUTs per GiB**', (a) => (a.error ? '–' : fmt(a.putsPerGiB))],
      ['objects created (listing) per GiB', (a) => `${fmt(a.objectsPerGiB)} (${Object.entries(a.objectKinds).map(([k, v]) => `${k} ${v}`).join(', ')})`],
      ['radosgw segment PUT latency p50 / p99, ms', (a) => `${fmt(a.rgwSegPutMs.p50)} / ${fmt(a.rgwSegPutMs.p99)}`],
      ['probe 4 KiB READ latency p50 / p99 / max, ms', (a) => `${fmt(a.stallMs.p50)} / ${fmt(a.stallMs.p99)} / ${fmt(a.stallMs.max)} (${a.stallMs.n} READs)`],
      ['baton warnings and errors', (a) => (a.warnings.length ? a.warnings.join('; ') : 'none')],
    ];
    L.push(markdownTable(['', ...at.map((a) => `baton on RGW, ${a.label}`)], rows.map(([label, g]) => [label, ...at.map(g)]), ['l', ...at.map(() => 'r' as const)]));
  }

  if (r.errors.length) L.push('## Errors\n\n' + r.errors.map((e) => `- ${e.step}: ${e.error.split('\n')[0]}`).join('\n') + '\n');

  // ---- commands
  const redact = (argv: string[]): string => {
    let t = shellQuote(argv).split(work).join('$TMP').split(process.execPath).join('node');
    t = t.replace(/[^ ]*\/dist\/cli\/bin\.cjs/, 'dist/cli/bin.cjs').replace(/\$TMP\/fio-[^ ]+\.json/g, '$TMP/fio.json')
      .replace(/\/dev\/shm\/baton-bench-vol-src-[^ ]+\/random\.bin/g, '$SRC').replace(/'([^']*)'/g, '"$1"');
    return t;
  };
  L.push('## Commands\n');
  L.push('$TMP = the run\'s private temp dir; baton gets the radosgw credentials as AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (rgw.sh\'s env file),');
  L.push('and `BATON_FAULTS={"latencyMs":N}` for the "+N ms" servers. ext4 targets: `nbdfuse $DIR/fuse URI` (own session), `losetup -f --show $DIR/fuse/nbd`,');
  L.push('`mkfs.ext4 -q -F /dev/loopN` (not on server B), `mount -t ext4 /dev/loopN $DIR/mnt`; torn down in reverse.\n');
  L.push('```sh');
  L.push(`scripts/rgw.sh start $TMP/rgw    # then a bucket "${BUCKET}" (AWS SDK CreateBucket)`);
  const seen = new Set<string>();
  for (const c of r.commands) {
    const line = redact(c.argv);
    if (seen.has(line)) continue;
    seen.add(line);
    L.push(`# ${c.step}\n${line}`);
  }
  for (const f of r.flush ?? []) L.push(`# flush (${f.label})\n${redact(f.argv)}`);
  const fb = npmB ?? npmL;
  if (fb && fb.argv.npm.length) {
    L.push(`# npm (in $MNT/app; $MNT = the ext4 mount or the local dir)\n${redact(fb.argv.npm).replace(/\$TMP\/npm-cache-\w+/, '$TMP/npm-cache-TARGET')} && sync -f $MNT`);
    L.push(`git clone -q file://$TMP/npm-src/repo $MNT/clone && sync -f $MNT`);
  }
  L.push('```\n');
  return L.join('\n') + '\n';
}

// ------------------------------------------------------------------ main

async function main(): Promise<void> {
  const t0 = performance.now();
  const need = ['fio', 'nbdcopy', 'nbdfuse', 'fusermount3', 'losetup', 'mkfs.ext4', 'mount', 'umount', 'npm', 'git', 'radosgw', 'radosgw-admin', 'ceph-mon', 'ceph-osd'];
  const missing = need.filter((t) => !has(t));
  if (missing.length) throw new Error(`missing tools: ${missing.join(', ')} (scripts/install-deps.sh; libnbd-bin, fuse3, fio, nbdkit, radosgw)`);
  if (process.getuid?.() !== 0) throw new Error('bench/volume needs root (losetup, mount)');

  const machine = machineInfo();
  work = makeTempDir('baton-bench-vol-');
  log(`volume bench: ${machine.nproc} cores, load ${machine.loadavgAtStart.join(' ')}, temp dir ${work}`);
  const report: Report = {
    machine, loadavgAtEnd: [], durationS: NaN, rgwStartS: NaN,
    knobs: { STEPS: [...STEPS].join(','), FLUSH_RUNTIME, LATENCY_MS, FS_SIZE: formatSize(FS_SIZE), COLD_SIZE: formatSize(COLD_SIZE), COPY_SIZE: formatSize(COPY_SIZE), NPM_PACKAGES, NPM_FILES, NPM_PASSES },
    errors: [], commands, tools: {
      radosgw: (await runCommand(['radosgw', '--version']).catch(() => null))?.stdout.trim().split('\n')[0]?.replace(/\s*\([0-9a-f]{40}\)/, '') ?? null,
      npm: (await runCommand(['npm', '--version']).catch(() => null))?.stdout.trim() ?? null,
      git: (await runCommand(['git', '--version']).catch(() => null))?.stdout.trim() ?? null,
    },
  };

  // The npm project is made first (it needs no server), in parallel with radosgw starting.
  log('radosgw: starting');
  const rgwP = startRgw(path.join(work, 'rgw'));
  const projectP = STEPS.has('npm') ? makeNpmProject(path.join(work, 'npm-src')) : Promise.resolve(null);
  projectP.catch(() => {});
  rgw = await rgwP;
  // Not while measuring: npm pack / npm install would take CPU from the flush step.
  let project: NpmProject | null = null;
  let projectError: Error | null = null;
  try { project = await projectP; } catch (e) { projectError = e as Error; }
  report.rgwStartS = rgw.startSeconds;
  s3 = new S3Client({
    endpoint: rgw.endpoint, region: rgw.env.AWS_REGION ?? 'us-east-1', forcePathStyle: true,
    credentials: { accessKeyId: rgw.env.AWS_ACCESS_KEY_ID!, secretAccessKey: rgw.env.AWS_SECRET_ACCESS_KEY! },
  });
  try {
    await s3.send(new CreateBucketCommand({ Bucket: BUCKET }));
    log(`radosgw: ${rgw.endpoint} up in ${rgw.startSeconds.toFixed(1)} s, bucket ${BUCKET}`);

    const step = async <T>(name: string, fn: () => Promise<T>): Promise<T | undefined> => {
      if (!STEPS.has(name)) return undefined;
      log(`${name}:`);
      const t = performance.now();
      try {
        return await fn();
      } catch (e) {
        log(`  ${name}: ERROR ${(e as Error).stack ?? String(e)}`);
        report.errors.push({ step: name, error: (e as Error).message });
        return undefined;
      } finally {
        log(`  (${name}: ${since(t).toFixed(0)} s)`);
      }
    };

    report.flush = await step('flush', async () => {
      const out: FlushResult[] = [];
      out.push(await flushStep('RGW', 0));
      if (LATENCY_MS > 0) out.push(await flushStep(`RGW +${LATENCY_MS} ms`, LATENCY_MS));
      return out;
    });
    report.npm = await step('npm', async () => {
      if (!project) throw projectError ?? new Error('no npm project');
      report.npmProject = project;
      log(`  project: ${project.packages} packages, ${project.files} files, ${formatSize(project.tarballBytes)} of tarballs (made in ${project.setupSeconds.toFixed(1)} s)`);
      return npmStep(project);
    });
    report.cold = await step('cold', coldStep);
    report.puts = await step('puts', putsStep);
    report.stream = await step('stream', () => streamStep(report.puts));
  } finally {
    s3.destroy();
    await rgw.stop();
  }
  report.loadavgAtEnd = os.loadavg().map((x) => Math.round(x * 100) / 100);
  report.durationS = since(t0);
  report.goals = goalRows(report);
  const md = render(report);
  // The per-request lists are only needed for the breakdowns; the JSON keeps those, not every request
  keepLogs();
  // (short lists, like the cold attach's, are kept: they show every request)
  const json: unknown = JSON.parse(JSON.stringify(report, (k, v: unknown) => (k === 'requests' && Array.isArray(v) && v.length > 200 ? undefined : v)));
  const files = writeResults('volume', md, json);
  process.stdout.write(md);
  log(`results: ${files.md}, ${files.json} (${report.durationS.toFixed(0)} s)`);
  // Explicitly: idle keep-alive sockets of the S3 clients would otherwise hold the process for a minute.
  process.exit(report.errors.length ? 1 : 0);
}

main().catch((e: unknown) => {
  process.stderr.write(`volume: ${(e as Error).stack ?? String(e)}\n`);
  process.exit(1);
});

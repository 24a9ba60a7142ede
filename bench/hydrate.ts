/**
 * Issue 13: a new host resumes at warm speed. The seed's day: a workspace (a `git clone` of the
 * seed repository and an `npm ci --offline` of PACKAGES packages, about 10,000 files) on ext4
 * over baton (nbdfuse + loop); the host is lost; a new host with an empty cache serves the
 * volume, and the agent's next step reads its whole install.
 *
 * Per store (`file:` with LATENCY_MS added to every store request through BATON_FAULTS, which
 * also hides the local store's in-place reads so the read cache is used as for S3; and a
 * radosgw on loopback, scripts/rgw.sh, as it is):
 *
 *   build   `baton serve` (host A, --idle-grace 0.5); create the volume; mkfs.ext4, mount,
 *           clone, npm ci, sync; unmount and detach (A closes the volume: a checkpoint with its
 *           working set, and the lease is free).
 *   rounds  ROUNDS times, the three B modes in a rotating order, each right after a measurement
 *           on A: "A warm": attach (a new nbdfuse + loop + mount: no kernel cache; A's read cache
 *           holds what it wrote), `find node_modules -type f -exec cat {} +` + `git status` (the
 *           measurement), detach, A closes the volume. "B": a new `baton serve --hydrate MODE`
 *           with an empty cache: one NBD READ of 4 KiB at offset 0 (connect + handshake, which
 *           opens the volume, then the READ: cold attach and first read), then attach + mount and
 *           the measurement (with `all`: once hydration is done; with `working-set`: at once,
 *           while it runs); detach; SIGKILL B (its lease file frees at once). Each B is compared
 *           with the mean of the A measurements just before and after it (the machine is shared
 *           and its load moves: pairs are fairer than one reference).
 *   crash   SIGKILL A (the host is lost, with nothing closed); then B with `working-set` and B
 *           with `all` once more: the working set now comes from A's last checkpoint and the log
 *           after it. Compared with the median of the A measurements.
 *
 * Every baton process: --lease-ttl 60, its own --cache-dir, the same BATON_HOME (lease files);
 * B: --idle-grace 120 (the volume stays open between the probe READ and the mount).
 * Needs root (losetup, mount), nbdfuse, fusermount3, e2fsprogs, git, npm; radosgw optional.
 * Knobs: SIZE (1G), PACKAGES (340), FILES (28 per package), LATENCY_MS (20), ROUNDS (3), FILE (1; 0 skips
 * the file: store), RGW (1; 0 skips radosgw), SEED (1).
 * Results: bench/results/hydrate.md and .json (with goal rows).
 */

import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { spawnSync } from 'node:child_process';
import { formatSize } from '../src/size.js';
import { GIT, git, makeManyPackagesProject, makeSourceRepo, npmEnv } from '../test/helpers/workspace.js';
import { rngFrom } from '../test/helpers/writer.js';
import {
  BATON_BIN, REPO_ROOT, attachExt4, envFlag, envNumber, envSize, fmt, has, limitGoal, machineInfo, makeTempDir, markdownTable, median, nbdReadOnce, runCommand, shellQuote, slowdownGoal,
  startBaton, startRgwBucket, writeResults, type GoalRow, type RgwServer, type Server,
} from './lib.js';

const SIZE = envSize('SIZE', '1G');
const PACKAGES = Math.floor(envNumber('PACKAGES', 340));
const FILES = Math.floor(envNumber('FILES', 28));
const LATENCY_MS = envNumber('LATENCY_MS', 20);
const SEED = Math.floor(envNumber('SEED', 1)) >>> 0;
const ROUNDS = Math.max(1, Math.floor(envNumber('ROUNDS', 3)));
const IS_ROOT = process.getuid?.() === 0;
const RGW = envFlag('RGW', true) && IS_ROOT && has('radosgw');
const FILE = envFlag('FILE', true);
const VOLUME = 'ws';
const TOOLS = ['nbdfuse', 'fusermount3', 'losetup', 'mkfs.ext4', 'mount', 'umount', 'git', 'npm', 'sync', 'find', 'cat'];

const log = (s: string): void => { process.stderr.write(s + '\n'); };
const commands: { step: string; argv: string[] }[] = [];
const since = (t: number): number => (performance.now() - t) / 1000;

interface Target {
  label: string;
  store: string;
  /** Environment of every baton process. */
  env: Record<string, string>;
  /** One store request's added latency, ms (0 for radosgw as it is). */
  latencyMs: number;
  rgw?: RgwServer;
}

type Mode = 'off' | 'working-set' | 'all';
const MODES: readonly Mode[] = ['off', 'working-set', 'all'];

interface Variant {
  name: string;
  hydrate: Mode;
  /** The round (0-based), or 'crash': after A was SIGKILLed. */
  round: number | 'crash';
  /** The A measurements just before and after (rounds), or the median of all of them (crash), s. */
  warmS?: number;
  /** readS ÷ warmS. */
  ratio?: number;
  /** Connect + NBD handshake (opens the volume: recovery + takeover), ms; B only. */
  attachMs?: number;
  /** The first 4 KiB READ after the handshake, ms; B only. */
  firstReadMs?: number;
  /** From the probe's connect to "hydration done" in the log, s. */
  hydratedAfterS?: number;
  /** From the probe's connect to the start of the measurement, s (with hydration.ms: how much of it overlapped hydration). */
  readStartedAfterS?: number;
  hydration?: { fetchedBytes: number; plannedBytes: number; requests: number; workingSetChunks: number; ms: number; truncated: boolean };
  mountS: number;
  /** The measurement: read every file of node_modules + git status, s. */
  readS: number;
  /** radosgw only: GET requests and bytes during the whole variant (from the probe on). */
  rgwGets?: number;
  rgwGetBytes?: number;
}

interface TargetResult {
  label: string;
  build: { mkfsS: number; cloneS: number; npmCiS: number; syncS: number; files: number; usedBytes: number };
  /** Every "A warm" measurement (read all + git status, s), in order. */
  warm: number[];
  warmMountS: number[];
  variants: Variant[];
}

function env(t: Target): NodeJS.ProcessEnv {
  return { ...process.env, ...t.env };
}

async function batonCli(t: Target, step: string, args: string[]): Promise<string> {
  const argv = [process.execPath, BATON_BIN, ...args, '--store', t.store];
  commands.push({ step: `${step} (${t.label})`, argv });
  return (await runCommand(argv, { env: env(t), timeoutMs: 120_000 })).stdout;
}

/** One host: `baton serve` with its own cache dir, log in DIR/log.jsonl. */
async function startHost(t: Target, root: string, name: string, hydrate: string, idleGrace = '120'): Promise<{ server: Server; dir: string; logFile: string }> {
  const dir = fs.mkdtempSync(path.join(root, `${t.label.replace(/[^a-z0-9]/gi, '')}-${name.replace(/[^a-z0-9]/gi, '')}-`));
  const logFile = path.join(dir, 'log.jsonl');
  const extraArgs = ['--lease-ttl', '60', '--idle-grace', idleGrace, '--hydrate', hydrate, '--cache-dir', path.join(dir, 'cache')];
  const server = await startBaton({ dir, volume: VOLUME, size: SIZE, store: t.store, create: false, logLevel: 'info', logFile, extraArgs, env: { ...t.env, BATON_HOME: path.join(root, 'home') } });
  commands.push({ step: `serve, host ${name} (${t.label})`, argv: server.argv });
  return { server, dir, logFile };
}

function logLines(file: string, msg: string): Record<string, unknown>[] {
  let text = '';
  try { text = fs.readFileSync(file, 'utf8'); } catch { return []; }
  const out: Record<string, unknown>[] = [];
  for (const l of text.split('\n')) {
    if (!l.includes(`"msg":"${msg}"`)) continue;
    try { out.push(JSON.parse(l) as Record<string, unknown>); } catch { /* partial */ }
  }
  return out;
}

async function kill(server: Server): Promise<void> {
  if (server.pid !== undefined && server.alive()) process.kill(server.pid, 'SIGKILL');
  const deadline = Date.now() + 10_000;
  while (server.alive() && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
}

/** The measurement: every file of node_modules read (one process, in `find` order), then `git status`. */
async function readAll(mnt: string): Promise<number> {
  const argv = ['sh', '-c', `cd '${mnt}/app' && find node_modules -type f -exec cat {} + > /dev/null && git ${GIT.map((a) => `'${a}'`).join(' ')} -C '${mnt}/repo' status --porcelain > /dev/null`];
  commands.push({ step: 'the measurement (read every file of node_modules, git status)', argv });
  return (await runCommand(argv, { timeoutMs: 600_000 })).seconds;
}

async function variant(t: Target, root: string, hydrate: Mode, round: number | 'crash'): Promise<Variant> {
  const name = `B --hydrate ${hydrate}${round === 'crash' ? ' (after A was SIGKILLed)' : ''}`;
  const { server, dir, logFile } = await startHost(t, root, `B-${hydrate}-${round}`, hydrate);
  try {
    const rgwBefore = t.rgw ? await t.rgw.counters() : null;
    const probe = await nbdReadOnce(server.socket, VOLUME, 0, 4096);
    const v: Variant = { name, hydrate, round, attachMs: probe.goAt - probe.connectedAt, firstReadMs: probe.readAt - probe.goAt, mountS: NaN, readS: NaN };
    if (hydrate === 'all') {
      const deadline = Date.now() + 600_000;
      while (logLines(logFile, 'hydration done').length === 0) {
        if (Date.now() > deadline) throw new Error('hydration did not finish in 10 minutes');
        await new Promise((r) => setTimeout(r, 20));
      }
      v.hydratedAfterS = (performance.now() - probe.connectedAt) / 1000;
    }
    const stack = await attachExt4(server.uri, dir);
    v.mountS = stack.seconds.mount;
    v.readStartedAfterS = (performance.now() - probe.connectedAt) / 1000;
    v.readS = await readAll(stack.mnt);
    await stack.teardown();
    const done = logLines(logFile, 'hydration done')[0];
    if (done) {
      v.hydration = { fetchedBytes: done.fetchedBytes as number, plannedBytes: done.plannedBytes as number, requests: done.requests as number, workingSetChunks: done.workingSetChunks as number, ms: done.ms as number, truncated: done.truncated as boolean };
    }
    if (t.rgw && rgwBefore) {
      const after = await t.rgw.counters();
      v.rgwGets = after.get - rgwBefore.get;
      v.rgwGetBytes = after.getBytes - rgwBefore.getBytes;
    }
    log(`  [${t.label}] ${round === 'crash' ? 'crash' : `round ${round + 1}`}: ${name}: attach ${fmt(v.attachMs)} ms, first 4 KiB read ${fmt(v.firstReadMs)} ms${v.hydratedAfterS !== undefined ? `, hydrated after ${fmt(v.hydratedAfterS)} s` : ''}; measurement started ${fmt(v.readStartedAfterS)} s after connect; mount ${fmt(v.mountS)} s, read all + git status ${fmt(v.readS)} s${v.hydration ? `; hydration ${formatSize(v.hydration.fetchedBytes)} in ${v.hydration.requests} GETs, ${v.hydration.ms} ms` : ''}${v.rgwGets !== undefined ? `; rgw ${v.rgwGets} GETs, ${formatSize(v.rgwGetBytes ?? 0)}` : ''}`);
    return v;
  } finally {
    await kill(server);
  }
}

/** Until host A's log says "volume closed" at least `n` times (its idle close after a detach). */
async function waitClosed(logFile: string, n: number): Promise<void> {
  const deadline = Date.now() + 120_000;
  while (logLines(logFile, 'volume closed').length < n) {
    if (Date.now() > deadline) throw new Error(`host A did not close the volume (${n}) within 2 minutes`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

async function scenario(t: Target, fx: { src: string; app: string; work: string }, root: string): Promise<TargetResult> {
  await batonCli(t, 'create', ['create', VOLUME, '--size', String(SIZE)]);
  // ---- host A builds the workspace
  const A = await startHost(t, root, 'A', 'working-set', '0.5');
  let closes = 0;
  let stack = await attachExt4(A.server.uri, A.dir, { mkfs: true });
  const mkfsS = stack.seconds.mkfs ?? NaN;
  let tt = performance.now();
  await git(['clone', '-q', '--no-hardlinks', fx.src, path.join(stack.mnt, 'repo')], undefined, 300_000);
  const cloneS = since(tt);
  fs.cpSync(fx.app, path.join(stack.mnt, 'app'), { recursive: true });
  tt = performance.now();
  await runCommand(['npm', 'ci', '--offline', '--ignore-scripts'], { cwd: path.join(stack.mnt, 'app'), env: { ...process.env, ...npmEnv(fx.work) }, timeoutMs: 900_000 });
  const npmCiS = since(tt);
  tt = performance.now();
  await runCommand(['sync', '-f', stack.mnt], { timeoutMs: 300_000 });
  const syncS = since(tt);
  const files = Number((await runCommand(['sh', '-c', `find '${stack.mnt}/app/node_modules' -type f | wc -l`])).stdout.trim());
  const df = spawnSync('df', ['-B1', '--output=used', stack.mnt], { encoding: 'utf8' });
  const usedBytes = Number(df.stdout.trim().split('\n')[1] ?? NaN);
  await stack.teardown();
  await waitClosed(A.logFile, ++closes);
  log(`  [${t.label}] built: mkfs ${fmt(mkfsS)} s, clone ${fmt(cloneS)} s, npm ci ${fmt(npmCiS)} s (${files} files in node_modules, ${formatSize(usedBytes)} used), sync ${fmt(syncS)} s`);
  const warm: number[] = [];
  const warmMountS: number[] = [];
  // A warm: a new nbdfuse + loop + mount (no kernel cache), A's read cache as the build left it.
  const measureA = async (): Promise<number> => {
    stack = await attachExt4(A.server.uri, fs.mkdtempSync(path.join(A.dir, 'warm-')));
    const s = await readAll(stack.mnt);
    warmMountS.push(stack.seconds.mount);
    await stack.teardown();
    await waitClosed(A.logFile, ++closes);
    warm.push(s);
    log(`  [${t.label}] A warm: mount ${fmt(stack.seconds.mount)} s, read all + git status ${fmt(s)} s`);
    return s;
  };
  const variants: Variant[] = [];
  let before = await measureA();
  for (let r = 0; r < ROUNDS; r++) {
    for (let k = 0; k < MODES.length; k++) {
      const v = await variant(t, root, MODES[(k + r) % MODES.length]!, r);
      const after = await measureA();
      v.warmS = (before + after) / 2;
      v.ratio = v.readS / v.warmS;
      variants.push(v);
      before = after;
    }
  }
  await kill(A.server); // the host is lost
  const warmMedian = median(warm);
  for (const mode of ['working-set', 'all'] as const) {
    const v = await variant(t, root, mode, 'crash');
    v.warmS = warmMedian;
    v.ratio = v.readS / warmMedian;
    variants.push(v);
  }
  return { label: t.label, build: { mkfsS, cloneS, npmCiS, syncS, files, usedBytes }, warm, warmMountS, variants };
}

// ------------------------------------------------------------------ report

interface Report {
  machine: ReturnType<typeof machineInfo>;
  loadavgAtEnd: number[];
  durationS: number;
  fixtures: { seconds: number; files: number; bytes: number };
  knobs: { SIZE: number; PACKAGES: number; FILES: number; LATENCY_MS: number; ROUNDS: number; RGW: boolean; SEED: number };
  rgw: string | null;
  targets: TargetResult[];
  goals: GoalRow[];
  errors: { step: string; error: string }[];
  commands: { step: string; argv: string[] }[];
}

/** The rounds' B measurements of one mode. */
function ofMode(x: TargetResult, mode: Mode): Variant[] {
  return x.variants.filter((v) => v.hydrate === mode && v.round !== 'crash');
}

function goals(targets: TargetResult[]): GoalRow[] {
  const out: GoalRow[] = [];
  for (const x of targets) {
    const warm = median(x.warm);
    const row = (mode: Mode, max: number, what: string): GoalRow => {
      const vs = ofMode(x, mode);
      const g = slowdownGoal(`hydrate (${x.label}): ${what}, vs the warm host`, median(vs.map((v) => v.readS)), 'warm host A', warm, max);
      // The result is the median of the paired ratios (each B against the A measurements around it).
      const r = median(vs.map((v) => v.ratio ?? NaN));
      return { ...g, result: `${fmt(r)}× the time (median of ${vs.length} pairs)`, pass: Number.isFinite(r) ? r <= max : null };
    };
    out.push(row('working-set', 1.5, 'new host, --hydrate working-set, read all + git status at once'));
    out.push(row('all', 1.2, 'new host, --hydrate all, read all + git status once hydrated'));
    const off = median(ofMode(x, 'off').map((v) => v.firstReadMs ?? NaN));
    const lat = x.label.startsWith('file') ? LATENCY_MS : 0;
    for (const h of ['working-set', 'all'] as const) {
      out.push(limitGoal(`hydrate (${x.label}): cold attach, first 4 KiB read after the handshake, --hydrate ${h} (median)`, median(ofMode(x, h).map((v) => v.firstReadMs ?? NaN)), 'ms', '≤', 50 + lat, `--hydrate off ${fmt(off)} ms`));
    }
  }
  return out;
}

function render(r: Report): string {
  const m = r.machine;
  const L: string[] = [];
  L.push('# A new host resumes at warm speed (issue 13)', '');
  L.push(`${m.date.slice(0, 16).replace('T', ' ')} UTC on \`${m.hostname}\`: ${m.nproc} cores (${m.cpuModel}), ${m.memTotalGiB} GiB RAM, ${m.kernel}; **load average ${m.loadavgAtStart.join(' ')} at start, ${r.loadavgAtEnd.join(' ')} at end** (a shared machine: other jobs ran meanwhile, times are noisy).`);
  L.push(`node ${m.node}; baton ${m.batonCommit ?? '?'} (working tree as built). Whole run ${r.durationS.toFixed(0)} s (fixtures ${r.fixtures.seconds.toFixed(0)} s).`);
  L.push(`Produced by \`node dist/bench/hydrate.js\` (after \`npx tsc -p .\`; or \`SCENARIOS=hydrate npm run bench\`). Knobs: SIZE=${formatSize(r.knobs.SIZE)}, PACKAGES=${r.knobs.PACKAGES}, FILES=${r.knobs.FILES}, LATENCY_MS=${r.knobs.LATENCY_MS}, ROUNDS=${r.knobs.ROUNDS}, RGW=${r.knobs.RGW ? 1 : 0}, SEED=${r.knobs.SEED}.`, '');
  L.push(`The workspace: \`git clone\` of the seed repository (test/helpers/workspace.ts) and \`npm ci --offline --ignore-scripts\` of ${r.knobs.PACKAGES} generated packages (${r.fixtures.files} files, ${formatSize(r.fixtures.bytes)} of JavaScript, sizes log-uniform from 100 B to 64 KiB) on ext4 over nbdfuse + loop. The measurement: \`find node_modules -type f -exec cat {} +\` then \`git status\`, after a fresh attach + mount (no kernel cache). "A": the host that built it, its read cache warm, measured before and after every B. "B": a new \`baton serve\` with an empty cache, after A closed the volume (rounds) or after A was SIGKILLed (crash); "first 4 KiB": one NBD READ at offset 0 right after the handshake that opened the volume. "vs warm": B's time ÷ the mean of the A measurements just before and after it (crash: ÷ the median of all A measurements).`, '');
  for (const x of r.targets) {
    L.push(`## ${x.label}`, '');
    L.push(`Built: ${x.build.files} files in node_modules, ${formatSize(x.build.usedBytes)} used on ext4; mkfs ${fmt(x.build.mkfsS)} s, clone ${fmt(x.build.cloneS)} s, npm ci ${fmt(x.build.npmCiS)} s, sync ${fmt(x.build.syncS)} s. A warm, read all + git status: ${x.warm.map((w) => fmt(w)).join(', ')} s (median ${fmt(median(x.warm))} s).`, '');
    const sum: string[][] = [['A (warm cache)', '-', '-', '-', fmt(median(x.warmMountS)), fmt(median(x.warm)), '1×']];
    for (const mode of MODES) {
      const vs = ofMode(x, mode);
      const h = vs.map((v) => v.hydration).filter((y): y is NonNullable<Variant['hydration']> => !!y);
      sum.push([`B --hydrate ${mode}`, fmt(median(vs.map((v) => v.attachMs ?? NaN))), fmt(median(vs.map((v) => v.firstReadMs ?? NaN))),
        h.length ? `${formatSize(median(h.map((y) => y.fetchedBytes)))}, ${Math.round(median(h.map((y) => y.requests)))} GETs, ${fmt(median(h.map((y) => y.ms)) / 1000)} s` : '-',
        fmt(median(vs.map((v) => v.mountS))), fmt(median(vs.map((v) => v.readS))), `${fmt(median(vs.map((v) => v.ratio ?? NaN)))}×`]);
    }
    L.push(`Medians of ${r.knobs.ROUNDS} rounds:`, '');
    L.push(markdownTable(['host', 'attach, ms', 'first 4 KiB read, ms', 'hydration (fetched, GETs, time)', 'mount, s', 'read all + git status, s', 'vs warm (median of pairs)'], sum, ['l', 'r', 'r', 'r', 'r', 'r', 'r']));
    L.push('Every B measurement:', '');
    const rows = x.variants.map((v) => [
      v.round === 'crash' ? 'crash' : String(v.round + 1),
      v.name,
      v.attachMs !== undefined ? fmt(v.attachMs) : '-',
      v.firstReadMs !== undefined ? fmt(v.firstReadMs) : '-',
      v.hydration ? `${formatSize(v.hydration.fetchedBytes)}, ${v.hydration.requests} GETs, ${fmt(v.hydration.ms / 1000)} s${v.hydration.truncated ? ' (truncated)' : ''}` : '-',
      v.readStartedAfterS !== undefined ? fmt(v.readStartedAfterS) : '-',
      fmt(v.mountS),
      fmt(v.readS),
      fmt(v.warmS),
      `${fmt(v.ratio)}×`,
      v.rgwGets !== undefined ? `${v.rgwGets} / ${formatSize(v.rgwGetBytes ?? 0)}` : '-',
    ]);
    L.push(markdownTable(['round', 'host', 'attach, ms', 'first 4 KiB, ms', 'hydration (fetched, GETs, time)', 'measurement began, s after connect', 'mount, s', 'read all + git status, s', 'A warm, s', 'vs warm', 'rgw GETs / bytes'], rows, ['l', 'l', 'r', 'r', 'r', 'r', 'r', 'r', 'r', 'r', 'r']));
  }
  if (r.rgw) L.push(`radosgw: ${r.rgw}.`, '');
  if (r.goals.length) {
    L.push('## Goals', '', markdownTable(['goal', 'baton', 'peer (same run)', 'result', 'target', ''], r.goals.map((g) => [g.goal, g.baton, g.peer, g.result, g.target, g.pass === null ? '?' : g.pass ? '✓' : '✗']), ['l', 'r', 'r', 'r', 'l', 'l']));
  }
  if (r.errors.length) L.push('## Errors', '', ...r.errors.map((e) => `- ${e.step}: ${e.error.replace(/\n/g, ' ')}`), '');
  L.push('## Commands', '', '$TMP = the run\'s private temp dir.', '', '```sh');
  const seen = new Set<string>();
  for (const c of r.commands) {
    const line = shellQuote(c.argv).replaceAll(REPO_ROOT + '/', '').replace(/\/tmp\/baton-bench-hydrate-[^/ ']+/g, '$TMP');
    const key = `${c.step}\n${line}`;
    if (seen.has(key)) continue;
    seen.add(key);
    L.push(`# ${c.step}`, line);
  }
  L.push('```', '');
  return L.join('\n');
}

// ------------------------------------------------------------------ main

async function main(): Promise<void> {
  const missing = TOOLS.filter((x) => !has(x));
  if (!IS_ROOT || missing.length || !fs.existsSync('/dev/fuse') || !fs.existsSync('/dev/loop-control')) {
    log(`hydrate: skipped: needs root (${IS_ROOT ? 'yes' : 'no'}), /dev/fuse, /dev/loop-control and ${TOOLS.join(', ')} (missing: ${missing.join(', ') || 'none'})`);
    return;
  }
  const machine = machineInfo();
  const started = performance.now();
  const root = makeTempDir('baton-bench-hydrate-');
  process.env.TMPDIR = root;
  log(`hydrate bench: ${machine.nproc} cores, load ${machine.loadavgAtStart.join(' ')}, temp dir ${root}`);
  const t0 = performance.now();
  const fxDir = path.join(root, 'fixtures');
  fs.mkdirSync(fxDir);
  const src = path.join(fxDir, 'src');
  await makeSourceRepo(src, rngFrom(SEED));
  const bulk = await makeManyPackagesProject(fxDir, rngFrom(SEED + 1), PACKAGES, FILES);
  const fixtures = { seconds: since(t0), files: bulk.files, bytes: bulk.bytes };
  log(`fixtures ready in ${fixtures.seconds.toFixed(0)} s (${bulk.files} files, ${formatSize(bulk.bytes)})`);

  const errors: Report['errors'] = [];
  const targets: TargetResult[] = [];
  let rgwVersion: string | null = null;
  const opens: (() => Promise<{ target: Target; done: () => Promise<void> }>)[] = [];
  if (FILE) {
    opens.push(async () => ({ target: { label: `file: +${LATENCY_MS} ms`, store: `file:${path.join(root, 'file-store')}`, env: { BATON_FAULTS: JSON.stringify({ latencyMs: LATENCY_MS }) }, latencyMs: LATENCY_MS }, done: async () => {} }));
  }
  if (RGW) {
    opens.push(async () => {
      const { rgw, version } = await startRgwBucket(path.join(root, 'rgw'), 'bench');
      rgwVersion = version;
      return { target: { label: 'radosgw', store: 's3://bench/hydrate', env: rgw.env, latencyMs: 0, rgw }, done: () => rgw.stop() };
    });
  }
  for (const open of opens) {
    let opened: Awaited<ReturnType<typeof open>> | null = null;
    try {
      opened = await open();
      log(`[${opened.target.label}]`);
      targets.push(await scenario(opened.target, { src, app: bulk.app, work: fxDir }, root));
    } catch (e) {
      const label = opened?.target.label ?? 'radosgw';
      log(`  [${label}] ERROR ${(e as Error).stack ?? String(e)}`);
      errors.push({ step: label, error: (e as Error).message });
    } finally {
      await opened?.done().catch((e: unknown) => log(`  cleanup: ${String(e)}`));
    }
  }
  const report: Report = {
    machine, loadavgAtEnd: os.loadavg().map((x) => Math.round(x * 100) / 100), durationS: since(started), fixtures,
    knobs: { SIZE, PACKAGES, FILES, LATENCY_MS, ROUNDS, RGW, SEED }, rgw: rgwVersion, targets, goals: goals(targets), errors, commands,
  };
  const out = writeResults('hydrate', render(report), report);
  log(`hydrate bench: ${out.md}, ${out.json} (${report.durationS.toFixed(0)} s)`);
  if (errors.length) process.exitCode = 1;
}

await main();

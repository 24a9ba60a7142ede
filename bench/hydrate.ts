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
 *   A       `baton serve` (host A); create the volume; mkfs.ext4, mount, clone, npm ci, sync;
 *           unmount and detach. Then "warm": attach again (new nbdfuse + loop + mount: the
 *           kernel's caches of the old ones are gone; A's read cache holds what it wrote) and
 *           time `find node_modules -type f -exec cat {} +` + `git status` (the measurement);
 *           unmount; SIGKILL A (the host is lost; its lease file frees at once).
 *   B:off   a new `baton serve --hydrate off` with an empty cache: one NBD READ of 4 KiB at
 *           offset 0 (connect + handshake, which opens the volume, then the READ: cold attach and
 *           first read), then attach + mount and the same measurement; unmount; SIGKILL.
 *   B:ws    the same with `--hydrate working-set` (the default): the measurement starts right
 *           after the mount, while hydration runs.
 *   B:all   the same with `--hydrate all`, measured once hydration is done.
 *
 * Each B is SIGKILLed after its measurement so that the next B starts from the store A left
 * (B's takeover record and ext4's superblock updates at mount are the only things a B adds).
 * Every baton process: --lease-ttl 60, --idle-grace 120 (the volume stays open between the
 * probe READ and the mount), its own --cache-dir, the same BATON_HOME (lease files).
 *
 * Needs root (losetup, mount), nbdfuse, fusermount3, e2fsprogs, git, npm; radosgw optional.
 * Knobs: SIZE (1G), PACKAGES (340), FILES (28 per package), LATENCY_MS (20), RGW (1), SEED (1).
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
  BATON_BIN, MiB, REPO_ROOT, attachExt4, envFlag, envNumber, envSize, fmt, has, limitGoal, machineInfo, makeTempDir, markdownTable, nbdReadOnce, runCommand, shellQuote, slowdownGoal,
  startBaton, startRgwBucket, writeResults, type GoalRow, type RgwServer, type Server,
} from './lib.js';

const SIZE = envSize('SIZE', '1G');
const PACKAGES = Math.floor(envNumber('PACKAGES', 340));
const FILES = Math.floor(envNumber('FILES', 28));
const LATENCY_MS = envNumber('LATENCY_MS', 20);
const SEED = Math.floor(envNumber('SEED', 1)) >>> 0;
const IS_ROOT = process.getuid?.() === 0;
const RGW = envFlag('RGW', true) && IS_ROOT && has('radosgw');
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

interface Variant {
  name: string;
  hydrate: 'off' | 'working-set' | 'all' | 'warm';
  /** Connect + NBD handshake (opens the volume: recovery + takeover), ms; B only. */
  attachMs?: number;
  /** The first 4 KiB READ after the handshake, ms; B only. */
  firstReadMs?: number;
  /** From the probe's connect to "hydration done" in the log, s. */
  hydratedAfterS?: number;
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
async function startHost(t: Target, root: string, name: string, hydrate: string): Promise<{ server: Server; dir: string; logFile: string }> {
  const dir = fs.mkdtempSync(path.join(root, `${t.label.replace(/[^a-z0-9]/gi, '')}-${name.replace(/[^a-z0-9]/gi, '')}-`));
  const logFile = path.join(dir, 'log.jsonl');
  const extraArgs = ['--lease-ttl', '60', '--idle-grace', '120', '--hydrate', hydrate, '--cache-dir', path.join(dir, 'cache')];
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

async function variant(t: Target, root: string, name: string, hydrate: 'off' | 'working-set' | 'all'): Promise<Variant> {
  const { server, dir, logFile } = await startHost(t, root, name, hydrate);
  try {
    const rgwBefore = t.rgw ? await t.rgw.counters() : null;
    const probe = await nbdReadOnce(server.socket, VOLUME, 0, 4096);
    const v: Variant = { name, hydrate, attachMs: probe.goAt - probe.connectedAt, firstReadMs: probe.readAt - probe.goAt, mountS: NaN, readS: NaN };
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
    log(`  [${t.label}] ${name}: attach ${fmt(v.attachMs)} ms, first 4 KiB read ${fmt(v.firstReadMs)} ms${v.hydratedAfterS !== undefined ? `, hydrated after ${fmt(v.hydratedAfterS)} s` : ''}; mount ${fmt(v.mountS)} s, read all + git status ${fmt(v.readS)} s${v.hydration ? `; hydration ${formatSize(v.hydration.fetchedBytes)} in ${v.hydration.requests} GETs, ${v.hydration.ms} ms` : ''}${v.rgwGets !== undefined ? `; rgw ${v.rgwGets} GETs, ${formatSize(v.rgwGetBytes ?? 0)}` : ''}`);
    return v;
  } finally {
    await kill(server);
  }
}

async function scenario(t: Target, fx: { src: string; app: string; work: string }, root: string): Promise<TargetResult> {
  await batonCli(t, 'create', ['create', VOLUME, '--size', String(SIZE)]);
  // ---- host A builds the workspace
  const A = await startHost(t, root, 'A', 'working-set');
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
  log(`  [${t.label}] built: mkfs ${fmt(mkfsS)} s, clone ${fmt(cloneS)} s, npm ci ${fmt(npmCiS)} s (${files} files in node_modules, ${formatSize(usedBytes)} used), sync ${fmt(syncS)} s`);
  // ---- A warm: a new nbdfuse + loop + mount (no kernel cache), A's read cache as the build left it
  stack = await attachExt4(A.server.uri, fs.mkdtempSync(path.join(A.dir, 'warm-')));
  const warm: Variant = { name: 'A (warm cache)', hydrate: 'warm', mountS: stack.seconds.mount, readS: await readAll(stack.mnt) };
  await stack.teardown();
  log(`  [${t.label}] A warm: mount ${fmt(warm.mountS)} s, read all + git status ${fmt(warm.readS)} s`);
  await kill(A.server); // the host is lost
  const variants = [warm];
  for (const [name, mode] of [['B --hydrate off', 'off'], ['B --hydrate working-set', 'working-set'], ['B --hydrate all', 'all']] as const) {
    variants.push(await variant(t, root, name, mode));
  }
  return { label: t.label, build: { mkfsS, cloneS, npmCiS, syncS, files, usedBytes }, variants };
}

// ------------------------------------------------------------------ report

interface Report {
  machine: ReturnType<typeof machineInfo>;
  loadavgAtEnd: number[];
  durationS: number;
  fixtures: { seconds: number; files: number; bytes: number };
  knobs: { SIZE: number; PACKAGES: number; FILES: number; LATENCY_MS: number; RGW: boolean; SEED: number };
  rgw: string | null;
  targets: TargetResult[];
  goals: GoalRow[];
  errors: { step: string; error: string }[];
  commands: { step: string; argv: string[] }[];
}

function goals(targets: TargetResult[]): GoalRow[] {
  const out: GoalRow[] = [];
  for (const x of targets) {
    const v = (h: Variant['hydrate']): Variant | undefined => x.variants.find((y) => y.hydrate === h);
    const warm = v('warm')?.readS;
    out.push(slowdownGoal(`hydrate (${x.label}): new host, --hydrate working-set, read all + git status, vs the warm host`, v('working-set')?.readS, 'warm host A', warm, 1.5));
    out.push(slowdownGoal(`hydrate (${x.label}): new host, --hydrate all, once hydrated, vs the warm host`, v('all')?.readS, 'warm host A', warm, 1.2));
    const off = v('off');
    const lat = x.label.startsWith('file') ? LATENCY_MS : 0;
    for (const h of ['working-set', 'all'] as const) {
      out.push(limitGoal(`hydrate (${x.label}): cold attach, first 4 KiB read after the handshake, --hydrate ${h}`, v(h)?.firstReadMs, 'ms', '≤', 50 + lat, `--hydrate off ${fmt(off?.firstReadMs)} ms`));
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
  L.push(`Produced by \`node dist/bench/hydrate.js\` (after \`npx tsc -p .\`; or \`SCENARIOS=hydrate npm run bench\`). Knobs: SIZE=${formatSize(r.knobs.SIZE)}, PACKAGES=${r.knobs.PACKAGES}, FILES=${r.knobs.FILES}, LATENCY_MS=${r.knobs.LATENCY_MS}, RGW=${r.knobs.RGW ? 1 : 0}, SEED=${r.knobs.SEED}.`, '');
  L.push(`The workspace: \`git clone\` of the seed repository (test/helpers/workspace.ts) and \`npm ci --offline --ignore-scripts\` of ${r.knobs.PACKAGES} generated packages (${r.fixtures.files} files, ${formatSize(r.fixtures.bytes)} of JavaScript, sizes log-uniform from 100 B to 64 KiB) on ext4 over nbdfuse + loop. The measurement: \`find node_modules -type f -exec cat {} +\` then \`git status\`, after a fresh attach + mount (no kernel cache). "A (warm)": the host that built it, its read cache warm. "B": a new \`baton serve\` with an empty cache after A was SIGKILLed; first 4 KiB: one NBD READ at offset 0 right after the handshake that opened the volume.`, '');
  for (const x of r.targets) {
    L.push(`## ${x.label}`, '');
    L.push(`Built: ${x.build.files} files in node_modules, ${formatSize(x.build.usedBytes)} used on ext4; mkfs ${fmt(x.build.mkfsS)} s, clone ${fmt(x.build.cloneS)} s, npm ci ${fmt(x.build.npmCiS)} s, sync ${fmt(x.build.syncS)} s.`, '');
    const warm = x.variants.find((y) => y.hydrate === 'warm')?.readS ?? NaN;
    const rows = x.variants.map((v) => [
      v.name,
      v.attachMs !== undefined ? fmt(v.attachMs) : '-',
      v.firstReadMs !== undefined ? fmt(v.firstReadMs) : '-',
      v.hydration ? `${formatSize(v.hydration.fetchedBytes)}, ${v.hydration.requests} GETs, ${fmt(v.hydration.ms / 1000)} s${v.hydration.truncated ? ' (truncated)' : ''}` : '-',
      fmt(v.mountS),
      fmt(v.readS),
      `${fmt(v.readS / warm)}×`,
      v.rgwGets !== undefined ? `${v.rgwGets} / ${formatSize(v.rgwGetBytes ?? 0)}` : '-',
    ]);
    L.push(markdownTable(['host', 'attach, ms', 'first 4 KiB read, ms', 'hydration (fetched, GETs, time)', 'mount, s', 'read all + git status, s', 'vs warm', 'rgw GETs / bytes'], rows, ['l', 'r', 'r', 'r', 'r', 'r', 'r', 'r']));
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
  const opens: (() => Promise<{ target: Target; done: () => Promise<void> }>)[] = [
    async () => ({ target: { label: `file: +${LATENCY_MS} ms`, store: `file:${path.join(root, 'file-store')}`, env: { BATON_FAULTS: JSON.stringify({ latencyMs: LATENCY_MS }) }, latencyMs: LATENCY_MS }, done: async () => {} }),
  ];
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
    knobs: { SIZE, PACKAGES, FILES, LATENCY_MS, RGW, SEED }, rgw: rgwVersion, targets, goals: goals(targets), errors, commands,
  };
  const out = writeResults('hydrate', render(report), report);
  log(`hydrate bench: ${out.md}, ${out.json} (${report.durationS.toFixed(0)} s)`);
  if (errors.length) process.exitCode = 1;
}

await main();

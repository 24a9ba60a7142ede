/**
 * How long a volume is unavailable when it moves between hosts, under a writer.
 *
 *   1. graceful  `baton handoff`: a checksummed writer (test/helpers/writer.ts: writes, a FLUSH
 *                every 4 writes, 4 in flight) runs on the holder; a handoff to the other host is
 *                requested; the holder drains (ESHUTDOWN), flushes, closes its clients and
 *                releases the lease reserved for the other host; the writer reconnects there
 *                (served by `--on-held wait`) and goes on. Stall = last command the old holder
 *                acknowledged -> first command the new holder acknowledged.
 *   2. crash     the holder is SIGKILLed under the same writer; the writer reconnects to the
 *                standby (`--on-held wait`), which gets the lease once the dead holder's lease
 *                expired in Redis, recovers the volume and commits its takeover record. Times
 *                from the kill to the standby serving (GO answered) and to its first
 *                acknowledged command. The killed host is restarted as the next standby.
 *
 * Two `baton serve` processes (host ids h0, h1, their own cache dirs) on one file: store, the
 * lease in a real redis-server on a Unix socket, RUNS rounds of each (20), hosts alternating.
 * The handoff is requested the way `baton handoff` does it (requestHandoff through the lease
 * manager) but in-process: the CLI's own wait loop has a bug (it misses a target that takes
 * the volume at once, see test/integration/lease.test.ts) and node's start-up is not part of
 * the stall anyway. After all rounds every block is read back through a third host and checked
 * against the writer's model: every acknowledged FLUSH survived 20 handoffs and 20 crashes.
 *
 * Knobs (environment): RUNS (20), LEASE_TTL (seconds, 5: the documented default of
 * --lease-ttl), FLUSHES (acknowledged flushes per phase before the handoff or kill, 5),
 * STORE (`rgw`: a throwaway radosgw from scripts/rgw.sh, the default when radosgw is
 * installed and we are root; `file`: a file: store in the temp dir).
 * Results: bench/results/handoff.md and handoff.json.
 */

import * as path from 'node:path';
import { performance } from 'node:perf_hooks';
import { openRedisLeaseManager } from '../src/lease/redis.js';
import { BLOCK, BlockModel, describeProblems, rngFrom, runWriter, verifyVolume, type WriterStats } from '../test/helpers/writer.js';
import {
  envNumber, fmt, goalsTable, has, limitGoal, machineInfo, makeTempDir, markdownTable, median, runCommand, spawnTracked, startBaton, startRgwBucket,
  writeResults, type GoalRow, type RgwServer, type Server,
} from './lib.js';

const RUNS = Math.max(1, Math.floor(envNumber('RUNS', 20)));
const TTL_S = envNumber('LEASE_TTL', 5);
const FLUSHES = Math.max(1, Math.floor(envNumber('FLUSHES', 5)));
const VOL = 'bench';
const SIZE = 64 * 1024 * 1024;
const BLOCKS = SIZE / BLOCK;

const log = (s: string): void => { process.stderr.write(s + '\n'); };
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));
const now = (): number => performance.now();

if (!has('redis-server')) {
  log('bench/handoff: redis-server is not installed (Debian: redis-server); skipped');
  process.exit(0);
}

const root = makeTempDir('baton-bench-handoff-');
const STORE = process.env.STORE || (has('radosgw') && process.getuid?.() === 0 ? 'rgw' : 'file');
let rgw: RgwServer | null = null;
let rgwVersion = '';
let store = `file:${path.join(root, 'store')}`;
let storeArgs: string[] = [];
let storeEnv: NodeJS.ProcessEnv = {};
if (STORE === 'rgw') {
  const r = await startRgwBucket(path.join(root, 'rgw'), 'handoff');
  rgw = r.rgw;
  rgwVersion = r.version;
  store = 's3://handoff/bench';
  storeArgs = ['--endpoint', rgw.endpoint];
  storeEnv = rgw.env;
  log(`bench/handoff: radosgw at ${rgw.endpoint}`);
} else if (STORE !== 'file') {
  throw new Error(`STORE must be rgw or file, not ${STORE}`);
}

// ------------------------------------------------------------------ redis

const redisSock = path.join(root, 'redis.sock');
const redisUrl = `unix://${redisSock}`;
const redis = spawnTracked(['redis-server', '--port', '0', '--unixsocket', redisSock, '--unixsocketperm', '700', '--save', '', '--appendonly', 'no', '--dir', root], { stdout: 'ignore' });
{
  const deadline = Date.now() + 10_000;
  for (;;) {
    try {
      const r = await runCommand(['redis-cli', '-s', redisSock, 'PING'], { timeoutMs: 2000 });
      if (r.stdout.trim() === 'PONG') break;
    } catch { /* not up yet */ }
    if (Date.now() > deadline || redis.exitCode !== null) throw new Error('redis-server did not start');
    await sleep(50);
  }
}

// ------------------------------------------------------------------ hosts

const hostArgs = (id: string): string[] => [
  '--host-id', id, '--redis', redisUrl, '--lease-ttl', String(TTL_S), '--on-held', 'wait', '--held-wait', String(Math.max(30, 4 * TTL_S)), '--idle-grace', '1',
];
async function startHost(id: string, create = false): Promise<Server> {
  const dir = makeTempDir(`baton-bench-handoff-host-`);
  return startBaton({ dir, volume: VOL, size: SIZE, store, create, extraArgs: [...hostArgs(id), ...storeArgs], env: storeEnv, logLevel: 'info' });
}

const hosts: Server[] = [await startHost('h0', true), await startHost('h1')];
const lm = await openRedisLeaseManager(redisUrl, { ttlMs: TTL_S * 1000 });
const model = new BlockModel(BLOCKS, 0x4a4d0ff);
const rng = rngFrom(20261129);
const wopts = { exportName: VOL, rng, flushEvery: 4, depth: 4, maxRunBlocks: 16, hotBlocks: 1024, bigWriteRate: 0.02 };

interface Phase { stats: WriterStats; readyAt: number; firstOk: number; lastOk: number }

/**
 * One writer session on `server`, reconnecting until the handshake succeeds. With `onFlushes`,
 * it is called once the session has `FLUSHES` acknowledged flushes (it hands off or kills the
 * server, which ends the session); without, the session stops there by itself and flushes.
 */
async function phase(server: Server, onFlushes?: () => void): Promise<Phase> {
  for (;;) {
    let readyAt = 0;
    let firstOk = 0;
    let lastOk = 0;
    let flushes = 0;
    try {
      const stats = await runWriter(server.socket, model, {
        ...wopts,
        durationMs: 120_000,
        ...(onFlushes ? {} : { stopWhen: (st: WriterStats) => st.flushesOk >= FLUSHES, finalFlushTries: 5 }),
        onEvent: (e) => {
          if (e.type === 'ready') readyAt = now();
          if ((e.type === 'write-done' || e.type === 'flush-done') && e.ok) {
            lastOk = now();
            if (!firstOk) firstOk = lastOk;
            if (e.type === 'flush-done' && ++flushes === FLUSHES) onFlushes?.();
          }
        },
      });
      return { stats, readyAt, firstOk, lastOk };
    } catch (err) {
      if (!/GO .* failed/.test(String(err))) throw err;
      await sleep(10);
    }
  }
}

/** A field of the newest log line of `server` with this msg. */
function logField(server: Server, msg: string, field: string): number | undefined {
  const lines = server.stderr().split('\n').reverse();
  for (const l of lines) {
    try {
      const o = JSON.parse(l) as Record<string, unknown>;
      if (o.msg === msg && typeof o[field] === 'number') return o[field] as number;
    } catch { /* not JSON */ }
  }
  return undefined;
}

// ------------------------------------------------------------------ 1. graceful

interface GracefulRun { run: number; from: string; to: string; stallMs: number; releaseMs: number | undefined; writesOk: number; shutdownErrors: number; otherErrors: number }
const graceful: GracefulRun[] = [];
const handTo = (to: string) => (): void => { lm.requestHandoff(VOL, to).catch((err: unknown) => log(`requestHandoff to ${to} failed: ${String(err)}`)); };
let holder = 0;
log(`bench/handoff: ${RUNS} graceful handoffs, lease TTL ${TTL_S} s`);
{
  let prev = await phase(hosts[holder]!, handTo(`h${1 - holder}`));
  for (let run = 1; run <= RUNS; run++) {
    const from = holder;
    holder = 1 - holder;
    model.serverLost();
    const next = await phase(hosts[holder]!, run < RUNS ? handTo(`h${1 - holder}`) : undefined);
    const errnos = prev.stats.errnos;
    const shutdownErrors = errnos[108] ?? 0;
    const r: GracefulRun = {
      run, from: `h${from}`, to: `h${holder}`, stallMs: next.firstOk - prev.lastOk, releaseMs: logField(hosts[from]!, 'volume handed off', 'ms'),
      writesOk: prev.stats.writesOk, shutdownErrors, otherErrors: Object.values(errnos).reduce((a, b) => a + b, 0) - shutdownErrors,
    };
    graceful.push(r);
    log(`  graceful ${run}: h${from} -> h${holder}: stall ${Math.round(r.stallMs)} ms (release took ${r.releaseMs ?? '?'} ms on h${from})`);
    prev = next;
  }
}

// ------------------------------------------------------------------ 2. crash

interface CrashRun { run: number; killed: string; to: string; servingMs: number; firstAckMs: number }
const crashes: CrashRun[] = [];
log(`bench/handoff: ${RUNS} crash takeovers, lease TTL ${TTL_S} s`);
{
  let killedAt = 0;
  const kill = (i: number) => (): void => {
    process.kill(hosts[i]!.pid!, 'SIGKILL');
    killedAt = now();
  };
  // A new session on the holder, killed after FLUSHES acknowledged flushes.
  await phase(hosts[holder]!, kill(holder));
  for (let run = 1; run <= RUNS; run++) {
    const dead = holder;
    const t0 = killedAt;
    holder = 1 - holder;
    model.serverLost();
    // Restart the killed host (the next standby) while the writer waits on the other one; the
    // next kill waits for it.
    const restart = startHost(`h${dead}`).then((s) => { hosts[dead] = s; });
    const killNext = kill(holder);
    const r = await phase(hosts[holder]!, run < RUNS ? () => { void restart.then(killNext); } : undefined);
    const c: CrashRun = { run, killed: `h${dead}`, to: `h${holder}`, servingMs: r.readyAt - t0, firstAckMs: r.firstOk - t0 };
    crashes.push(c);
    log(`  crash ${run}: h${dead} killed -> h${holder} serving ${Math.round(c.servingMs)} ms, first ack ${Math.round(c.firstAckMs)} ms`);
    await restart;
  }
}

// ------------------------------------------------------------------ check and report

await lm.close();
model.serverLost();
for (const s of hosts) await s.stop();
const checker = await startHost('check');
const v = await verifyVolume(checker.socket, VOL, model);
await checker.stop();
log(`bench/handoff: read back ${v.blocks} blocks through a third host: ${describeProblems(v)}`);

const stall = graceful.map((r) => r.stallMs);
const release = graceful.flatMap((r) => (r.releaseMs === undefined ? [] : [r.releaseMs]));
const serving = crashes.map((r) => r.servingMs);
const firstAck = crashes.map((r) => r.firstAckMs);
const worst = (xs: number[]): number => Math.max(...xs);
const best = (xs: number[]): number => Math.min(...xs);
const machine = machineInfo();
const rows = [
  ['graceful handoff: stall (last ack on old holder → first ack on new)', fmt(median(stall)), fmt(best(stall)), fmt(worst(stall)), '< 1000'],
  ['graceful handoff: old holder drain + flush + release (its log)', fmt(median(release)), fmt(best(release)), fmt(worst(release)), ''],
  ['crash takeover: SIGKILL → new holder serving (GO answered)', fmt(median(serving)), fmt(best(serving)), fmt(worst(serving)), `≤ TTL (${TTL_S * 1000}) + recovery`],
  ['crash takeover: SIGKILL → first acknowledged command', fmt(median(firstAck)), fmt(best(firstAck)), fmt(worst(firstAck)), ''],
];
const where = STORE === 'rgw' ? `radosgw (${rgwVersion})` : 'a `file:` store';
const goals: GoalRow[] = [
  limitGoal(`handoff on ${STORE === 'rgw' ? 'radosgw' : 'file:'}: graceful stall, worst of ${RUNS}`, worst(stall), 'ms', '≤', 300, `median ${fmt(median(stall))} ms`),
  limitGoal(`handoff on ${STORE === 'rgw' ? 'radosgw' : 'file:'}: crash takeover (SIGKILL → serving), worst of ${RUNS}`, worst(serving), 'ms', '≤', TTL_S * 1000 + 500, `median ${fmt(median(serving))} ms; TTL ${TTL_S * 1000} ms`),
];
const md = [
  '# Handoff and takeover times',
  '',
  '## Goals (issue 11), this run',
  '',
  goalsTable(goals),
  `${machine.date}, ${machine.nproc} cores (${machine.cpuModel}), load average ${machine.loadavgAtStart.join(' ')} at the start, node ${machine.node}, baton ${machine.batonCommit ?? '?'} (+ working tree).`,
  `Two \`baton serve\` hosts on ${where}, lease in redis-server on a Unix socket, \`--lease-ttl ${TTL_S}\`, \`--on-held wait\`, ${RUNS} runs each; a checksummed writer (FLUSH every 4 writes, 4 in flight), handoff or kill after ${FLUSHES} acknowledged flushes per phase.`,
  '',
  markdownTable(['ms', 'median', 'best', 'worst', 'target'], rows, ['l', 'r', 'r', 'r', 'l']),
  `Read back after all ${2 * RUNS} moves through a third host: ${v.problemCount === 0 ? `all ${v.blocks} blocks as the writer's model allows (every acknowledged FLUSH survived)` : describeProblems(v)}.`,
  `Writes refused with ESHUTDOWN while draining: ${graceful.reduce((a, r) => a + r.shutdownErrors, 0)} over ${RUNS} handoffs; other errors on the old holder: ${graceful.reduce((a, r) => a + r.otherErrors, 0)}.`,
  '',
  '## Runs',
  '',
  markdownTable(['run', 'graceful', 'stall ms', 'release ms', 'crash', 'serving ms', 'first ack ms'],
    graceful.map((g, i) => {
      const c = crashes[i];
      return [String(g.run), `${g.from} → ${g.to}`, fmt(g.stallMs), fmt(g.releaseMs), c ? `${c.killed} killed → ${c.to}` : '', fmt(c?.servingMs), fmt(c?.firstAckMs)];
    }), ['r', 'l', 'r', 'r', 'l', 'r', 'r']),
].join('\n');
const out = writeResults('handoff', md, { machine, store: STORE, goals, ttlSeconds: TTL_S, runs: RUNS, flushesPerPhase: FLUSHES, graceful, crashes, verify: { blocks: v.blocks, problems: v.problemCount, atAcked: v.atAcked, newer: v.newer } });
process.stdout.write(md + '\n');
log(`bench/handoff: wrote ${out.md} and ${out.json}`);
redis.kill('SIGTERM');
await rgw?.stop();
process.exit(v.problemCount === 0 ? 0 : 1);

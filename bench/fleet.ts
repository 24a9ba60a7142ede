/**
 * Cost that grows with the fleet (issue 12): a `file:` store holding 10, 1,000 and 10,000
 * volumes, nearly all idle, and what the everyday operations cost there.
 *
 * For each count in VOLUMES (10, 1000, 10000): a fresh `file:` store in a temp dir; that many
 * 1 GiB volumes made through the catalog (16 at a time), one in WRITTEN_EVERY (100) given
 * 1 MiB of data and a flush. Then, each as a user runs it:
 *
 *   ls        `baton ls --json` (space accounting included): wall time;
 *   info      `baton info v0 --json`: wall time;
 *   serve     `baton serve` on a Unix socket: time until it listens, and its RSS then;
 *   attach    `nbdinfo` of one volume on that server: wall time (the open, recovery and takeover);
 *   gc        one collectGarbage run in this process through an instrumented store (a dry run:
 *             it computes everything a real run does, and deletes and marks nothing):
 *             time and store requests by kind.
 *
 * BATON_MAX_OPERATION_MS is MAX_OP_MS (2000) for everything (GC's fixed point waits M/2; the
 * store records the value and refuses processes with another, so the CLI gets the same).
 *
 * Knobs (environment): VOLUMES (10,1000,10000), WRITTEN_EVERY (100), CHANGED (10), MAX_OP_MS (2000).
 * Results: bench/results/fleet.md and fleet.json.
 */

import * as fs from 'node:fs';
import * as path from 'node:path';
import { BlockCache } from '../src/cache.js';
import { silentLogger } from '../src/log.js';
import { InstrumentedObjectStore } from '../src/store/decorators.js';
import { openStore } from '../src/store/open.js';
import { StoreCatalog } from '../src/volume/catalog.js';
import { collectGarbage } from '../src/volume/gc.js';
import { mapLimit, type Volume } from '../src/volume/volume.js';
import { BATON_BIN, MiB, fmt, machineInfo, makeTempDir, markdownTable, runCommand, startBaton, writeResults } from './lib.js';

const VOLUMES = (process.env.VOLUMES || '10,1000,10000').split(',').map((x) => Math.max(1, Math.floor(Number(x))));
const WRITTEN_EVERY = Math.max(1, Number(process.env.WRITTEN_EVERY || 100));
const MAX_OP_MS = Math.max(100, Number(process.env.MAX_OP_MS || 2000));
const CHANGED = Math.max(0, Number(process.env.CHANGED || 10));
const log = (s: string): void => { process.stderr.write(s + '\n'); };

function rssMiB(pid: number | undefined): number {
  try {
    const m = /VmRSS:\s+(\d+) kB/.exec(fs.readFileSync(`/proc/${pid}/status`, 'utf8'));
    return m ? Number(m[1]) / 1024 : NaN;
  } catch { return NaN; }
}

interface FleetResult {
  volumes: number;
  createS: number;
  lsS: number;
  infoS: number;
  /** `baton info` once GC has run. */
  infoAfterGcS: number;
  serveStartS: number;
  serveRssMiB: number;
  attachS: number;
  changed: number;
  gcFirst: GcRun;
  gcSecond: GcRun;
}

interface GcRun {
  seconds: number;
  records: number;
  reused: number;
  /** Records loaded live (not as of the run's listing), and listings of volumes/ (1 when none was). */
  live: number;
  recordListings: number;
  /** Keys under vol/ and volumes/ when the run listed them. */
  storeKeys: number;
  /** Keys all listings returned (an S3 listing is one request per 1,000 keys). */
  keysListed: number;
  requests: Record<'get' | 'head' | 'list' | 'put' | 'delete', number>;
}

const reqs = (g: GcRun): string => `${g.requests.get} / ${g.requests.head} / ${g.requests.list} / ${g.requests.put} / ${g.requests.delete}`;

async function oneFleet(n: number, root: string): Promise<FleetResult> {
  const dir = path.join(root, `f${n}`);
  const storeDir = path.join(dir, 'store');
  const env = { ...process.env, BATON_MAX_OPERATION_MS: String(MAX_OP_MS), BATON_HOME: path.join(dir, 'home'), BATON_CACHE_DIR: path.join(dir, 'cache') };
  process.env.BATON_MAX_OPERATION_MS = String(MAX_OP_MS);
  const store = openStore(`file:${storeDir}`);
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => BlockCache.open({ capacityBytes: 64 * MiB }), volume: { maxOperationMs: MAX_OP_MS } });
  const t0 = performance.now();
  const data = Buffer.alloc(MiB, 7);
  await mapLimit(Array.from({ length: n }, (_, i) => i), 16, async (i) => {
    await catalog.create(`v${i}`, 1024 * MiB);
    if (i % WRITTEN_EVERY !== 0) return;
    const v = (await catalog.open(`v${i}`, { readOnly: false })).backend as Volume;
    await v.write(0, data, false);
    await v.flush();
    await v.close();
  });
  const createS = (performance.now() - t0) / 1000;
  log(`  ${n} volumes made in ${createS.toFixed(1)} s`);
  await store.close();

  const cli = async (...args: string[]): Promise<number> => (await runCommand(['node', BATON_BIN, ...args, '--store', `file:${storeDir}`], { env, timeoutMs: 1_800_000 })).seconds;
  const lsS = await cli('ls', '--json');
  const infoS = await cli('info', 'v0', '--json');
  log(`  baton ls ${lsS.toFixed(2)} s, baton info ${infoS.toFixed(2)} s`);

  const sdir = path.join(dir, 'serve');
  fs.mkdirSync(sdir, { recursive: true });
  const server = await startBaton({ dir: sdir, volume: 'v0', size: 0, store: `file:${storeDir}`, create: false, env });
  const serveStartS = (performance.now() - server.spawnedAt) / 1000;
  const serveRssMiB = rssMiB(server.pid);
  let attachS = NaN;
  try {
    attachS = (await runCommand(['nbdinfo', server.uri], { timeoutMs: 600_000 })).seconds;
  } finally {
    await server.stop();
  }
  log(`  serve listening after ${serveStartS.toFixed(2)} s (${fmt(serveRssMiB)} MiB RSS); attach ${attachS.toFixed(2)} s`);

  // GC twice: the first run computes every record (and saves its state), then CHANGED volumes
  // are written, and the second run reads only what changed (src/volume/gc.ts, "Reusing").
  const inst = new InstrumentedObjectStore(openStore(`file:${storeDir}`));
  const gcCatalog = new StoreCatalog({ store: inst, log: silentLogger(), cache: () => BlockCache.open({ capacityBytes: 64 * MiB }), volume: { maxOperationMs: MAX_OP_MS } });
  const gcRun = async (): Promise<GcRun> => {
    inst.reset();
    const g0 = performance.now();
    const r = await collectGarbage(gcCatalog, { graceMs: 2 * MAX_OP_MS, maxOperationMs: MAX_OP_MS });
    const seconds = (performance.now() - g0) / 1000;
    const st = inst.stats();
    return {
      seconds, records: r.records, reused: r.reusedRecords, live: r.liveRecords, recordListings: r.recordListings, storeKeys: r.objects + r.records, keysListed: st.list.items,
      requests: { get: st.get.requests, head: st.head.requests, list: st.list.requests, put: st.put.requests, delete: st.delete.requests },
    };
  };
  const gcFirst = await gcRun();
  log(`  gc, first run ${gcFirst.seconds.toFixed(1)} s, requests ${JSON.stringify(gcFirst.requests)}`);
  const changed = Array.from({ length: Math.min(CHANGED, n) }, (_, k) => Math.floor((k * n) / Math.min(CHANGED, n)));
  for (const i of changed) {
    const v = (await gcCatalog.open(`v${i}`, { readOnly: false })).backend as Volume;
    await v.write(2 * MiB, data, false);
    await v.flush();
    await v.close();
  }
  const gcSecond = await gcRun();
  log(`  gc, second run after ${changed.length} volumes were written: ${gcSecond.seconds.toFixed(1)} s, ${gcSecond.reused} of ${gcSecond.records} records reused, requests ${JSON.stringify(gcSecond.requests)}`);
  await inst.close();
  // `baton info` again, after GC runs (a family found through fork markers reads neither every record nor GC's state).
  const infoAfterGcS = await cli('info', 'v0', '--json');
  log(`  baton info after the GC runs ${infoAfterGcS.toFixed(2)} s`);
  fs.rmSync(dir, { recursive: true, force: true });
  return { volumes: n, createS, lsS, infoS, infoAfterGcS, serveStartS, serveRssMiB, attachS, changed: changed.length, gcFirst, gcSecond };
}

async function main(): Promise<void> {
  const machine = machineInfo();
  const started = Date.now();
  log(`fleet: VOLUMES=${VOLUMES.join(',')} WRITTEN_EVERY=${WRITTEN_EVERY} MAX_OP_MS=${MAX_OP_MS}; ${machine.nproc} cores`);
  const root = makeTempDir('baton-fleet-');
  const results: FleetResult[] = [];
  try {
    for (const n of VOLUMES) results.push(await oneFleet(n, root));
  } finally {
    fs.rmSync(root, { recursive: true, force: true });
  }
  const L: string[] = [];
  L.push('# fleet: one store, many idle volumes\n');
  L.push(`${new Date(started).toISOString().slice(0, 16).replace('T', ' ')} UTC, ${machine.nproc} cores, node ${machine.node}, baton ${machine.batonCommit ?? '?'}; whole run ${((Date.now() - started) / 1000).toFixed(0)} s.`);
  L.push(`A \`file:\` store; 1 GiB volumes, one in ${WRITTEN_EVERY} with 1 MiB written and flushed. \`ls\` and \`info\` are the CLI with --json; serve is \`baton serve\` on a Unix socket (time to listening, RSS then), attach is \`nbdinfo\` of one volume on it; GC below. BATON_MAX_OPERATION_MS=${MAX_OP_MS}.\n`);
  L.push(markdownTable(['volumes', 'baton ls, s', 'baton info one, s (before any GC run / after)', 'serve start-up, s', 'serve RSS, MiB', 'attach one, s'],
    results.map((r) => [r.volumes.toLocaleString('en-US'), fmt(r.lsS), `${fmt(r.infoS)} / ${fmt(r.infoAfterGcS)}`, fmt(r.serveStartS), fmt(r.serveRssMiB), fmt(r.attachS)])));
  L.push(`\n### Garbage collection: a first run, then a run after ${CHANGED} volumes were written\n`);
  L.push('Two real runs (grace 2M) through an instrumented store; requests by kind (get / head / list / put / delete). The first run computes every record\'s map and saves `gc/state`; the second reuses the contribution of every record whose inputs are unchanged in its listing and reads only the written volumes. "keys listed" is what every listing returned: on S3 a listing costs one request per 1,000 keys, so the store-wide listings cost keys/1000 requests there.\n');
  L.push(markdownTable(['volumes', 'keys in the store', 'first run, s', 'first run requests', 'second run, s', 'records reused', 'second run requests', 'listings of volumes/ (second)', 'keys listed (second)', 'S3 list pages at 1,000 keys (second, store-wide) / allowed'],
    results.map((r) => [r.volumes.toLocaleString('en-US'), r.gcSecond.storeKeys.toLocaleString('en-US'), fmt(r.gcFirst.seconds), reqs(r.gcFirst), fmt(r.gcSecond.seconds), `${r.gcSecond.reused} of ${r.gcSecond.records}`, reqs(r.gcSecond),
      String(r.gcSecond.recordListings), r.gcSecond.keysListed.toLocaleString('en-US'), `${Math.ceil(r.gcSecond.keysListed / 1000)} / ${Math.ceil(r.gcSecond.storeKeys / 1000)}`])));
  L.push('\n```sh\nnode dist/bench/fleet.js   # VOLUMES=10,1000,10000\n```\n');
  const out = writeResults('fleet', L.join('\n'), { machine, knobs: { VOLUMES, WRITTEN_EVERY, CHANGED, MAX_OP_MS }, results });
  log(`results: ${out.md}, ${out.json}`);
}

await main();

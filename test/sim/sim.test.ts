/**
 * The simulator in CI: a fixed budget of seeds (two worker threads, one per core), the seeds
 * that found each trust item when its fix was reverted (they must pass on the fixed code),
 * the open findings (test.failing: they start passing when fixed), and self-tests of the
 * simulated world, store and model (the checks can fail).
 *
 * SIM_SEEDS=N overrides the budget's seed count (default 500), SIM_STEPS its steps.
 */
import test from 'ava';
import { readFileSync } from 'node:fs';
import { Worker } from 'node:worker_threads';
import { NotFoundError, OutOfRangeError, PreconditionFailedError } from '../../src/errors.js';
import { listAll } from '../../src/store/object-store.js';
import { BLOCK, Model, Violation } from './model.js';
import { KNOWN_OPEN } from './run.js';
import { describeFailure, replayCommand, runSeed } from './sim.js';
import { NO_FAULTS, SimStoreClient, SimStoreServer } from './store.js';
import type { SeedSummary } from './worker.js';
import { Rng, Sim } from './world.js';

const SEEDS = Number(process.env.SIM_SEEDS ?? 500);
const STEPS = Number(process.env.SIM_STEPS ?? 300);

/**
 * test/sim/regressions.json: one seed per fix that the simulator found with that fix
 * reverted (`revert`: test/sim/reverts/REVERT.patch; `check`: what fired). The fixed code
 * must pass each; `bash test/sim/reverts/run.sh --check` shows each still fails on its
 * revert (a change to the simulator moves what a seed does: re-find seeds then).
 */
const REGRESSIONS: { item: string; revert: string; seed: number; steps: number; workload: 'engine' | 'served'; off?: string[]; check: string }[] = JSON.parse(
  readFileSync(new URL('../../../test/sim/regressions.json', import.meta.url), 'utf8'),
);

/** Open findings: each seed fails today with its known check; test.failing flips when fixed. */
// F4 (run.ts KNOWN_F4) is open, but no seed of the current simulator shows it (seeds 303 and
// 5012 did on the version it was found with; 1,500 seeds of this one did not): it stays
// recognised, and a seed goes here once one shows it again.
const OPEN: { finding: string; seed: number; steps: number; workload: 'engine' | 'served'; check: string }[] = [];

// ------------------------------------------------------------------ self-tests

/** Drive `fn` on a fresh world until it settles. */
async function inWorld<T>(fn: (sim: Sim) => Promise<T>): Promise<T> {
  const sim = new Sim(1);
  let done = false;
  let value!: T;
  let error: unknown = null;
  void fn(sim).then((v) => { value = v; done = true; }, (e) => { error = e; done = true; });
  while (!done && (await sim.step()));
  await new Promise((r) => setImmediate(r));
  if (error) throw error;
  if (!done) throw new Error('the world went quiet before the test settled');
  return value;
}

test('world: timers fire in (time, sequence) order; a paused host\'s fire late, a crashed process\'s never', async (t) => {
  const order: string[] = [];
  await inWorld(async (sim) => {
    const a = sim.host('a');
    const b = sim.host('b');
    const pa = a.start();
    const pb = b.start();
    pa.setTimeout(() => order.push(`a1@${sim.now}`), 10);
    pb.setTimeout(() => order.push(`b1@${sim.now}`), 10);
    pa.setTimeout(() => order.push(`a2@${sim.now}`), 20);
    pb.setTimeout(() => order.push(`b-dead@${sim.now}`), 30);
    sim.after(15, () => a.pause());
    sim.after(25, () => b.crash());
    sim.after(100, () => a.resume());
    await new Promise<void>((r) => { sim.after(200, r); });
  });
  t.deepEqual(order, ['a1@10', 'b1@10', 'a2@100']);
});

test('world: a pause is ended only by its own resume (an earlier pause\'s timer never cuts a later one short)', async (t) => {
  const order: string[] = [];
  await inWorld(async (sim) => {
    const a = sim.host('a');
    const pa = a.start();
    pa.setTimeout(() => order.push(`a@${sim.now}`), 50);
    let first = -1;
    let second = -1;
    sim.after(10, () => { first = a.pause(); });
    sim.after(20, () => a.resume(first));
    sim.after(30, () => { second = a.pause(); });
    sim.after(60, () => a.resume(first)); // the first pause's late timer: not this pause's
    sim.after(90, () => a.resume(second));
    await new Promise<void>((r) => { sim.after(200, r); });
  });
  t.deepEqual(order, ['a@90']);
});

test('sim store: S3 semantics (create-only, ranges, listing order and pages, read-after-write) and the GC audit', async (t) => {
  const violations: string[] = [];
  await inWorld(async (sim) => {
    const server = new SimStoreServer(sim);
    server.onViolation = (m) => violations.push(m);
    const p = sim.host('h').start();
    const faults = { ...NO_FAULTS, pageSize: 2 };
    const c = new SimStoreClient(server, p, () => faults, new Rng(3), 'host');
    const gc = new SimStoreClient(server, p, () => faults, new Rng(4), 'gc');
    // Two racing create-only puts: exactly one wins.
    const r = await Promise.allSettled([c.put('vol/x/log/1', Buffer.from('a'), { ifNoneMatch: true }), c.put('vol/x/log/1', Buffer.from('b'), { ifNoneMatch: true })]);
    t.is(r.filter((x) => x.status === 'fulfilled').length, 1);
    t.true(r.some((x) => x.status === 'rejected' && x.reason instanceof PreconditionFailedError));
    await c.put('vol/x/seg/2', Buffer.from('0123456789'));
    t.is((await c.get('vol/x/seg/2', { offset: 3, length: 4 })).toString(), '3456');
    await t.throwsAsync(c.get('vol/x/seg/2', { offset: 8, length: 4 }), { instanceOf: OutOfRangeError });
    for (const k of ['vol/x/b', 'vol/x/a', 'vol/y/a', 'vol/x/c', 'vol/x/\u00e9']) await c.put(k, Buffer.from(k));
    t.deepEqual((await listAll(c, 'vol/x/')).map((o) => o.key), ['vol/x/a', 'vol/x/b', 'vol/x/c', 'vol/x/log/1', 'vol/x/seg/2', 'vol/x/\u00e9']);
    t.deepEqual((await listAll(c, 'vol/x/', { startAfter: 'vol/x/c' })).map((o) => o.key), ['vol/x/log/1', 'vol/x/seg/2', 'vol/x/\u00e9']);
    await gc.delete('vol/x/seg/2');
    await c.delete('vol/x/seg/2'); // idempotent
    await t.throwsAsync(c.get('vol/x/seg/2'), { instanceOf: NotFoundError });
    t.is(violations.length, 0, 'a metadata read of a deleted key is tolerated');
    await t.throwsAsync(c.forData().get('vol/x/seg/2'), { instanceOf: NotFoundError });
  });
  t.is(violations.length, 1, 'a data read of an object GC deleted is a violation');
  t.regex(violations[0]!, /GC deleted an object a live map still reads/);
});

test('model: a lost acknowledged write, a stale holder\'s write and garbage are each a violation', (t) => {
  const sim = new Sim(1);
  const found: Violation[] = [];
  const m = new Model(sim, (v) => found.push(v));
  const vol = m.volume('id1', 'v', 'volume', 4, null);
  const a = m.beginSession(vol, 'h0', 1, m.stamp());
  const w1 = m.issueWrite(a, 0, 1, false, false);
  m.writeDone(w1.wid, true);
  sim.now = 10;
  m.durable(a, m.stamp());
  sim.now = 20;
  // A fresh reader that sees zeroes at block 0 after the flush was acknowledged: lost.
  m.checkRead(vol, null, 0, Buffer.alloc(BLOCK), m.stamp(), m.stamp(), 'reader');
  t.is(found.pop()?.check, 'lost-write');
  // It sees the write: fine.
  m.checkRead(vol, null, 0, w1.data!, m.stamp(), m.stamp(), 'reader');
  t.is(found.length, 0);
  // B takes over; A, stale, writes block 1 afterwards; nobody may ever see it.
  const b = m.beginSession(vol, 'h1', 2, m.stamp());
  void b;
  const w2 = m.issueWrite(a, 1, 1, false, false);
  m.writeDone(w2.wid, true);
  const buf = Buffer.alloc(BLOCK);
  w2.data!.copy(buf);
  m.checkRead(vol, null, BLOCK, buf, m.stamp(), m.stamp(), 'reader');
  t.is(found.pop()?.check, 'stale-writer-visible');
  // Bytes nobody wrote.
  m.checkRead(vol, null, 2 * BLOCK, Buffer.alloc(BLOCK, 7), m.stamp(), m.stamp(), 'reader');
  t.is(found.pop()?.check, 'never-written');
});

test('a seed replays exactly (same trace, same numbers)', async (t) => {
  for (const workload of ['engine', 'served'] as const) {
    const a = await runSeed({ seed: 7, steps: 120, workload });
    const b = await runSeed({ seed: 7, steps: 120, workload });
    t.is(a.events, b.events);
    t.is(a.simMs, b.simMs);
    t.deepEqual(a.stats, b.stats);
    t.deepEqual(a.trace, b.trace);
  }
});

test('the replay command replays the run: naming the workload the seed drew changes nothing', async (t) => {
  for (const seed of [7, 8]) {
    const drawn = await runSeed({ seed, steps: 120 });
    const named = await runSeed({ seed, steps: 120, workload: drawn.workload });
    t.is(named.events, drawn.events);
    t.deepEqual(named.trace, drawn.trace);
  }
});

// ------------------------------------------------------------------ the budget

test.serial(`budget: ${SEEDS} seeds of ${STEPS} steps, no new finding`, async (t) => {
  t.timeout(15 * 60_000);
  const t0 = performance.now();
  const workers = 2;
  const parts: number[][] = Array.from({ length: workers }, () => []);
  for (let s = 1; s <= SEEDS; s++) parts[s % workers]!.push(s);
  const results = (await Promise.all(parts.map((seeds) => new Promise<SeedSummary[]>((resolve, reject) => {
    const w = new Worker(new URL('./worker.js', import.meta.url), { workerData: { seeds, steps: STEPS } });
    w.once('message', resolve);
    w.once('error', reject);
    w.once('exit', (code) => { if (code !== 0) reject(new Error(`sim worker exited with ${code}`)); });
  })))).flat().sort((a, b) => a.seed - b.seed);
  const wall = (performance.now() - t0) / 1000;
  const simMs = results.reduce((n, r) => n + r.simMs, 0);
  const events = results.reduce((n, r) => n + r.events, 0);
  t.log(`${results.length} seeds in ${wall.toFixed(1)} s: ${(results.length / wall).toFixed(2)} seeds/s, ${(simMs / 3.6e6 / (wall / 60)).toFixed(1)} simulated hours per real minute, ${events} events, ${results.filter((r) => r.workload === 'served').length} served-volume runs`);
  const known = results.filter((r) => !r.ok && KNOWN_OPEN.includes(r.check!));
  for (const k of known) t.log(`known open finding ${k.check} at seed ${k.seed} (see OPEN in sim.test.ts)`);
  const fresh = results.filter((r) => !r.ok && !KNOWN_OPEN.includes(r.check!));
  for (const f of fresh) t.log(f.report!);
  t.is(fresh.length, 0, `${fresh.length} seeds failed: ${fresh.map((f) => `${f.seed} (${f.check})`).join(', ')}`);
});

// ------------------------------------------------------------------ regressions and open findings

for (const r of REGRESSIONS) {
  test(`regression ${r.item}: seed ${r.seed} (${r.workload}, ${r.steps} steps${r.off?.length ? `, off ${r.off.join(',')}` : ''}) passes`, async (t) => {
    const res = await runSeed({ seed: r.seed, steps: r.steps, workload: r.workload, off: new Set(r.off ?? []) });
    if (!res.ok) t.log(describeFailure(res));
    t.true(res.ok, res.ok ? '' : `${res.violation!.check}: ${res.violation!.message}; ${replayCommand(res)}`);
  });
}

for (const o of OPEN) {
  test.failing(`open finding ${o.finding}: seed ${o.seed} (${o.workload}) passes once it is fixed`, async (t) => {
    const res = await runSeed({ seed: o.seed, steps: o.steps, workload: o.workload });
    t.true(res.ok, res.ok ? '' : `${res.violation!.check}: ${res.violation!.message}`);
  });
}

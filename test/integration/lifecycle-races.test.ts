/**
 * Rename racing what else changes the catalog (docs/rfc-lifecycle.md, "Races"), through the
 * API on a real `file:` store: a fork of the source, another rename onto the same name, GC
 * runs (with M = 1 s so that a grace period is seconds), a handoff, and a client attaching
 * the destination while it is replaced. After each: every name names one whole volume whose
 * bytes are what was written to it, and nothing a name needs was deleted.
 */

import test from 'ava';
import { execFile } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { promisify } from 'node:util';

// GC's grace must be >= 2M: with M = 1 s a grace is 2 s. Set before anything reads it.
process.env.BATON_MAX_OPERATION_MS = '1000';

const { openDeployment, isBatonError } = await import('../../src/api.js');
type Deployment = Awaited<ReturnType<typeof openDeployment>>;
const { has, tempDir } = await import('../helpers/server.js');

const run = promisify(execFile);
const MiB = 1024 * 1024;
const withNbdcopy = has('nbdcopy') ? test : test.skip;

async function deployment(t: { teardown(fn: () => unknown): void }, hostId = 'race-host'): Promise<{ d: Deployment; dir: string }> {
  const dir = tempDir(t, 'baton-race-');
  const d = await openDeployment({ store: `file:${path.join(dir, 'store')}`, hostId, cacheDir: path.join(dir, 'cache') });
  t.teardown(() => d.close());
  return { d, dir };
}

/** Write `fill` over the first MiB through the engine (no server; a writer without a lease) and flush. */
async function fillVolume(d: Deployment, name: string, fill: number): Promise<void> {
  const ov = await d.storeCatalog('test').open(name, { readOnly: false });
  try {
    await ov.backend.write(0, Buffer.alloc(MiB, fill), false);
    await ov.backend.flush();
  } finally {
    await ov.close();
  }
}

/** The fill byte of a volume's first MiB, or 'mixed' if it is not one byte throughout. */
async function fillOf(d: Deployment, name: string): Promise<number | 'mixed'> {
  const ov = await d.storeCatalog('test').open(name, { readOnly: true });
  try {
    const b = await ov.backend.read(0, MiB);
    return b.every((x) => x === b[0]) ? b[0]! : 'mixed';
  } finally {
    await ov.close();
  }
}

async function names(d: Deployment): Promise<string[]> {
  return (await d.list({ accounting: false })).map((v) => v.name).sort();
}

const jitter = (): Promise<void> => new Promise((r) => setTimeout(r, Math.floor(Math.random() * 15)));

test('rename racing a fork of its source: the fork is of the source or refused; both volumes whole', async (t) => {
  const { d } = await deployment(t);
  let forked = 0;
  for (let i = 0; i < 12; i++) {
    const [a, b, f] = [`a${i}`, `b${i}`, `f${i}`];
    await d.create(a, { size: 4 * MiB });
    await fillVolume(d, a, 0x10 + i);
    const [ren, fork] = await Promise.allSettled([
      d.rename(a, b),
      // Started at different points of the rename: before it, during its lease and landing, after.
      (async () => { await new Promise((r) => setTimeout(r, i * 6)); return d.fork(a, f); })(),
    ]);
    t.is(ren.status, 'fulfilled', ren.status === 'rejected' ? String(ren.reason) : '');
    if (fork.status === 'rejected') t.true(isBatonError(fork.reason, 'BATON_ERR_NOT_FOUND'), String(fork.reason));
    else forked++;
    const now = await names(d);
    t.false(now.includes(a), `${a} renamed away`);
    t.is(await fillOf(d, b), 0x10 + i);
    t.is(now.includes(f), fork.status === 'fulfilled');
    if (fork.status === 'fulfilled') t.is(await fillOf(d, f), 0x10 + i, 'the fork holds the source\'s data');
  }
  t.log(`${forked} of 12 forks landed before the rename took the name away`);
  // rm of everything works and finds every ancestry (nothing names a missing meta).
  for (const n of await names(d)) await d.rm(n);
  t.deepEqual(await names(d), []);
});

test('two renames onto one name: exactly one lands; the other changes nothing', async (t) => {
  const { d } = await deployment(t);
  for (let i = 0; i < 8; i++) {
    const [x, y, to] = [`x${i}`, `y${i}`, `t${i}`];
    await d.create(x, { size: 4 * MiB });
    await d.create(y, { size: 4 * MiB });
    await fillVolume(d, x, 0x21);
    await fillVolume(d, y, 0x22);
    const rs = await Promise.allSettled([d.rename(x, to), d.rename(y, to)]);
    const won = rs.filter((r) => r.status === 'fulfilled').length;
    t.is(won, 1, rs.map((r) => (r.status === 'rejected' ? String(r.reason) : 'ok')).join(' / '));
    for (const r of rs) if (r.status === 'rejected') t.true(isBatonError(r.reason, 'BATON_ERR_LEASE_HELD') || isBatonError(r.reason, 'BATON_ERR_ALREADY_EXISTS'), String(r.reason));
    const winner = rs[0]!.status === 'fulfilled' ? x : y;
    const loser = winner === x ? y : x;
    t.deepEqual((await names(d)).filter((n) => n.endsWith(String(i))), [loser, to].sort());
    t.is(await fillOf(d, to), winner === x ? 0x21 : 0x22);
    t.is(await fillOf(d, loser), loser === x ? 0x21 : 0x22, 'the loser is untouched');
  }
});

test('rename --replace racing GC runs: after the grace, every name still reads its data', async (t) => {
  const { d } = await deployment(t);
  await d.create('work', { size: 4 * MiB });
  await fillVolume(d, 'work', 0x30);
  const expected = new Map<string, number>([['work', 0x30]]);
  let gcRuns = 0;
  let stop = false;
  const gcLoop = (async () => {
    while (!stop) {
      await d.gc({ graceMs: 2000 });
      gcRuns++;
    }
  })();
  for (let i = 1; i <= 4; i++) {
    const attempt = `try-${i}`;
    await d.fork('work', attempt);
    await fillVolume(d, attempt, 0x30 + i);
    await jitter();
    await d.rename(attempt, 'work', { replace: true });
    expected.set('work', 0x30 + i);
    await new Promise((r) => setTimeout(r, 700));
  }
  // Past two grace periods, with GC still running: whatever it marked while the renames ran
  // has been deleted by now if it was going to be.
  await new Promise((r) => setTimeout(r, 4500));
  stop = true;
  await gcLoop;
  t.true(gcRuns >= 3, `${gcRuns} GC runs`);
  const r = await d.gc({ graceMs: 2000 });
  t.true(r.deletedObjects + r.markedObjects >= 0);
  t.deepEqual(await names(d), ['work']);
  t.is(await fillOf(d, 'work'), expected.get('work')!);
  const info = await d.info('work');
  t.is(info.size, 4 * MiB);
});

withNbdcopy('rename racing a handoff of its source, and a client attaching during rename --replace: never a mix', async (t) => {
  const { d, dir } = await deployment(t);
  const server = await d.serve({ listen: { path: path.join(dir, 'nbd.sock') }, idleGraceMs: 60_000 });
  t.teardown(() => server.close());
  await d.create('work', { size: 4 * MiB });
  await d.create('src', { size: 4 * MiB });
  const file = path.join(dir, 'fill.bin');
  fs.writeFileSync(file, Buffer.alloc(MiB, 0x51));
  await run('nbdcopy', ['--flush', file, server.uri('src')]);
  t.is(server.exports.stateOf('src'), 'serving');
  // The handoff releases src's lease reserved for host-b; the rename needs that lease.
  const [h, r] = await Promise.allSettled([d.handoff('src', 'host-b', { waitMs: 10_000 }), d.rename('src', 'renamed')]);
  t.is(h.status, 'fulfilled', h.status === 'rejected' ? String(h.reason) : '');
  t.is(r.status, 'rejected', 'the source was served, then reserved for host-b');
  if (r.status === 'rejected') t.true(isBatonError(r.reason, 'BATON_ERR_LEASE_HELD'), String(r.reason));
  t.deepEqual(await names(d), ['src', 'work'], 'nothing changed');
  t.is(await fillOf(d, 'src'), 0x51);

  // Clients read work over NBD while attempts replace it: each read is one whole volume.
  fs.writeFileSync(file, Buffer.alloc(MiB, 0x60));
  await run('nbdcopy', ['--flush', file, server.uri('work')]);
  await server.release('work');
  const seen = new Set<string>();
  for (let i = 1; i <= 4; i++) {
    await d.fork('work', `try-${i}`);
    await fillVolume(d, `try-${i}`, 0x60 + i);
    const reader = (async () => {
      const out = path.join(dir, `read-${i}.bin`);
      for (let k = 0; k < 6; k++) {
        try {
          await run('nbdcopy', [server.uri('work'), out]);
        } catch (err) {
          seen.add('refused'); // held by the rename, or absent for a moment: never a mix
          continue;
        }
        const b = fs.readFileSync(out).subarray(0, MiB);
        seen.add(b.every((x) => x === b[0]) ? `fill ${b[0]}` : 'MIX');
        await server.release('work').catch(() => {});
      }
    })();
    await jitter();
    await d.rename(`try-${i}`, 'work', { replace: true, force: true });
    await reader;
    await server.release('work').catch(() => {});
    t.is(await fillOf(d, 'work'), 0x60 + i);
  }
  t.log(`reads saw: ${[...seen].join(', ')}`);
  t.false(seen.has('MIX'));
  t.deepEqual(await names(d), ['src', 'work']);
});

/** Write `fill` over [offset, offset + MiB) through the engine, and flush. */
async function fillAt(d: Deployment, name: string, offset: number, fill: number): Promise<void> {
  const ov = await d.storeCatalog('test').open(name, { readOnly: false });
  try {
    await ov.backend.write(offset, Buffer.alloc(MiB, fill), false);
    await ov.backend.flush();
  } finally {
    await ov.close();
  }
}

async function readAt(d: Deployment, name: string, offset: number): Promise<number | 'mixed'> {
  const ov = await d.storeCatalog('test').open(name, { readOnly: true });
  try {
    const b = await ov.backend.read(offset, MiB);
    return b.every((x) => x === b[0]) ? b[0]! : 'mixed';
  } finally {
    await ov.close();
  }
}

test('resize racing a fork: the fork has the size before or after, and its data; the volume the new size', async (t) => {
  const { d } = await deployment(t);
  const sizes = new Set<number>();
  for (let i = 0; i < 10; i++) {
    const [v, f] = [`v${i}`, `f${i}`];
    await d.create(v, { size: 4 * MiB });
    await fillVolume(d, v, 0x70 + i);
    const [r, fk] = await Promise.allSettled([
      d.resize(v, { size: 8 * MiB }),
      (async () => { await new Promise((res) => setTimeout(res, i * 3)); return d.fork(v, f); })(),
    ]);
    t.is(r.status, 'fulfilled', r.status === 'rejected' ? String(r.reason) : '');
    t.is(fk.status, 'fulfilled', fk.status === 'rejected' ? String(fk.reason) : '');
    t.is((await d.info(v)).size, 8 * MiB);
    const fs = (await d.info(f)).size;
    t.true(fs === 4 * MiB || fs === 8 * MiB, String(fs));
    sizes.add(fs);
    t.is(await fillOf(d, f), 0x70 + i);
    if (fs === 8 * MiB) await fillAt(d, f, 7 * MiB, 0x7f); // the fork is writable to its end
  }
  t.log(`fork sizes seen: ${[...sizes].map((s) => s / MiB).join(', ')} MiB`);
});

test('resize racing GC runs: data past the old end survives; a shrunk volume and its fork still recover', async (t) => {
  const { d } = await deployment(t);
  await d.create('v', { size: 4 * MiB });
  await fillVolume(d, 'v', 0x11);
  let stop = false;
  let runs = 0;
  const gcLoop = (async () => { while (!stop) { await d.gc({ graceMs: 2000 }); runs++; } })();
  await d.resize('v', { size: 16 * MiB });
  await fillAt(d, 'v', 12 * MiB, 0x12); // past the old end: named by the log, read by GC's recovery
  await d.fork('v', 'f');
  // Trim the tail, then shrink under the lease: the old records still name extents past the new end.
  {
    const ov = await d.storeCatalog('test').open('v', { readOnly: false });
    await ov.backend.trim(4 * MiB, 12 * MiB, false);
    await ov.backend.flush();
    await ov.close();
  }
  const shrink = await d.resize('v', { size: 8 * MiB, shrink: true });
  t.deepEqual(shrink, { name: 'v', from: 16 * MiB, to: 8 * MiB });
  await d.fork('v', 'g'); // a fork of the shrunk volume replays records of its larger past
  await new Promise((r) => setTimeout(r, 5000)); // two grace periods of GC
  stop = true;
  await gcLoop;
  t.true(runs >= 2, `${runs} GC runs`);
  t.is(await fillOf(d, 'v'), 0x11);
  t.is(await readAt(d, 'f', 12 * MiB), 0x12, 'the fork of the grown volume keeps the data past the old end');
  t.is((await d.info('g')).size, 8 * MiB);
  t.is(await fillOf(d, 'g'), 0x11);
  t.is(await readAt(d, 'g', 7 * MiB), 0, 'past the trim: zeroes');
});

test('grow racing a rename of the volume: when the grow reports success, the renamed volume has the new size', async (t) => {
  const { d } = await deployment(t);
  let carried = 0;
  let refused = 0;
  for (let i = 0; i < 14; i++) {
    const [a, b] = [`a${i}`, `b${i}`];
    await d.create(a, { size: 4 * MiB });
    const [ren, rs] = await Promise.allSettled([
      d.rename(a, b),
      (async () => { await new Promise((res) => setTimeout(res, i * 4)); return d.resize(a, { size: 8 * MiB }); })(),
    ]);
    t.is(ren.status, 'fulfilled', ren.status === 'rejected' ? String(ren.reason) : '');
    const size = (await d.info(b)).size;
    if (rs.status === 'fulfilled') {
      t.is(size, 8 * MiB, `round ${i}: the grow succeeded, so ${b} has its size`);
      carried++;
    } else {
      t.true(isBatonError(rs.reason, 'BATON_ERR_NOT_FOUND') || isBatonError(rs.reason, 'BATON_ERR_PRECONDITION_FAILED'), String(rs.reason));
      refused++;
    }
    t.deepEqual((await names(d)).filter((n) => n.endsWith(String(i))), [b]);
  }
  t.log(`${carried} grows reached the renamed volume, ${refused} were told the name went away`);
});

withNbdcopy('resize racing a handoff of the served volume: the grow lands, the new holder serves the new size; a shrink is refused while served', async (t) => {
  const { d, dir } = await deployment(t);
  const server = await d.serve({ listen: { path: path.join(dir, 'nbd.sock') }, idleGraceMs: 60_000 });
  t.teardown(() => server.close());
  await d.create('v', { size: 4 * MiB });
  const file = path.join(dir, 'fill.bin');
  fs.writeFileSync(file, Buffer.alloc(MiB, 0x55));
  await run('nbdcopy', ['--flush', file, server.uri('v')]);
  const [h, g, s] = await Promise.allSettled([
    d.handoff('v', 'host-b', { waitMs: 10_000 }),
    d.resize('v', { size: 8 * MiB }),
    d.resize('v', { size: 2 * MiB, shrink: true }),
  ]);
  t.is(h.status, 'fulfilled', h.status === 'rejected' ? String(h.reason) : '');
  t.is(g.status, 'fulfilled', g.status === 'rejected' ? String(g.reason) : '');
  t.is(s.status, 'rejected');
  if (s.status === 'rejected') t.true(isBatonError(s.reason, 'BATON_ERR_LEASE_HELD') || isBatonError(s.reason, 'BATON_ERR_INVALID_ARGUMENT'), String(s.reason));
  // host-b takes it (another deployment, as another host would) and serves the new size.
  const b = await openDeployment({ store: d.store, hostId: 'host-b', cacheDir: path.join(dir, 'cache-b') });
  t.teardown(() => b.close());
  const sb = await b.serve({ listen: { path: path.join(dir, 'nbd-b.sock') }, idleGraceMs: 200 });
  t.teardown(() => sb.close());
  const out = path.join(dir, 'out.bin');
  await run('nbdcopy', [sb.uri('v'), out]);
  const got = fs.readFileSync(out);
  t.is(got.length, 8 * MiB, 'served at its new size');
  t.true(got.subarray(0, MiB).equals(Buffer.alloc(MiB, 0x55)));
  t.true(got.subarray(4 * MiB).equals(Buffer.alloc(4 * MiB)));
});

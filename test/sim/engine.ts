/**
 * The engine workload: the real Volume, StoreCatalog and collectGarbage on every host,
 * sharing the simulated store and lease service.
 *
 * - Writers: a session takes the lease of a volume (or fork), recovers it, commits a
 *   takeover record under the lease's token, binds the write deadline to the lease, and
 *   then 1-3 clients write, trim, zero, read, flush (FUA too), compact and read everything
 *   back, concurrently (never two writes to one block at once: the model orders versions
 *   by issue). Most sessions close (flush + checkpoint) and release the lease; some are
 *   dropped. A crash or a long pause leaves the lease to expire: the next session takes over.
 * - Readers: long-lived read-only views (which must refresh a map older than M/2), fresh
 *   opens on a cold cache, reads at any offset.
 * - Admin: create, fork (of volumes, forks and snapshots), snapshot, rm (of what nobody uses;
 *   forks keep their ancestors' data).
 * - GC: collectGarbage with the run's grace, now and then, on one or two hosts.
 * Every read is checked against the model; every ack is recorded as evidence.
 */

import { BatonError, LeaseLostError, errorMessage } from '../../src/errors.js';
import type { Lease } from '../../src/lease/lease.js';
import { collectGarbage } from '../../src/volume/gc.js';
import { keys } from '../../src/volume/format.js';
import { StaleTokenError, Volume } from '../../src/volume/volume.js';
import { BLOCK, Violation, type Session } from './model.js';
import { M, type Actor, type Live, type Node, type SimRun, type Workload } from './run.js';
import { Sim, type Rng } from './world.js';

export const engineWorkload: Workload = {
  actors(i: number): [string, Actor][] {
    const a: [string, Actor][] = [['writer', writerActor], ['reader', readerActor]];
    if (i === 0) a.push(['admin', adminActor]);
    if (i === 0 || i === 2) a.push(['gc', gcActor]);
    return a;
  },
};

// ------------------------------------------------------------------ writers

async function writerActor(run: SimRun, node: Node): Promise<void> {
  const rng = node.rng.derive('writer');
  await node.proc.sleep(rng.logUniform(1, 3000));
  while (run.take(node, 'writer: next session')) {
    // Often the volume another host holds (a user who reattaches elsewhere after the first
    // host hung): the session then waits for the lease and takes over.
    const contended = rng.chance(0.4);
    const l = (contended ? run.pick(rng, (x) => x.vm.kind === 'volume' && (run.leaseService.holderOf(x.name)?.holder ?? node.hostId) !== node.hostId) : null)
      ?? run.pick(rng, (x) => x.vm.kind === 'volume');
    if (!l) { await node.proc.sleep(2000); continue; }
    l.users++;
    try {
      await writerSession(run, node, l, rng);
    } finally {
      l.users--;
    }
    await node.proc.sleep(rng.logUniform(5, 10_000));
  }
}

/** Acquire, with one re-acquire above the log's token if the takeover says so. */
async function openWriter(run: SimRun, node: Node, l: Live, rng: Rng): Promise<{ vol: Volume; lease: Lease; session: Session } | null> {
  const what = `${node.proc.label} writer ${l.name}`;
  let lease: Lease;
  try {
    lease = await run.op(node, `acquire ${l.name}`, () => node.leases.acquire(l.name, node.hostId, { waitMs: rng.chance(0.4) ? 0 : rng.int(500, 4 * run.config.ttlMs) }));
  } catch (err) {
    run.expect(err, `${what}: acquire`, ['LEASE_HELD']);
    return null;
  }
  let vol: Volume | null = null;
  try {
    const rec = await run.op(node, `record ${l.name}`, () => node.catalog('host').record(l.name));
    if (rec.id !== l.vm.id) throw new Error(`${l.name} is ${rec.id} in the store, ${l.vm.id} in the model`);
    const cache = await node.cache();
    vol = await run.op(node, `open ${l.name}`, () => Volume.open(rec, node.volumeOptions(false, cache, 'host', rec)));
    const v = vol;
    const issued = run.model.stamp();
    for (let attempt = 0; ; attempt++) {
      try {
        await run.op(node, `takeover ${l.name} token ${lease.token}`, () => v.takeover(lease.token));
        break;
      } catch (err) {
        if (!(err instanceof StaleTokenError) || attempt > 0) throw err;
        run.note(`  ${what}: token ${lease.token} not above the log's ${err.minToken}: re-acquiring`);
        await lease.release().catch(() => {});
        lease = await run.op(node, `acquire ${l.name} above ${err.minToken}`, () => node.leases.acquire(l.name, node.hostId, { minToken: err.minToken }));
      }
    }
    const held = lease;
    // As exports.ts does (stillOpening): a lease that ran out while we recovered and took over
    // (a long pause) means somebody else may hold the volume: this open is void.
    if (!(held.validUntil() > node.proc.now())) throw new LeaseLostError(`the lease of ${l.name} ran out while it was being opened`);
    v.setWriteDeadline(() => held.validUntil());
    held.onLost((reason) => { run.note(`  ${what}: lease lost (${reason})`); v.fenceLocally(`lease lost: ${reason}`); });
    const session = run.model.beginSession(l.vm, node.proc.label, held.token, issued);
    run.sessionsByVolume.set(v, session);
    run.note(`  ${what}: ${session.label} begins`);
    return { vol: v, lease: held, session };
  } catch (err) {
    // A volume whose open or takeover failed writes nothing (as exports.ts closeEngine does).
    if (vol) { vol.fenceLocally('the takeover failed'); await vol.close().catch(() => {}); }
    await lease.release().catch(() => {});
    run.expect(err, `${what}: open`, ['LEASE_HELD', 'LEASE_LOST', 'FENCED', 'CORRUPT', 'NOT_FOUND']);
    return null;
  }
}

async function writerSession(run: SimRun, node: Node, l: Live, rng: Rng): Promise<void> {
  const w = await openWriter(run, node, l, rng);
  if (!w) return;
  const { vol, lease, session } = w;
  const entry = { vol, proc: node.proc };
  run.writers.add(entry);
  const what = `${node.proc.label} ${session.label}`;
  try {
    const busy = new Set<number>();
    let left = rng.chance(0.3) ? rng.int(0, 2) : rng.int(2, 40);
    if (rng.chance(0.8)) await readBack(run, node, vol, session, lease, rng, what);
    const client = async (c: number): Promise<void> => {
      while (left-- > 0 && !vol.isFenced && lease.validUntil() > node.proc.now() && run.take(node, `${session.label} client ${c}`)) {
        await clientOp(run, node, vol, session, lease, rng, busy, `${what} client ${c}`);
        if (rng.chance(0.3)) await node.proc.sleep(rng.logUniform(1, 4000));
      }
    };
    await Promise.all(Array.from({ length: rng.int(1, 3) }, (_, c) => client(c)));
    if (rng.chance(0.85)) {
      const issued = run.model.stamp();
      try {
        await run.op(node, `close ${l.name}`, () => vol.close());
        if (!vol.isFenced) run.model.durable(session, issued);
        run.note(`  ${what}: closed`);
      } catch (err) {
        run.checkFence(err, session, `${what}: close`);
        run.expect(err, `${what}: close`, ['FENCED', 'LEASE_LOST', 'SHUTDOWN']);
      }
    } else {
      run.note(`  ${what}: dropped without a final flush`);
      vol.fenceLocally('the session was dropped');
      await vol.close();
    }
  } finally {
    run.writers.delete(entry);
    await lease.release().catch(() => {});
  }
}

/** One client request of a writer session. */
export async function clientOp(run: SimRun, node: Node, vol: Volume, s: Session, lease: Lease, rng: Rng, busy: Set<number>, what: string): Promise<void> {
  const model = run.model;
  const nb = s.vol.nblocks;
  const t0 = node.proc.now();
  const r = rng.float();
  const free = (first: number, n: number): boolean => { for (let b = first; b < first + n; b++) if (busy.has(b)) return false; return true; };
  if (r < 0.52) {
    const n = rng.chance(0.7) ? rng.int(1, 4) : rng.int(1, Math.min(16, nb));
    const first = rng.int(0, nb - n);
    if (!free(first, n)) return;
    const zero = r >= 0.46;
    const fua = rng.chance(0.15);
    for (let b = first; b < first + n; b++) busy.add(b);
    const postLease = lease.validUntil() <= node.proc.now();
    const { wid, data } = model.issueWrite(s, first, n, zero, postLease);
    const issued = model.stamp();
    const desc = `${zero ? 'zero' : 'write'} ${wid} blocks [${first}, ${first + n})${fua ? ' fua' : ''}`;
    try {
      await run.op(node, `${what}: ${desc}`, () => {
        if (!zero) return vol.write(first * BLOCK, data!, fua);
        return rng.chance(0.5) ? vol.trim(first * BLOCK, n * BLOCK, fua) : vol.zero(first * BLOCK, n * BLOCK, { fua, mayTrim: rng.chance(0.5), fastZero: false });
      }, { lease });
      model.writeDone(wid, true);
      if (fua) model.durable(s, issued, wid);
      run.count('writes');
    } catch (err) {
      model.writeDone(wid, false);
      run.checkFence(err, s, `${what}: ${desc}`);
      run.expectWriter(err, `${what}: ${desc}`, lease, t0, ['FENCED', 'LEASE_LOST', 'SHUTDOWN']);
    } finally {
      for (let b = first; b < first + n; b++) busy.delete(b);
    }
  } else if (r < 0.56) {
    await burst(run, node, vol, s, lease, rng, busy, what);
  } else if (r < 0.75) {
    await ownRead(run, node, vol, s, lease, rng, what);
  } else if (r < 0.93) {
    const issued = model.stamp();
    try {
      await run.op(node, `${what}: flush`, () => vol.flush(), { lease });
      model.durable(s, issued);
      run.count('flushes');
    } catch (err) {
      run.checkFence(err, s, `${what}: flush`);
      run.expectWriter(err, `${what}: flush`, lease, t0, ['FENCED', 'LEASE_LOST', 'SHUTDOWN']);
      run.count('failedFlushes');
    }
  } else if (r < 0.97 && run.on('compact')) {
    const issued = model.stamp();
    try {
      const c = await run.op(node, `${what}: compact`, () => vol.compact({ below: rng.pick([0.5, 0.9]) }), { lease, read: true });
      model.durable(s, issued);
      run.count('compactions');
      run.count('compactedObjects', c.objects);
    } catch (err) {
      run.checkFence(err, s, `${what}: compact`);
      run.expectWriter(err, `${what}: compact`, lease, t0, ['FENCED', 'LEASE_LOST', 'SHUTDOWN']);
    }
  } else {
    await readBack(run, node, vol, s, lease, rng, what);
  }
}

/**
 * A client that writes and flushes in a loop and keeps going when flushes fail (a database's
 * commit loop): through an outage, every failed commit leaves its data buffered. Now and then
 * it is a long-lived one (a database that commits for minutes, through whatever outage comes:
 * failed commit after failed commit, each leaving buffered data behind).
 */
async function burst(run: SimRun, node: Node, vol: Volume, s: Session, lease: Lease, rng: Rng, busy: Set<number>, what: string): Promise<void> {
  const model = run.model;
  const n = rng.chance(0.2) ? rng.int(100, 250) : rng.int(5, 60);
  for (let i = 0; i < n && !vol.isFenced && lease.validUntil() > node.proc.now(); i++) {
    const b = rng.int(0, s.vol.nblocks - 1);
    if (busy.has(b)) continue;
    busy.add(b);
    let t0 = node.proc.now();
    const { wid, data } = model.issueWrite(s, b, 1, false, lease.validUntil() <= node.proc.now());
    try {
      await run.op(node, `${what}: burst write ${wid} block ${b}`, () => vol.write(b * BLOCK, data!, false), { lease });
      model.writeDone(wid, true);
    } catch (err) {
      model.writeDone(wid, false);
      run.checkFence(err, s, `${what}: burst write`);
      run.expectWriter(err, `${what}: burst write`, lease, t0, ['FENCED', 'LEASE_LOST', 'SHUTDOWN']);
    } finally {
      busy.delete(b);
    }
    const issued = model.stamp();
    t0 = node.proc.now();
    try {
      await run.op(node, `${what}: burst flush`, () => vol.flush(), { lease });
      model.durable(s, issued);
      run.count('flushes');
    } catch (err) {
      run.checkFence(err, s, `${what}: burst flush`);
      run.expectWriter(err, `${what}: burst flush`, lease, t0, ['FENCED', 'LEASE_LOST', 'SHUTDOWN']);
      run.count('failedFlushes');
    }
    await node.proc.sleep(rng.logUniform(1, 1000));
  }
}

function readRange(rng: Rng, size: number): { off: number; len: number } {
  if (rng.chance(0.8)) {
    const nb = size / BLOCK;
    const n = rng.int(1, Math.min(16, nb));
    return { off: rng.int(0, nb - n) * BLOCK, len: n * BLOCK };
  }
  const len = rng.int(1, 40_000);
  return { off: rng.int(0, size - len), len };
}

async function ownRead(run: SimRun, node: Node, vol: Volume, s: Session, lease: Lease, rng: Rng, what: string): Promise<void> {
  const { off, len } = readRange(rng, vol.size);
  await checkedRead(run, node, vol, s, off, len, () => run.model.stamp(), what, lease);
}

/** The whole volume, in pieces (after a takeover: what the new holder recovered). */
export async function readBack(run: SimRun, node: Node, vol: Volume, s: Session, lease: Lease, rng: Rng, what: string): Promise<void> {
  const chunk = rng.pick([4, 16]) * BLOCK;
  for (let off = 0; off < vol.size && !vol.isFenced && lease.validUntil() > node.proc.now(); off += chunk) {
    if (!(await checkedRead(run, node, vol, s, off, Math.min(chunk, vol.size - off), () => run.model.stamp(), `${what} read-back`, lease))) return;
  }
}

/**
 * A read into a buffer of ours, checked against the model, made as the NBD session makes it:
 * answered on the spot when the volume can (Volume.readNow), else through read(). A failed
 * read's buffer is watched: nothing may write into it after the read settled (9.1).
 */
export async function checkedRead(
  run: SimRun, node: Node, vol: Volume, owner: Session | null, off: number, len: number, lo: () => number, what: string, lease: Lease | null, vm = owner?.vol,
): Promise<boolean> {
  const into = Buffer.alloc(len, 0xee);
  const l = lo();
  const desc = `${what}: read [${off}, ${off + len})`;
  try {
    await run.op(node, desc, async () => (vol.readNow(off, len, into) ? into : vol.read(off, len, into)), { read: true, lease });
  } catch (err) {
    run.watchFailedRead(into, desc);
    // A writer's read past its lease deadline, or of a fenced volume, is refused (F2).
    run.expect(err, desc, lease ? ['CORRUPT', 'NOT_FOUND', 'LEASE_LOST', 'FENCED'] : ['CORRUPT', 'NOT_FOUND']);
    run.count('failedReads');
    return false;
  }
  run.model.checkRead(vm!, owner, off, into, l, run.model.stamp(), `${node.proc.label}${owner ? ' (writer)' : ''}`);
  run.count('reads');
  return true;
}

// ------------------------------------------------------------------ readers

interface View { l: Live; vol: Volume; opened: number; snapshot: boolean }

export async function readerActor(run: SimRun, node: Node): Promise<void> {
  if (!run.on('views')) return;
  const rng = node.rng.derive('reader');
  const views: View[] = [];
  await node.proc.sleep(rng.logUniform(1, 5000));
  try {
    while (run.take(node, 'reader: next')) {
      const r = rng.float();
      if (views.length === 0 || (r < 0.12 && views.length < 2)) {
        const v = await openView(run, node, rng, await node.cache());
        if (v) views.push(v);
      } else if (r < 0.2) {
        const v = views.splice(rng.int(0, views.length - 1), 1)[0]!;
        await v.vol.close();
        v.l.users--;
      } else if (r < 0.3) {
        // A fresh host: a cold cache, open, a few reads, close.
        const v = await openView(run, node, rng, await node.newCache());
        if (v) {
          for (let i = rng.int(1, 3); i > 0; i--) await viewRead(run, node, v, rng);
          await v.vol.close();
          v.l.users--;
        }
      } else {
        await viewRead(run, node, rng.pick(views), rng);
      }
      await node.proc.sleep(rng.chance(0.35) ? rng.logUniform(M, 20 * M) : rng.logUniform(5, M));
    }
  } finally {
    for (const v of views) { await v.vol.close().catch(() => {}); v.l.users--; }
  }
}

async function openView(run: SimRun, node: Node, rng: Rng, cache: Awaited<ReturnType<Node['cache']>>): Promise<View | null> {
  const l = run.pick(rng, () => true);
  if (!l) return null;
  l.users++;
  const opened = run.model.stamp();
  try {
    const rec = await run.op(node, `view record ${l.name}`, () => node.catalog('host').record(l.name));
    const vol = await run.op(node, `view open ${l.name}`, () => Volume.open(rec, node.volumeOptions(true, cache, 'host', rec)));
    run.count('viewsOpened');
    return { l, vol, opened, snapshot: l.vm.kind === 'snapshot' };
  } catch (err) {
    l.users--;
    run.expect(err, `${node.proc.label} view open ${l.name}`, ['CORRUPT', 'NOT_FOUND']);
    return null;
  }
}

async function viewRead(run: SimRun, node: Node, v: View, rng: Rng): Promise<void> {
  const { off, len } = readRange(rng, v.vol.size);
  // A view of a live volume never reads through a map older than M/2 (it refreshes first).
  const lo = (): number => (v.snapshot ? v.opened : Math.max(v.opened, Sim.stampAt(run.sim.now - M / 2)));
  await checkedRead(run, node, v.vol, null, off, len, lo, `${node.proc.label} view of ${v.l.name}`, null, v.l.vm);
}

// ------------------------------------------------------------------ admin

export async function adminActor(run: SimRun, node: Node): Promise<void> {
  const rng = node.rng.derive('admin');
  await node.proc.sleep(rng.logUniform(100, 5000));
  // Does anything live descend from `l` (through removed volumes too)?
  const hasDescendant = (l: Live): boolean => [...run.live.values()].some((x) => {
    for (let f = x.vm.fork; f; f = f.source.fork) if (f.source === l.vm) return true;
    return false;
  });
  // ... through at least one volume between them (rm must read that one's meta: 9.3).
  const hasDeepDescendant = (l: Live): boolean => [...run.live.values()].some((x) => {
    for (let f = x.vm.fork; f; f = f.source.fork) if (f.source === l.vm) return f !== x.vm.fork;
    return false;
  });
  // ... only through removed volumes (kept for their relatives): the old base of a lineage whose
  // direct forks were cleaned up first, removed last (rm must read the removed ones' metas).
  const onlyThroughRemoved = (l: Live): boolean => [...run.live.values()].some((x) => {
    const parent = x.vm.fork?.source;
    if (!parent?.removed) return false;
    for (let f = parent.fork; f; f = f.source.fork) if (f.source === l.vm) return true;
    return false;
  });
  // The lifecycle workload's own draws (never made in the engine workload, whose seeds stay as they were).
  const lrng = node.rng.derive('lifecycle');
  while (run.take(node, 'admin: next')) {
    if (run.workloadName === 'lifecycle' && lrng.chance(0.5)) {
      await renameOp(run, node, lrng);
      await node.proc.sleep(lrng.logUniform(50, 8000));
      continue;
    }
    const r = rng.float();
    const count = [...run.live.values()].filter((l) => !l.removing).length;
    if (r < 0.12 && count < run.config.maxVolumes + 3) {
      await create(run, node, rng);
    } else if (r < 0.5 && run.on('forks') && count < run.config.maxVolumes + 5) {
      const snap = rng.chance(0.3);
      // Chains (forks of forks) half the time: rm must then follow ancestries.
      const chain = rng.chance(0.5);
      const src = run.pick(rng, (l) => (!snap || l.vm.kind === 'volume') && (!chain || l.vm.fork !== null)) ?? run.pick(rng, (l) => !snap || l.vm.kind === 'volume');
      if (src) await derive(run, node, src, snap);
    } else if (r < 0.8 && run.on('rm')) {
      // Often one with descendants (kept for its relatives), or an ancestor of such.
      const l = (rng.chance(0.4) ? run.pick(rng, (x) => x.users === 0 && onlyThroughRemoved(x)) : null)
        ?? (rng.chance(0.4) ? run.pick(rng, (x) => x.users === 0 && hasDeepDescendant(x)) : null)
        ?? (rng.chance(0.5) ? run.pick(rng, (x) => x.users === 0 && hasDescendant(x)) : null) ?? run.pick(rng, (x) => x.users === 0);
      if (l && (await remove(run, node, l)) && l.vm.fork && l.vm.fork.source.kind === 'volume') {
        // A lineage cleaned up: the fork was kept for its own forks; its base goes next (rm
        // must then follow the ancestry of those through the removed fork's meta).
        const base = [...run.live.values()].find((x) => x.vm === l.vm.fork!.source && x.users === 0 && !x.removing && !x.unknown);
        if (base && rng.chance(0.6)) await remove(run, node, base);
      }
    } else if (r < 0.9 && run.on('forks') && run.on('rm') && count < run.config.maxVolumes + 3) {
      // An agent's day: attempts of attempts (each one runs: a session on this host writes it,
      // so its log names it as the fork point of a fork of it); the last is kept, the others
      // are cleaned up newest first, then the workspace they came from. Each rm after the
      // first can tell that the kept one needs its data only through removed attempts' metas
      // (the case of 9.3).
      const root = run.pick(rng, (l) => l.vm.kind === 'volume');
      const chain: Live[] = [];
      for (let depth = rng.int(2, 3), src = root; src && chain.length < depth; src = chain[chain.length - 1]!) {
        if (chain.length > 0) {
          src.users++;
          try { await writerSession(run, node, src, rng); } finally { src.users--; }
          if (run.live.get(src.name) !== src) break;
        }
        const made = await derive(run, node, src, false);
        if (!made) break;
        chain.push(made);
      }
      // Never one somebody uses, as everywhere here (a view may have opened an attempt meanwhile).
      const idle = (x: Live | null): x is Live => x !== null && x.users === 0 && !x.removing && !x.unknown && run.live.get(x.name) === x;
      if (chain.length >= 2) {
        let kept = true;
        for (const x of [...chain.slice(0, -1).reverse(), root]) {
          if (!kept || !idle(x)) break;
          kept = await remove(run, node, x);
          if (kept) run.count('lineageRemovalsKept');
        }
      }
    }
    await node.proc.sleep(rng.logUniform(50, 8000));
  }
}

/**
 * `baton rename SRC TO [--replace]` on idle volumes (the lifecycle workload): a plain rename to
 * a new name, or the promote of an agent's attempt over another volume. As the CLI does, a name
 * a host holds the lease of is not renamed. In the model the renamed volume is a fork of SRC
 * (idle: its content is fixed), and SRC and a replaced TO are removed.
 */
async function renameOp(run: SimRun, node: Node, rng: Rng): Promise<void> {
  const catalog = node.catalog('admin');
  const hasSnapshots = (x: Live): boolean => [...run.live.values()].some((y) => y.vm.kind === 'snapshot' && y.vm.fork?.source === x.vm);
  const idle = (x: Live): boolean => x.vm.kind === 'volume' && x.users === 0 && !x.removing && !x.unknown && !hasSnapshots(x);
  // Half the time an attempt promoted over the workspace it was forked from (which then has a
  // descendant: its data must stay), else any idle volume.
  const promote = rng.chance(0.5);
  const src = (promote ? run.pick(rng, (x) => idle(x) && x.vm.fork !== null && [...run.live.values()].some((y) => y.vm === x.vm.fork!.source && idle(y))) : null) ?? run.pick(rng, idle);
  if (!src) return;
  const base = src.vm.fork ? [...run.live.values()].find((y) => y.vm === src.vm.fork!.source && y !== src && idle(y)) ?? null : null;
  const dst = promote && base ? base : rng.chance(0.7) ? run.pick(rng, (x) => x !== src && idle(x)) : null;
  const to = dst ? dst.name : run.newName('r');
  const involved = dst ? [src, dst] : [src];
  for (const x of involved) x.removing = true;
  const restore = (): void => { for (const x of involved) x.removing = false; };
  try {
    for (const n of [src.name, to]) {
      const held = await run.op(node, `lease of ${n}`, () => node.leases.inspect(n));
      if (held?.holder) { restore(); run.count('renameRefusedServed'); return; }
    }
  } catch (err) {
    restore();
    run.expect(err, `${node.proc.label} rename ${src.name}: lease`);
    return;
  }
  const lo = run.model.stamp();
  try {
    const r = await run.op(node, `rename ${src.name} -> ${to}${dst ? ' (replace)' : ''}`, () => catalog.rename(src.name, to, { replace: dst !== null }));
    const hi = run.model.stamp();
    for (const x of involved) { run.live.delete(x.name); x.vm.removed = true; }
    run.live.set(to, { name: to, vm: run.model.volume(r.id, to, 'volume', run.config.blocks, { source: src.vm, lo, hi }), users: 0, removing: false, unknown: false });
    run.count(dst ? 'renamesReplacing' : 'renames');
    run.note(`  renamed ${src.name} to ${to} (${r.id})${dst ? `, replacing ${dst.vm.id}` : ''}`);
  } catch (err) {
    // Part of it may have happened (the error says which): nobody uses these names again; the verifier looks.
    for (const x of involved) { x.removing = false; x.unknown = true; }
    run.expect(err, `${node.proc.label} rename ${src.name}`, ['ALREADY_EXISTS', 'NOT_FOUND', 'PRECONDITION_FAILED', 'INVALID_ARGUMENT']);
  }
}

async function create(run: SimRun, node: Node, rng: Rng): Promise<void> {
  // Now and then the name of a volume removed earlier: whatever of the old one's requests
  // still lands late (a delete of its record retried by its rm) must not touch the new one.
  // The most recent one (its rm's requests are the likeliest to be still on their way).
  const reuse = run.reusableNames.length > 0 && run.reuseRng.chance(0.7);
  const name = reuse ? run.reusableNames.pop()! : run.newName('v');
  if (reuse) { run.count('namesReused'); run.note(`  create ${name}: a name used before`); }
  const catalog = node.catalog('admin');
  let failed: unknown = null;
  try {
    await run.op(node, `create ${name}`, () => catalog.create(name, run.config.blocks * BLOCK, { encrypt: run.encrypts(name) }));
  } catch (err) {
    failed = err;
    run.expect(err, `${node.proc.label} create ${name}`);
  }
  if (failed) {
    // A create that failed without an answer may have landed. What its error says to do, and
    // what a user does (or a second create answers "already exists"): look, and if the volume
    // is there, use it (write it, fork it). Else the verifier adopts one that lands later.
    if (!(failed instanceof BatonError) || !['STORE_UNAVAILABLE', 'TIMEOUT'].includes(failed.code.replace('BATON_ERR_', '')) || !rng.chance(0.8)) return;
    await node.proc.sleep(rng.logUniform(100, 10_000));
    try {
      const rec = await run.op(node, `record ${name} (after its create failed)`, () => catalog.record(name));
      // A create undone too late said "if it is there, remove it": without its id record it is
      // not used (the verifier removes it); see verify in run.ts.
      if (!(await run.op(node, `meta of ${name}`, () => catalog.store.head(keys.meta(rec.id))))) return;
      run.live.set(name, { name, vm: run.model.volume(rec.id, name, 'volume', run.config.blocks, null), users: 0, removing: false, unknown: false });
      run.count('adoptedAfterFailedCreate');
      run.note(`  ${name} is there after its create failed (${rec.id}): in use from now on`);
    } catch (err) {
      run.expect(err, `${node.proc.label} record ${name} (after its create failed)`, ['NOT_FOUND']);
    }
    return;
  }
  // Learn the id.
  try {
    const rec = await run.op(node, `record ${name}`, () => catalog.record(name));
    run.live.set(name, { name, vm: run.model.volume(rec.id, name, 'volume', run.config.blocks, null), users: 0, removing: false, unknown: false });
    run.note(`  created ${name} (${rec.id})`);
  } catch (err) {
    run.expect(err, `${node.proc.label} record ${name}`);
  }
}

/** The fork or snapshot made, or null. */
async function derive(run: SimRun, node: Node, src: Live, snapshot: boolean): Promise<Live | null> {
  const catalog = node.catalog('admin');
  const name = snapshot ? `${src.name}@${run.newName('s')}` : run.newName('f');
  src.users++;
  const lo = run.model.stamp();
  try {
    await run.op(node, `${snapshot ? 'snapshot' : 'fork'} ${src.name} -> ${name}`, () => (snapshot ? catalog.snapshot(src.name, name.slice(name.indexOf('@') + 1)) : catalog.fork(src.name, name)));
    const hi = run.model.stamp();
    const rec = await run.op(node, `record ${name}`, () => catalog.record(name));
    const made: Live = { name, vm: run.model.volume(rec.id, name, snapshot ? 'snapshot' : 'volume', run.config.blocks, { source: src.vm, lo, hi }), users: 0, removing: false, unknown: false };
    run.live.set(name, made);
    run.count(snapshot ? 'snapshots' : 'forks');
    run.note(`  made ${name} (${rec.id}) of ${src.name}`);
    return made;
  } catch (err) {
    run.expect(err, `${node.proc.label} ${snapshot ? 'snapshot' : 'fork'} ${src.name}`, ['ALREADY_EXISTS']);
    return null;
  } finally {
    src.users--;
  }
}

/** True if `l` was removed and kept for its relatives. */
async function remove(run: SimRun, node: Node, l: Live): Promise<boolean> {
  const catalog = node.catalog('admin');
  // Its snapshots go with it (all unused: else it waits).
  const snaps = l.vm.kind === 'volume' ? [...run.live.values()].filter((x) => x.vm.kind === 'snapshot' && x.vm.fork?.source === l.vm && !x.removing) : [];
  if (snaps.some((x) => x.users > 0)) return false;
  // As `baton rm` does: a volume some host serves (its lease is held) is not removed.
  for (const x of [l, ...snaps]) x.removing = true;
  try {
    const held = await run.op(node, `lease of ${l.name}`, () => node.leases.inspect(l.name));
    if (held?.holder) { run.count('rmRefusedServed'); run.note(`  rm ${l.name}: refused, served by ${held.holder}`); for (const x of [l, ...snaps]) x.removing = false; return false; }
  } catch (err) {
    for (const x of [l, ...snaps]) x.removing = false;
    run.expect(err, `${node.proc.label} rm ${l.name}: lease`);
    return false;
  }
  // rm must then follow an ancestry through a meta (the case of 9.3).
  if ([...run.live.values()].some((x) => { for (let f = x.vm.fork; f; f = f.source.fork) { if (f.source === l.vm) return f !== x.vm.fork; } return false; })) run.count('rmDeepDescendants');
  // ... only through removed ones: rm can tell only by reading their metas.
  if ([...run.live.values()].some((x) => { for (let f = x.vm.fork, depth = 0; f; f = f.source.fork, depth++) { if (f.source === l.vm) return depth > 0; if (!f.source.removed) return false; } return false; })) run.count('rmThroughRemoved');
  try {
    const r = await run.op(node, `rm ${l.name}`, () => catalog.remove(l.name, { snapshots: true }));
    for (const x of [l, ...snaps]) { run.live.delete(x.name); x.vm.removed = true; }
    if (l.vm.kind === 'volume') run.reusableNames.push(l.name);
    run.count('removals');
    run.note(`  removed ${l.name}${snaps.length ? ` with ${snaps.map((x) => x.name).join(', ')}` : ''}: ${r.keptForRelatives ? 'kept for relatives' : `${r.deletedObjects} objects deleted`}`);
    return r.keptForRelatives;
  } catch (err) {
    // The record may or may not be gone: nobody uses it again; the verifier looks.
    for (const x of [l, ...snaps]) { x.removing = false; x.unknown = true; }
    run.expect(err, `${node.proc.label} rm ${l.name}`, ['CORRUPT', 'NOT_FOUND']);
    return false;
  }
}

// ------------------------------------------------------------------ GC

export async function gcActor(run: SimRun, node: Node): Promise<void> {
  if (!run.on('gc')) return;
  const rng = node.rng.derive('gc');
  const catalog = node.catalog('gc');
  await node.proc.sleep(rng.logUniform(1000, 10_000));
  while (run.take(node, 'gc run')) {
    try {
      const r = await run.op(node, 'gc', () => collectGarbage(catalog, { graceMs: run.config.graceMs, maxOperationMs: M, world: node.proc }));
      run.count('gcRuns');
      run.count('gcDeleted', r.deletedObjects);
      run.count('gcRecords', r.records);
      run.count('gcRecordsReused', r.reusedRecords);
      run.count('gcRecordsLive', r.liveRecords);
      if (r.recordListings === 1) run.count('gcRunsOneRecordListing');
      if (r.markedObjects > 0) run.auditMarks();
      if (r.deletedObjects) run.note(`  gc deleted ${r.deletedObjects}, marked ${r.markedObjects}`);
    } catch (err) {
      // "cannot compute what X needs (...); nothing was deleted": a store error while it looked.
      if (!(err instanceof BatonError) && err instanceof Error && /nothing was deleted/.test(err.message)) { run.count('gcAborted'); run.note(`  gc: ${errorMessage(err).slice(0, 160)}`); } else run.expect(err, `${node.proc.label} gc`);
    }
    await node.proc.sleep(rng.logUniform(300, 3 * M));
  }
}

export { Violation };

/**
 * The served-volume workload: every host runs the real VolumeExports (src/exports.ts), with
 * the simulated lease service behind a LeaseManager per process, and clients attach to it
 * as the NBD server's sessions do: open(name) -> an ExportHandle whose backend they read,
 * write and flush, release() when they leave. The lease, the takeover record, the write
 * deadline, handoffs between hosts (onHeld: takeover sends a request the holder's renewal
 * sees), lost leases, fenced volumes and the idle close all run inside exports.ts, on the
 * process's World. The disconnector plays the NBD server: it ends every connection of the
 * volume it is told to drop (their handles are released; requests in flight still settle).
 * Readers, admin (forks, snapshots, rm) and GC are the engine workload's.
 */

import type { ExportHandle } from '../../nbd/backend.js';
import { VolumeExports, type OnHeld } from '../../src/exports.js';
import type { Lease } from '../../src/lease/lease.js';
import type { Volume } from '../../src/volume/volume.js';
import type { HydrateOptions } from '../../src/volume/hydrate.js';
import { adminActor, clientOp, gcActor, readBack, readerActor, checkedRead } from './engine.js';
import { Violation, type Session } from './model.js';
import { M, type Actor, type Live, type Node, type SimRun, type Workload } from './run.js';
import { Sim, type Rng } from './world.js';

interface Conn { name: string; handle: ExportHandle; open: boolean }

/** A host process's exports and the client connections on it. */
class Served {
  readonly exports: VolumeExports;
  readonly conns = new Set<Conn>();
  /** Open calls in progress per name (their issue stamps). */
  readonly pending = new Map<string, number[]>();
  readonly onHeld: OnHeld;
  constructor(readonly run: SimRun, readonly node: Node) {
    const rng = node.rng.derive('served');
    this.onHeld = rng.pick(['refuse', 'wait', 'takeover'] as const);
    this.exports = new VolumeExports(node.catalog('host'), {
      readOnly: false,
      idleGraceMs: rng.pick([200, 2000, 10_000]),
      log: node.log,
      lease: { manager: node.leases, hostId: node.hostId, onHeld: this.onHeld, waitMs: rng.pick([500, 3000, 3 * run.config.ttlMs]) },
      world: node.proc,
      ...hydrateOptions(rng),
    });
    this.exports.setDisconnector((name) => {
      for (const c of this.conns) {
        if (c.name !== name || !c.open) continue;
        c.open = false;
        run.note(`  ${node.proc.label}: the server disconnects a client of ${name}`);
        c.handle.release();
      }
    });
  }
}

/**
 * `baton serve --read-only` (a backup or reporting host): volumes opened as views that follow
 * the log, without a lease; its clients stay attached and read now and then.
 */
class ReadOnlyServed {
  readonly exports: VolumeExports;
  readonly conns = new Set<Conn>();
  constructor(readonly run: SimRun, readonly node: Node) {
    const rng = node.rng.derive('served-ro');
    this.exports = new VolumeExports(node.catalog('host'), { readOnly: true, idleGraceMs: rng.pick([200, 2000, 10_000]), log: node.log, world: node.proc, ...hydrateOptions(rng) });
    this.exports.setDisconnector((name) => {
      for (const c of this.conns) if (c.name === name && c.open) { c.open = false; c.handle.release(); }
    });
  }
}
/**
 * Background hydration (serve --hydrate) on most hosts, with small windows and GETs so that
 * its fetches interleave with the guests' reads, takeovers, handoffs, closes and GC. Drawn
 * from a generator derived last from the host's own, so the draws of everything else (and the
 * regression seeds' scenarios) are unchanged. What it is held to: guest reads through the
 * cache it fills are checked against the model as every read is; it must stop with its
 * volume (an operation pending past the end or a request after close is a finding).
 */
function hydrateOptions(parent: Rng): { hydrate?: HydrateOptions } {
  const rng = parent.derive('hydrate');
  if (rng.chance(0.25)) return {};
  return {
    hydrate: {
      mode: rng.pick(['working-set', 'all'] as const),
      concurrency: rng.int(1, 8),
      fetchBytes: rng.pick([64 * 1024, 256 * 1024, 2 * 1024 * 1024]),
      guestQuietMs: rng.pick([0, 50, 500]),
    },
  };
}

const roServed = new WeakMap<Node, ReadOnlyServed>();

const served = new WeakMap<Node, Served>();
function servedOf(run: SimRun, node: Node): Served {
  let s = served.get(node);
  if (!s) { s = new Served(run, node); served.set(node, s); }
  return s;
}

export const servedWorkload: Workload = {
  actors(i: number): [string, Actor][] {
    const a: [string, Actor][] = [['client-a', clientActor], ['client-b', clientActor], ['reader', readerActor]];
    if (i === 0) a.push(['admin', adminActor]);
    if (i === 0 || i === 2) a.push(['gc', gcActor]);
    if (i === 1) a.push(['read-only client', readOnlyClientActor]);
    return a;
  },
  async finish(run: SimRun): Promise<void> {
    // The servers shut down: every volume flushed, closed, its lease released.
    await Promise.all([...run.nodes.values()].map(async (node) => {
      const ro = roServed.get(node);
      if (ro && !node.proc.dead) await run.op(node, 'read-only exports shutdown', () => ro.exports.close()).catch((err) => run.expect(err, `${node.proc.label} read-only exports shutdown`));
      const s = served.get(node);
      if (!s || node.proc.dead) return;
      await run.op(node, 'exports shutdown', () => s.exports.close()).catch((err) => run.expect(err, `${node.proc.label} exports shutdown`));
    }));
    // A volume that was fenced or closed lets go of its lease: once a TTL has passed (a lease an
    // acquire took although its reply was lost belongs to nobody, and expires), nobody holds one.
    await run.waitGlobal(run.config.ttlMs + 1000);
    for (const l of run.live.values()) {
      const h = run.leaseService.holderOf(l.name);
      const node = [...run.nodes.values()].find((n) => n.hostId === h?.holder);
      if (h && node && !node.proc.dead) run.fail(new Violation('lease-kept', `after every server shut down, ${h.holder} still holds the lease of ${l.name} (token ${h.token})`));
    }
  },
};

async function clientActor(run: SimRun, node: Node): Promise<void> {
  const rng = node.rng.derive(`client-${Math.floor(node.rng.float() * 1e6)}`);
  const s = servedOf(run, node);
  await node.proc.sleep(rng.logUniform(1, 4000));
  while (run.take(node, `client (${s.onHeld}): attach`)) {
    const l = run.pick(rng, () => true);
    if (!l) { await node.proc.sleep(2000); continue; }
    l.users++;
    try {
      await connection(run, node, s, l, rng);
    } finally {
      l.users--;
    }
    await node.proc.sleep(rng.chance(0.3) ? rng.logUniform(1000, 30_000) : rng.logUniform(5, 1000));
  }
}

/** The session of the model that a served Volume object belongs to (made when it is first seen). */
function sessionOf(run: SimRun, node: Node, s: Served, l: Live, vol: Volume, issued: number): { session: Session; lease: Lease } | null {
  const lease = node.leases.held(l.name);
  if (!lease) return null;
  let session = run.sessionsByVolume.get(vol);
  if (!session) {
    session = run.model.beginSession(l.vm, node.proc.label, vol.highestTokenSeen, issued);
    run.sessionsByVolume.set(vol, session);
    run.note(`  ${node.proc.label}: ${session.label} begins (served)`);
  }
  void s;
  return { session, lease };
}

async function connection(run: SimRun, node: Node, s: Served, l: Live, rng: Rng): Promise<void> {
  const what = `${node.proc.label} client of ${l.name}`;
  const issued = run.model.stamp();
  let pend = s.pending.get(l.name);
  if (!pend) s.pending.set(l.name, pend = []);
  pend.push(issued);
  let handle: ExportHandle;
  try {
    handle = await run.op(node, `attach ${l.name}`, () => s.exports.open(l.name));
  } catch (err) {
    run.expect(err, `${what}: attach`, ['LEASE_HELD', 'SHUTDOWN', 'FENCED', 'LEASE_LOST', 'CORRUPT', 'NOT_FOUND', 'INVALID_ARGUMENT']);
    return;
  } finally {
    pend.splice(pend.indexOf(issued), 1);
  }
  const conn: Conn = { name: l.name, handle, open: true };
  s.conns.add(conn);
  const since = Math.min(issued, ...pend);
  try {
    // The handshake's last reply travels to the client and its first request back (a round
    // trip: no request can arrive before the server's session holds the export).
    await node.proc.sleep(1);
    if (conn.open && (handle.backend as Volume).isFenced) {
      // A fenced volume is terminal (9.6): it is dropped, and the next attach recovers the volume from the store.
      run.fail(new Violation('attached-to-fenced', `${what}: the attach returned a volume that had fenced itself (its writes fail for good): a fenced volume must be dropped, and the next attach must open the volume anew from the store`));
    }
    const vol = handle.backend as Volume;
    if (handle.backend.readOnly) {
      // A snapshot: reads of a fixed map.
      for (let i = rng.int(1, 8); i > 0 && conn.open && run.take(node, `${what}: read`); i--) {
        const off = rng.int(0, vol.size / 4096 - 1) * 4096;
        await checkedRead(run, node, vol, null, off, 4096 * rng.int(1, Math.min(8, vol.size / 4096 - off / 4096)), () => run.model.stamp(), what, null, l.vm);
        attachedToClosed(run, conn, vol, what);
      }
      return;
    }
    const w = sessionOf(run, node, s, l, vol, since);
    if (!w) { run.note(`  ${what}: attached, but this host holds no lease for it (already lost?)`); return; }
    const { session, lease } = w;
    if (rng.chance(0.25)) {
      // A probe (udev's blkid, lsblk, a monitoring check): the device is attached, its first
      // blocks read, and it is let go without a write. Its host took the volume over for it
      // and closes it when idle (a checkpoint at the takeover record).
      for (let i = rng.int(1, 2); i > 0 && conn.open && !vol.isFenced && run.take(node, `${what}: probe read`); i--) {
        await checkedRead(run, node, vol, session, rng.int(0, 1) * 4096, 4096 * rng.int(1, 2), () => run.model.stamp(), `${what} probe`, lease);
        attachedToClosed(run, conn, vol, what);
      }
      return;
    }
    const busy = new Set<number>();
    // A mounted filesystem nobody uses for a while: attached (the volume taken over, nothing
    // committed since), idle for seconds to minutes.
    if (rng.chance(0.2)) {
      await node.proc.sleep(rng.logUniform(5000, 120_000));
      if (!conn.open) return; // disconnected meanwhile (handoff, lost lease, shutdown)
    }
    if (rng.chance(0.6)) await readBack(run, node, vol, session, lease, rng, what);
    for (let i = rng.int(1, 30); i > 0 && conn.open && !vol.isFenced && run.take(node, `${what}: request`); i--) {
      await clientOp(run, node, vol, session, lease, rng, busy, what);
      attachedToClosed(run, conn, vol, what);
      if (rng.chance(0.3)) await node.proc.sleep(rng.logUniform(1, 5000));
    }
  } finally {
    attachedToClosed(run, conn, handle.backend as Volume, what);
    s.conns.delete(conn);
    if (conn.open) { conn.open = false; handle.release(); }
  }
}

/**
 * A connection the server never ended, whose volume was closed under it (17.1): its writes
 * fail forever and its reads answer from a map nobody maintains any more, while another host
 * may serve the volume. Every client of a volume that leaves service must be disconnected.
 */
function attachedToClosed(run: SimRun, conn: Conn, vol: Volume, what: string): void {
  const closed = (vol as unknown as { closed?: unknown }).closed;
  if (typeof closed !== 'boolean') throw new Error('Volume has no `closed` flag any more: update attachedToClosed() in test/sim/served.ts');
  if (conn.open && closed) {
    run.fail(new Violation('client-on-closed-volume', `${what}: the volume this client is attached to was closed, but its connection was never ended (a client left behind on a closed volume)`));
  }
}

/**
 * A client of the read-only server: attaches to any volume or snapshot, stays attached and
 * reads now and then (seconds to a minute apart), as a backup or reporting job does. Its
 * view catches up with the log before a read when its map is older than M/2.
 */
async function readOnlyClientActor(run: SimRun, node: Node): Promise<void> {
  if (!run.on('views')) return;
  const rng = node.rng.derive('read-only client');
  let ro = roServed.get(node);
  if (!ro) { ro = new ReadOnlyServed(run, node); roServed.set(node, ro); }
  await node.proc.sleep(rng.logUniform(1, 4000));
  while (run.take(node, 'read-only client: attach')) {
    const l = run.pick(rng, () => true);
    if (!l) { await node.proc.sleep(2000); continue; }
    l.users++;
    const what = `${node.proc.label} read-only client of ${l.name}`;
    const opened = run.model.stamp();
    try {
      let handle: ExportHandle;
      try {
        handle = await run.op(node, `read-only attach ${l.name}`, () => ro.exports.open(l.name));
      } catch (err) {
        run.expect(err, `${what}: attach`, ['SHUTDOWN', 'CORRUPT', 'NOT_FOUND']);
        continue;
      }
      const conn: Conn = { name: l.name, handle, open: true };
      ro.conns.add(conn);
      const vol = handle.backend as Volume;
      const snapshot = l.vm.kind === 'snapshot';
      const lo = (): number => (snapshot ? opened : Math.max(opened, Sim.stampAt(run.sim.now - M / 2)));
      try {
        for (let i = rng.int(1, 12); i > 0 && conn.open && run.take(node, `${what}: read`); i--) {
          await node.proc.sleep(rng.logUniform(1000, 60_000));
          if (!conn.open) break;
          const n = rng.int(1, 8);
          const off = rng.int(0, vol.size / 4096 - n) * 4096;
          await checkedRead(run, node, vol, null, off, n * 4096, lo, what, null, l.vm);
          attachedToClosed(run, conn, vol, what);
        }
      } finally {
        ro.conns.delete(conn);
        if (conn.open) { conn.open = false; handle.release(); }
      }
    } finally {
      l.users--;
    }
    await node.proc.sleep(rng.logUniform(5, 5000));
  }
}

/**
 * VolumeExports: the ExportProvider that serves catalog volumes over NBD, and where the
 * single-writer lease meets the engine.
 *
 * - A volume is opened on a client's first attach and its one backend object is shared by
 *   every connection to it (CAN_MULTI_CONN needs one cache and one flush path). When the
 *   last connection leaves, a grace period starts; then the volume is flushed, closed and
 *   its lease given back. So the lease follows the user: attach on any host running baton.
 * - Read-write opening of an engine volume: acquire the lease, recover the volume, commit a
 *   takeover record under the lease's token (Volume.takeover), and bind the volume's write
 *   deadline to the lease's validUntil. If the log already holds a token as high as ours
 *   (Redis lost data), re-acquire with a higher one.
 * - A volume held by another host: `refuse` (default) fails the attach with a message
 *   naming the holder; `wait` waits for it to be released or to expire; `takeover` asks
 *   the holder to hand it over and waits for that.
 * - Handoff (another host asked): stop taking writes (ESHUTDOWN), let in-flight requests
 *   finish and close the clients' connections, flush, close, and release the lease
 *   reserved for the new host, which may acquire at once. If that flush fails the handoff
 *   is refused and the volume keeps serving (its unflushed data exists only here).
 * - Fenced (the lease was lost, the volume fenced itself, or it was removed or replaced in
 *   the store): the volume never writes again. Its clients are disconnected, it is closed
 *   without flushing or checkpointing, its lease is released, and the next attach opens the
 *   volume anew from the store (which recovers whatever landed).
 *
 * One Served per volume name, in exactly one state:
 *
 *   opening ──> serving <──> draining ──> closed | fenced
 *      └───────────────────────^
 *
 * - opening: the lease is being acquired and the volume recovered. Attaching clients wait
 *   for `ready`; no handle exists yet.
 * - serving: handles are given out. The status timer runs while a lease is held; the idle
 *   timer runs exactly while no handle is out.
 * - draining: on its way out, for one Exit (idle, shutdown, handoff, failed open, fence).
 *   No handle is given out; clients attaching meanwhile wait for the state to change and then
 *   attach anew (so a client on this host goes through the normal acquire, not "already
 *   served under this host id"). One exit routine runs; it may end in serving again only
 *   when a handoff or idle close could not flush (and the volume is not fenced).
 * - closed, fenced: terminal; the volume is closed and its lease released or given up.
 *
 * Invariants (each transition is one function that asserts where it comes from):
 * - `volumes` maps a name to its one Served until that Served is terminal: a new Served for
 *   the name (a reopen) never overlaps an older one, so this host never holds two engines or
 *   two leases for one name, and a reopen never finds its own lease still held.
 * - Leaving `opening` for anything but `serving` rejects `ready`: a client waiting for the
 *   open gets an error, never a handle to a volume that is being closed. Leaving `serving`
 *   disconnects every handle's connection. Together: every client of a volume that is handed
 *   off, lost, fenced or closed is disconnected, whatever state its session is in.
 * - `fence` once set never clears: a fenced Served ends `fenced` and never serves again.
 * - A volume is closed with flush and checkpoint only if it was opened completely (with a
 *   takeover record under our lease) and is not fenced; otherwise it is fenced locally first,
 *   so it writes nothing (a failed takeover must not write a checkpoint it does not hold).
 * - Lease callbacks and the volume's onFenced act only on the Served they were registered
 *   for, never on a later Served of the same name.
 */

import * as os from 'node:os';
import { systemWorld, type TimerHandle, type World } from './clock.js';
import type { ExportHandle, ExportProvider, ExportSummary } from '../nbd/backend.js';
import { RequestStats } from '../nbd/stats.js';
import { LeaseHeldError, NotFoundError, ShutdownError, errorMessage } from './errors.js';
import type { Lease, LeaseManager } from './lease/lease.js';
import type { Logger } from './log.js';
import { formatSize } from './size.js';
import type { HydrateOptions } from './volume/hydrate.js';
import { StaleTokenError, type Volume } from './volume/volume.js';
import { checkExportName, isSnapshotName, type OpenVolume, type VolumeCatalog } from './volumes.js';

export type OnHeld = 'refuse' | 'wait' | 'takeover';

export interface LeaseConfig {
  manager: LeaseManager;
  hostId: string;
  onHeld: OnHeld;
  /** How long `wait` and `takeover` wait for the other host. */
  waitMs: number;
  /** Shown in `baton status`. */
  address?: string;
}

export interface VolumeExportsOptions {
  readOnly: boolean;
  /** How long a volume stays open after its last client left. */
  idleGraceMs: number;
  log: Logger;
  lease?: LeaseConfig;
  /** The clock and timers of the idle grace, the handoff wait and the status updates (src/clock.ts); the real ones by default. */
  world?: World;
  /**
   * Background hydration of every volume this host opens (src/volume/hydrate.ts; `serve
   * --hydrate`): started once the volume is recovered, and, when the volume is held by another
   * host that this one waits for or asks to hand it over, already while waiting (from the
   * newest checkpoint, catalog.prehydrate). Off when absent.
   */
  hydrate?: HydrateOptions;
  /** Count each volume's NBD requests (serve --metrics): its connections share one RequestStats. */
  requestStats?: boolean;
  /**
   * Told what happens to each volume (the API's per-volume events, src/api.ts). Called
   * synchronously where it happens; it must not throw or block (an exception is swallowed).
   */
  onEvent?: (e: VolumeEvent) => void;
}

/**
 * What happened to a served volume:
 * - attached / detached: a connection got or gave back a handle (`connections`: how many now);
 * - flushed: a commit landed: every write acknowledged before it is in the store;
 * - leaseLost: this host lost the lease (renewal failed, revoked by `rm --force` or `rename
 *   --force`): the volume was fenced and its clients disconnected;
 * - handedOff: given to another host on its request (`baton handoff`);
 * - dropped: fenced for another reason: removed or replaced in the store, or it fenced itself.
 */
export type VolumeEvent =
  | { type: 'attached'; volume: string; connections: number }
  | { type: 'detached'; volume: string; connections: number }
  | { type: 'flushed'; volume: string; seq: number; bytes: number }
  | { type: 'leaseLost'; volume: string; reason: string }
  | { type: 'handedOff'; volume: string; to: string }
  | { type: 'dropped'; volume: string; reason: string };

/** A volume this host has in hand (opening, serving or draining), as serve --metrics reports it. */
export interface ServedVolumeInfo {
  name: string;
  state: ServedState;
  /** NBD connections attached to it now. */
  connections: number;
  /** The engine volume, once open (absent for the plain backends and while opening). */
  volume: Volume | undefined;
  /** Its request counters (requestStats), kept from open to close: a reopened volume starts again at 0. */
  requests: RequestStats | null;
  /** The lease it is served under: its token and how long this host may still write under it (ms, >= 0). */
  lease: { token: number; remainingMs: number } | null;
}

export type ServedState = 'opening' | 'serving' | 'draining' | 'closed' | 'fenced';

/** Why a volume leaves service: decides whether it is flushed and whom the lease goes to. */
type Exit =
  | { kind: 'idle' }
  | { kind: 'shutdown' }
  | { kind: 'handoff'; to: string }
  | { kind: 'failed'; err: unknown }
  | { kind: 'fence'; reason: string };

/** Where each state may go (checked by every transition). */
const NEXT: Record<ServedState, readonly ServedState[]> = {
  opening: ['serving', 'draining'],
  serving: ['draining'],
  draining: ['serving', 'closed', 'fenced'],
  closed: [],
  fenced: [],
};

/** How long a handoff waits for its clients' in-flight requests before flushing anyway. */
const HANDOFF_CLIENT_WAIT_MS = 2000;

class Served {
  state: ServedState = 'opening';
  /** Handles given out and not yet released. */
  refs = 0;
  lease: Lease | null = null;
  ov: OpenVolume | null = null;
  /**
   * The open finished: for a read-write engine volume under a lease, its takeover record is
   * committed under `lease`. Only then may closing flush and checkpoint.
   */
  complete = false;
  /** Why the volume must never write again; set once, never cleared. Ends in `fenced`. */
  fence: string | null = null;
  /** We fenced the engine ourselves (its onFenced is then not news). */
  fencedByUs = false;
  /** A host that asked for the volume while it was leaving for another reason. */
  releaseTo: string | undefined;
  /** Settles when the open routine finished, whatever happened; never rejects. */
  opening: Promise<void> = Promise.resolve();
  /** The exit routine, while draining. */
  exit: Promise<void> | null = null;
  /** Hydration from the newest checkpoint while waiting for another host's lease (stopped once the volume hydrates itself). */
  prehydration: { stop(): void } | null = null;
  idleTimer: TimerHandle | null = null;
  statusTimer: TimerHandle | null = null;
  /** Request counters shared by its connections (VolumeExportsOptions.requestStats), else null. */
  readonly stats: RequestStats | null;
  /** Resolves when serving; rejects (with what the waiting clients are told) if it left before. */
  readonly ready: Promise<void>;
  resolveReady!: () => void;
  rejectReady!: (err: unknown) => void;
  private changeWaiters: (() => void)[] = [];
  private idleWaiters: (() => void)[] = [];

  constructor(readonly name: string, countRequests: boolean) {
    this.stats = countRequests ? new RequestStats() : null;
    this.ready = new Promise<void>((res, rej) => { this.resolveReady = res; this.rejectReady = rej; });
    this.ready.catch(() => {}); // an open nobody waits for must not be an unhandled rejection
  }

  /** Resolves at the next state change. */
  changed(): Promise<void> { return new Promise((r) => this.changeWaiters.push(r)); }
  notifyChanged(): void { for (const w of this.changeWaiters.splice(0)) w(); }

  /** Resolves when no handle is out (or after `ms`). */
  async noClients(ms: number, world: World): Promise<void> {
    if (this.refs === 0) return;
    let timer: TimerHandle | undefined;
    await Promise.race([
      new Promise<void>((r) => this.idleWaiters.push(r)),
      new Promise<void>((r) => { timer = world.setTimeout(r, ms); }),
    ]);
    if (timer) world.clearTimeout(timer);
  }
  notifyNoClients(): void { for (const w of this.idleWaiters.splice(0)) w(); }

  get volume(): Volume | undefined { return this.ov?.volume; }
}

export function defaultHostId(): string {
  return process.env.BATON_HOST_ID || os.hostname();
}

export class VolumeExports implements ExportProvider {
  /** The one Served per name, until it is terminal (see the invariants above). */
  private readonly volumes = new Map<string, Served>();
  private closing = false;
  private disconnect: (name: string) => void = () => {};
  private readonly world: World;

  constructor(private readonly catalog: VolumeCatalog, private readonly opts: VolumeExportsOptions) {
    this.world = opts.world ?? systemWorld;
  }

  /** How to close the NBD connections of a volume (the server's disconnectExport). */
  setDisconnector(fn: (name: string) => void): void { this.disconnect = fn; }

  /** The state of the volume served under `name`, or null if none (diagnostics, tests). */
  stateOf(name: string): ServedState | null { return this.volumes.get(name)?.state ?? null; }

  /** One catalog listing, whatever the number of volumes (NBD_OPT_LIST needs no figures). */
  async list(): Promise<ExportSummary[]> {
    const names = await this.catalog.names();
    return names.map((name) => ({ name, description: describeName(name) }));
  }

  /** "" (nbd-client without -N) means the only volume, if there is exactly one (one listing). */
  private async resolve(name: string): Promise<string> {
    if (name !== '') return name;
    const names = await this.catalog.names();
    if (names.length === 1) return names[0]!;
    throw new NotFoundError(names.length === 0
      ? `no volumes in ${this.catalog.description}; create one with: baton create NAME --size 10G`
      : `no export name given and there are ${names.length} volumes; name one (nbd-client -N NAME, nbd://host/NAME): ${names.join(', ')}`);
  }

  /**
   * What NBD_OPT_INFO needs, without attaching: from the open volume if it is served here,
   * else from the catalog record (one GET for object-store catalogs). No lease, no store
   * write, no open: it has no effect on this host or any other.
   */
  async info(requested: string): Promise<{ name: string; size: number; readOnly: boolean; description: string }> {
    const name = await this.resolve(requested);
    checkExportName(name);
    const s = this.volumes.get(name);
    if (s?.state === 'serving' && s.ov) {
      return { name, size: s.ov.backend.size, readOnly: s.ov.backend.readOnly, description: describeName(name, s.ov.backend.size) };
    }
    const rec = this.catalog.record ? await this.catalog.record(name) : await this.catalog.info(name).then((v) => ({ size: v.size, snapshot: v.kind === 'snapshot' }));
    const readOnly = this.opts.readOnly || isSnapshotName(name) || !!rec.snapshot;
    return { name, size: rec.size, readOnly, description: describeName(name, rec.size) };
  }

  async open(requested: string): Promise<ExportHandle> {
    const name = await this.resolve(requested);
    checkExportName(name);
    for (;;) {
      if (this.closing) throw new ShutdownError('server is shutting down');
      const s = this.volumes.get(name) ?? this.startOpening(name);
      if (s.state === 'opening') {
        // Rejects if the volume leaves before it serves (handoff, lease lost, failed open,
        // shutdown): this client then gets that error, not a handle to a closed volume.
        await s.ready;
        if ((s.state as ServedState) !== 'serving') throw new ShutdownError(`volume ${name} stopped being served here while this client attached; reconnect`);
        return this.handle(s);
      }
      if (s.state === 'serving') {
        if (!(await this.stillInStore(s))) continue;
        if ((s.state as ServedState) !== 'serving') continue; // it changed while we looked
        return this.handle(s);
      }
      // draining: wait for it to serve again or to be gone, then attach anew.
      await s.changed();
    }
  }

  private emit(e: VolumeEvent): void {
    if (!this.opts.onEvent) return;
    try { this.opts.onEvent(e); } catch { /* a listener's own bug must not break serving */ }
  }

  private handle(s: Served): ExportHandle {
    const ov = s.ov!;
    s.refs++;
    this.updateIdle(s);
    this.emit({ type: 'attached', volume: s.name, connections: s.refs });
    let released = false;
    return {
      name: s.name,
      // From what is open: no store request per connection.
      description: describeName(s.name, ov.backend.size),
      backend: ov.backend,
      ...(s.stats ? { stats: s.stats } : {}),
      release: () => {
        if (released) return;
        released = true;
        s.refs--;
        if (s.refs === 0) s.notifyNoClients();
        this.updateIdle(s);
        this.emit({ type: 'detached', volume: s.name, connections: s.refs });
      },
    };
  }

  /**
   * 9.4: is the open volume still the one the catalog names? A volume removed (its record
   * gone) or removed and created again (another id) must not be served to the new volume's
   * clients. `rm --force` also revokes the lease, which the renewal notices (onLost); this
   * check is the backstop at the next attach. One GET per attach of an already open volume.
   * A store error is the attaching client's error: we cannot tell which volume it would get.
   */
  private async stillInStore(s: Served): Promise<boolean> {
    const vol = s.volume;
    if (!vol || !this.catalog.record) return true;
    let id: string | null;
    let size = 0;
    try {
      ({ id, size } = await this.catalog.record(s.name));
    } catch (err) {
      if (!(err instanceof NotFoundError)) throw err;
      id = null;
    }
    if (id === vol.volumeId) {
      // `baton resize` grew it: this connection (and every later one) gets the new size;
      // connections attached before keep the size they negotiated. A shrink needs the lease,
      // so it never happens to a volume served here.
      if (size > vol.size) {
        this.opts.log.info({ volume: s.name, from: vol.size, to: size }, 'volume grown in the store: new connections get the new size');
        vol.grow(size);
      }
      return true;
    }
    const reason = id === null
      ? `volume ${s.name} was removed from ${this.catalog.description} while served here`
      : `volume ${s.name} was removed and created again in ${this.catalog.description} (id ${vol.volumeId} is now ${id}) while served here`;
    this.opts.log.error({ volume: s.name, id: vol.volumeId, now: id }, `${reason}: dropping it, its clients are disconnected`);
    this.stop(s, { kind: 'fence', reason });
    this.emit({ type: 'dropped', volume: s.name, reason });
    return false;
  }

  // ------------------------------------------------------------------ transitions

  private expect(s: Served, to: ServedState): void {
    if (!NEXT[s.state].includes(to)) throw new Error(`internal error: served volume ${s.name} cannot go from ${s.state} to ${to}`);
  }

  private move(s: Served, to: ServedState): void {
    this.expect(s, to);
    s.state = to;
    // Both timers run only while serving.
    if (to !== 'serving') this.stopTimers(s);
    s.notifyChanged();
  }

  /** (none) -> opening: start the open routine. */
  private startOpening(name: string): Served {
    const s = new Served(name, !!this.opts.requestStats);
    this.volumes.set(name, s);
    s.opening = this.openServed(s).finally(() => this.stopPrehydration(s)).then(
      () => { if (s.state === 'opening') this.startServing(s); },
      (err: unknown) => { if (s.state === 'opening') this.beginExit(s, { kind: 'failed', err }); },
    );
    return s;
  }

  /** opening -> serving: the waiting clients get their handles. */
  private startServing(s: Served): void {
    this.move(s, 'serving');
    this.opts.log.info({ volume: s.name, token: s.lease?.token }, 'volume opened');
    this.startStatus(s);
    s.resolveReady();
    this.updateIdle(s);
  }

  /** opening | serving -> draining: no new handles; waiting clients get an error; connections are closed. */
  private beginExit(s: Served, exit: Exit): void {
    const from = s.state;
    this.move(s, 'draining');
    if (from === 'opening') s.rejectReady(exit.kind === 'failed' ? exit.err : new ShutdownError(`volume ${s.name}: ${exitMessage(exit)}; reconnect to attach again`));
    if (!s.fence) s.volume?.drain();
    if (from === 'serving' && s.refs > 0) this.disconnect(s.name);
    s.exit = this.runExit(s, exit).catch((err: unknown) => {
      this.opts.log.error({ volume: s.name, err: errorMessage(err) }, 'internal error while taking a volume out of service');
    });
  }

  /** draining -> serving: a handoff or idle close that could not flush; keep serving the data. */
  private resumeServing(s: Served): void {
    if (s.fence) throw new Error(`internal error: fenced volume ${s.name} cannot serve again`);
    this.move(s, 'serving');
    s.volume?.undrain();
    s.releaseTo = undefined;
    this.startStatus(s);
    this.updateIdle(s);
  }

  /** draining -> closed | fenced: gone; the next attach opens the volume anew. */
  private finish(s: Served, flushed: boolean): void {
    const to: ServedState = s.fence ? 'fenced' : 'closed';
    this.expect(s, to);
    if (this.volumes.get(s.name) === s) this.volumes.delete(s.name);
    this.move(s, to);
    if (s.fence) this.opts.log.warn({ volume: s.name, reason: s.fence }, 'fenced volume closed and dropped; the next attach opens it anew from the store');
    else this.opts.log.info({ volume: s.name, flushed }, 'volume closed');
  }

  /**
   * Ask a volume to leave service. Fencing takes effect at once (the engine stops writing);
   * if it is already draining, the running exit routine sees `fence` and `releaseTo`.
   */
  private stop(s: Served, exit: Exit): void {
    if (s.state === 'closed' || s.state === 'fenced') return;
    if (exit.kind === 'fence' && !s.fence) {
      s.fence = exit.reason;
      this.fenceEngine(s, exit.reason);
    }
    if (exit.kind === 'handoff') s.releaseTo ??= exit.to;
    if (s.state === 'opening' || s.state === 'serving') this.beginExit(s, exit);
    else if (exit.kind === 'fence' && s.refs > 0) this.disconnect(s.name);
  }

  private fenceEngine(s: Served, reason: string): void {
    const vol = s.volume;
    if (!vol || vol.isFenced) return;
    s.fencedByUs = true;
    vol.fenceLocally(reason);
  }

  // ------------------------------------------------------------------ opening

  /** Acquire, recover, take over; records each step on `s` so that an exit can undo exactly what was done. */
  private async openServed(s: Served): Promise<void> {
    const lc = this.opts.lease;
    const name = s.name;
    // Snapshots are read-only: no lease, any number of hosts may serve them.
    const readOnly = this.opts.readOnly || isSnapshotName(name);
    if (readOnly || !lc) {
      s.ov = await this.catalog.open(name, { readOnly });
      this.watchVolume(s);
      this.stillOpening(s);
      this.startHydration(s);
      s.complete = true;
      return;
    }
    s.lease = await this.acquire(name, lc, 0, s);
    // Watched from here on: a handoff or lost lease during the (maybe long) recovery acts at once.
    this.watchLease(s, s.lease);
    this.stillOpening(s);
    s.ov = await this.catalog.open(name, { readOnly: false });
    this.watchVolume(s);
    this.stillOpening(s);
    const vol = s.ov.volume;
    if (vol) {
      try {
        await vol.takeover(s.lease.token);
      } catch (err) {
        if (!(err instanceof StaleTokenError)) throw err;
        // The log has seen this token (Redis lost its data): take a higher one.
        this.opts.log.warn({ volume: name, token: s.lease.token, logToken: err.minToken }, 'lease token not above the log; re-acquiring');
        const old = s.lease;
        s.lease = null;
        await old.release();
        this.stillOpening(s);
        s.lease = await this.acquire(name, lc, err.minToken, s);
        this.watchLease(s, s.lease);
        this.stillOpening(s);
        await vol.takeover(s.lease.token);
      }
      this.stillOpening(s);
      const held = s.lease;
      vol.setWriteDeadline(() => held.validUntil());
    }
    // Hydrate once the takeover record is in (its put then has the store to itself; the
    // hydration from before the lease was ours, if any, runs until here). Reads only, of
    // immutable objects; close() and a fence stop it.
    this.startHydration(s);
    s.complete = true;
  }

  /** Between the open's steps: stop if the volume was asked to leave meanwhile (its exit undoes what was done). */
  private stillOpening(s: Served): void {
    if (s.state !== 'opening') throw new ShutdownError(`volume ${s.name} stopped opening`);
  }

  private watchLease(s: Served, lease: Lease): void {
    lease.onLost((reason) => { if (s.lease === lease) this.leaseLost(s, reason); });
    lease.onHandoffRequest((to) => { if (s.lease === lease) this.handoffRequested(s, to); });
  }

  private watchVolume(s: Served): void {
    const vol = s.volume;
    vol?.onCommitted((c) => this.emit({ type: 'flushed', volume: s.name, seq: c.seq, bytes: c.bytes }));
    vol?.onFenced((err) => {
      if (s.fencedByUs || s.fence || s.state === 'closed' || s.state === 'fenced') return;
      // 9.6: the engine fenced itself (its log position was taken, its lease deadline
      // passed): terminal. Retrying its flush, refusing handoffs or renewing its lease would
      // keep the volume unusable everywhere until this process restarts.
      this.opts.log.error({ volume: s.name, err: errorMessage(err) }, 'volume fenced itself: disconnecting its clients, closing it without flushing and releasing its lease; the next attach recovers it from the store');
      this.stop(s, { kind: 'fence', reason: errorMessage(err) });
      this.emit({ type: 'dropped', volume: s.name, reason: errorMessage(err) });
    });
  }

  /**
   * The lease, by the --on-held policy. When it is held and we wait for it (`wait`, or
   * `takeover` after asking for a handoff), the volume starts hydrating from its newest
   * checkpoint meanwhile (prehydrate): the holder is flushing and closing, and the guest's
   * first reads here need not wait for a cold cache after it let go.
   */
  private async acquire(name: string, lc: LeaseConfig, minToken: number, s?: Served): Promise<Lease> {
    const base = minToken > 0 ? { minToken } : {};
    try {
      return await lc.manager.acquire(name, lc.hostId, base);
    } catch (err) {
      if (!(err instanceof LeaseHeldError) || lc.onHeld === 'refuse') throw err;
    }
    if (s) this.startPrehydration(s);
    if (lc.onHeld === 'takeover') {
      this.opts.log.info({ volume: name }, 'volume held elsewhere; asking for a handoff');
      await lc.manager.requestHandoff(name, lc.hostId);
    }
    return lc.manager.acquire(name, lc.hostId, { ...base, waitMs: lc.waitMs });
  }

  private startPrehydration(s: Served): void {
    const h = this.opts.hydrate;
    if (!h || h.mode === 'off' || s.prehydration || !this.catalog.prehydrate) return;
    s.prehydration = this.catalog.prehydrate(s.name, h);
  }

  private stopPrehydration(s: Served): void {
    s.prehydration?.stop();
    s.prehydration = null;
  }

  /** The opened volume hydrates itself (replacing any hydration from before the lease was ours). */
  private startHydration(s: Served): void {
    this.stopPrehydration(s);
    const h = this.opts.hydrate;
    if (h) s.volume?.startHydration(h);
  }

  // ------------------------------------------------------------------ events

  /**
   * Close a volume nobody is attached to now, as its idle grace would (flush, close, give
   * the lease back), so that this process or another may change it (rename, resize) at once.
   * Refused while clients are attached here; a flush that fails keeps it open (as an idle
   * close does) and is this call's error. Nothing to do for a volume not open here.
   */
  async release(name: string): Promise<void> {
    const s = this.volumes.get(name);
    if (!s) return;
    await s.opening;
    if (s.state === 'serving') {
      if (s.refs > 0) throw new LeaseHeldError(`volume ${name} has ${s.refs} client${s.refs > 1 ? 's' : ''} attached on this host; detach ${s.refs > 1 ? 'them' : 'it'} first`);
      this.beginExit(s, { kind: 'idle' });
    }
    await s.exit;
    if ((s.state as ServedState) === 'serving') throw new ShutdownError(`volume ${name} could not be flushed, so it stays open here with its unflushed data (see the log); try again once the store answers`);
  }

  /** Another host asked for this volume: give it over cleanly. */
  async handoff(name: string, to: string): Promise<void> {
    const s = this.volumes.get(name);
    if (!s) return;
    this.handoffRequested(s, to);
    await s.exit;
  }

  private handoffRequested(s: Served, to: string): void {
    this.opts.log.debug({ volume: s.name, to, state: s.state }, 'handoff requested'); // the lease logs it at info
    this.stop(s, { kind: 'handoff', to });
  }

  private leaseLost(s: Served, reason: string): void {
    if (s.state === 'closed' || s.state === 'fenced') return;
    this.opts.log.error({ volume: s.name, reason }, 'lease lost: volume fenced, clients disconnected');
    this.stop(s, { kind: 'fence', reason: `lease lost: ${reason}` });
    this.emit({ type: 'leaseLost', volume: s.name, reason });
  }

  /**
   * The last client left a while ago: flush (still serving: a client coming back meanwhile
   * is served at once), then leave. If the flush fails the volume stays open with its dirty
   * data (a later client sees it, and a later FLUSH still has to land it) and closing is
   * tried again later: acknowledged writes are never dropped because nobody is attached.
   */
  private async closeIdle(s: Served): Promise<void> {
    s.idleTimer = null;
    if (s.state !== 'serving' || s.refs > 0) return;
    const ov = s.ov!;
    if (!ov.backend.readOnly) {
      try {
        await ov.backend.flush();
      } catch (err) {
        if (s.state !== 'serving') return; // fenced meanwhile: its exit is running
        this.retryIdle(s, err);
        return;
      }
    }
    if (s.state !== 'serving' || s.refs > 0) return; // a client came back meanwhile
    this.beginExit(s, { kind: 'idle' });
  }

  private retryIdle(s: Served, err: unknown): void {
    const retryMs = Math.min(Math.max(this.opts.idleGraceMs * 2, 1000), 30_000);
    this.opts.log.warn({ volume: s.name, err: errorMessage(err), retryMs }, 'idle volume could not be flushed; keeping it open and trying again');
    if (s.state === 'serving' && s.refs === 0 && !s.idleTimer) s.idleTimer = this.world.setTimeout(() => void this.closeIdle(s), retryMs);
  }

  // ------------------------------------------------------------------ leaving

  /** The one exit routine of a draining volume; ends in serving (refused), closed or fenced. */
  private async runExit(s: Served, exit: Exit): Promise<void> {
    await s.opening; // an exit during the open waits for its current step, then undoes what it did
    const ov = s.ov;
    let flushed = true;
    try {
      if ((exit.kind === 'handoff' || exit.kind === 'idle') && ov && s.complete && !s.fence) {
        // Clients must be gone before the data is final (a handoff disconnected them; an idle
        // volume has none); then the flush that decides whether we may let go.
        if (exit.kind === 'handoff') await s.noClients(HANDOFF_CLIENT_WAIT_MS, this.world);
        try {
          await ov.backend.flush();
        } catch (err) {
          if (!s.fence && !s.volume?.isFenced) {
            if (exit.kind === 'handoff') {
              // Unflushed data exists only here: handing over now would lose it. Keep the
              // lease and the volume (dirty data included), take writes again, and say so;
              // the handoff can be asked for again once the store is reachable.
              this.opts.log.error({ volume: s.name, to: exit.to, err: errorMessage(err) }, 'handoff refused: the final flush did not reach the store; keeping the volume and its unflushed data');
            }
            this.resumeServing(s);
            if (exit.kind === 'idle') this.retryIdle(s, err);
            return;
          }
          // Fenced meanwhile: nothing more can be written; close as fenced.
        }
      }
      if (ov) flushed = await this.closeEngine(s, ov, exit);
      await this.releaseLease(s, exit);
    } catch (err) {
      this.opts.log.error({ volume: s.name, err: errorMessage(err) }, 'closing volume failed');
    }
    this.finish(s, flushed);
  }

  /**
   * Close the engine. Flushes and checkpoints only a volume opened completely and not
   * fenced; anything else is fenced locally first, so that close() writes nothing: a volume
   * whose takeover failed does not hold the log, and a removed or fenced one must not write.
   * Returns false if a final flush failed.
   */
  private async closeEngine(s: Served, ov: OpenVolume, exit: Exit): Promise<boolean> {
    let flushed = true;
    if (!s.complete) this.fenceEngine(s, `volume ${s.name} did not finish opening (${exitMessage(exit)}); closing it without writing`);
    else if (!s.fence && !ov.backend.readOnly && !s.volume?.isFenced) {
      try {
        await ov.backend.flush();
      } catch (err) {
        flushed = false;
        // Only on shutdown does this give up on data (idle and handoff refuse instead, above).
        // The writes no FLUSH acknowledged die with this process whatever we do; closing
        // without another attempt bounds the shutdown.
        this.opts.log.error({ volume: s.name, err: errorMessage(err) }, 'final flush at shutdown failed: writes no FLUSH acknowledged are lost with this process');
        this.fenceEngine(s, `final flush failed: ${errorMessage(err)}`);
      }
    }
    try {
      await ov.close();
    } catch (err) {
      flushed = false;
      this.opts.log.error({ volume: s.name, err: errorMessage(err) }, 'closing the volume failed');
    }
    return flushed;
  }

  /**
   * Give the lease back (reserved for the host that asked, if one did). Also after a failed
   * final flush at shutdown: the unflushed writes were never acknowledged by a FLUSH and are
   * lost with this process whether or not the lease is kept (the lease manager's close
   * releases it anyway), so keeping it would only keep the volume from every other host for
   * a TTL. Safety never depends on it: the store's create-only log positions fence any put
   * of ours that lands late, and release() ends our local validity before telling the store.
   */
  private async releaseLease(s: Served, exit: Exit): Promise<void> {
    const lease = s.lease;
    if (!lease) return;
    const to = exit.kind === 'handoff' ? exit.to : s.releaseTo;
    try {
      await lease.release(to);
      if (to !== undefined) {
        this.opts.log.info({ volume: s.name, to, fenced: !!s.fence }, 'volume handed off');
        this.emit({ type: 'handedOff', volume: s.name, to });
      }
    } catch (err) {
      // The lease was already gone (or the lease store is unreachable): the new host gets
      // the volume when the lease expires instead of at once.
      this.opts.log.warn({ volume: s.name, to, err: errorMessage(err) }, to !== undefined
        ? 'handed off, but the lease could not be reserved for the new host; it will acquire after the TTL'
        : 'the lease could not be released; it expires after its TTL');
    }
  }

  // ------------------------------------------------------------------ timers

  /** The idle timer runs exactly while serving with no handle out. */
  private updateIdle(s: Served): void {
    if (s.state === 'serving' && s.refs === 0) {
      if (!s.idleTimer) s.idleTimer = this.world.setTimeout(() => void this.closeIdle(s), this.opts.idleGraceMs);
    } else if (s.idleTimer) {
      this.world.clearTimeout(s.idleTimer);
      s.idleTimer = null;
    }
  }

  /** While serving under a lease: publish the volume's status for `baton status`. */
  private startStatus(s: Served): void {
    const lease = s.lease;
    const vol = s.volume;
    if (!lease || !vol || s.statusTimer) return;
    const publish = (): void => {
      const st = vol.stats();
      const h = st.hydration;
      lease.setStatus({
        dirtyBytes: st.dirtyBytes + st.sealedBytes, lastFlushAt: st.lastFlushAt, lastCommitSeq: st.lastCommitSeq,
        ...(this.opts.lease?.address ? { address: this.opts.lease.address } : {}),
        ...(h ? { hydration: { mode: h.mode, state: h.state, fetchedBytes: h.fetchedBytes, plannedBytes: h.plannedBytes, planned: h.planned } } : {}),
      });
    };
    // Every second while serving: a timer re-armed after each update (stopTimers cancels the pending one).
    const tick = (): void => {
      publish();
      s.statusTimer = this.world.setTimeout(tick, 1000);
      s.statusTimer.unref?.();
    };
    publish();
    s.statusTimer = this.world.setTimeout(tick, 1000);
    s.statusTimer.unref?.();
  }

  private stopTimers(s: Served): void {
    if (s.idleTimer) this.world.clearTimeout(s.idleTimer);
    if (s.statusTimer) this.world.clearTimeout(s.statusTimer);
    s.idleTimer = null;
    s.statusTimer = null;
  }

  /**
   * Every volume this host has in hand (not yet closed or fenced), for serve --metrics: read
   * at scrape time, so it costs nothing between scrapes.
   */
  servedVolumes(): ServedVolumeInfo[] {
    const now = this.world.now();
    const out: ServedVolumeInfo[] = [];
    for (const s of this.volumes.values()) {
      const lease = s.lease;
      out.push({
        name: s.name, state: s.state, connections: s.refs, volume: s.volume, requests: s.stats,
        // validUntil() is on this world's clock; -Infinity once released.
        lease: lease ? { token: lease.token, remainingMs: Math.max(0, lease.validUntil() - now) } : null,
      });
    }
    return out;
  }

  /** Volumes this host serves read-write under its lease (background compaction works on these). */
  writableVolumes(): { name: string; volume: Volume }[] {
    const out: { name: string; volume: Volume }[] = [];
    for (const s of this.volumes.values()) {
      const vol = s.volume;
      if (s.state === 'serving' && s.lease && vol && !vol.isFenced) out.push({ name: s.name, volume: vol });
    }
    return out;
  }

  /** Flush and close every open volume (server shutdown, after the sessions ended). */
  async close(): Promise<void> {
    this.closing = true;
    // A refused handoff may bring a volume back to serving: repeat until none is left.
    while (this.volumes.size > 0) {
      for (const s of [...this.volumes.values()]) if (s.state === 'opening' || s.state === 'serving') this.stop(s, { kind: 'shutdown' });
      await Promise.all([...this.volumes.values()].map((s) => s.exit));
    }
  }
}

function describeName(name: string, size?: number): string {
  const base = `baton ${isSnapshotName(name) ? 'snapshot' : 'volume'} ${name}`;
  return size === undefined ? base : `${base}, ${formatSize(size)}`;
}

function exitMessage(exit: Exit): string {
  switch (exit.kind) {
    case 'idle': return 'closed after its last client left';
    case 'shutdown': return 'the server is shutting down';
    case 'handoff': return `being handed over to ${exit.to}`;
    case 'failed': return `opening failed: ${errorMessage(exit.err)}`;
    case 'fence': return exit.reason;
  }
}

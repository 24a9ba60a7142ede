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
 *   reserved for the new host, which may acquire at once.
 * - Lease lost (renewals failed past the deadline): fence the volume locally (EIO for
 *   writes and flushes), disconnect its clients, drop it; a later attach acquires anew.
 */

import * as os from 'node:os';
import type { ExportHandle, ExportProvider, ExportSummary } from '../nbd/backend.js';
import { LeaseHeldError, NotFoundError, ShutdownError, errorMessage } from './errors.js';
import type { Lease, LeaseManager } from './lease/lease.js';
import type { Logger } from './log.js';
import { formatSize } from './size.js';
import { StaleTokenError, type Volume } from './volume/volume.js';
import { checkExportName, isSnapshotName, type OpenVolume, type VolumeCatalog, type VolumeInfo } from './volumes.js';

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
}

interface Served {
  name: string;
  refs: number;
  opening: Promise<{ ov: OpenVolume; lease: Lease | null }>;
  idleTimer: NodeJS.Timeout | null;
  statusTimer: NodeJS.Timeout | null;
  /** Set once opened read-write with the lease: what background compaction may rewrite. */
  writable: Volume | null;
}

export function defaultHostId(): string {
  return process.env.BATON_HOST_ID || os.hostname();
}

export class VolumeExports implements ExportProvider {
  private readonly served = new Map<string, Served>();
  /**
   * Volumes on their way out (idle close: flush, checkpoint, lease release). A client that
   * attaches meanwhile opens the volume again once that is done; acquiring at once would find
   * the lease still held by this very host and refuse the client.
   */
  private readonly leaving = new Map<string, Promise<void>>();
  private closing = false;
  private disconnect: (name: string) => void = () => {};

  constructor(private readonly catalog: VolumeCatalog, private readonly opts: VolumeExportsOptions) {}

  /** How to close the NBD connections of a volume (the server's disconnectExport). */
  setDisconnector(fn: (name: string) => void): void { this.disconnect = fn; }

  async list(): Promise<ExportSummary[]> {
    const vols = await this.catalog.list();
    return vols.map((v) => ({ name: v.name, description: describe(v) }));
  }

  /** "" (nbd-client without -N) means the only volume, if there is exactly one. */
  private async resolve(name: string): Promise<string> {
    if (name !== '') return name;
    const vols = await this.catalog.list();
    if (vols.length === 1) return vols[0]!.name;
    throw new NotFoundError(vols.length === 0
      ? `no volumes in ${this.catalog.description}; create one with: baton create NAME --size 10G`
      : `no export name given and there are ${vols.length} volumes; name one (nbd-client -N NAME, nbd://host/NAME): ${vols.map((v) => v.name).join(', ')}`);
  }

  async open(requested: string): Promise<ExportHandle> {
    if (this.closing) throw new ShutdownError('server is shutting down');
    const name = await this.resolve(requested);
    checkExportName(name);
    let s = this.served.get(name);
    if (!s) {
      const opening = (this.leaving.get(name) ?? Promise.resolve()).then(() => this.openServed(name));
      const fresh: Served = { name, refs: 0, opening, idleTimer: null, statusTimer: null, writable: null };
      s = fresh;
      this.served.set(name, fresh);
      opening.then(
        ({ ov, lease }) => {
          this.opts.log.info({ volume: name, token: lease?.token }, 'volume opened');
          if (lease && ov.volume) {
            const vol = ov.volume;
            fresh.writable = vol;
            const publish = (): void => { const st = vol.stats(); lease.setStatus({ dirtyBytes: st.dirtyBytes + st.sealedBytes, lastFlushAt: st.lastFlushAt, lastCommitSeq: st.lastCommitSeq, ...(this.opts.lease?.address ? { address: this.opts.lease.address } : {}) }); };
            publish();
            fresh.statusTimer = setInterval(publish, 1000);
            fresh.statusTimer.unref();
          }
        },
        () => { if (this.served.get(name) === fresh) this.served.delete(name); },
      );
    }
    s.refs++;
    if (s.idleTimer) { clearTimeout(s.idleTimer); s.idleTimer = null; }
    let ov: OpenVolume;
    try {
      ({ ov } = await s.opening);
    } catch (err) {
      s.refs--;
      throw err;
    }
    let released = false;
    const served = s;
    return {
      name,
      // From what is open: no store request per connection.
      description: `baton ${isSnapshotName(name) ? 'snapshot' : 'volume'} ${name}, ${formatSize(ov.backend.size)}`,
      backend: ov.backend,
      release: () => {
        if (released) return;
        released = true;
        served.refs--;
        if (served.refs === 0 && this.served.get(name) === served) {
          served.idleTimer = setTimeout(() => void this.closeIdle(served), this.opts.idleGraceMs);
        }
      },
    };
  }

  private async openServed(name: string): Promise<{ ov: OpenVolume; lease: Lease | null }> {
    const lc = this.opts.lease;
    // Snapshots are read-only: no lease, any number of hosts may serve them.
    if (this.opts.readOnly || !lc || isSnapshotName(name)) return { ov: await this.catalog.open(name, { readOnly: this.opts.readOnly || isSnapshotName(name) }), lease: null };
    let lease = await this.acquire(name, lc, 0);
    let ov: OpenVolume | null = null;
    try {
      ov = await this.catalog.open(name, { readOnly: false });
      const vol = ov.volume;
      if (vol) {
        try {
          await vol.takeover(lease.token);
        } catch (err) {
          if (!(err instanceof StaleTokenError)) throw err;
          // The log has seen this token (Redis lost its data): take a higher one.
          this.opts.log.warn({ volume: name, token: lease.token, logToken: err.minToken }, 'lease token not above the log; re-acquiring');
          await lease.release();
          lease = await this.acquire(name, lc, err.minToken);
          await vol.takeover(lease.token);
        }
        const held = lease;
        vol.setWriteDeadline(() => held.validUntil());
        held.onLost((reason) => void this.lost(name, reason));
        held.onHandoffRequest((to) => void this.handoff(name, to));
      }
      return { ov, lease };
    } catch (err) {
      if (ov) await ov.close().catch(() => {});
      await lease.release().catch(() => {});
      throw err;
    }
  }

  private async acquire(name: string, lc: LeaseConfig, minToken: number): Promise<Lease> {
    const base = minToken > 0 ? { minToken } : {};
    if (lc.onHeld === 'wait') return lc.manager.acquire(name, lc.hostId, { ...base, waitMs: lc.waitMs });
    try {
      return await lc.manager.acquire(name, lc.hostId, base);
    } catch (err) {
      if (!(err instanceof LeaseHeldError) || lc.onHeld !== 'takeover') throw err;
      this.opts.log.info({ volume: name, err: errorMessage(err) }, 'volume held elsewhere; asking for a handoff');
      await lc.manager.requestHandoff(name, lc.hostId);
      return lc.manager.acquire(name, lc.hostId, { ...base, waitMs: lc.waitMs });
    }
  }

  /** Another host asked for this volume: give it over cleanly. */
  async handoff(name: string, to: string): Promise<void> {
    const s = this.served.get(name);
    if (!s) return;
    const t0 = performance.now();
    this.served.delete(name);
    this.stopTimers(s);
    const { ov, lease } = await s.opening;
    ov.volume?.drain();
    this.disconnect(name);
    // Wait (briefly) for the clients' in-flight requests to finish and their connections to go.
    const deadline = Date.now() + 2000;
    while (s.refs > 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 5));
    try {
      await ov.backend.flush();
    } catch (err) {
      // Unflushed data exists only here: handing over now would lose it. Keep the lease and
      // the volume (dirty data included), take writes again, and say so; the handoff can be
      // asked for again once the store is reachable.
      this.opts.log.error({ volume: name, to, err: errorMessage(err) }, 'handoff refused: the final flush did not reach the store; keeping the volume and its unflushed data');
      ov.volume?.undrain();
      if (!this.served.has(name)) {
        this.served.set(name, s);
        if (s.refs === 0) s.idleTimer = setTimeout(() => void this.closeIdle(s), this.opts.idleGraceMs);
      }
      return;
    }
    await ov.close().catch(() => {});
    try {
      await lease?.release(to);
      this.opts.log.info({ volume: name, to, ms: Math.round(performance.now() - t0) }, 'volume handed off');
    } catch (err) {
      // Flushed and closed; the lease was already gone (or Redis is unreachable): the new
      // host gets the volume when the lease expires instead of at once.
      this.opts.log.warn({ volume: name, to, err: errorMessage(err) }, 'handed off, but the lease could not be reserved for the new host; it will acquire after the TTL');
    }
  }

  private async lost(name: string, reason: string): Promise<void> {
    const s = this.served.get(name);
    if (!s) return;
    this.served.delete(name);
    this.stopTimers(s);
    const { ov } = await s.opening;
    ov.volume?.fenceLocally(`lease lost: ${reason}`);
    this.opts.log.error({ volume: name, reason }, 'lease lost: volume fenced, clients disconnected');
    this.disconnect(name);
    await ov.close().catch(() => {});
  }

  private stopTimers(s: Served): void {
    if (s.idleTimer) clearTimeout(s.idleTimer);
    if (s.statusTimer) clearInterval(s.statusTimer);
    s.idleTimer = null;
    s.statusTimer = null;
  }

  /**
   * The last client left a while ago: flush, close, give the lease back. If the flush fails
   * the volume stays open with its dirty data (a later client sees it, and a later FLUSH
   * still has to land it) and closing is tried again later: acknowledged writes are never
   * dropped because nobody is attached.
   */
  private async closeIdle(s: Served): Promise<void> {
    if (s.refs > 0 || this.served.get(s.name) !== s) return;
    const { ov } = await s.opening;
    if (!ov.backend.readOnly) {
      try {
        await ov.backend.flush();
      } catch (err) {
        const retryMs = Math.min(Math.max(this.opts.idleGraceMs * 2, 1000), 30_000);
        this.opts.log.warn({ volume: s.name, err: errorMessage(err), retryMs }, 'idle volume could not be flushed; keeping it open and trying again');
        if (s.refs === 0 && this.served.get(s.name) === s) s.idleTimer = setTimeout(() => void this.closeIdle(s), retryMs);
        return;
      }
    }
    if (s.refs > 0 || this.served.get(s.name) !== s) return; // a client came back meanwhile
    this.served.delete(s.name);
    const closing = this.closeVolume(s).finally(() => { if (this.leaving.get(s.name) === closing) this.leaving.delete(s.name); });
    this.leaving.set(s.name, closing);
    await closing;
  }

  private async closeVolume(s: Served): Promise<void> {
    this.stopTimers(s);
    try {
      const { ov, lease } = await s.opening;
      let flushed = true;
      try {
        if (!ov.backend.readOnly) await ov.backend.flush();
      } catch (err) {
        flushed = false;
        this.opts.log.error({ volume: s.name, err: errorMessage(err) }, 'final flush at shutdown failed: writes no FLUSH acknowledged are lost with this process');
      }
      await ov.close().catch(() => {});
      await lease?.release();
      this.opts.log.info({ volume: s.name, flushed }, 'volume closed');
    } catch (err) {
      this.opts.log.error({ volume: s.name, err: errorMessage(err) }, 'closing volume failed');
    }
  }

  /** Volumes this host serves read-write under its lease (background compaction works on these). */
  writableVolumes(): { name: string; volume: Volume }[] {
    const out: { name: string; volume: Volume }[] = [];
    for (const s of this.served.values()) if (s.writable && !s.writable.isFenced) out.push({ name: s.name, volume: s.writable });
    return out;
  }

  /** Flush and close every open volume (server shutdown, after the sessions ended). */
  async close(): Promise<void> {
    this.closing = true;
    const all = [...this.served.values()];
    this.served.clear();
    await Promise.all(all.map((s) => this.closeVolume(s)));
  }
}

function describe(v: VolumeInfo): string {
  return `baton volume ${v.name}, ${formatSize(v.size)}`;
}

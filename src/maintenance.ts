/**
 * Compaction and garbage collection as operations: `baton gc` (once, from any host) and the
 * background pass of `baton serve`.
 *
 * Compaction rewrites data, so only the holder of a volume's lease may do it (it commits
 * under its token, fenced like any write): `baton gc --compact` takes the lease of each
 * volume nobody serves, exactly as an attach would; a served volume is compacted by the
 * host serving it, in the background. GC itself needs no lease (src/volume/gc.ts).
 *
 * The background pass runs only while this host serves a volume read-write, and only when
 * there is something to do: a served volume committed since the last pass, or the last GC
 * run left objects to delete later. A quiet server makes no store requests.
 */

import { errorMessage, isBatonError, LeaseHeldError } from './errors.js';
import type { VolumeExports } from './exports.js';
import type { LeaseManager } from './lease/lease.js';
import type { Logger } from './log.js';
import type { StoreCatalog } from './volume/catalog.js';
import { collectGarbage, type GcResult } from './volume/gc.js';
import { Volume, type CompactionResult } from './volume/volume.js';

export const DEFAULT_COMPACT_BELOW = 0.5;

export interface CompactionReport {
  name: string;
  result?: CompactionResult;
  /** Why it was not compacted (served elsewhere, snapshot, error). */
  skipped?: string;
}

/** Compact every volume whose lease this process can take (the others are compacted by their servers). */
export async function compactIdleVolumes(catalog: StoreCatalog, exports: VolumeExports, opts: { below: number; log?: Logger }): Promise<CompactionReport[]> {
  const out: CompactionReport[] = [];
  try {
    for (const rec of await catalog.allRecords()) {
      if (rec.snapshot) continue; // immutable: never rewritten
      // Look before taking the lease: a volume with nothing to compact is left alone (no
      // takeover record, no checkpoint written for nothing).
      try {
        const view = await catalog.openView(rec, catalog.store, true);
        const c = await view.compactionCandidates(opts.below);
        await view.close();
        if (c.victims.size === 0) { out.push({ name: rec.name, skipped: 'nothing to compact' }); continue; }
      } catch (err) {
        out.push({ name: rec.name, skipped: errorMessage(err) });
        continue;
      }
      let handle;
      try {
        handle = await exports.open(rec.name);
      } catch (err) {
        const served = isBatonError(err, 'BATON_ERR_LEASE_HELD');
        out.push({ name: rec.name, skipped: served ? `${errorMessage(err)} (its server compacts it)` : errorMessage(err) });
        continue;
      }
      try {
        if (!(handle.backend instanceof Volume)) { out.push({ name: rec.name, skipped: 'not an object-store volume' }); continue; }
        const result = await handle.backend.compact({ below: opts.below });
        out.push({ name: rec.name, result });
        opts.log?.info({ volume: rec.name, ...result }, 'compacted');
      } catch (err) {
        out.push({ name: rec.name, skipped: errorMessage(err) });
      } finally {
        handle.release();
      }
    }
  } finally {
    // Flush, checkpoint (so the records compaction superseded are garbage), give the leases back.
    await exports.close();
  }
  return out;
}

export interface ExpiryReport {
  name: string;
  expiresAt: string;
  /** Removed (its data kept if relatives use it). */
  removed: boolean;
  keptForRelatives?: boolean;
  /** Why it was not removed: served, has snapshots, an error. */
  skipped?: string;
}

/**
 * Remove the volumes whose expiry (docs/rfc-lifecycle.md, "Expiry") has passed and that nobody
 * serves. Each is removed the way `rm` would, under its lease, taken as an attach would: a
 * volume a host serves (attached, or within its idle grace, or opening) holds its lease, so
 * taking it fails and the volume is skipped, never removed; `servedHere` skips those this
 * process serves (its own lease would be refused too, but not by name). The expiry is read
 * again once the lease is held (an `expire --never` before that wins). Every removal and
 * every skip is logged.
 */
export async function removeExpired(catalog: StoreCatalog, o: { leases: LeaseManager; hostId: string; log: Logger; now?: number; servedHere?: (name: string) => boolean }): Promise<ExpiryReport[]> {
  const now = o.now ?? Date.now();
  const out: ExpiryReport[] = [];
  for (const raw of await catalog.allRecords()) {
    if (raw.snapshot) continue;
    let expiresAt: string | undefined;
    try {
      expiresAt = (await catalog.effective(raw)).expiresAt;
    } catch (err) {
      o.log.warn({ volume: raw.name, err: errorMessage(err) }, 'expiry: could not read the volume\'s attributes; skipped');
      continue;
    }
    if (!expiresAt || Date.parse(expiresAt) > now) continue;
    const report: ExpiryReport = { name: raw.name, expiresAt, removed: false };
    out.push(report);
    if (o.servedHere?.(raw.name)) {
      report.skipped = 'served by this host';
      o.log.info({ volume: raw.name, expiresAt }, 'expired volume is served here: not removed');
      continue;
    }
    let lease;
    try {
      lease = await o.leases.acquire(raw.name, o.hostId);
    } catch (err) {
      report.skipped = err instanceof LeaseHeldError ? `served: ${errorMessage(err)}` : errorMessage(err);
      o.log.info({ volume: raw.name, expiresAt, reason: report.skipped }, 'expired volume is in use: not removed');
      continue;
    }
    try {
      const still = await catalog.record(raw.name);
      if (still.id !== raw.id || !still.expiresAt || Date.parse(still.expiresAt) > now) { report.skipped = 'changed meanwhile'; continue; }
      const r = await catalog.remove(raw.name);
      report.removed = true;
      report.keptForRelatives = r.keptForRelatives;
      o.log.warn({ volume: raw.name, expiresAt, keptForRelatives: r.keptForRelatives }, 'expired volume removed');
    } catch (err) {
      report.skipped = errorMessage(err);
      o.log.warn({ volume: raw.name, expiresAt, err: errorMessage(err) }, 'expired volume not removed');
    } finally {
      await lease.release().catch(() => {});
    }
  }
  return out;
}

export interface BackgroundOptions {
  /** Remove expired volumes nobody serves before each GC run (removeExpired). */
  expiry?: { leases: LeaseManager; hostId: string };
  intervalMs: number;
  graceMs: number;
  compactBelow: number;
  /** Bytes one compaction pass may rewrite per volume (spreads the work over passes). */
  compactMaxBytes?: number;
  log: Logger;
}

/** What the background passes of this process did, summed (serve --metrics reads it at scrape time). */
export interface MaintenanceStats {
  /** GC runs that finished, and runs that failed (nothing deleted that should not be; the next pass retries). */
  gcRuns: number;
  gcFailures: number;
  markedObjects: number;
  markedBytes: number;
  deletedObjects: number;
  deletedBytes: number;
  /** When the last run (finished or failed) ended: ms since the epoch; null before the first. */
  lastGcEndedAt: number | null;
  /** How long that run took, in seconds. */
  lastGcSeconds: number;
  /** Live bytes compaction rewrote into new objects. */
  compactedBytes: number;
}

/** Periodic compaction of the volumes this host serves, then a GC run over the store. */
export class BackgroundMaintenance {
  readonly stats: MaintenanceStats = {
    gcRuns: 0, gcFailures: 0, markedObjects: 0, markedBytes: 0, deletedObjects: 0, deletedBytes: 0,
    lastGcEndedAt: null, lastGcSeconds: 0, compactedBytes: 0,
  };
  private timer: NodeJS.Timeout | null = null;
  private running: Promise<unknown> | null = null;
  private stopped = false;
  /** Commits per served volume at the last pass, and whether that pass left work pending. */
  private seen = new Map<string, number>();
  private pending = false;

  constructor(private readonly catalog: StoreCatalog, private readonly exports: VolumeExports, private readonly opts: BackgroundOptions) {}

  start(): void {
    if (this.opts.intervalMs <= 0) return;
    this.timer = setInterval(() => { if (!this.running) this.running = this.pass().finally(() => { this.running = null; }); }, this.opts.intervalMs);
    this.timer.unref();
  }

  /** One pass; errors are logged, never thrown (the next pass tries again). */
  async pass(): Promise<{ compacted: CompactionReport[]; gc: GcResult | null }> {
    const served = this.exports.writableVolumes();
    if (served.length === 0 || this.stopped) return { compacted: [], gc: null };
    const changed = served.some(({ name, volume }) => this.seen.get(name) !== volume.stats().commits);
    if (!changed && !this.pending) return { compacted: [], gc: null };
    const compacted: CompactionReport[] = [];
    for (const { name, volume } of served) {
      try {
        const result = await volume.compact({ below: this.opts.compactBelow, maxBytes: this.opts.compactMaxBytes ?? 256 * 1024 * 1024 });
        compacted.push({ name, result });
        this.stats.compactedBytes += result.rewrittenBytes;
      } catch (err) {
        compacted.push({ name, skipped: errorMessage(err) });
        this.opts.log.warn({ volume: name, err: errorMessage(err) }, 'background compaction failed; trying again next pass');
      }
    }
    if (this.opts.expiry) {
      try {
        await removeExpired(this.catalog, { ...this.opts.expiry, log: this.opts.log, servedHere: (n) => this.exports.stateOf(n) !== null });
      } catch (err) {
        this.opts.log.warn({ err: errorMessage(err) }, 'background expiry pass failed; trying again next pass');
      }
    }
    let gc: GcResult | null = null;
    const t0 = performance.now();
    try {
      gc = await collectGarbage(this.catalog, { graceMs: this.opts.graceMs, log: this.opts.log });
      const st = this.stats;
      st.gcRuns++;
      st.markedObjects += gc.markedObjects;
      st.markedBytes += gc.markedBytes;
      st.deletedObjects += gc.deletedObjects;
      st.deletedBytes += gc.deletedBytes;
      // Work left: what this run marked, what an earlier (or another host's) mark names and
      // waits to age, and what is too young to mark yet. Each needs a later run.
      this.pending = gc.markedObjects > 0 || gc.awaitingMarkAge > 0 || gc.youngUnreferenced > 0;
    } catch (err) {
      this.pending = true;
      this.stats.gcFailures++;
      this.opts.log.warn({ err: errorMessage(err) }, 'background GC failed; nothing was deleted that should not be, trying again next pass');
    }
    this.stats.lastGcEndedAt = Date.now();
    this.stats.lastGcSeconds = (performance.now() - t0) / 1000;
    // After compaction's own commits: a pass that only compacted counts as a change once.
    this.seen = new Map(served.map(({ name, volume }) => [name, volume.stats().commits]));
    return { compacted, gc };
  }

  async stop(): Promise<void> {
    this.stopped = true;
    if (this.timer) clearInterval(this.timer);
    await this.running;
  }
}

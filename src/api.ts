/**
 * The embeddable control plane: everything the `baton` command does, as a typed API. The
 * CLI (cli/baton.ts) is a thin layer over it (parse flags, call this, print), so the two
 * cannot drift. This module is the package's entry point (`import { openDeployment } from
 * 'baton'`, package.json "exports").
 *
 *   const d = await openDeployment({ store: 'file:/var/lib/baton' });
 *   await d.create('work', { size: 10 * 2 ** 30 });
 *   const server = await d.serve({ listen: { host: '127.0.0.1', port: 10809 } });
 *   server.on('attached', (e) => console.log(e.volume, e.connections));
 *   await d.fork('work', 'try-1');
 *   await d.rename('try-1', 'work', { replace: true });
 *   await server.close();
 *   await d.close();
 *
 * Contract:
 * - Settings are the CLI's (store URL, endpoint, region, Redis URL, host id, lease TTL, cache
 *   directory and size), and default the way the CLI's do, from the same environment
 *   variables (BATON_STORE, BATON_S3_ENDPOINT, AWS_REGION, BATON_REDIS_URL, BATON_HOST_ID,
 *   BATON_CACHE_DIR, BATON_LOG_LEVEL, BATON_HOME).
 * - Every failure is a BatonError with a stable `code` (src/errors.ts); the message says what
 *   to do, in the CLI's words.
 * - Every operation that can take long (fork, snapshot, rm, rename, gc, handoff, prefetch)
 *   takes an AbortSignal and reports progress through `onProgress`. The signal is checked
 *   between steps, never inside one: a store request in flight is not cancelled, and what the
 *   steps before it did stands, as each step's own guarantee says (a fork that landed is
 *   there; a rename aborted after its destination was removed says so). An aborted call
 *   rejects with AbortedError (BATON_ERR_ABORTED).
 * - A Deployment opens its catalog and lease manager on first use and releases them in
 *   close(); it may be used concurrently.
 */

import { NbdClient } from '../nbd/client.js';
import type { ListenAddress } from '../nbd/server.js';
import { defaultCacheDir, openCatalog, type CatalogOptions } from './catalog.js';
import { defaultStoreUrl, parseListen } from './config.js';
import { AbortedError, BatonError, InvalidArgumentError, LeaseHeldError, NotFoundError, TimeoutError, errorMessage } from './errors.js';
import { defaultHostId, VolumeExports } from './exports.js';
import type { Lease, LeaseManager, LeaseRecord } from './lease/lease.js';
import { openLeaseManager } from './lease/open.js';
import { makeLogger, silentLogger, type Logger } from './log.js';
import { compactIdleVolumes, DEFAULT_COMPACT_BELOW, removeExpired, type CompactionReport, type ExpiryReport } from './maintenance.js';
import { INTERACTIVE_RETRY_BUDGET_MS } from './store/open.js';
import { StoreCatalog, type StoreRemoveResult, type StoreVolumeInfo } from './volume/catalog.js';
import { collectGarbage, DEFAULT_GC_GRACE_MS, type GcResult } from './volume/gc.js';
import type { Range } from '../cow/diff.js';
import type { VolumeCatalog } from './volumes.js';
import { startServer, type BatonServer, type ServeOptions } from './api-serve.js';
import { exportImage, importImage, type ExportOptions, type ExportResult, type ImportOptions, type ImportResult } from './api-images.js';

export { AbortedError, BatonError, isBatonError, type BatonErrorCode } from './errors.js';
export type { StoreVolumeInfo as VolumeInfo, SnapshotOf } from './volume/catalog.js';
export type { LeaseRecord, LeaseStatus } from './lease/lease.js';
export type { GcResult } from './volume/gc.js';
export type { CompactionReport, ExpiryReport } from './maintenance.js';
export type { Range } from '../cow/diff.js';
export type { ListenAddress } from '../nbd/server.js';
export type { VolumeEvent } from './exports.js';
export type { BatonServer, ServeOptions, ServerEvents } from './api-serve.js';
export type { ExportOptions, ExportResult, ImportOptions, ImportResult } from './api-images.js';
export { parseSize, formatSize } from './size.js';

/** Where the volumes live and how this process takes part. Every field is optional. */
export interface DeploymentOptions {
  /** `file:DIR`, `s3://bucket[/prefix]`, `memory:` (this process only), or the plain `ram:`/`raw:DIR`. Default $BATON_STORE, else file: under $BATON_HOME. */
  store?: string;
  /** S3-compatible endpoint (MinIO, Ceph RGW, R2). Default $BATON_S3_ENDPOINT. Credentials come from the AWS chain. */
  endpoint?: string;
  /** S3 region. Default $AWS_REGION. */
  region?: string;
  /** Redis holding the single-writer leases. Default $BATON_REDIS_URL; without it, lease files on this machine. */
  redis?: string;
  /** This host's name in leases and handoffs. Default $BATON_HOST_ID, else the host name. */
  hostId?: string;
  /** Lease time-to-live (a dead host is taken over after it). Default 5000. */
  leaseTtlMs?: number;
  /** The local read cache directory. Default $BATON_CACHE_DIR, else under $BATON_HOME. */
  cacheDir?: string;
  /** The local read cache capacity in bytes. Default 2 GiB. */
  cacheSize?: number;
  /** A pino logger, or a level for one on stderr. Default: silent. */
  log?: Logger | string;
  /** How long one store operation may retry before it fails naming the store. Default 30 s (what the CLI's commands use). */
  retryBudgetMs?: number;
  /**
   * The master key file of encrypted volumes (32 bytes, or 64 hex digits or base64 text; see
   * README "Encryption at rest"). Default $BATON_KEY_FILE, else the key in $BATON_KEY; read only
   * when an encrypted volume is created, forked or opened. Never a key itself in a setting.
   */
  keyFile?: string;
}

/** Progress of a long operation: its phase, and bytes or items done of a total where known. */
export interface Progress {
  operation: string;
  /** What it is doing now, in words ("removing work", "landing work", "collecting"). */
  phase: string;
  done?: number;
  total?: number;
  /** With bytes: per second, and seconds left at that rate (null before there is a rate). */
  bytesPerSecond?: number;
  etaSeconds?: number | null;
  /** The last report of the operation. */
  finished?: boolean;
}

/** What every long operation takes. */
export interface LongOperation {
  signal?: AbortSignal;
  onProgress?: (p: Progress) => void;
}

export interface CreateOptions {
  size: number;
  /** Expire this long from now: GC removes it after that unless a host serves it. */
  expiresInMs?: number;
  /** Compress its data per 32 KiB frame (default lz4; frames that do not shrink are stored as they are). */
  compression?: 'lz4' | 'none';
  /** Encrypt its data at rest (AES-256-GCM) with a data key of its own, wrapped by the master key (`keyFile`). */
  encrypt?: boolean;
  /** framed (checksummed frames, the default) or raw (the layout before frames: no checksums; tests and benchmarks). */
  dataFormat?: 'framed' | 'raw';
}
export interface ForkOptions extends LongOperation {
  /** The fork expires this long from now (the source's expiry is not inherited). */
  expiresInMs?: number;
}
export interface ResizeOptions extends LongOperation {
  /** The new size in bytes (a multiple of 4096). */
  size: number;
  /** Allow a smaller size (refused while data is mapped past the new end, and while a host serves the volume). */
  shrink?: boolean;
}
export interface ExpireOptions {
  /** Expire this long from now... */
  inMs?: number;
  /** ...or never (clears the expiry). */
  never?: boolean;
}
export interface ListOptions { /** Space accounting (written, exclusive, shared); loads every map. Default true. */ accounting?: boolean }
export interface RmOptions extends LongOperation {
  /** Also remove the volume's snapshots (first). */
  snapshots?: boolean;
  /** Remove it even if a host serves it: that host's lease is broken; it fences the volume and disconnects its clients at its next renewal. */
  force?: boolean;
}
export interface RmResult extends StoreRemoveResult {
  /** With force: the host whose lease was broken, if one held it. */
  brokeLeaseOf: string | null;
  /** With force: a lease was held and is now broken. */
  revokedLease: boolean;
}
export interface DiffResult { a: string; b: string; sharedHistory: boolean; differentBytes: number; ranges: Range[] }
export interface GcOptions extends LongOperation {
  /** Only objects unreferenced for this long are deleted. Default 1 h. */
  graceMs?: number;
  dryRun?: boolean;
  /** First compact every volume nobody serves (takes its lease, like an attach). */
  compact?: boolean;
  compactBelow?: number;
}
export interface GcReport extends GcResult {
  compacted: CompactionReport[];
  /** Expired volumes: removed, or skipped (served, has snapshots) and why. */
  expired: ExpiryReport[];
}
export interface HandoffOptions extends LongOperation { /** How long to wait for the holder to release it. Default 10 s. */ waitMs?: number }
export interface PrefetchOptions extends LongOperation {
  /** The serving host's NBD address. Default 127.0.0.1:10809. */
  address?: ListenAddress;
  /** Every range holding data, working set first (default: the working set only). */
  all?: boolean;
  /** CACHE requests in flight. Default 8. */
  concurrency?: number;
}
export interface RenameOptions extends LongOperation {
  /** Make the source THE destination: the destination's current volume is removed (its data kept while relatives use it). */
  replace?: boolean;
  /** With replace: even if a host serves the destination (its lease is broken; it drops the old volume like a removed one). */
  force?: boolean;
}
export interface RenameResult {
  from: string;
  to: string;
  /** The renamed volume keeps its expiry (ISO time), if it had one. */
  expiresAt?: string;
  /** The renamed volume's new id (a rename is an O(1) fork under the new name, then the old name's removal). */
  id: string;
  /** With replace: what happened to the volume that had the destination name. */
  replaced: { keptForRelatives: boolean; deletedObjects: number; brokeLeaseOf: string | null } | null;
}

/** An AbortSignal that fired: AbortedError naming the operation (and the step it stopped before). */
export function checkAborted(signal: AbortSignal | undefined, what: string): void {
  if (signal?.aborted) throw new AbortedError(`${what} was aborted${signal.reason instanceof Error ? ` (${signal.reason.message})` : ''}`, { cause: signal.reason });
}

function sleep(ms: number, signal: AbortSignal | undefined, what: string): Promise<void> {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => { signal?.removeEventListener('abort', onAbort); resolve(); }, ms);
    const onAbort = (): void => { clearTimeout(t); try { checkAborted(signal, what); } catch (err) { reject(err); } };
    signal?.addEventListener('abort', onAbort, { once: true });
  });
}

/** Open a deployment: nothing is contacted until the first call that needs it. */
export async function openDeployment(options: DeploymentOptions = {}): Promise<Deployment> {
  return new Deployment(options);
}

export class Deployment {
  readonly store: string;
  readonly hostId: string;
  readonly leaseTtlMs: number;
  readonly log: Logger;
  private readonly opts: DeploymentOptions;
  private cat: VolumeCatalog | null = null;
  private leases: Promise<LeaseManager> | null = null;

  constructor(options: DeploymentOptions = {}) {
    const env = process.env;
    const endpoint = options.endpoint ?? env.BATON_S3_ENDPOINT;
    const region = options.region ?? env.AWS_REGION;
    const redis = options.redis ?? env.BATON_REDIS_URL;
    this.opts = {
      ...options,
      ...(endpoint ? { endpoint } : {}), ...(region ? { region } : {}), ...(redis ? { redis } : {}),
    };
    this.store = options.store ?? defaultStoreUrl();
    this.hostId = options.hostId ?? defaultHostId();
    this.leaseTtlMs = options.leaseTtlMs ?? 5000;
    this.log = typeof options.log === 'string' ? makeLogger(options.log) : options.log ?? silentLogger();
  }

  /** The Redis URL of the leases, if any (else lease files on this machine). */
  get redisUrl(): string | undefined { return this.opts.redis; }

  /** The settings a catalog of this deployment is opened with (serve adds its own). */
  catalogOptions(extra: CatalogOptions = {}): CatalogOptions {
    const o = this.opts;
    return {
      retry: { budgetMs: o.retryBudgetMs ?? INTERACTIVE_RETRY_BUDGET_MS }, log: this.log,
      cacheDir: o.cacheDir ?? defaultCacheDir(), ...(o.cacheSize !== undefined ? { cacheSize: o.cacheSize } : {}),
      ...(o.keyFile !== undefined ? { keyFile: o.keyFile } : {}),
      ...extra,
      ...(o.endpoint ? { endpoint: o.endpoint } : {}), ...(o.region ? { region: o.region } : {}),
    };
  }

  /** The volume catalog (opened once). */
  get catalog(): VolumeCatalog {
    return (this.cat ??= openCatalog(this.store, this.catalogOptions()));
  }

  /** The engine's catalog, or a clear error for the plain backends (ram:, raw:). */
  storeCatalog(what: string): StoreCatalog {
    const c = this.catalog;
    if (!(c instanceof StoreCatalog)) throw new InvalidArgumentError(`${what} needs an object store (file:DIR, s3://, memory:), not ${this.store}`);
    return c;
  }

  /** The lease manager the settings name: Redis, or lease files next to a local store. */
  leaseManager(): Promise<LeaseManager> {
    this.leases ??= openLeaseManager({ storeUrl: this.store, ttlMs: this.leaseTtlMs, log: this.log, ...(this.opts.redis ? { redis: this.opts.redis } : {}) });
    return this.leases;
  }

  /** A sparse volume of `size` bytes (a multiple of 4096). */
  async create(name: string, options: CreateOptions): Promise<StoreVolumeInfo> {
    const c = this.catalog;
    if (!(c instanceof StoreCatalog)) {
      // The plain backends (ram:, raw:DIR) store bytes as they are: compression and the frame
      // format do not apply to them; expiry and encryption would be promises they cannot keep.
      if (options.expiresInMs !== undefined || options.encrypt) throw new InvalidArgumentError(`${options.encrypt ? 'encryption' : 'expiry'} needs an object store (file:DIR, s3://, memory:), not ${this.store}`);
      return c.create(name, options.size);
    }
    return c.create(name, options.size, {
      ...(options.compression !== undefined ? { compression: options.compression } : {}),
      ...(options.dataFormat !== undefined ? { format: options.dataFormat } : {}),
      ...(options.encrypt ? { encrypt: true } : {}),
      ...(options.expiresInMs !== undefined ? { expiresAt: expiryTime(options.expiresInMs) } : {}),
    });
  }

  /** Every volume and snapshot (with space accounting unless `accounting: false`). */
  async list(options: ListOptions = {}): Promise<StoreVolumeInfo[]> {
    const c = this.catalog;
    if (c instanceof StoreCatalog) return options.accounting === false ? c.list() : c.listWithAccounting();
    return c.list();
  }

  /** One volume or snapshot (with space accounting unless `accounting: false`). */
  async info(name: string, options: ListOptions = {}): Promise<StoreVolumeInfo> {
    const c = this.catalog;
    if (c instanceof StoreCatalog && options.accounting !== false) return c.infoWithAccounting(name);
    return c.info(name);
  }

  /** An O(1) copy-on-write fork of a volume (or NAME@SNAP) at its last acknowledged flush. */
  async fork(src: string, dst: string, options: ForkOptions = {}): Promise<StoreVolumeInfo> {
    const expiresAt = options.expiresInMs !== undefined ? expiryTime(options.expiresInMs) : undefined;
    checkAborted(options.signal, `fork ${src} ${dst}`);
    options.onProgress?.({ operation: 'fork', phase: `forking ${src} into ${dst}` });
    const v = await this.storeCatalog('fork').fork(src, dst, expiresAt ? { expiresAt } : {});
    options.onProgress?.({ operation: 'fork', phase: 'done', finished: true });
    return v;
  }

  /** A read-only snapshot NAME@SNAP of a volume's last acknowledged flush. */
  async snapshot(name: string, snap: string, options: LongOperation = {}): Promise<StoreVolumeInfo> {
    checkAborted(options.signal, `snapshot ${name} ${snap}`);
    options.onProgress?.({ operation: 'snapshot', phase: `snapshotting ${name}` });
    const v = await this.storeCatalog('snapshot').snapshot(name, snap);
    options.onProgress?.({ operation: 'snapshot', phase: 'done', finished: true });
    return v;
  }

  /** Byte ranges that differ between two volumes or snapshots (from the maps; no data read). */
  async diff(a: string, b: string): Promise<DiffResult> {
    const c = this.storeCatalog('diff');
    const [ranges, sharedHistory] = await Promise.all([c.diff(a, b), c.shareHistory(a, b)]);
    return { a, b, sharedHistory, differentBytes: ranges.reduce((n, r) => n + r.length, 0), ranges };
  }

  /**
   * Remove a volume (or NAME@SNAP) and its data. Refused (LeaseHeldError) while a host serves
   * it unless `force`; refused while it has snapshots unless `snapshots`.
   */
  async rm(name: string, options: RmOptions = {}): Promise<RmResult> {
    checkAborted(options.signal, `rm ${name}`);
    const catalog = this.catalog;
    // Snapshots are served read-only, without a lease.
    const leases = name.includes('@') ? null : await this.leaseManager();
    const held = leases ? await leases.inspect(name) : null;
    if (held?.holder && !options.force) throw new LeaseHeldError(`volume ${name} is being served by ${held.holder}; detach its clients (the lease is given back after --idle-grace) or hand it over, then retry; --force removes it anyway (and breaks that host's lease)`);
    checkAborted(options.signal, `rm ${name}`);
    options.onProgress?.({ operation: 'rm', phase: `removing ${name}` });
    let r: StoreRemoveResult;
    let revokedLease = false;
    try {
      r = catalog instanceof StoreCatalog ? await catalog.remove(name, { snapshots: !!options.snapshots }) : { ...(await catalog.remove(name)), removedSnapshots: [] };
    } finally {
      // force: break the lease once the record is gone (also if rm failed after that), not
      // before: the holder, fenced, must find nothing to reopen under that name. Without it,
      // a host serving a removed volume would go on serving its old bytes under that name.
      if (options.force && leases && await isGone(catalog, name)) revokedLease = await leases.revoke(name);
    }
    options.onProgress?.({ operation: 'rm', phase: 'done', finished: true });
    return { ...r, brokeLeaseOf: revokedLease ? held?.holder ?? null : null, revokedLease };
  }

  /**
   * Give volume `from` the name `to` (docs/rfc-lifecycle.md). Without `replace`, an existing `to`
   * is refused (AlreadyExistsError). With it, `to`'s current volume is removed (its data kept
   * while relatives use it) and `from` becomes `to`: the agent's attempt becomes THE workspace.
   *
   * Both names are leased for the whole operation, as an attach would lease them, so no host
   * serves either while it runs: a served `from` is refused (LeaseHeldError: detach it or hand
   * it over first); a served `to` is refused too unless `force`, which breaks that host's
   * lease (it fences and drops the old volume, and its next attach finds the new one).
   */
  async rename(from: string, to: string, options: RenameOptions = {}): Promise<RenameResult> {
    const what = `rename ${from} ${to}`;
    const catalog = this.storeCatalog('rename');
    catalog.checkRename(from, to);
    checkAborted(options.signal, what);
    const leases = await this.leaseManager();
    const progress = (phase: string): void => options.onProgress?.({ operation: 'rename', phase });
    const held: Lease[] = [];
    let brokeLeaseOf: string | null = null;
    try {
      progress(`leasing ${from} and ${to}`);
      held.push(await this.leaseForChange(leases, from, `rename ${from}: it is being served by HOLDER; detach its clients (its lease is given back after serve's --idle-grace) or hand it over, then retry`));
      try {
        held.push(await this.leaseForChange(leases, to, `${to} is being served by HOLDER; detach its clients first, or add --force to break that host's lease (it drops the old ${to} and disconnects its clients)`));
      } catch (err) {
        if (!(err instanceof LeaseHeldError) || !options.force || !options.replace) throw err;
        const rec = await leases.inspect(to);
        brokeLeaseOf = rec?.holder || null;
        // The holder finds its lease gone at its next renewal, fences the old volume and
        // disconnects its clients; a client attaching there meanwhile is checked against the
        // record (stillInStore), which names the new volume once we are done.
        await leases.revoke(to);
        held.push(await leases.acquire(to, this.hostId, { waitMs: this.leaseTtlMs }));
      }
      checkAborted(options.signal, what);
      const r = await catalog.rename(from, to, {
        replace: !!options.replace,
        onStep: (step) => { checkAborted(options.signal, what); progress(step); },
        // The leases are what keeps attaches, other renames and compaction off both names;
        // each step that changes a name first checks they still hold (a paused process whose
        // leases expired must not go on: docs/rfc-lifecycle.md, "What the leases give").
        leased: () => {
          const now = performance.now();
          for (const l of held) if (l.validUntil() <= now) throw new BatonError('BATON_ERR_LEASE_LOST', `${what}: the lease on ${l.volume} expired before the rename was done (is this process starved, or the lease service unreachable?); see baton ls: ${from} or ${to} names a whole volume, never a mix; run it again`);
        },
      });
      options.onProgress?.({ operation: 'rename', phase: 'done', finished: true });
      return { ...r, replaced: r.replaced ? { ...r.replaced, brokeLeaseOf } : null };
    } finally {
      await Promise.all(held.map((l) => l.release().catch(() => {})));
    }
  }

  /** Acquire a volume's lease to change its name, or LeaseHeldError with `message` (HOLDER: who holds it). */
  private async leaseForChange(leases: LeaseManager, name: string, message: string): Promise<Lease> {
    try {
      return await leases.acquire(name, this.hostId);
    } catch (err) {
      if (!(err instanceof LeaseHeldError)) throw err;
      const rec = await leases.inspect(name).catch(() => null);
      throw new LeaseHeldError(message.replace('HOLDER', rec?.holder || rec?.reservedFor || 'another host'));
    }
  }

  /**
   * Resize a volume (docs/rfc-lifecycle.md, "Resize"). Growing is allowed at any time: a host
   * serving the volume gives the new size to connections attached from then on. Shrinking needs
   * `shrink`, takes the volume's lease (LeaseHeldError while a host serves it) and is refused
   * while data is mapped past the new end.
   */
  async resize(name: string, options: ResizeOptions): Promise<{ name: string; from: number; to: number }> {
    const what = `resize ${name}`;
    checkAborted(options.signal, what);
    const catalog = this.storeCatalog('resize');
    if (!options.shrink) return catalog.resize(name, options.size);
    const cur = await catalog.record(name);
    if (options.size >= cur.size) return catalog.resize(name, options.size);
    const leases = await this.leaseManager();
    const lease = await this.leaseForChange(leases, name, `${name} is being served by HOLDER: a volume is shrunk only while nobody serves it (its clients could be writing past the new end); detach them (and shrink the filesystem first), then retry`);
    try {
      checkAborted(options.signal, what);
      return await catalog.resize(name, options.size, {
        shrink: true,
        leased: () => { if (lease.validUntil() <= performance.now()) throw new BatonError('BATON_ERR_LEASE_LOST', `${what}: the lease on ${name} expired before the shrink was done; nothing was changed; run it again`); },
      });
    } finally {
      await lease.release().catch(() => {});
    }
  }

  /** Set when a volume expires (`inMs` from now), or clear it (`never`). */
  async expire(name: string, options: ExpireOptions): Promise<{ name: string; expiresAt: string | null }> {
    if ((options.inMs === undefined) === !options.never) throw new InvalidArgumentError('expire takes either a time (--in 24h) or --never');
    const expiresAt = options.never ? null : expiryTime(options.inMs!);
    await this.storeCatalog('expire').setExpiry(name, expiresAt);
    return { name, expiresAt };
  }

  /** Who serves each volume: holder, token, TTL left, dirty bytes, last flush, hydration. */
  async status(): Promise<LeaseRecord[]> {
    return (await this.leaseManager()).list();
  }

  /**
   * Ask the host serving `name` to hand it to host `to` (it flushes, releases the lease reserved
   * for `to` and disconnects its clients); resolves once it is released (TimeoutError after `waitMs`).
   */
  async handoff(name: string, to: string, options: HandoffOptions = {}): Promise<{ ms: number }> {
    const what = `handoff ${name} to ${to}`;
    checkAborted(options.signal, what);
    const leases = await this.leaseManager();
    const waitMs = options.waitMs ?? 10_000;
    const t0 = performance.now();
    await leases.requestHandoff(name, to);
    const deadline = Date.now() + waitMs;
    for (;;) {
      const l = await leases.inspect(name);
      // Done once it is free, reserved for the new host, or already taken by it.
      if (!l || !l.holder || l.reservedFor === to || l.holder === to) break;
      options.onProgress?.({ operation: 'handoff', phase: `waiting for ${l.holder} to release ${name}` });
      if (Date.now() > deadline) throw new TimeoutError(`${l.holder} did not release ${name} within ${waitMs / 1000} s; it may be flushing a lot of data, or unable to reach the store (see its log)`);
      await sleep(20, options.signal, what);
    }
    options.onProgress?.({ operation: 'handoff', phase: 'done', finished: true });
    return { ms: Math.round(performance.now() - t0) };
  }

  /** Garbage collection (and with `compact`, compaction of the volumes nobody serves first). */
  async gc(options: GcOptions = {}): Promise<GcReport> {
    checkAborted(options.signal, 'gc');
    const catalog = this.storeCatalog('gc');
    let compacted: CompactionReport[] = [];
    if (options.compact && !options.dryRun) {
      options.onProgress?.({ operation: 'gc', phase: 'compacting volumes nobody serves' });
      const leases = await this.leaseManager();
      const exports = new VolumeExports(catalog, { readOnly: false, idleGraceMs: 0, log: this.log, lease: { manager: leases, hostId: this.hostId, onHeld: 'refuse', waitMs: 0 } });
      compacted = await compactIdleVolumes(catalog, exports, { below: options.compactBelow ?? DEFAULT_COMPACT_BELOW, log: this.log });
    }
    // Expired volumes go first (their data then is garbage like any removed volume's).
    let expired: ExpiryReport[] = [];
    if (!options.dryRun) {
      checkAborted(options.signal, 'gc');
      options.onProgress?.({ operation: 'gc', phase: 'removing expired volumes nobody serves' });
      expired = await removeExpired(catalog, { leases: await this.leaseManager(), hostId: this.hostId, log: this.log });
    }
    checkAborted(options.signal, 'gc');
    options.onProgress?.({ operation: 'gc', phase: 'collecting' });
    const r = await collectGarbage(catalog, { graceMs: options.graceMs ?? DEFAULT_GC_GRACE_MS, dryRun: !!options.dryRun, log: this.log });
    options.onProgress?.({ operation: 'gc', phase: 'done', finished: true });
    return { ...r, compacted, expired };
  }

  /**
   * Warm a serving host's read cache with a volume's working set (or all of it): the ranges
   * come from the store, read-only; the server at `address` is asked with NBD CACHE requests
   * (it attaches the volume as for any client). Progress in bytes.
   */
  async prefetch(name: string, options: PrefetchOptions = {}): Promise<{ bytes: number; ms: number }> {
    const what = `prefetch ${name}`;
    checkAborted(options.signal, what);
    const view = await this.storeCatalog('prefetch').loadMap(name);
    let ranges: { offset: number; length: number }[];
    try {
      ranges = view.hydrationPlan(options.all ? 'all' : 'working-set');
    } finally {
      await view.close();
    }
    // CACHE requests of at most 4 MiB: the server warms each one piece at a time, so requests
    // in flight are what makes its GETs parallel.
    const PIECE = 4 * 1024 * 1024;
    const pieces: { offset: number; length: number }[] = [];
    for (const r of ranges) for (let o = r.offset; o < r.offset + r.length; o += PIECE) pieces.push({ offset: o, length: Math.min(PIECE, r.offset + r.length - o) });
    const total = pieces.reduce((n, p) => n + p.length, 0);
    const meter = new ByteMeter('prefetch', name, total, options.onProgress);
    const client = await NbdClient.connect(options.address ?? parseListen('127.0.0.1:10809'), name);
    try {
      meter.report(false);
      let next = 0;
      await Promise.all(Array.from({ length: Math.min(options.concurrency ?? 8, pieces.length) }, async () => {
        while (next < pieces.length) {
          checkAborted(options.signal, what);
          const p = pieces[next++]!;
          await client.cache(p.offset, p.length);
          meter.add(p.length);
        }
      }));
      meter.report(true);
    } finally {
      await client.close();
    }
    return { bytes: total, ms: meter.elapsedMs() };
  }

  /**
   * A new volume `name` from a disk image (raw; qcow2 and the other formats qemu-img reads,
   * when it is installed), writing only the image's non-zero data. Progress in bytes of the image.
   */
  async importImage(name: string, file: string, options: ImportOptions = {}): Promise<ImportResult> {
    return importImage(this, name, file, options);
  }

  /** Write a volume (or NAME@SNAP) as of its last flush to a sparse raw file (or qcow2). Progress in mapped bytes. */
  async exportImage(name: string, file: string, options: ExportOptions = {}): Promise<ExportResult> {
    return exportImage(this, name, file, options);
  }

  /**
   * Serve volumes over NBD in this process (export name = volume name). Resolves once it
   * listens; the returned server reports per-volume events and stops with close().
   */
  async serve(options: ServeOptions = {}): Promise<BatonServer> {
    return startServer(this, options);
  }

  /** Release the lease manager (the catalog holds nothing that needs closing). */
  async close(): Promise<void> {
    const l = this.leases;
    this.leases = null;
    if (l) await (await l.catch(() => null))?.close();
  }
}

/** An expiry `ms` from now, as stored (ISO time). */
function expiryTime(ms: number): string {
  if (!Number.isFinite(ms) || ms <= 0) throw new InvalidArgumentError(`an expiry must be a positive duration (for example 24h), got ${ms} ms`);
  return new Date(Date.now() + ms).toISOString();
}

/** Is the record of `name` gone (a definite "not found")? */
async function isGone(catalog: { info(name: string): Promise<unknown> }, name: string): Promise<boolean> {
  try {
    await catalog.info(name);
    return false;
  } catch (err) {
    return err instanceof NotFoundError;
  }
}

/**
 * Bytes done of a total, as Progress: reported at most every 200 ms while running (and at
 * start and end), with rate and ETA.
 */
export class ByteMeter {
  private done = 0;
  private readonly t0 = performance.now();
  private last = 0;
  constructor(private readonly operation: string, private readonly phase: string, private readonly total: number, private readonly onProgress: ((p: Progress) => void) | undefined) {}

  add(n: number): void {
    this.done += n;
    if (performance.now() - this.last >= 200) this.report(false);
  }

  elapsedMs(): number { return Math.round(performance.now() - this.t0); }

  report(finished: boolean): void {
    this.last = performance.now();
    if (!this.onProgress) return;
    const s = (this.last - this.t0) / 1000;
    const rate = s > 0 ? this.done / s : 0;
    try {
      this.onProgress({
        operation: this.operation, phase: this.phase, done: this.done, total: this.total, bytesPerSecond: Math.round(rate),
        etaSeconds: rate > 0 ? Math.round(((this.total - this.done) / rate) * 10) / 10 : null, finished,
      });
    } catch (err) {
      throw new BatonError('BATON_ERR_INVALID_ARGUMENT', `the onProgress callback threw: ${errorMessage(err)}`);
    }
  }
}

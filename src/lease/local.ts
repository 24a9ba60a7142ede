/**
 * LocalLeaseManager: the embedded lease, without Redis. Lease files in one directory keep two
 * baton processes on one machine (or on machines sharing that directory) from serving a
 * volume read-write at once.
 *
 * Safety argument (same for Redis): a lease is ADVISORY. It decides who SHOULD write; it does
 * not stop a stale writer by itself. What makes a second writer harmless is the object store:
 * every commit is a create-only put of the next log position, tagged with the writer's
 * fencing token, and a new holder first commits a takeover record under a token higher than
 * any in the log. Tokens therefore only grow (counter under a lock here, INCR in Redis, and
 * never below the `minToken` the caller read from the log). The lease's job is liveness and
 * politeness: one writer at a time in the normal case, a fast handoff, and a holder that
 * stops acknowledging writes (validUntil) before anybody else can be granted the lease.
 *
 * Files, all in DIR:
 * - `<vol>.lease`: JSON {holder, token, pid, hostname, bootId, monoExpiresAt, expiresAt,
 *   reservedFor, handoffRequestedBy, handoffId, status}. Replaced atomically (write a temp
 *   file, rename). Free when missing, when it has expired, or when its holder process is dead
 *   (pid on this hostname that answers ESRCH). `holder: ''` with `reservedFor` is a
 *   reservation left by a graceful handoff: only that host may acquire until it expires.
 *   Expiry (msLeft) is on the clock the file and the reader share, never on a wall clock
 *   that can step when a better one exists (clock.ts says what is assumed):
 *   - same boot id as ours: `monoExpiresAt`, CLOCK_MONOTONIC ms (system-wide, never stepped);
 *   - another boot id, our hostname: written before this machine rebooted: expired;
 *   - no boot id (a file from an older baton, or a system without /proc), or another machine
 *     sharing the directory: `expiresAt`, wall-clock ms, as before (a forward wall-clock
 *     step expires such a lease early; the store still fences). Every writer keeps writing
 *     `expiresAt` too, so an older baton on this machine still reads the files as it did.
 *   An unreadable file is treated as free, as before (with a warning in the log).
 * - `<vol>.token`: the last token handed out; only grows.
 * - `<vol>.lock`: a short mutex (created with O_EXCL) held while reading and replacing the two
 *   files above. A lock whose process is dead or that is older than `lockStaleMs` is broken.
 *
 * The holder notices a handoff request at its next renewal, or at once through fs.watch on
 * the directory (a fast path; renewals remain the guarantee).
 */

import { randomBytes, randomUUID } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as os from 'node:os';
import * as path from 'node:path';
import { performance } from 'node:perf_hooks';
import { InvalidArgumentError, LeaseHeldError, StoreUnavailableError, errorMessage } from '../errors.js';
import { silentLogger, type Logger } from '../log.js';
import { checkVolumeName } from '../volumes.js';
import { systemClock, type LeaseClock } from './clock.js';
import type { AcquireOptions, Lease, LeaseManager, LeaseRecord, LeaseStatus } from './lease.js';

import {
  checkTtl, checkHolderId, checkAcquireOptions, heldError, reservedError, nobodyHoldsError, alreadyHolderError, sleep, parseStatus, type RenewResult, type RenewingLeaseArgs, RenewingLease,
} from './renewing.js';
// ------------------------------------------------------------------ local files

export interface LocalLeaseOptions {
  /** Lease TTL in ms (default 5000); renewals every ttl/3. */
  ttlMs?: number;
  /** false: leases are never renewed (test hook: a holder that hangs). Default true. */
  renew?: boolean;
  log?: Logger;
  /** A `.lock` older than this is assumed abandoned (default 3000 ms). */
  lockStaleMs?: number;
  /** How often a waiting acquire re-checks when no file event wakes it (default 100 ms). */
  pollMs?: number;
  /** Test hook: the clocks (default systemClock; see clock.ts). */
  clock?: LeaseClock;
}

interface LeaseFile {
  holder: string;
  token: number;
  pid: number;
  hostname: string;
  /** Wall-clock ms (Date.now()); judged only when no monotonic expiry applies (msLeft). */
  expiresAt: number;
  /** The boot the writer ran in, and its CLOCK_MONOTONIC expiry (ms); both or neither. */
  bootId?: string;
  monoExpiresAt?: number;
  reservedFor?: string;
  handoffRequestedBy?: string;
  handoffId?: string;
  status?: LeaseStatus;
}

const HOSTNAME = os.hostname();

function pidAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    // EPERM: it exists but belongs to someone else. Only ESRCH proves it is gone.
    return (err as NodeJS.ErrnoException).code !== 'ESRCH';
  }
}

/** Milliseconds until `f` expires (<= 0: expired), on the best clock it shares with us (see the header). */
function msLeft(f: LeaseFile, clock: LeaseClock): number {
  if (f.bootId !== undefined && f.monoExpiresAt !== undefined && clock.bootId !== null) {
    if (f.bootId === clock.bootId) return f.monoExpiresAt - clock.monoMs();
    // Our hostname, another boot: this machine rebooted since, and the holder with it.
    if (f.hostname === HOSTNAME) return -Infinity;
  }
  return f.expiresAt - clock.wallMs();
}

/** The expiry fields of a file written now for `ttlMs`: monotonic with our boot id, and wall for the rest. */
function expiryIn(ttlMs: number, clock: LeaseClock): Pick<LeaseFile, 'expiresAt' | 'bootId' | 'monoExpiresAt'> {
  const wall = clock.wallMs() + ttlMs;
  return clock.bootId === null ? { expiresAt: wall } : { expiresAt: wall, bootId: clock.bootId, monoExpiresAt: clock.monoMs() + ttlMs };
}

type Liveness = 'free' | 'held' | 'reserved';

function liveness(f: LeaseFile | null, clock: LeaseClock): Liveness {
  if (!f || !(msLeft(f, clock) > 0)) return 'free';
  if (f.holder === '') return f.reservedFor ? 'reserved' : 'free';
  // A pid means something only on the machine that wrote it (the directory may be shared).
  if (f.hostname === HOSTNAME && Number.isSafeInteger(f.pid) && f.pid > 0 && !pidAlive(f.pid)) return 'free';
  return 'held';
}

function parseLeaseFile(text: string): LeaseFile | null {
  let o: unknown;
  try { o = JSON.parse(text); } catch { return null; }
  if (!o || typeof o !== 'object') return null;
  const r = o as Record<string, unknown>;
  if (typeof r.holder !== 'string' || typeof r.token !== 'number' || typeof r.expiresAt !== 'number') return null;
  const f: LeaseFile = {
    holder: r.holder,
    token: r.token,
    pid: typeof r.pid === 'number' ? r.pid : 0,
    hostname: typeof r.hostname === 'string' ? r.hostname : '',
    expiresAt: r.expiresAt,
  };
  // Both or neither: a boot id without a monotonic expiry (or the reverse) is read as an old-format file.
  if (typeof r.bootId === 'string' && r.bootId && typeof r.monoExpiresAt === 'number' && Number.isFinite(r.monoExpiresAt)) {
    f.bootId = r.bootId;
    f.monoExpiresAt = r.monoExpiresAt;
  }
  if (typeof r.reservedFor === 'string' && r.reservedFor) f.reservedFor = r.reservedFor;
  if (typeof r.handoffRequestedBy === 'string' && r.handoffRequestedBy) f.handoffRequestedBy = r.handoffRequestedBy;
  if (typeof r.handoffId === 'string' && r.handoffId) f.handoffId = r.handoffId;
  const st = parseStatus(r.status);
  if (st) f.status = st;
  return f;
}

function toRecord(volume: string, f: LeaseFile, clock: LeaseClock): LeaseRecord {
  const rec: LeaseRecord = { volume, holder: f.holder, token: f.token, ttlMs: Math.max(0, msLeft(f, clock)) };
  if (f.reservedFor) rec.reservedFor = f.reservedFor;
  if (f.handoffRequestedBy) rec.handoffRequestedBy = f.handoffRequestedBy;
  if (f.status) rec.status = f.status;
  return rec;
}

function ioError(what: string, err: unknown): StoreUnavailableError {
  return new StoreUnavailableError(`lease directory: ${what}: ${errorMessage(err)}`, { cause: err });
}

class LocalLease extends RenewingLease {
  readonly #mgr: LocalLeaseManager;

  constructor(mgr: LocalLeaseManager, a: RenewingLeaseArgs) {
    super(a);
    this.#mgr = mgr;
  }

  protected renewOnce(status: LeaseStatus | undefined): Promise<RenewResult> {
    return this.#mgr._renew(this, status);
  }

  protected releaseOnce(to: string | undefined): Promise<boolean> {
    return this.#mgr._release(this, to);
  }

  /** fs.watch saw the lease file change: look (without the lock) for a handoff or a new holder. */
  async peek(): Promise<void> {
    if (!this.held) return;
    const f = await this.#mgr._read(this.volume).catch(() => undefined);
    if (f === undefined || !this.held) return;
    if (f && f.holder === this.holder && f.token === this.token) {
      if (f.handoffRequestedBy && f.handoffId) this.noticeHandoff(f.handoffRequestedBy, f.handoffId);
      return;
    }
    // Someone replaced or removed our file: a renewal under the lock decides (and fires onLost).
    void this.renewNow();
  }
}

export class LocalLeaseManager implements LeaseManager {
  readonly description: string;
  readonly dir: string;
  readonly #ttlMs: number;
  readonly #renew: boolean;
  readonly #log: Logger;
  readonly #lockStaleMs: number;
  readonly #pollMs: number;
  readonly #clock: LeaseClock;
  readonly #leases = new Set<LocalLease>();
  /** Listeners for file events in DIR, by file name. */
  readonly #listeners = new Map<string, Set<() => void>>();
  #watcher: fs.FSWatcher | null = null;
  #dirReady: Promise<void> | null = null;
  #closed = false;

  constructor(dir: string, opts: LocalLeaseOptions = {}) {
    this.dir = path.resolve(dir);
    this.description = `lease files in ${this.dir}`;
    this.#ttlMs = checkTtl(opts.ttlMs);
    this.#renew = opts.renew ?? true;
    this.#log = opts.log ?? silentLogger();
    this.#lockStaleMs = opts.lockStaleMs ?? 3000;
    this.#pollMs = opts.pollMs ?? 100;
    this.#clock = opts.clock ?? systemClock;
  }

  async acquire(volume: string, holder: string, options: AcquireOptions = {}): Promise<Lease> {
    checkVolumeName(volume);
    checkHolderId(holder);
    const { waitMs, minToken } = checkAcquireOptions(options);
    this.#checkOpen();
    await this.#ensureDir();
    const deadline = performance.now() + waitMs;
    for (;;) {
      try {
        return await this.#tryAcquire(volume, holder, minToken);
      } catch (err) {
        if (!(err instanceof LeaseHeldError) || performance.now() >= deadline) throw err;
      }
      await this.#waitForChange(volume, Math.min(this.#pollMs, deadline - performance.now()));
      this.#checkOpen();
    }
  }

  async inspect(volume: string): Promise<LeaseRecord | null> {
    checkVolumeName(volume);
    const f = await this._read(volume);
    return liveness(f, this.#clock) === 'free' || !f ? null : toRecord(volume, f, this.#clock);
  }

  async list(): Promise<LeaseRecord[]> {
    let names: string[];
    try {
      names = await fsp.readdir(this.dir);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'ENOENT') return [];
      throw ioError(`cannot list ${this.dir}`, err);
    }
    const vols = names.filter((n) => n.endsWith('.lease')).map((n) => n.slice(0, -'.lease'.length)).sort();
    const out: LeaseRecord[] = [];
    for (const v of vols) {
      try {
        const r = await this.inspect(v);
        if (r) out.push(r);
      } catch (err) {
        if (!(err instanceof InvalidArgumentError)) throw err; // a stray file with a bad name
      }
    }
    return out;
  }

  async requestHandoff(volume: string, to: string): Promise<void> {
    checkVolumeName(volume);
    checkHolderId(to, 'handoff target');
    this.#checkOpen();
    await this.#ensureDir();
    await this.#withLock(volume, async () => {
      const f = await this._read(volume);
      const st = liveness(f, this.#clock);
      if (st !== 'held' || !f) throw nobodyHoldsError(volume, to, st === 'reserved' ? f?.reservedFor : undefined);
      if (f.holder === to) throw alreadyHolderError(volume, to);
      f.handoffRequestedBy = to;
      f.handoffId = randomUUID();
      await this.#write(this.#leasePath(volume), JSON.stringify(f));
    });
  }

  /**
   * Remove the lease file under the lock, whatever it holds: a live holder (its next renewal,
   * or at once its fs.watch peek, finds the file gone and fires onLost), a reservation left by
   * a handoff, or an expired file. `<vol>.token` stays, raised to the file's token if it was
   * ever below it, so the next acquire's token is above every token handed out. True only if
   * a live holder held it.
   */
  async revoke(volume: string): Promise<boolean> {
    checkVolumeName(volume);
    this.#checkOpen();
    await this.#ensureDir();
    return this.#withLock(volume, async () => {
      const f = await this._read(volume);
      const held = liveness(f, this.#clock) === 'held';
      if (f && (await this.#readCounter(volume)) < f.token) await this.#write(this.#tokenPath(volume), `${f.token}\n`);
      const file = this.#leasePath(volume);
      await fsp.unlink(file).catch((err: NodeJS.ErrnoException) => { if (err.code !== 'ENOENT') throw ioError(`cannot remove ${file}`, err); });
      return held;
    });
  }

  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    await Promise.all([...this.#leases].map((l) => l.closeByManager()));
    this.#listeners.clear();
    this.#stopWatcher();
  }

  // ---------------------------------------------------------------- internals used by LocalLease

  /** @internal Read a lease file without the lock (renames make it atomic); null if none or unreadable. */
  async _read(volume: string): Promise<LeaseFile | null> {
    let text: string;
    try {
      text = await fsp.readFile(this.#leasePath(volume), 'utf8');
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'ENOENT') return null;
      throw ioError(`cannot read the lease of ${volume}`, err);
    }
    const f = parseLeaseFile(text);
    if (!f) this.#log.warn({ volume, file: this.#leasePath(volume) }, 'unreadable lease file; treating the volume as free');
    return f;
  }

  /** @internal */
  async _renew(lease: LocalLease, status: LeaseStatus | undefined): Promise<RenewResult> {
    return this.#withLock(lease.volume, async () => {
      const f = await this._read(lease.volume);
      if (!f || f.holder !== lease.holder || f.token !== lease.token) return { held: false, reason: takenReason(f) };
      if (!(msLeft(f, this.#clock) > 0)) return { held: false, reason: 'the lease expired before it was renewed' };
      // Read after the renewal started (RenewingLease took performance.now() before calling
      // us), on the same CLOCK_MONOTONIC: the holder's new validUntil precedes this expiry.
      delete f.bootId; // (a writer without a boot id must not keep a previous writer's)
      delete f.monoExpiresAt;
      Object.assign(f, expiryIn(this.#ttlMs, this.#clock));
      f.pid = process.pid;
      if (status) f.status = status;
      await this.#write(this.#leasePath(lease.volume), JSON.stringify(f));
      return f.handoffRequestedBy && f.handoffId ? { held: true, handoff: { to: f.handoffRequestedBy, id: f.handoffId } } : { held: true };
    });
  }

  /** @internal */
  async _release(lease: LocalLease, to: string | undefined): Promise<boolean> {
    return this.#withLock(lease.volume, async () => {
      const f = await this._read(lease.volume);
      if (!f || f.holder !== lease.holder || f.token !== lease.token || !(msLeft(f, this.#clock) > 0)) return false;
      const file = this.#leasePath(lease.volume);
      if (to === undefined) {
        await fsp.unlink(file).catch((err: NodeJS.ErrnoException) => { if (err.code !== 'ENOENT') throw ioError(`cannot remove ${file}`, err); });
        return true;
      }
      // Keep the token (for `baton status`), free the holder, and reserve for `to` for one TTL.
      const r: LeaseFile = { holder: '', token: f.token, pid: process.pid, hostname: HOSTNAME, ...expiryIn(this.#ttlMs, this.#clock), reservedFor: to };
      if (f.status) r.status = f.status;
      await this.#write(file, JSON.stringify(r));
      return true;
    });
  }

  // ---------------------------------------------------------------- private

  async #tryAcquire(volume: string, holder: string, minToken: number): Promise<LocalLease> {
    return this.#withLock(volume, async () => {
      // Taken before the file's expiry is computed, on the same CLOCK_MONOTONIC (clock.ts):
      // our deadline can only be earlier than what the file says.
      const startedAt = performance.now();
      const f = await this._read(volume);
      const st = liveness(f, this.#clock);
      if (f && st === 'held') throw heldError(volume, f.holder, f.token, msLeft(f, this.#clock), holder);
      if (f && st === 'reserved' && f.reservedFor !== holder) throw reservedError(volume, f.reservedFor ?? '', msLeft(f, this.#clock));
      // Tokens only grow: above the counter, above any token still in the lease file, and
      // above what the caller saw in the store's log.
      const token = Math.max(await this.#readCounter(volume), f?.token ?? 0, minToken) + 1;
      await this.#write(this.#tokenPath(volume), `${token}\n`);
      const rec: LeaseFile = { holder, token, pid: process.pid, hostname: HOSTNAME, ...expiryIn(this.#ttlMs, this.#clock) };
      await this.#write(this.#leasePath(volume), JSON.stringify(rec));
      const lease: LocalLease = new LocalLease(this, {
        volume, holder, token, ttlMs: this.#ttlMs, startedAt, renew: this.#renew, log: this.#log,
        ended: () => { this.#leases.delete(lease); this.#unlisten(`${volume}.lease`, onChange); },
      });
      const onChange = (): void => { void lease.peek(); };
      this.#leases.add(lease);
      this.#listen(`${volume}.lease`, onChange);
      lease.start();
      return lease;
    });
  }

  async #readCounter(volume: string): Promise<number> {
    try {
      const n = Number.parseInt(await fsp.readFile(this.#tokenPath(volume), 'utf8'), 10);
      return Number.isSafeInteger(n) && n > 0 ? n : 0;
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'ENOENT') return 0;
      throw ioError(`cannot read the token counter of ${volume}`, err);
    }
  }

  /** Write a temp file and rename it over `file`: readers see the old or the new, never half. */
  async #write(file: string, data: string): Promise<void> {
    const tmp = `${file}.${process.pid}.${randomBytes(4).toString('hex')}.tmp`;
    try {
      await fsp.writeFile(tmp, data);
      await fsp.rename(tmp, file);
    } catch (err) {
      await fsp.unlink(tmp).catch(() => {});
      throw ioError(`cannot write ${file}`, err);
    }
  }

  /**
   * Run `fn` holding DIR/<vol>.lock. The lock lives for a few ms; one left by a dead process
   * (or older than lockStaleMs) is moved aside and removed. Moving aside then checking the
   * inode narrows the race where two breakers both break and one removes the other's fresh
   * lock; a residual race remains (both then run `fn`), which is one reason the lease is only
   * advisory and the store fences.
   */
  async #withLock<T>(volume: string, fn: () => Promise<T>): Promise<T> {
    const lock = path.join(this.dir, `${volume}.lock`);
    const giveUp = performance.now() + this.#lockStaleMs + 2000;
    for (let attempt = 0; ; attempt++) {
      try {
        const fh = await fsp.open(lock, 'wx');
        // `at` (CLOCK_MONOTONIC ms, with the boot id) dates the lock on a clock that cannot step.
        const info = { pid: process.pid, hostname: HOSTNAME, ...(this.#clock.bootId !== null ? { bootId: this.#clock.bootId, at: this.#clock.monoMs() } : {}) };
        try { await fh.writeFile(JSON.stringify(info)); } finally { await fh.close(); }
        break;
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw ioError(`cannot create ${lock}`, err);
      }
      await this.#breakIfStale(lock);
      if (performance.now() > giveUp) {
        throw new StoreUnavailableError(`lease lock ${lock} has been held for more than ${Math.round(this.#lockStaleMs / 1000)} s; if no baton process is running, remove it`);
      }
      await sleep(Math.min(20, 1 + attempt) + Math.random() * 3);
    }
    try {
      return await fn();
    } finally {
      await fsp.unlink(lock).catch(() => {});
    }
  }

  async #breakIfStale(lock: string): Promise<void> {
    let st: fs.Stats;
    try { st = await fsp.stat(lock); } catch { return; }
    const o = await readLockInfo(lock);
    // The age on the monotonic clock when the lock says when (in our boot) it was taken: a
    // wall-clock step must not make a lock held for a few ms look abandoned, or two processes
    // would run the critical section (and hand out one token twice). Else by its mtime, on
    // the wall clock, as before (an older baton's lock, or one still being written).
    const mono = o !== null && this.#clock.bootId !== null && o.bootId === this.#clock.bootId && typeof o.at === 'number';
    const age = mono ? this.#clock.monoMs() - (o.at as number) : this.#clock.wallMs() - st.mtimeMs;
    const dead = age > 50 && o !== null && o.hostname === HOSTNAME && typeof o.pid === 'number' && !pidAlive(o.pid);
    if (!dead && age < this.#lockStaleMs) return;
    const aside = `${lock}.${process.pid}.${randomBytes(4).toString('hex')}.stale`;
    try { await fsp.rename(lock, aside); } catch { return; }
    try {
      const st2 = await fsp.stat(aside);
      if (st2.ino !== st.ino) {
        // We moved a fresh lock someone took meanwhile: put it back unless yet another exists.
        await fsp.link(aside, lock).catch(() => {});
      } else {
        this.#log.warn({ lock, ageMs: Math.round(age), dead }, 'broke a stale lease lock');
      }
    } finally {
      await fsp.unlink(aside).catch(() => {});
    }
  }

  /** Sleep up to `ms`, waking early when the volume's lease file changes. */
  #waitForChange(volume: string, ms: number): Promise<void> {
    return new Promise((resolve) => {
      const name = `${volume}.lease`;
      const done = (): void => { clearTimeout(timer); this.#unlisten(name, done); resolve(); };
      const timer = setTimeout(done, Math.max(1, ms));
      this.#listen(name, done);
    });
  }

  #listen(file: string, fn: () => void): void {
    let set = this.#listeners.get(file);
    if (!set) { set = new Set(); this.#listeners.set(file, set); }
    set.add(fn);
    if (!this.#watcher && !this.#closed) {
      try {
        this.#watcher = fs.watch(this.dir, { persistent: false }, (_event, name) => {
          const fns = name ? this.#listeners.get(name.toString()) : undefined;
          if (fns) for (const f of [...fns]) f();
        });
        this.#watcher.on('error', () => this.#stopWatcher());
      } catch (err) {
        // No inotify (or similar): renewals and polling still work, just slower.
        this.#log.debug({ dir: this.dir, err: errorMessage(err) }, 'fs.watch unavailable for lease files');
      }
    }
  }

  #unlisten(file: string, fn: () => void): void {
    const set = this.#listeners.get(file);
    if (!set) return;
    set.delete(fn);
    if (set.size === 0) this.#listeners.delete(file);
    if (this.#listeners.size === 0) this.#stopWatcher();
  }

  #stopWatcher(): void {
    this.#watcher?.close();
    this.#watcher = null;
  }

  /** The lease directory exists (or can be made) and this process may write in it. */
  async ping(): Promise<void> {
    this.#checkOpen();
    await this.#ensureDir();
    try {
      await fsp.access(this.dir, fs.constants.R_OK | fs.constants.W_OK);
    } catch (err) {
      throw ioError(`cannot write lease files in ${this.dir}`, err);
    }
  }

  #ensureDir(): Promise<void> {
    this.#dirReady ??= fsp.mkdir(this.dir, { recursive: true }).then(
      () => undefined,
      (err: unknown) => { this.#dirReady = null; throw ioError(`cannot create ${this.dir}`, err); },
    );
    return this.#dirReady;
  }

  #checkOpen(): void {
    if (this.#closed) throw new InvalidArgumentError('the lease manager is closed');
  }

  #leasePath(volume: string): string { return path.join(this.dir, `${volume}.lease`); }
  #tokenPath(volume: string): string { return path.join(this.dir, `${volume}.token`); }
}

interface LockInfo { pid?: unknown; hostname?: unknown; bootId?: unknown; at?: unknown }

/** What a `.lock` says about its taker; null if it is empty, being written, or gone. */
async function readLockInfo(lock: string): Promise<LockInfo | null> {
  try {
    const o: unknown = JSON.parse(await fsp.readFile(lock, 'utf8'));
    return o && typeof o === 'object' ? (o as LockInfo) : null;
  } catch {
    return null;
  }
}

function takenReason(f: LeaseFile | null): string {
  if (!f) return 'the lease file is gone (revoked by `baton rm --force`, or removed by hand)';
  if (f.holder === '') return `the lease was released${f.reservedFor ? ` for ${f.reservedFor}` : ''}`;
  return `${f.holder} holds it now (token ${f.token})`;
}

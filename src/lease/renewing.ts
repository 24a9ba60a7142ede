/**
 * What both lease managers share: argument checks and messages, and RenewingLease (the
 * renewal loop, the local validity deadline, lost/handoff callbacks). The safety argument
 * is in local.ts and lease.ts: the lease is advisory, fencing happens at the store.
 */

import { systemWorld, type TimerHandle, type World } from '../clock.js';
import { InvalidArgumentError, LeaseHeldError, LeaseLostError, errorMessage } from '../errors.js';
import type { Logger } from '../log.js';
import type { AcquireOptions, Lease, LeaseStatus } from './lease.js';

// ------------------------------------------------------------------ shared checks and messages

export const DEFAULT_LEASE_TTL_MS = 5000;
/** Below this, ttl/3 renewals leave too little slack before validUntil (ttl - max(ttl/5, 500 ms)). */
export const MIN_LEASE_TTL_MS = 1000;

export function checkTtl(ttlMs: number | undefined): number {
  const ttl = Math.round(ttlMs ?? DEFAULT_LEASE_TTL_MS); // --lease-ttl takes fractional seconds
  if (!Number.isSafeInteger(ttl) || ttl < MIN_LEASE_TTL_MS) {
    throw new InvalidArgumentError(`lease TTL must be at least ${MIN_LEASE_TTL_MS / 1000} s (got ${ttlMs} ms): renewals every TTL/3 need room before the deadline`);
  }
  return ttl;
}

/** The safety margin between our local deadline and the lease store's expiry. */
export function leaseMargin(ttlMs: number): number {
  return Math.max(ttlMs / 5, 500);
}

const BAD_HOLDER = /[\u0000-\u001f\u007f]/;

export function checkHolderId(holder: string, what = 'host id'): void {
  if (typeof holder !== 'string' || holder.length === 0 || holder.length > 255 || BAD_HOLDER.test(holder)) {
    throw new InvalidArgumentError(`invalid ${what} ${JSON.stringify(holder)}: use 1-255 printable characters`);
  }
}

export function checkAcquireOptions(o: AcquireOptions): { waitMs: number; minToken: number } {
  const waitMs = o.waitMs ?? 0;
  const minToken = o.minToken ?? 0;
  if (!Number.isFinite(waitMs) || waitMs < 0) throw new InvalidArgumentError(`waitMs must be a non-negative number (got ${o.waitMs})`);
  if (!Number.isSafeInteger(minToken) || minToken < 0) throw new InvalidArgumentError(`minToken must be a non-negative integer (got ${o.minToken})`);
  return { waitMs, minToken };
}

function secs(ms: number): string {
  return ms < 0 ? 'no expiry' : `${(ms / 1000).toFixed(1)} s`;
}

/** LeaseHeldError for a lease someone holds; the message says what to do. */
export function heldError(volume: string, holder: string, token: number | string, ttlMs: number, requester: string): LeaseHeldError {
  if (holder === requester) {
    return new LeaseHeldError(
      `volume ${volume} is already served under this host id ${holder} (token ${token}, lease expires in ${secs(ttlMs)}): ` +
      `another baton process with the same --host-id holds it; stop that process, or wait for its lease to expire`,
    );
  }
  return new LeaseHeldError(
    `volume ${volume} is served by ${holder} (token ${token}, lease expires in ${secs(ttlMs)}); ` +
    `attach there, or hand it over: baton handoff ${volume} --to ${requester}`,
  );
}

/** LeaseHeldError for a lease reserved for another host by a graceful handoff. */
export function reservedError(volume: string, reservedFor: string, ttlMs: number): LeaseHeldError {
  return new LeaseHeldError(
    `volume ${volume} was handed over to ${reservedFor} and is reserved for it (for ${secs(ttlMs)} more); ` +
    `attach on ${reservedFor}, or wait for the reservation to expire`,
  );
}

export function nobodyHoldsError(volume: string, to: string, reservedFor?: string): InvalidArgumentError {
  if (reservedFor && reservedFor !== to) {
    return new InvalidArgumentError(`nobody holds ${volume}; it is reserved for ${reservedFor} after a handoff, and ${to} can attach once that reservation expires`);
  }
  return new InvalidArgumentError(`nobody holds ${volume}; just attach on ${to}`);
}

export function alreadyHolderError(volume: string, to: string): InvalidArgumentError {
  return new InvalidArgumentError(`${to} already serves ${volume}; nothing to hand over`);
}

export function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms));
}

export function parseStatus(v: unknown): LeaseStatus | undefined {
  if (typeof v === 'string') {
    if (!v) return undefined;
    try { v = JSON.parse(v); } catch { return undefined; }
  }
  if (!v || typeof v !== 'object') return undefined;
  const o = v as Record<string, unknown>;
  if (typeof o.dirtyBytes !== 'number' || typeof o.lastCommitSeq !== 'number') return undefined;
  const s: LeaseStatus = {
    dirtyBytes: o.dirtyBytes,
    lastFlushAt: typeof o.lastFlushAt === 'string' ? o.lastFlushAt : null,
    lastCommitSeq: o.lastCommitSeq,
  };
  if (typeof o.address === 'string') s.address = o.address;
  const h = o.hydration as Record<string, unknown> | undefined;
  if (h && typeof h === 'object' && typeof h.mode === 'string' && typeof h.state === 'string' && typeof h.fetchedBytes === 'number' && typeof h.plannedBytes === 'number') {
    s.hydration = { mode: h.mode, state: h.state, fetchedBytes: h.fetchedBytes, plannedBytes: h.plannedBytes, planned: h.planned === true };
  }
  return s;
}

// ------------------------------------------------------------------ the held lease (shared)

export type RenewResult =
  | { held: true; handoff?: { to: string; id: string } }
  | { held: false; reason: string };

export interface RenewingLeaseArgs {
  volume: string;
  holder: string;
  token: number;
  ttlMs: number;
  /** world.now() (performance.now() by default) taken BEFORE the acquiring request was sent. */
  startedAt: number;
  /** false: never renew (test hook that simulates a holder that hangs). */
  renew: boolean;
  log: Logger;
  /** Called once when the lease stops being held (lost, released, closed). */
  ended: () => void;
  /**
   * The clock and timers of renewals and the local deadline (src/clock.ts); the real ones by
   * default. `startedAt` and validUntil() are on this world's now().
   */
  world?: World;
}

/**
 * A held lease: renews every ttl/3 in the background and keeps the local deadline.
 *
 * validUntil() = start of the last successful renewal (or of the acquire) + ttl - margin,
 * on the monotonic clock. The lease store applied that renewal's TTL no earlier than we sent
 * it, so it cannot expire (and nobody else can be granted the lease) before start + ttl;
 * the margin, max(ttl/5, 500 ms), absorbs clock-rate differences and scheduling delays. If
 * renewals keep failing, a timer fires onLost at validUntil and renewing stops: the holder
 * must assume the lease is gone whatever the store says later. A renewal that finds another
 * holder or token fires onLost at once. None of this is needed for data safety (the store
 * fences), only so that a well-behaved old holder stops before the new one starts.
 *
 * Clocks: performance.now() is CLOCK_MONOTONIC (never stepped; stops during a suspend). For
 * lease files the expiry is written on that same clock (clock.ts), so the holder stops before
 * the file expires even across wall-clock steps and suspends. For Redis the expiry runs on
 * the Redis server's clock, which keeps running while this machine is suspended: what that
 * means, and why the store's fence still holds, is in redis.ts. The clock and the timers are
 * the injected World's (src/clock.ts: performance.now() and setTimeout in production, virtual
 * time in the simulator, test/sim).
 */
export abstract class RenewingLease implements Lease {
  readonly volume: string;
  readonly holder: string;
  readonly token: number;
  protected readonly ttlMs: number;
  protected readonly log: Logger;
  readonly #margin: number;
  readonly #interval: number;
  readonly #renewEnabled: boolean;
  readonly #ended: () => void;
  readonly #startedAt: number;
  readonly #world: World;
  #validUntil: number;
  #state: 'held' | 'lost' | 'released' = 'held';
  #lostReason = '';
  #lastError = '';
  #lostCbs: ((reason: string) => void)[] = [];
  #handoffCbs: ((to: string) => void)[] = [];
  #handoffTo: string | undefined;
  #handoffId: string | undefined;
  #status: LeaseStatus | undefined;
  #statusVersion = 0;
  #statusSent = 0;
  #renewTimer: TimerHandle | null = null;
  #deadlineTimer: TimerHandle | null = null;
  #chain: Promise<unknown> = Promise.resolve();

  protected constructor(a: RenewingLeaseArgs) {
    this.volume = a.volume;
    this.holder = a.holder;
    this.token = a.token;
    this.ttlMs = a.ttlMs;
    this.log = a.log;
    this.#margin = leaseMargin(a.ttlMs);
    this.#interval = a.ttlMs / 3;
    this.#renewEnabled = a.renew;
    this.#ended = a.ended;
    this.#startedAt = a.startedAt;
    this.#world = a.world ?? systemWorld;
    this.#validUntil = a.startedAt + a.ttlMs - this.#margin;
  }

  /** @internal Arm the deadline and the renewal loop (the manager calls this once, after registering the lease). */
  start(): void {
    this.#armDeadline();
    this.#scheduleRenew(Math.max(0, this.#startedAt + this.#interval - this.#world.now()));
  }

  /** Send one renewal carrying `status` (if it changed since the last one sent). */
  protected abstract renewOnce(status: LeaseStatus | undefined): Promise<RenewResult>;
  /** Give the lease back if it is still ours (holder AND token); false if it was not. */
  protected abstract releaseOnce(to: string | undefined): Promise<boolean>;

  get held(): boolean { return this.#state === 'held'; }

  validUntil(): number { return this.#validUntil; }

  onLost(cb: (reason: string) => void): void {
    if (this.#state === 'lost') { const r = this.#lostReason; queueMicrotask(() => this.#call(cb, r)); return; }
    this.#lostCbs.push(cb);
  }

  onHandoffRequest(cb: (to: string) => void): void {
    this.#handoffCbs.push(cb);
    const pending = this.#handoffTo;
    if (this.#state === 'held' && pending !== undefined) queueMicrotask(() => { if (this.#state === 'held') this.#call(cb, pending); });
  }

  setStatus(s: LeaseStatus): void {
    this.#status = { ...s };
    this.#statusVersion++;
  }

  /** Renew now (also sends pending status). Resolves true if this renewal succeeded. */
  renewNow(): Promise<boolean> {
    const p = this.#chain.then(() => this.#renewStep());
    this.#chain = p.catch(() => {});
    return p;
  }

  /**
   * Local validity ends at once (validUntil() = -Infinity), then the store is told. If that
   * fails (StoreUnavailableError) the lease simply expires after its TTL; calling again is a
   * no-op. With `to`, a lease that was already lost or taken throws LeaseLostError (the target
   * cannot acquire at once); without `to`, that is not an error.
   *
   * A lease lost at its own deadline (a renewal that came too late: a stalled event loop, a
   * slow lease store) is still recorded as ours in the store until the store's expiry, up to
   * the margin later. It is released there too: otherwise the next attach, on this host or
   * any other, is refused for that long ("already served under this host id"). Safe for the
   * reason every release is: the store removes the record only if it still holds our holder
   * AND token (releaseOnce), so a lease someone else took is untouched, and this host stopped
   * writing under it when it was lost (validUntil() is -Infinity since). Never throws then.
   */
  async release(to?: string): Promise<void> {
    if (to !== undefined) checkHolderId(to, 'handoff target');
    const prev = this.#state;
    if (prev === 'released') return;
    // From here on this host may not write: local validity ends before the store is told.
    this.#state = 'released';
    this.#validUntil = -Infinity;
    this.#stopTimers();
    if (prev === 'held') this.#ended();
    await this.#chain;
    if (prev === 'lost') {
      if (to !== undefined) throw new LeaseLostError(`cannot hand ${this.volume} to ${to}: this host's lease was lost (${this.#lostReason})`);
      // Best effort, as before this was done at all: if the store cannot be told, the
      // record expires on its own (and a closed manager already tried: closeByManager).
      await this.releaseOnce(undefined).catch(() => {});
      return;
    }
    const ok = await this.releaseOnce(to);
    if (!ok && to !== undefined) {
      throw new LeaseLostError(`cannot hand ${this.volume} to ${to}: this host's lease (token ${this.token}) had already expired or been taken`);
    }
  }

  /** The manager is closing: stop, tell the owner, give the lease back if we can. */
  async closeByManager(): Promise<void> {
    if (this.#state !== 'held') return;
    this.lose('the lease manager was closed');
    await this.#chain;
    await this.releaseOnce(undefined).catch(() => {});
  }

  /** A handoff request seen by a renewal or a fast path; fires the callbacks once per request id. */
  protected noticeHandoff(to: string, id: string): void {
    // A handoff "to" ourselves is no handoff (REQUEST_HANDOFF and requestHandoff refuse it).
    if (this.#state !== 'held' || id === this.#handoffId || to === this.holder) return;
    this.#handoffId = id;
    this.#handoffTo = to;
    this.log.info({ volume: this.volume, token: this.token, to }, 'handoff requested');
    for (const cb of [...this.#handoffCbs]) this.#call(cb, to);
  }

  #recheckWanted = false;
  #rechecking = false;

  /**
   * A message on the lease's notification channel (Redis pub/sub, redis.ts): a doorbell,
   * never an instruction. Anyone who can reach the lease store can PUBLISH, so what it says
   * (`to`, `id`) is not used; a renewal re-reads the lease record and acts on the handoff
   * request recorded there (noticeHandoff) or finds the lease gone (revoked, taken) and fires
   * onLost. The token filter only saves round trips for messages about other leases of the
   * volume; it is no check (the token is public). At most one re-check runs, plus one queued
   * behind it for messages that arrive meanwhile: a flood of messages costs one renewal at a
   * time, not one per message. (Here rather than in redis.ts so the simulator's lease runs it.)
   */
  message(msg: Record<string, unknown>): void {
    if ((msg.type !== 'handoff' && msg.type !== 'revoked') || String(msg.token ?? '') !== String(this.token)) return;
    this.#recheckWanted = true;
    if (this.#rechecking) return;
    this.#rechecking = true;
    void (async () => {
      try {
        while (this.#recheckWanted && this.held) {
          this.#recheckWanted = false;
          await this.renewNow();
        }
      } finally {
        this.#rechecking = false;
      }
    })();
  }

  protected lose(reason: string): void {
    if (this.#state !== 'held') return;
    this.#state = 'lost';
    this.#lostReason = reason;
    this.#validUntil = -Infinity;
    this.#stopTimers();
    this.#ended();
    this.log.warn({ volume: this.volume, token: this.token, reason }, 'lease lost');
    for (const cb of [...this.#lostCbs]) this.#call(cb, reason);
  }

  async #renewStep(): Promise<boolean> {
    if (this.#state !== 'held') return false;
    if (this.#renewTimer) { this.#world.clearTimeout(this.#renewTimer); this.#renewTimer = null; }
    const started = this.#world.now();
    const version = this.#statusVersion;
    const status = version !== this.#statusSent ? this.#status : undefined;
    let delay: number;
    let ok = false;
    try {
      const r = await this.renewOnce(status);
      if (this.#state !== 'held') return false;
      if (!r.held) { this.lose(r.reason); return false; }
      ok = true;
      this.#statusSent = version;
      this.#lastError = '';
      this.#validUntil = Math.max(this.#validUntil, started + this.ttlMs - this.#margin);
      this.#armDeadline();
      if (r.handoff) this.noticeHandoff(r.handoff.to, r.handoff.id);
      delay = started + this.#interval - this.#world.now();
    } catch (err) {
      if (this.#state !== 'held') return false;
      this.#lastError = errorMessage(err);
      this.log.warn({ volume: this.volume, token: this.token, err: this.#lastError, msLeft: Math.round(this.#validUntil - this.#world.now()) }, 'lease renewal failed; retrying');
      delay = Math.max(50, this.#interval / 3);
    }
    this.#scheduleRenew(Math.max(0, delay));
    return ok;
  }

  #scheduleRenew(ms: number): void {
    if (!this.#renewEnabled || this.#state !== 'held') return;
    if (this.#renewTimer) this.#world.clearTimeout(this.#renewTimer);
    this.#renewTimer = this.#world.setTimeout(() => { this.#renewTimer = null; void this.renewNow(); }, ms);
    this.#renewTimer.unref?.();
  }

  #armDeadline(): void {
    if (this.#deadlineTimer) this.#world.clearTimeout(this.#deadlineTimer);
    this.#deadlineTimer = null;
    if (this.#state !== 'held') return;
    const ms = this.#validUntil - this.#world.now();
    if (ms <= 0) {
      this.lose(`could not renew the lease within ${this.ttlMs - this.#margin} ms (last error: ${this.#lastError || 'none'}); it may expire at any moment`);
      return;
    }
    this.#deadlineTimer = this.#world.setTimeout(() => { this.#deadlineTimer = null; this.#armDeadline(); }, Math.ceil(ms) + 1);
    this.#deadlineTimer.unref?.();
  }

  #stopTimers(): void {
    if (this.#renewTimer) this.#world.clearTimeout(this.#renewTimer);
    if (this.#deadlineTimer) this.#world.clearTimeout(this.#deadlineTimer);
    this.#renewTimer = null;
    this.#deadlineTimer = null;
  }

  #call<A>(cb: (a: A) => void, a: A): void {
    try {
      cb(a);
    } catch (err) {
      this.log.error({ volume: this.volume, err: errorMessage(err) }, 'lease callback threw');
    }
  }
}


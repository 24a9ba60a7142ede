/**
 * The simulated lease service (what Redis is for baton) and a LeaseManager per process that
 * talks to it over the simulated network, on virtual time.
 *
 * The service keeps, per volume, the record Redis keeps (holder, token, expiry, reservation,
 * handoff request, status) and a token counter that only grows. Its expiry runs on the
 * service's clock (virtual time), as Redis's does. Each call is a request and a reply with
 * latencies; a call may fail before it is applied, have its reply lost after it was applied
 * (an acquire that took the lease although the caller got an error: it then simply expires),
 * or, while the host is cut off from the service, fail. The held lease is the real
 * RenewingLease of src/lease/renewing.ts, given the process's World: renewals every TTL/3, the
 * local deadline validUntil, onLost and handoff requests all run on simulated time.
 *
 * Pub/sub, as with Redis: a handoff request, a release and a revoke PUBLISH on the volume's
 * channel (a message carries the token, as the real scripts' do), and a holder subscribed to
 * it gets the message after a latency (lost while its host is cut off: pub/sub is at most
 * once). A message reaches the real RenewingLease.message. Anyone who can reach Redis can
 * PUBLISH too: the forger (`forge`) sends messages nobody asked for on held volumes' channels
 * (a handoff to another host, to the holder itself or to a name no host has, with the
 * current token, which `baton status` shows), as a user with Redis access can.
 */

import { LeaseHeldError, StoreUnavailableError } from '../../src/errors.js';
import type { Logger } from '../../src/log.js';
import type { AcquireOptions, Lease, LeaseManager, LeaseRecord, LeaseStatus } from '../../src/lease/lease.js';
import {
  RenewingLease, alreadyHolderError, checkAcquireOptions, checkHolderId, heldError, nobodyHoldsError, reservedError, type RenewResult, type RenewingLeaseArgs,
} from '../../src/lease/renewing.js';
import type { Proc, Rng, Sim } from './world.js';

interface Rec {
  holder: string;
  token: number;
  expiresAt: number;
  reservedFor?: string;
  handoffRequestedBy?: string;
  handoffId?: string;
  /** Every host that asked (requestHandoff) for this holder's lease. */
  requesters?: Set<string>;
  status?: LeaseStatus;
}

export interface LeaseFaults {
  latencyMs: [number, number];
  failBefore: number;
  lostReply: number;
  /** The client's command timeout. */
  timeoutMs: number;
}

export class SimLeaseService {
  private readonly recs = new Map<string, Rec>();
  private readonly counters = new Map<string, number>();
  private handoffIds = 0;
  /** Hosts cut off from the lease service. */
  readonly cut = new Set<string>();
  requests = 0;
  /** Every token handed out (a takeover may follow under it). */
  onGrant: (volume: string, token: number) => void = () => {};
  /** A holder gave the volume to `to` (release with a reservation); `requested`: the record held a request from `to`. */
  onHandoff: (volume: string, holder: string, to: string, requested: boolean) => void = () => {};
  private readonly subs = new Map<string, Set<(msg: Record<string, unknown>) => void>>();
  /** Messages published (real and forged). */
  published = 0;
  forged = 0;
  constructor(readonly sim: Sim, readonly ttlMs: number) {}

  private live(volume: string): Rec | null {
    const r = this.recs.get(volume);
    if (!r) return null;
    if (r.expiresAt <= this.sim.now) { this.recs.delete(volume); return null; }
    return r;
  }

  acquire(volume: string, holder: string, minToken: number): { token: number } | { err: LeaseHeldError } {
    const r = this.live(volume);
    if (r && r.holder !== '') return { err: heldError(volume, r.holder, r.token, r.expiresAt - this.sim.now, holder) };
    if (r && r.reservedFor !== undefined && r.reservedFor !== holder) return { err: reservedError(volume, r.reservedFor, r.expiresAt - this.sim.now) };
    const token = Math.max(this.counters.get(volume) ?? 0, r?.token ?? 0, minToken) + 1;
    this.counters.set(volume, token);
    this.recs.set(volume, { holder, token, expiresAt: this.sim.now + this.ttlMs });
    this.onGrant(volume, token);
    return { token };
  }

  renew(volume: string, holder: string, token: number, status: LeaseStatus | undefined): RenewResult {
    const r = this.live(volume);
    if (!r || r.holder !== holder || r.token !== token) return { held: false, reason: r ? `taken by ${r.holder || `a reservation for ${r.reservedFor}`} (token ${r.token})` : 'the lease expired or was revoked' };
    r.expiresAt = this.sim.now + this.ttlMs;
    if (status) r.status = status;
    return r.handoffRequestedBy && r.handoffId ? { held: true, handoff: { to: r.handoffRequestedBy, id: r.handoffId } } : { held: true };
  }

  release(volume: string, holder: string, token: number, to: string | undefined): boolean {
    const r = this.live(volume);
    if (!r || r.holder !== holder || r.token !== token) return false;
    if (to === undefined) this.recs.delete(volume);
    else {
      this.onHandoff(volume, holder, to, r.requesters?.has(to) ?? false);
      this.recs.set(volume, { holder: '', token: r.token, expiresAt: this.sim.now + this.ttlMs, reservedFor: to });
    }
    this.publish(volume, { type: 'released', token: String(r.token) });
    return true;
  }

  requestHandoff(volume: string, to: string): void {
    const r = this.live(volume);
    if (!r || r.holder === '') throw nobodyHoldsError(volume, to, r?.reservedFor);
    if (r.holder === to) throw alreadyHolderError(volume, to);
    r.handoffRequestedBy = to;
    r.handoffId = String(++this.handoffIds);
    (r.requesters ??= new Set()).add(to);
    this.publish(volume, { type: 'handoff', to, id: r.handoffId, token: String(r.token) });
  }

  /** PUBLISH on the volume's channel: every subscriber's handler is called (it adds its own latency). */
  publish(volume: string, msg: Record<string, unknown>): void {
    this.published++;
    for (const fn of [...(this.subs.get(volume) ?? [])]) fn(msg);
  }

  subscribe(volume: string, fn: (msg: Record<string, unknown>) => void): () => void {
    let set = this.subs.get(volume);
    if (!set) this.subs.set(volume, set = new Set());
    set.add(fn);
    return () => { set.delete(fn); };
  }

  /**
   * The forger: every so often (mean gap `gapMs`) a PUBLISH nobody asked for, on the channel
   * of a volume someone holds, with that lease's current token: a handoff to another host, to
   * the holder itself, or to a host that does not exist; now and then a burst of them, or a
   * "revoked". Runs until `stop()` says so.
   */
  forge(rng: Rng, hosts: () => string[], gapMs: number, stop: () => boolean): void {
    const next = (): void => {
      this.sim.after(rng.logUniform(gapMs / 10, gapMs * 3), () => {
        if (stop()) return;
        const held = [...this.recs.entries()].filter(([v]) => this.holderOf(v) !== null);
        if (held.length > 0) {
          const [volume, r] = rng.pick(held);
          const names = hosts();
          const n = rng.chance(0.2) ? rng.int(2, 20) : 1;
          for (let i = 0; i < n; i++) {
            const to = rng.chance(0.2) ? r.holder : rng.chance(0.2) ? 'mallory' : rng.pick(names);
            const msg = rng.chance(0.1) ? { type: 'revoked', token: String(r.token) } : { type: 'handoff', to, id: `forged-${rng.int(1, 1e9)}`, token: String(r.token) };
            this.forged++;
            this.publish(volume, msg);
          }
        }
        next();
      });
    };
    next();
  }

  inspect(volume: string): LeaseRecord | null {
    const r = this.live(volume);
    if (!r) return null;
    return {
      volume, holder: r.holder, token: r.token, ttlMs: r.expiresAt - this.sim.now,
      ...(r.reservedFor ? { reservedFor: r.reservedFor } : {}), ...(r.handoffRequestedBy ? { handoffRequestedBy: r.handoffRequestedBy } : {}), ...(r.status ? { status: r.status } : {}),
    };
  }

  list(): LeaseRecord[] {
    return [...this.recs.keys()].sort().map((v) => this.inspect(v)).filter((r): r is LeaseRecord => r !== null);
  }

  revoke(volume: string): boolean {
    const r = this.live(volume);
    this.recs.delete(volume);
    if (r) this.publish(volume, { type: 'revoked', token: String(r.token) });
    return !!r && r.holder !== '';
  }

  /** Who holds it now (for the model; null if nobody). */
  holderOf(volume: string): { holder: string; token: number } | null {
    const r = this.live(volume);
    return r && r.holder !== '' ? { holder: r.holder, token: r.token } : null;
  }
}

class SimLease extends RenewingLease {
  constructor(private readonly mgr: SimLeaseManager, a: RenewingLeaseArgs) { super(a); }
  /** Unsubscribes from the volume's channel (set by the manager). */
  unsubscribe: () => void = () => {};
  protected renewOnce(status: LeaseStatus | undefined): Promise<RenewResult> {
    return this.mgr.call('renew', (s) => s.renew(this.volume, this.holder, this.token, status));
  }
  protected releaseOnce(to: string | undefined): Promise<boolean> {
    return this.mgr.call('release', (s) => s.release(this.volume, this.holder, this.token, to));
  }
}

/** One process's client of the lease service. */
export class SimLeaseManager implements LeaseManager {
  readonly description = 'sim lease service';
  private readonly leases = new Set<SimLease>();
  private closed = false;

  constructor(
    private readonly service: SimLeaseService,
    private readonly proc: Proc,
    private readonly faults: () => LeaseFaults,
    private readonly rng: Rng,
    private readonly log: Logger,
    private readonly pollMs = 250,
  ) {}

  /** A call: to the service (latency), applied there, the reply back (a timer of this process). */
  call<T>(what: string, apply: (s: SimLeaseService) => T): Promise<T> {
    const proc = this.proc;
    const svc = this.service;
    const f = this.faults();
    svc.requests++;
    const lat = (): number => this.rng.logUniform(f.latencyMs[0], f.latencyMs[1]);
    return new Promise<T>((resolve, reject) => {
      if (proc.dead) return;
      let settled = false;
      const timer = proc.setTimeout(() => { if (!settled) { settled = true; reject(new StoreUnavailableError(`lease service: ${what} got no answer within ${f.timeoutMs} ms`)); } }, f.timeoutMs);
      const reply = (err: unknown, v?: T): void => {
        proc.setTimeout(() => {
          if (settled || svc.cut.has(proc.host.name)) return;
          settled = true;
          proc.clearTimeout(timer);
          if (err !== undefined) reject(err); else resolve(v as T);
        }, lat());
      };
      if (svc.cut.has(proc.host.name)) return; // the timeout fires
      const r = this.rng.float();
      svc.sim.after(lat(), () => {
        if (r < f.failBefore) { reply(new StoreUnavailableError(`lease service: ${what} failed (connection reset before it was sent)`)); return; }
        let v: T | undefined;
        let err: unknown;
        try { v = apply(svc); } catch (e) { err = e; }
        if (r < f.failBefore + f.lostReply) { reply(new StoreUnavailableError(`lease service: ${what}: connection reset (the command was sent)`)); return; }
        reply(err, v);
      });
    });
  }

  /** A round trip to the service (nothing in the simulation calls it: serve's /readyz does). */
  ping(): Promise<void> {
    if (this.closed) return Promise.reject(new StoreUnavailableError('lease manager closed'));
    return this.call('ping', () => undefined);
  }

  async acquire(volume: string, holder: string, options: AcquireOptions = {}): Promise<Lease> {
    checkHolderId(holder);
    const { waitMs, minToken } = checkAcquireOptions(options);
    const deadline = this.proc.now() + waitMs;
    for (;;) {
      if (this.closed) throw new StoreUnavailableError('lease manager closed');
      const startedAt = this.proc.now();
      const r = await this.call('acquire', (s) => s.acquire(volume, holder, minToken));
      if ('token' in r) {
        const lease: SimLease = new SimLease(this, {
          volume, holder, token: r.token, ttlMs: this.service.ttlMs, startedAt, renew: true, log: this.log, world: this.proc,
          ended: () => { this.leases.delete(lease); lease.unsubscribe(); },
        });
        this.leases.add(lease);
        lease.unsubscribe = this.subscribe(volume, lease);
        lease.start();
        return lease;
      }
      if (this.proc.now() >= deadline) throw r.err;
      await this.proc.sleep(Math.min(this.pollMs, deadline - this.proc.now()));
    }
  }

  /**
   * The holder's subscription to the volume's channel (redis.ts subscribes before acquiring;
   * here from the grant on, which is when a lease exists to deliver to). A message travels
   * from the service with a latency and arrives as a timer of this process; it is lost while
   * the host is cut off from the service, or once the process is gone.
   */
  private subscribe(volume: string, lease: SimLease): () => void {
    const proc = this.proc;
    const svc = this.service;
    return svc.subscribe(volume, (msg) => {
      if (proc.dead || svc.cut.has(proc.host.name)) return;
      const f = this.faults();
      proc.setTimeout(() => { if (!svc.cut.has(proc.host.name)) lease.message(msg); }, this.rng.logUniform(f.latencyMs[0], f.latencyMs[1]));
    });
  }

  /** The lease this process holds for `volume`, if any (for the model: its deadline). */
  held(volume: string): Lease | null {
    for (const l of this.leases) if (l.volume === volume && l.held) return l;
    return null;
  }

  inspect(volume: string): Promise<LeaseRecord | null> { return this.call('inspect', (s) => s.inspect(volume)); }
  list(): Promise<LeaseRecord[]> { return this.call('list', (s) => s.list()); }
  requestHandoff(volume: string, to: string): Promise<void> { return this.call('handoff', (s) => s.requestHandoff(volume, to)); }
  revoke(volume: string): Promise<boolean> { return this.call('revoke', (s) => s.revoke(volume)); }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    await Promise.all([...this.leases].map((l) => l.closeByManager()));
  }
}

/**
 * The single-writer lease: who SHOULD serve a volume read-write. (Who CAN write is decided
 * by the object store: see the fencing argument in src/volume/volume.ts and takeover.)
 *
 * A lease is per volume, held by one host id, carries a fencing token that only grows (a
 * new token on every acquisition), and has a TTL that the holder renews in the background.
 * Implementations: RedisLeaseManager (ioredis, Lua scripts, `--redis URL`) and
 * LocalLeaseManager (files in a local directory: the embedded default).
 */

export interface LeaseRecord {
  volume: string;
  holder: string;
  token: number;
  /** Milliseconds of TTL left when read. */
  ttlMs: number;
  /** A host the previous holder reserved the lease for on a graceful handoff (it may acquire at once). */
  reservedFor?: string;
  /** A pending request that the holder hand the volume to this host. */
  handoffRequestedBy?: string;
  /** What the holder last published about the volume (for `baton status`). */
  status?: LeaseStatus;
}

export interface LeaseStatus {
  dirtyBytes: number;
  lastFlushAt: string | null;
  lastCommitSeq: number;
  /** Where the holder serves NBD, for humans. */
  address?: string;
  /** The volume's background hydration on the holder (src/volume/hydrate.ts), if one was started. */
  hydration?: HydrationSummary;
}

/** What `baton status` shows of a hydration. */
export interface HydrationSummary {
  mode: string;
  state: string;
  /** Bytes fetched so far, of `plannedBytes` (final once `planned`). */
  fetchedBytes: number;
  plannedBytes: number;
  planned: boolean;
}

export interface AcquireOptions {
  /** Wait up to this long for a held lease to be released or expire (0 = fail at once). */
  waitMs?: number;
  /** Tokens at or below this are refused: the store's log has seen it (Redis may have lost data). */
  minToken?: number;
}

export interface Lease {
  readonly volume: string;
  readonly holder: string;
  readonly token: number;
  /**
   * Local monotonic deadline (performance.now() ms) before which this host may still
   * acknowledge writes: start of the last successful renewal + TTL - safety margin. Past it
   * the holder must assume the lease is gone, whatever Redis says later. (performance.now()
   * does not advance during a suspend: what that means is in redis.ts and clock.ts.)
   */
  validUntil(): number;
  /** Called once when the lease is lost (renewal failed past the deadline, or taken). */
  onLost(cb: (reason: string) => void): void;
  /** Called when another host asks for this volume (graceful handoff request). */
  onHandoffRequest(cb: (to: string) => void): void;
  /** Publish status for `baton status`; sent with the next renewal. */
  setStatus(s: LeaseStatus): void;
  /**
   * Give the lease back; with `to`, reserve it for that host so it can acquire at once. A lease
   * already lost (at its deadline) is still removed from the store if the store's record is
   * still ours (holder and token), best effort: the next acquire need not wait for its expiry.
   */
  release(to?: string): Promise<void>;
}

export interface LeaseManager {
  readonly description: string;
  /** Acquire for `holder`; throws LeaseHeldError naming the current holder. */
  acquire(volume: string, holder: string, options?: AcquireOptions): Promise<Lease>;
  /** Current lease of a volume, or null. */
  inspect(volume: string): Promise<LeaseRecord | null>;
  /** All held leases (for `baton status`). */
  list(): Promise<LeaseRecord[]>;
  /** Ask the holder of `volume` to hand it to `to`; resolves once the request is recorded. */
  requestHandoff(volume: string, to: string): Promise<void>;
  /**
   * Break the lease, whoever holds it (`rm --force`): the holder's next renewal finds it gone
   * and the holder fences the volume and disconnects its clients. The token counter is kept,
   * so later tokens still only grow. Resolves true if a lease was held.
   */
  revoke(volume: string): Promise<boolean>;
  /**
   * Is the lease service usable from here now (serve's /readyz)? Resolves, or throws an error
   * saying what is wrong. Bounded in time like any lease command; changes nothing.
   */
  ping(): Promise<void>;
  close(): Promise<void>;
}

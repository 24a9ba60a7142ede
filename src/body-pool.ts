/**
 * Segment bodies from reused memory. A segment's body (its frames in one buffer, what an S3
 * PUT sends) was a fresh 8 MiB allocation per segment: on this project's 2-core VM the kernel
 * zeroing those pages was a quarter of the server's cycles during a 1 GiB `nbdcopy --flush`
 * into radosgw (`perf`: clear_page_erms 26 %), and the bodies' external memory drove V8's full
 * collections. A volume now assembles bodies in buffers it takes back once nothing can read
 * them any more.
 *
 * When a body may be reused (the safety argument; BodyLease counts the holders):
 * 1. Its put SUCCEEDED AT THE FIRST TRY. A store reads none of a body after its put resolved:
 *    S3ObjectStore resolves a PUT only after the request's body was written out ('finish')
 *    and answered; the SDK path is answered after the body was sent; memory stores (and the
 *    simulator's) copy it at the call; the local store (`file:`) is never given one
 *    (putParts). But a put that FAILED, or succeeded only after a retry, may have an attempt
 *    still sending it (RetryingObjectStore abandons attempts at its deadline without stopping
 *    them, BATON_FAULTS' injected timeouts leave the inner put running: ArenaChunk's note in
 *    volume.ts): such a body is never taken back (Volume.upload drops its lease on `onRetry`),
 *    the collector frees it. (Session 21, a reviewed finding: a body reused after a retried
 *    put let the abandoned attempt land the next segment's bytes under the first one's key.)
 *    Likewise a GET body (cache.ts): a retried GET reads into memory of its own, and the
 *    cache reuses a body only when the store returned it (ObjectStore.get).
 * 2. The read cache no longer holds views of it. A landed segment is written through to the
 *    block cache from its body (BlockCache.insertObject); each cached block keeps a view and
 *    readers copy from it until its slab write succeeded. The cache holds the lease once per
 *    block it kept and lets go when that block's slab write succeeded; a block whose write
 *    failed keeps its view for its readers and never lets go (the collector again).
 * 3. The volume itself lets go once it handed the body to the cache (publish), and forgets
 *    it there; an attempt that never publishes (dropped, fenced, closed) never lets go.
 * Only a lease whose count reached zero returns its buffer, once (asserted).
 *
 * Memory: free buffers are kept while bodies are taken (at most `maxKept`), and let go once a
 * whole `idleMs` passed without a take (one timer, armed by a take, never re-armed while idle:
 * so between idleMs and 2 idleMs after the last take) or the pool is closed, so an idle volume
 * or cache holds none. It counts takes rather than reading the clock: a simulated process
 * whose clock stands still while its timers fire still goes idle.
 */

import { strict as assert } from 'node:assert';
import { systemWorld, type TimerHandle, type World } from './clock.js';

/** Something that must not be written again while a holder keeps views of it (BlockCache.insertObject). */
export interface BodyHold {
  acquire(): void;
  release(): void;
}

/** The holders of one pooled body; its buffer goes back to the pool when the last lets go. */
export class BodyLease implements BodyHold {
  private holds = 1; // the taker's
  private returned = false;

  constructor(private readonly pool: BodyPool, private readonly buffer: Buffer) {}

  acquire(): void {
    assert(this.holds > 0 && !this.returned, 'a body is held only while someone holds it');
    this.holds++;
  }

  release(): void {
    assert(this.holds > 0 && !this.returned, 'a body is let go once per hold');
    if (--this.holds > 0) return;
    this.returned = true;
    this.pool.giveBack(this.buffer);
  }
}

export class BodyPool {
  private readonly free: Buffer[] = [];
  private keeping = true;
  private takesSinceArmed = 0;
  private idleTimer: TimerHandle | null = null;
  /** Buffers taken back (for tests and stats). */
  reused = 0;

  /**
   * `capacity`: the size of every pooled buffer (a body longer than that is allocated on its
   * own, as before); `maxKept`: free buffers kept at most; `idleMs`: how long after the last
   * take the free ones are let go (on `world`'s clock: the simulator's in its runs).
   */
  constructor(readonly capacity: number, readonly maxKept: number, private readonly idleMs = 2000, private readonly world: World = systemWorld) {
    assert(capacity > 0 && maxKept >= 0);
  }

  /**
   * A body of `size` bytes (contents undefined) and its lease (null: not pooled, nothing to
   * let go). The caller holds the lease once.
   */
  take(size: number): { body: Buffer; lease: BodyLease | null } {
    this.keeping = true;
    this.takesSinceArmed++;
    if (this.idleTimer === null) this.armIdle();
    if (size > this.capacity) return { body: Buffer.allocUnsafe(size), lease: null };
    let buf = this.free.pop();
    if (buf !== undefined) this.reused++;
    else buf = Buffer.allocUnsafe(this.capacity);
    return { body: buf.subarray(0, size), lease: new BodyLease(this, buf) };
  }

  /** BodyLease: the last holder let go. */
  giveBack(buf: Buffer): void {
    assert(buf.length === this.capacity, 'only pooled buffers come back');
    if (this.keeping && this.free.length < this.maxKept) this.free.push(buf);
  }

  /** Let go of the free buffers, and of those given back until the next take(). */
  idle(): void {
    this.keeping = false;
    this.free.length = 0;
  }

  /** idle(), and no timer left behind. */
  close(): void {
    if (this.idleTimer !== null) { this.world.clearTimeout(this.idleTimer); this.idleTimer = null; }
    this.idle();
  }

  /** One timer for many takes: a period with a take arms the next one, a period without lets go. */
  private armIdle(): void {
    this.takesSinceArmed = 0;
    this.idleTimer = this.world.setTimeout(() => {
      this.idleTimer = null;
      if (this.takesSinceArmed > 0) this.armIdle();
      else this.idle();
    }, this.idleMs);
    this.idleTimer.unref?.();
  }

  /** Free buffers held now. */
  get kept(): number { return this.free.length; }
}

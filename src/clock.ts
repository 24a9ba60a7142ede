/**
 * Time and randomness, injected. Production code takes a `World` (or uses `systemWorld`); a
 * simulator passes one whose clock is virtual and whose randomness is seeded, so the same
 * engine code runs in both and a seed replays a run exactly. Nothing in the engine reads
 * performance.now(), Date.now(), setTimeout or crypto directly where a World is available.
 *
 * Clock assumptions (what safety may rely on): `now()` is monotonic within one process and
 * never steps (performance.now in production); `wallTime()` is for timestamps humans read
 * and may step: it never decides a deadline.
 */

import { randomBytes } from 'node:crypto';

export interface TimerHandle { unref?(): unknown }

export interface World {
  /** Monotonic milliseconds: deadlines, ages, timeouts. */
  now(): number;
  /** Wall-clock time, for timestamps in records and logs only. */
  wallTime(): Date;
  setTimeout(fn: () => void, ms: number): TimerHandle;
  clearTimeout(h: TimerHandle): void;
  /** Let other ready work run first (setImmediate in production). */
  yield(): Promise<void>;
  /** `n` random bytes (ids, nonces). */
  randomBytes(n: number): Buffer;
}

export const systemWorld: World = {
  now: () => performance.now(),
  wallTime: () => new Date(),
  setTimeout: (fn, ms) => setTimeout(fn, ms),
  clearTimeout: (h) => clearTimeout(h as NodeJS.Timeout),
  yield: () => new Promise((r) => setImmediate(r)),
  randomBytes: (n) => randomBytes(n),
};

/** A random hex id of `bytes` bytes. */
export function randomId(world: World, bytes: number): string {
  return world.randomBytes(bytes).toString('hex');
}

/**
 * Bytes of bulk work (encoding, copying, writing request bodies) one turn of the event loop may
 * do (bench/README.md, session 16: the stall probe's p99 halved, write throughput unchanged).
 */
export const TURN_BUDGET_BYTES = 1024 * 1024;

/**
 * What bulk work may do in the current turn of a World's event loop, shared by everything
 * that does it in slices: the frames and bodies of every volume's segment uploads (volume.ts),
 * the body writes of the S3 store's requests and the receipt of its GETs' bodies (those
 * spend() what arrived and pause their socket once the turn's budget is spent). Why shared:
 * each of those already yielded between slices, but sixteen uploads in flight each did their
 * slice in the same turn, so a turn held the loop for 16 slices (10-30 ms), and a guest's
 * 4 KiB read, or a lease renewal, waited behind all of them (bench/volume.ts, the stall probe). Now the slices of one turn
 * add up to about TURN_BUDGET_BYTES; the rest wait for the next turns, by priority (the
 * callers': request bodies first, then the oldest upload's slices; served round-robin instead,
 * every upload finished late and writes were ~9 % slower). The total work is the same; only
 * how it is spread over turns changes.
 *
 * take(n, priority) resolves once `n` more bytes may be done in the current turn: at once
 * while the turn's budget is not spent and nobody waits, else in a later turn, lower
 * priorities first, then in the order asked. A single take larger than the budget is still
 * granted (alone in its turn).
 */
export class TurnBudget {
  #spent = 0;
  #resetting = false;
  /** Bytes asked for so far (what went through this budget: tests read it). */
  asked = 0;
  #tickets = 0;
  /** Waiting takes, by priority (lower first), then in the order asked. */
  readonly #waiters: { bytes: number; priority: number; go: () => void }[] = [];
  constructor(private readonly world: World, private readonly limit = TURN_BUDGET_BYTES) {}

  /**
   * Increasing numbers, for priorities that put older work first: a segment upload takes one
   * as it starts, so the oldest upload's slices go first and segments finish in the order
   * they started (served round-robin, every upload finished late, and commits waited).
   */
  ticket(): number { return ++this.#tickets; }

  take(bytes: number, priority = 0): Promise<void> {
    this.asked += bytes;
    if (this.#spent < this.limit && this.#waiters.length === 0) {
      this.#spent += bytes;
      this.#resetSoon();
      return Promise.resolve();
    }
    return new Promise((go) => {
      let at = this.#waiters.length;
      while (at > 0 && this.#waiters[at - 1]!.priority > priority) at--;
      this.#waiters.splice(at, 0, { bytes, priority, go });
      this.#resetSoon();
    });
  }

  /**
   * Account `bytes` of work already done in this turn by something that cannot ask first: a
   * response body's chunks arrive when the socket has them. True while the turn's budget
   * lasts; false once it is spent (or others wait), and the caller stops its source (pauses
   * the stream) until take(0, priority) resolves in a later turn.
   */
  spend(bytes: number): boolean {
    this.asked += bytes;
    this.#spent += bytes;
    this.#resetSoon();
    return this.#spent < this.limit && this.#waiters.length === 0;
  }

  /** At the next turn: a new budget, granted to the waiters in order while it lasts. */
  #resetSoon(): void {
    if (this.#resetting) return;
    this.#resetting = true;
    void this.world.yield().then(() => {
      this.#resetting = false;
      this.#spent = 0;
      while (this.#waiters.length > 0 && this.#spent < this.limit) {
        const w = this.#waiters.shift()!;
        this.#spent += w.bytes;
        w.go();
      }
      if (this.#waiters.length > 0 || this.#spent > 0) this.#resetSoon();
    });
  }
}

const budgets = new WeakMap<World, TurnBudget>();

/** The one TurnBudget of `world` (every volume and store of a process share systemWorld's). */
export function turnBudget(world: World): TurnBudget {
  let b = budgets.get(world);
  if (b === undefined) budgets.set(world, b = new TurnBudget(world));
  return b;
}

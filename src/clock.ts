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

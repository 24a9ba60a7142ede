/**
 * The simulated world: one virtual clock, one queue of timers, seeded randomness, and hosts
 * whose processes can be paused, resumed and crashed.
 *
 * Everything the engine waits for in the simulator is a timer in this queue: a store reply,
 * a lease reply, a retry backoff, a renewal, `world.yield()`. Nothing does real I/O. The
 * driver (`Sim.step`) lets every ready microtask run (one `setImmediate` turn drains them
 * all), then fires the earliest timer, ordered by (time, sequence). So a run is a pure
 * function of its seed, and virtual time costs nothing: an hour of GC grace is one pop.
 *
 * Hosts and processes. A host runs one process at a time (`Proc`, which is the `World` its
 * code gets). A timer belongs to a process, or to nobody (the store's and the lease
 * service's own events, the scheduler). While a host is paused (SIGSTOP), its process's
 * timers that come due are held, and fire when it resumes, late; time goes on for everybody
 * else. When a host crashes, its process is dead: its pending and held timers are dropped
 * and never fire, so every promise its code awaits stays pending forever (its objects are
 * abandoned, as memory is when a process dies). A restart is a new process with new objects.
 * Crashes and pauses strike between events, i.e. at an await point.
 */

import type { TimerHandle, World } from '../../src/clock.js';

// ------------------------------------------------------------------ randomness

/** splitmix32: seeds the main generator from any 32-bit value. */
function splitmix32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x9e3779b9) >>> 0;
    let z = a;
    z = Math.imul(z ^ (z >>> 16), 0x85ebca6b) >>> 0;
    z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35) >>> 0;
    return (z ^ (z >>> 16)) >>> 0;
  };
}

/** xoshiro128**: small, fast, and good enough for choosing faults. */
export class Rng {
  private s0: number; private s1: number; private s2: number; private s3: number;
  constructor(seed: number) {
    const sm = splitmix32(seed);
    this.s0 = sm(); this.s1 = sm(); this.s2 = sm(); this.s3 = sm();
    if ((this.s0 | this.s1 | this.s2 | this.s3) === 0) this.s0 = 1;
  }
  u32(): number {
    const r = Math.imul(rotl(Math.imul(this.s1, 5) >>> 0, 7), 9) >>> 0;
    const t = (this.s1 << 9) >>> 0;
    this.s2 = (this.s2 ^ this.s0) >>> 0;
    this.s3 = (this.s3 ^ this.s1) >>> 0;
    this.s1 = (this.s1 ^ this.s2) >>> 0;
    this.s0 = (this.s0 ^ this.s3) >>> 0;
    this.s2 = (this.s2 ^ t) >>> 0;
    this.s3 = rotl(this.s3, 11);
    return r;
  }
  /** [0, 1) */
  float(): number { return this.u32() / 4294967296; }
  /** Inclusive. */
  int(lo: number, hi: number): number { return lo + Math.floor(this.float() * (hi - lo + 1)); }
  chance(p: number): boolean { return p > 0 && this.float() < p; }
  pick<T>(xs: readonly T[]): T { return xs[Math.floor(this.float() * xs.length)]!; }
  /** Log-uniform in [lo, hi]: most values small, a few large (latencies, pauses). */
  logUniform(lo: number, hi: number): number { return lo * Math.pow(hi / lo, this.float()); }
  bytes(n: number): Buffer {
    const b = Buffer.allocUnsafe(n);
    for (let i = 0; i < n; i += 4) {
      const v = this.u32();
      for (let j = 0; j < 4 && i + j < n; j++) b[i + j] = (v >>> (8 * j)) & 0xff;
    }
    return b;
  }
  /** An independent stream, so one concern's draws do not shift another's. */
  derive(label: string): Rng {
    let h = this.u32() ^ 0x9e3779b9;
    for (let i = 0; i < label.length; i++) h = Math.imul(h ^ label.charCodeAt(i), 0x01000193) >>> 0;
    return new Rng(h);
  }
}

function rotl(x: number, k: number): number { return ((x << k) | (x >>> (32 - k))) >>> 0; }

// ------------------------------------------------------------------ timers

export class SimTimer implements TimerHandle {
  cancelled = false;
  constructor(public at: number, public seq: number, readonly fn: () => void, readonly proc: Proc | null) {}
  unref(): this { return this; }
}

/** A binary min-heap of timers ordered by (at, seq). */
class TimerHeap {
  private readonly a: SimTimer[] = [];
  get size(): number { return this.a.length; }
  push(t: SimTimer): void {
    const a = this.a;
    a.push(t);
    let i = a.length - 1;
    while (i > 0) {
      const p = (i - 1) >> 1;
      if (!less(a[i]!, a[p]!)) break;
      [a[i], a[p]] = [a[p]!, a[i]!];
      i = p;
    }
  }
  peek(): SimTimer | undefined { return this.a[0]; }
  pop(): SimTimer | undefined {
    const a = this.a;
    if (a.length === 0) return undefined;
    const top = a[0]!;
    const last = a.pop()!;
    if (a.length > 0) {
      a[0] = last;
      let i = 0;
      for (;;) {
        const l = 2 * i + 1;
        const r = l + 1;
        let m = i;
        if (l < a.length && less(a[l]!, a[m]!)) m = l;
        if (r < a.length && less(a[r]!, a[m]!)) m = r;
        if (m === i) break;
        [a[i], a[m]] = [a[m]!, a[i]!];
        i = m;
      }
    }
    return top;
  }
}

function less(x: SimTimer, y: SimTimer): boolean { return x.at < y.at || (x.at === y.at && x.seq < y.seq); }

const drainMicrotasks = (): Promise<void> => new Promise((r) => setImmediate(r));

// ------------------------------------------------------------------ the world

export class Sim {
  /** Virtual monotonic milliseconds. */
  now = 0;
  /** Wall time at now = 0 (only for timestamps: lastModified, record times). */
  readonly epochMs = Date.parse('2030-01-01T00:00:00Z');
  readonly rng: Rng;
  /** Ids and nonces (World.randomBytes). */
  private readonly ids: Rng;
  private readonly heap = new TimerHeap();
  private seq = 0;
  events = 0;
  readonly hosts: SimHost[] = [];
  private stampMs = -1;
  private stampN = 0;

  constructor(readonly seed: number) {
    this.rng = new Rng(seed);
    this.ids = this.rng.derive('ids');
  }

  /** Orders model events: virtual ms * 1e6 + a counter within the ms. */
  stamp(): number {
    if (this.now !== this.stampMs) { this.stampMs = this.now; this.stampN = 0; }
    return this.now * 1e6 + ++this.stampN;
  }

  /** The lowest stamp at virtual time `ms` (for "acknowledged before `ms`"). */
  static stampAt(ms: number): number { return ms * 1e6; }

  randomBytes(n: number): Buffer { return this.ids.bytes(n); }

  schedule(at: number, fn: () => void, proc: Proc | null): SimTimer {
    const t = new SimTimer(Math.max(at, this.now), ++this.seq, fn, proc);
    this.heap.push(t);
    return t;
  }

  /** Put a held timer back, due now. */
  requeue(t: SimTimer): void {
    t.at = this.now;
    t.seq = ++this.seq;
    this.heap.push(t);
  }

  /** A timer of nobody's process: the store's, the lease service's, the scheduler's. */
  after(ms: number, fn: () => void): SimTimer { return this.schedule(this.now + ms, fn, null); }

  host(name: string): SimHost {
    const h = new SimHost(this, name);
    this.hosts.push(h);
    return h;
  }

  /**
   * Let all ready work run, then fire the earliest timer (skipping cancelled ones, holding a
   * paused host's, dropping a dead process's). False if no timer is left (quiescent).
   */
  async step(): Promise<boolean> {
    await drainMicrotasks();
    for (;;) {
      const t = this.heap.pop();
      if (!t) return false;
      if (t.cancelled) continue;
      const p = t.proc;
      if (p) {
        if (p.dead) continue;
        if (p.host.state === 'paused') { p.host.held.push(t); continue; }
      }
      if (t.at > this.now) this.now = t.at;
      this.events++;
      t.fn();
      return true;
    }
  }

  /** No timer left at all. */
  get idle(): boolean { return this.heap.size === 0; }
}

export type HostState = 'up' | 'paused' | 'down';

export class SimHost {
  state: HostState = 'down';
  proc: Proc | null = null;
  /** A paused host's timers that came due. */
  held: SimTimer[] = [];
  generation = 0;
  pausedAt = 0;
  constructor(readonly sim: Sim, readonly name: string) {}

  /** Start a new process (new objects): the host is up. */
  start(): Proc {
    if (this.proc && !this.proc.dead) throw new Error(`${this.name} already runs a process`);
    this.proc = new Proc(this.sim, this, ++this.generation);
    this.state = 'up';
    return this.proc;
  }

  private pauses = 0;

  /** Stops the host; returns this pause's number (resume(n) ends only that pause, not a later one). */
  pause(): number {
    if (this.state !== 'up') return -1;
    this.state = 'paused';
    this.pausedAt = this.sim.now;
    return ++this.pauses;
  }

  /** Ends the pause (only pause number `pause`, if given); true if the host was resumed. */
  resume(pause?: number): boolean {
    if (this.state !== 'paused' || (pause !== undefined && pause !== this.pauses)) return false;
    this.state = 'up';
    const held = this.held;
    this.held = [];
    // They fire now, late, in the order they came due (the same handles: clearTimeout still works).
    for (const t of held) if (!t.cancelled) this.sim.requeue(t);
    return true;
  }

  /** The process dies at its current await point: nothing it waits for ever happens. */
  crash(): void {
    if (this.proc) this.proc.dead = true;
    this.proc = null;
    this.held = [];
    this.state = 'down';
  }
}

/** One process of a host: the World its code runs in. */
export class Proc implements World {
  dead = false;
  constructor(readonly sim: Sim, readonly host: SimHost, readonly gen: number) {}
  get label(): string { return `${this.host.name}#${this.gen}`; }
  now(): number { return this.sim.now; }
  wallTime(): Date { return new Date(this.sim.epochMs + this.sim.now); }
  setTimeout(fn: () => void, ms: number): SimTimer {
    return this.sim.schedule(this.sim.now + Math.max(0, Number.isFinite(ms) ? ms : 0), fn, this);
  }
  clearTimeout(h: TimerHandle): void { (h as SimTimer).cancelled = true; }
  yield(): Promise<void> { return new Promise((r) => { this.sim.schedule(this.sim.now, r, this); }); }
  randomBytes(n: number): Buffer { return this.sim.randomBytes(n); }
  sleep(ms: number): Promise<void> { return new Promise((r) => { this.setTimeout(r, ms); }); }
  /** True while this process is the host's live one and the host is not paused. */
  get running(): boolean { return !this.dead && this.host.state === 'up'; }
}

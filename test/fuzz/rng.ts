/**
 * The fuzzer's one source of randomness: xoshiro128** seeded through splitmix32. Every input
 * gets its own stream derived from (run seed, input index), so input N is generated the same
 * way whether it runs after inputs 0..N-1 or alone (`--only N`); the well-behaved client gets
 * its own stream derived from the run seed. Nothing in the fuzzer calls Math.random.
 */

function splitmix32(state: { s: number }): number {
  state.s = (state.s + 0x9e3779b9) >>> 0;
  let z = state.s;
  z = Math.imul(z ^ (z >>> 16), 0x85ebca6b) >>> 0;
  z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35) >>> 0;
  return (z ^ (z >>> 16)) >>> 0;
}

export class Rng {
  private a: number;
  private b: number;
  private c: number;
  private d: number;

  /** A stream for (seed, stream): e.g. (run seed, input index). */
  constructor(seed: number, stream = 0) {
    const st = { s: (seed ^ Math.imul(stream + 1, 0x27d4eb2d)) >>> 0 };
    splitmix32(st); // decorrelate neighbouring seeds
    st.s = (st.s ^ Math.imul((stream >>> 0) ^ 0x165667b1, 0x9e3779b1)) >>> 0;
    this.a = splitmix32(st); this.b = splitmix32(st); this.c = splitmix32(st); this.d = splitmix32(st);
    if ((this.a | this.b | this.c | this.d) === 0) this.a = 1;
  }

  /** Uniform u32. */
  u32(): number {
    const r = Math.imul(rotl(Math.imul(this.b, 5), 7), 9) >>> 0;
    const t = (this.b << 9) >>> 0;
    this.c ^= this.a; this.d ^= this.b; this.b ^= this.c; this.a ^= this.d;
    this.c ^= t;
    this.d = rotl(this.d, 11);
    return r;
  }

  /** Uniform float in [0, 1). */
  float(): number { return this.u32() / 0x100000000; }

  /** Uniform integer in [lo, hi] (inclusive; safe integers). */
  int(lo: number, hi: number): number {
    if (hi < lo) throw new Error(`rng.int(${lo}, ${hi})`);
    const span = hi - lo + 1;
    if (span <= 0x100000000) return lo + Math.floor(this.float() * span);
    return lo + Math.floor((this.u32() * 0x100000000 + this.u32()) / 2 ** 64 * span);
  }

  chance(p: number): boolean { return this.float() < p; }

  pick<T>(xs: readonly T[]): T {
    if (xs.length === 0) throw new Error('rng.pick of nothing');
    return xs[Math.floor(this.float() * xs.length)]!;
  }

  /** Pick by weight: [[weight, value], ...]. */
  weighted<T>(xs: readonly (readonly [number, T])[]): T {
    let total = 0;
    for (const [w] of xs) total += w;
    let r = this.float() * total;
    for (const [w, v] of xs) { r -= w; if (r < 0) return v; }
    return xs[xs.length - 1]![1];
  }

  /** u64 as a bigint. */
  u64(): bigint { return (BigInt(this.u32()) << 32n) | BigInt(this.u32()); }

  bytes(n: number): Buffer {
    const b = Buffer.allocUnsafe(n);
    let i = 0;
    for (; i + 4 <= n; i += 4) b.writeUInt32LE(this.u32(), i);
    if (i < n) { const r = this.u32(); for (let k = 0; i < n; i++, k++) b[i] = (r >>> (8 * k)) & 0xff; }
    return b;
  }
}

function rotl(x: number, k: number): number { return ((x << k) | (x >>> (32 - k))) >>> 0; }

/** A random seed for a run that was not given one (the only non-deterministic choice; it is printed). */
export function freshSeed(): number {
  return (Date.now() ^ (process.pid << 16) ^ Math.floor(performance.now() * 1000)) >>> 0;
}

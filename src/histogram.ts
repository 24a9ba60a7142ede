/**
 * A fixed-bucket histogram of durations as plain numbers: what the engine, the store
 * decorators and the NBD session record, and what `serve --metrics` exports at scrape time
 * (src/metrics.ts) in Prometheus's histogram shape (cumulative `le` buckets, `_sum`, `_count`).
 *
 * Why not prom-client's Histogram on the hot path: its observe() builds a label object and a
 * hash string per call. This one is an array index and three additions, no allocation, and
 * nothing here knows about Prometheus: one that is never scraped costs only that.
 */

/**
 * Upper bounds in seconds: 0.5 ms doubling to 32.8 s (17 buckets, then +Inf). Covers a
 * FLUSH on a local disk (sub-millisecond to a few ms) up to an S3 commit that rides out
 * retries (the retry budget is 60 s; past 32 s it is +Inf, which still counts it).
 */
export const LATENCY_BOUNDS_SECONDS: readonly number[] = Object.freeze(Array.from({ length: 17 }, (_, i) => 0.0005 * 2 ** i));

export class DurationHistogram {
  /** Upper bounds, ascending (seconds). */
  readonly bounds: Float64Array;
  /** counts[i]: observations in (bounds[i-1], bounds[i]]; the last slot is (bounds[n-1], +Inf). Not cumulative. */
  readonly counts: Float64Array;
  sum = 0;
  count = 0;

  constructor(bounds: readonly number[] = LATENCY_BOUNDS_SECONDS) {
    for (let i = 1; i < bounds.length; i++) {
      if (!(bounds[i]! > bounds[i - 1]!)) throw new RangeError(`histogram bounds must ascend: ${bounds.join(', ')}`);
    }
    this.bounds = Float64Array.from(bounds);
    this.counts = new Float64Array(bounds.length + 1);
  }

  /** Record one duration in seconds. Negative (a clock that stepped) counts as 0. */
  observe(seconds: number): void {
    const v = seconds > 0 ? seconds : 0;
    const b = this.bounds;
    // Linear: 17 comparisons at most, and most durations fall in the first few buckets.
    let i = 0;
    while (i < b.length && v > b[i]!) i++;
    this.counts[i]!++;
    this.sum += v;
    this.count++;
  }
}

/**
 * `serve --metrics`: the Prometheus registry (prom-client). Every baton series is read at
 * scrape time from stats objects the serving code keeps anyway (collect()), so a process
 * that is never scraped pays only for those: the NBD session's per-request counters
 * (nbd/stats.ts: array increments), the engine's commit stats, the store's
 * InstrumentedObjectStore, the read cache's and the background GC's counters.
 *
 * Naming follows Prometheus: `baton_` prefix, base units in the name (`_seconds`, `_bytes`),
 * counters end in `_total`. Labels are bounded sets: `volume` (volumes this host has in hand
 * now: a volume's series go away when it is closed or handed to another host, whose series
 * then appear), `cmd` and `result` (NBD commands, errnos), `op` and `outcome` (store
 * operations, outcome classes), `result` of a GC run. Never a key, an offset, a client or a
 * request id. test/unit/metrics.test.ts checks both.
 *
 * Counters keep what the serving code counted since its object was made: a volume's since
 * it was opened on this host (a reopen starts at 0 again, which Prometheus's rate() and
 * increase() treat as a counter reset), the store's and the cache's since the process started.
 */

import { Counter, Gauge, Registry, collectDefaultMetrics, type Metric } from 'prom-client';
import { COMMAND_LABELS, RESULT_LABELS } from '../nbd/stats.js';
import type { BlockCache } from './cache.js';
import type { ServedVolumeInfo } from './exports.js';
import type { DurationHistogram } from './histogram.js';
import type { MaintenanceStats } from './maintenance.js';
import { InstrumentedObjectStore, RetryingObjectStore, STORE_OPS, STORE_OUTCOMES } from './store/decorators.js';
import type { ObjectStore } from './store/object-store.js';

/**
 * Where the series come from. Read at every scrape (not at registration), so a source made
 * after the registry (the NBD server, the exports, the cache) is filled in when it exists.
 */
export interface MetricsSources {
  /** Volumes this host has in hand (VolumeExports). */
  volumes?: { servedVolumes(): ServedVolumeInfo[] };
  /** The store as opened; its InstrumentedObjectStore and RetryingObjectStore layers are found by following `next`. */
  store?: ObjectStore;
  /** The local read cache, once it exists. */
  cache?: BlockCache | null;
  /** Background compaction and GC of `serve`. */
  maintenance?: { readonly stats: MaintenanceStats } | null;
  /** The NBD listener: connections open now, attached or still handshaking. */
  nbd?: { readonly connectionCount: number };
  /** Constant labels of `baton_info`. */
  info?: { hostId: string; store: string; version: string };
}

export interface MetricsOptions {
  /**
   * prom-client's process metrics (CPU, memory, heap, GC, event-loop lag) with the baton_
   * prefix (default true). Its event-loop monitor wakes the loop every 10 ms while enabled.
   */
  processMetrics?: boolean;
}

/** What hydration progress looks like where the engine has it (see hydrationOf). */
export interface HydrationProgress {
  state: string;
  plannedBytes: number;
  fetchedBytes: number;
}

/**
 * Extension point for hydration (issue 13, another branch): a Volume that has a
 * `hydrationStatus` getter (HydrationStatus: state, plannedBytes, fetchedBytes, ...) gets the
 * baton_volume_hydration_* series; one without has none. Read structurally so this file needs
 * no change when that branch lands; replace with the typed getter then.
 */
export function hydrationOf(volume: object): HydrationProgress | null {
  const h = (volume as { hydrationStatus?: HydrationProgress | null }).hydrationStatus;
  return h && typeof h.plannedBytes === 'number' && typeof h.fetchedBytes === 'number' ? h : null;
}

/** The store decorators of `store`'s stack that the store series read. */
export function storeLayers(store: ObjectStore | undefined): { instrumented: InstrumentedObjectStore | null; retrying: RetryingObjectStore | null } {
  let instrumented: InstrumentedObjectStore | null = null;
  let retrying: RetryingObjectStore | null = null;
  for (let s: ObjectStore | undefined = store, depth = 0; s && depth < 16; s = (s as { next?: ObjectStore }).next, depth++) {
    if (s instanceof InstrumentedObjectStore) instrumented ??= s;
    if (s instanceof RetryingObjectStore) retrying ??= s;
  }
  return { instrumented, retrying };
}

/**
 * A histogram whose buckets a DurationHistogram keeps (no prom-client work per observation),
 * exported in the text format's histogram shape at scrape time. prom-client's registry takes
 * any object with name, help, type and get(); its Histogram class cannot be filled from
 * counts, only by observing.
 */
class BucketsMetric<L extends string> {
  readonly type = 'histogram';
  readonly aggregator = 'sum';
  constructor(
    readonly name: string,
    readonly help: string,
    readonly labelNames: readonly L[],
    private readonly series: () => Iterable<{ labels: Record<L, string>; h: DurationHistogram }>,
  ) {}

  get(): { name: string; help: string; type: 'histogram'; aggregator: 'sum'; values: { labels: Record<string, string | number>; value: number; metricName: string }[] } {
    const values: { labels: Record<string, string | number>; value: number; metricName: string }[] = [];
    for (const { labels, h } of this.series()) {
      let cumulative = 0;
      for (let i = 0; i < h.bounds.length; i++) {
        cumulative += h.counts[i]!;
        values.push({ labels: { ...labels, le: h.bounds[i]! }, value: cumulative, metricName: `${this.name}_bucket` });
      }
      cumulative += h.counts[h.bounds.length]!;
      values.push({ labels: { ...labels, le: '+Inf' }, value: cumulative, metricName: `${this.name}_bucket` });
      values.push({ labels, value: h.sum, metricName: `${this.name}_sum` });
      values.push({ labels, value: h.count, metricName: `${this.name}_count` });
    }
    return { name: this.name, help: this.help, type: this.type, aggregator: this.aggregator, values };
  }
}

type VolumeGetter = (v: ServedVolumeInfo) => number | undefined;

export function createMetricsRegistry(src: MetricsSources, opts: MetricsOptions = {}): Registry {
  const reg = new Registry();
  if (opts.processMetrics ?? true) collectDefaultMetrics({ register: reg, prefix: 'baton_' });

  // One listing of the served volumes per scrape: every collect() of a scrape runs in the
  // same turn of the event loop (the registry starts them all before awaiting any), so the
  // per-volume series of one scrape describe one moment.
  let snapshot: ServedVolumeInfo[] | null = null;
  const served = (): ServedVolumeInfo[] => {
    if (snapshot === null) {
      snapshot = src.volumes?.servedVolumes() ?? [];
      setImmediate(() => { snapshot = null; });
    }
    return snapshot;
  };

  const volumeSeries = (kind: 'counter' | 'gauge', name: string, help: string, value: VolumeGetter): void => {
    const collect = function (this: Gauge<'volume'> | Counter<'volume'>): void {
      this.reset();
      for (const v of served()) {
        const x = value(v);
        if (x === undefined) continue;
        if (this instanceof Gauge) this.set({ volume: v.name }, x);
        else this.inc({ volume: v.name }, x);
      }
    };
    if (kind === 'gauge') new Gauge({ name, help, labelNames: ['volume'] as const, registers: [reg], collect });
    else new Counter({ name, help, labelNames: ['volume'] as const, registers: [reg], collect });
  };
  const histogram = <L extends string>(name: string, help: string, labelNames: readonly L[], series: () => Iterable<{ labels: Record<L, string>; h: DurationHistogram }>): void => {
    reg.registerMetric(new BucketsMetric(name, help, labelNames, series) as unknown as Metric);
  };

  // ---------------------------------------------------------------- NBD, per volume

  new Counter({
    name: 'baton_nbd_requests_total',
    help: 'NBD requests answered, by command and result (ok, or the errno the client got). Successes of every command are always exported; errors once they happened.',
    labelNames: ['volume', 'cmd', 'result'] as const,
    registers: [reg],
    collect() {
      this.reset();
      for (const v of served()) {
        const r = v.requests;
        if (!r) continue;
        for (let c = 0; c < COMMAND_LABELS.length; c++) {
          for (let k = 0; k < RESULT_LABELS.length; k++) {
            const n = r.requests[c * RESULT_LABELS.length + k]!;
            const cmd = COMMAND_LABELS[c]!;
            // ok of every real command (DISC is not a request that gets an answer), so rate()
            // works from the first request; any other pair only once it happened.
            const always = k === 0 && cmd !== 'disc' && cmd !== 'other';
            if (n > 0 || always) this.inc({ volume: v.name, cmd, result: RESULT_LABELS[k]! }, n);
          }
        }
      }
    },
  });
  volumeSeries('counter', 'baton_nbd_read_bytes_total', 'Bytes successful NBD READs returned to clients.', (v) => v.requests?.readBytes);
  volumeSeries('counter', 'baton_nbd_write_bytes_total', 'Bytes of successful NBD WRITEs (acknowledged to clients; durable once a FLUSH or FUA covered them).', (v) => v.requests?.writeBytes);
  histogram('baton_nbd_flush_duration_seconds', 'NBD FLUSH: from dispatch to the backend\'s answer (success or failure), one sample per FLUSH the backend answered.', ['volume'], function* () {
    for (const v of served()) if (v.requests) yield { labels: { volume: v.name }, h: v.requests.flushSeconds };
  });
  volumeSeries('gauge', 'baton_volume_connections', 'NBD connections attached to the volume now.', (v) => v.connections);

  // ---------------------------------------------------------------- engine, per volume

  volumeSeries('counter', 'baton_volume_commits_total', 'Commits that landed in the log (a flush, a background commit past the soft limit, compaction).', (v) => v.volume?.stats().commits);
  volumeSeries('counter', 'baton_volume_commit_bytes_total', 'Bytes landed commits put into the store: data segments and log records.', (v) => v.volume?.stats().committedBytes);
  histogram('baton_volume_commit_duration_seconds', 'A landed commit from sealing its data to its log record landing, retries included.', ['volume'], function* () {
    for (const v of served()) if (v.volume) yield { labels: { volume: v.name }, h: v.volume.commitSeconds };
  });
  volumeSeries('gauge', 'baton_volume_dirty_bytes', 'Written and not yet sealed for a commit (trimmed and zeroed ranges count their length).', (v) => v.volume?.stats().dirtyBytes);
  volumeSeries('gauge', 'baton_volume_sealed_bytes', 'Sealed for a commit that has not landed yet (in flight, or kept after a failed commit).', (v) => v.volume?.stats().sealedBytes);
  volumeSeries('gauge', 'baton_volume_extents', 'Extents of the committed map.', (v) => v.volume?.stats().extents);
  volumeSeries('gauge', 'baton_volume_size_bytes', 'Logical size of the volume.', (v) => v.volume?.size);
  volumeSeries('gauge', 'baton_volume_fenced', '1 once the volume fenced itself (it writes nothing more here; its clients are disconnected).', (v) => (v.volume ? (v.volume.isFenced ? 1 : 0) : undefined));
  volumeSeries('gauge', 'baton_volume_hydration_planned_bytes', 'Bytes hydration plans to fetch into the read cache (volumes whose engine has hydration).', (v) => (v.volume ? hydrationOf(v.volume)?.plannedBytes : undefined));
  volumeSeries('gauge', 'baton_volume_hydration_fetched_bytes', 'Bytes hydration has fetched into the read cache.', (v) => (v.volume ? hydrationOf(v.volume)?.fetchedBytes : undefined));
  volumeSeries('gauge', 'baton_volume_hydration_running', '1 while hydration is fetching.', (v) => {
    const h = v.volume ? hydrationOf(v.volume) : null;
    return h ? (h.state === 'running' ? 1 : 0) : undefined;
  });

  // ---------------------------------------------------------------- lease, per volume

  volumeSeries('gauge', 'baton_lease_held', '1 if this host serves the volume under a lease it holds (read-write); 0 if it serves it without one (read-only, snapshot).', (v) => (v.lease && v.lease.remainingMs > 0 ? 1 : 0));
  volumeSeries('gauge', 'baton_lease_token', 'Fencing token of the lease the volume is served under.', (v) => v.lease?.token);
  volumeSeries('gauge', 'baton_lease_remaining_seconds', 'How long this host may still write under the lease without another renewal (renewals every TTL/3 push it back; at 0 the volume is fenced).', (v) => (v.lease ? v.lease.remainingMs / 1000 : undefined));

  // ---------------------------------------------------------------- store

  const layers = (): ReturnType<typeof storeLayers> => storeLayers(src.store);
  new Counter({
    name: 'baton_store_requests_total',
    help: 'Object-store requests (each attempt of a retried one), by operation and outcome (not_found and precondition_failed are answers: an absent key, a create-only put that lost). A file: store\'s in-place reads count as get.',
    labelNames: ['op', 'outcome'] as const,
    registers: [reg],
    collect() {
      this.reset();
      const inst = layers().instrumented;
      const reads = src.store?.local?.reads;
      if (!inst && !reads) return;
      const m = inst?.metrics();
      for (const op of STORE_OPS) {
        for (const outcome of STORE_OUTCOMES) {
          let n = m ? m[op].outcomes[outcome] : 0;
          if (op === 'get' && reads) n += outcome === 'ok' ? reads.ok : outcome === 'not_found' ? reads.notFound : outcome === 'error' ? reads.error : 0;
          if (n > 0 || outcome === 'ok') this.inc({ op, outcome }, n);
        }
      }
    },
  });
  histogram('baton_store_request_duration_seconds', 'Object-store request latency per attempt (a listing: time waiting for the store, all pages). A file: store\'s in-place reads (page-cache preads of microseconds, one per NBD READ piece) are not timed.', ['op'], function* () {
    const inst = layers().instrumented;
    if (inst) for (const op of STORE_OPS) yield { labels: { op }, h: inst.metrics()[op].seconds };
  });
  new Counter({
    name: 'baton_store_received_bytes_total', help: 'Object bytes received from the store (get, ranged or whole; a file: store\'s in-place reads).', registers: [reg],
    collect() { this.reset(); this.inc((layers().instrumented?.metrics().get.bytes ?? 0) + (src.store?.local?.reads?.bytes ?? 0)); },
  });
  new Counter({
    name: 'baton_store_sent_bytes_total', help: 'Object bytes sent to the store (put).', registers: [reg],
    collect() { this.reset(); const inst = layers().instrumented; if (inst) this.inc(inst.metrics().put.bytes); },
  });
  new Gauge({
    name: 'baton_store_in_flight_requests', help: 'Object-store requests in flight now.', registers: [reg],
    collect() { this.set(layers().instrumented?.stats().inFlight ?? 0); },
  });
  new Counter({
    name: 'baton_store_retries_total',
    help: 'Store requests retried after a transient failure, per operation (stores without a retry layer, such as file:, never retry).',
    labelNames: ['op'] as const,
    registers: [reg],
    collect() {
      this.reset();
      const r = layers().retrying;
      for (const op of STORE_OPS) this.inc({ op }, r ? r.retries[op] : 0);
    },
  });

  // ---------------------------------------------------------------- read cache

  const cacheCounter = (name: string, help: string, value: (c: BlockCache) => number): void => {
    new Counter({ name, help, registers: [reg], collect() { this.reset(); if (src.cache) this.inc(value(src.cache)); } });
  };
  const cacheGauge = (name: string, help: string, value: (c: BlockCache) => number): void => {
    new Gauge({ name, help, registers: [reg], collect() { this.set(src.cache ? value(src.cache) : 0); } });
  };
  cacheCounter('baton_cache_hits_total', 'Read-cache blocks (256 KiB) found in the cache.', (c) => c.stats.hits);
  cacheCounter('baton_cache_misses_total', 'Read-cache blocks (256 KiB) that had to be fetched from the store.', (c) => c.stats.misses);
  cacheCounter('baton_cache_fetches_total', 'Ranged GETs the read cache made (adjacent missing blocks share one).', (c) => c.stats.fetches);
  cacheCounter('baton_cache_fetched_bytes_total', 'Bytes the read cache fetched from the store.', (c) => c.stats.bytesFetched);
  cacheCounter('baton_cache_evictions_total', 'Blocks evicted (least recently used) to make room.', (c) => c.stats.evictions);
  cacheGauge('baton_cache_bytes', 'Bytes held in the read cache now.', (c) => c.stats.cachedBytes);
  cacheGauge('baton_cache_capacity_bytes', 'Capacity of the read cache (--cache-size).', (c) => c.capacityBytes);

  // ---------------------------------------------------------------- background GC and compaction

  const gcCounter = (name: string, help: string, value: (s: MaintenanceStats) => number): void => {
    new Counter({ name, help, registers: [reg], collect() { this.reset(); const m = src.maintenance; if (m) this.inc(value(m.stats)); } });
  };
  new Counter({
    name: 'baton_gc_runs_total', help: 'Background GC runs of this process, by result (failed: nothing was deleted that should not be; the next pass retries).',
    labelNames: ['result'] as const, registers: [reg],
    collect() {
      this.reset();
      const s = src.maintenance?.stats;
      this.inc({ result: 'ok' }, s?.gcRuns ?? 0);
      this.inc({ result: 'failed' }, s?.gcFailures ?? 0);
    },
  });
  gcCounter('baton_gc_marked_objects_total', 'Unreferenced objects GC marked (a later run deletes them if still unreferenced after the grace).', (s) => s.markedObjects);
  gcCounter('baton_gc_marked_bytes_total', 'Bytes of the objects GC marked.', (s) => s.markedBytes);
  gcCounter('baton_gc_deleted_objects_total', 'Objects GC deleted.', (s) => s.deletedObjects);
  gcCounter('baton_gc_deleted_bytes_total', 'Bytes of the objects GC deleted.', (s) => s.deletedBytes);
  gcCounter('baton_compaction_rewritten_bytes_total', 'Live bytes background compaction rewrote into new objects.', (s) => s.compactedBytes);
  new Gauge({
    name: 'baton_gc_last_run_timestamp_seconds', help: 'When the last background GC run ended (Unix time; 0: none yet).', registers: [reg],
    collect() { const t = src.maintenance?.stats.lastGcEndedAt; this.set(t ? t / 1000 : 0); },
  });
  new Gauge({
    name: 'baton_gc_last_run_duration_seconds', help: 'How long the last background GC run took.', registers: [reg],
    collect() { this.set(src.maintenance?.stats.lastGcSeconds ?? 0); },
  });

  // ---------------------------------------------------------------- process-wide

  new Gauge({
    name: 'baton_nbd_connections', help: 'NBD connections open now (attached or handshaking).', registers: [reg],
    collect() { this.set(src.nbd?.connectionCount ?? 0); },
  });
  new Gauge({
    name: 'baton_info', help: 'Always 1; labels: this host\'s --host-id, the store it serves from, baton\'s version.',
    labelNames: ['host_id', 'store', 'version'] as const, registers: [reg],
    collect() {
      this.reset();
      if (src.info) this.set({ host_id: src.info.hostId, store: src.info.store, version: src.info.version }, 1);
    },
  });

  return reg;
}

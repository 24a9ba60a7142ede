/**
 * serve --metrics, in process: the registry of src/metrics.ts over a real NbdServer,
 * VolumeExports, StoreCatalog and local lease files, driven by a hand-written NBD client
 * (test/helpers/nbd-raw.ts), read back through a strict text-format parser
 * (test/helpers/prom.ts). What it proves:
 * - the exported numbers are what happened: bytes the client wrote and read, one FLUSH
 *   histogram sample per FLUSH, commit bytes equal to the objects the commits created, and
 *   store requests, outcomes, retries and bytes equal to an independent count taken beneath
 *   the exported layer (plus the failures injected between the two);
 * - name and label hygiene: every family is baton_*, follows Prometheus naming, has help,
 *   uses only bounded labels with known values, and more traffic at new offsets over new
 *   connections adds no series (a volume adds a fixed number);
 * - the HTTP side: /healthz, /readyz (flags, failing and hanging probes), 404, 405, a
 *   failing collection answered 500 without harming the next scrape, and a clear error for
 *   an address in use.
 */
import test, { type ExecutionContext } from 'ava';
import { randomBytes } from 'node:crypto';
import * as fsp from 'node:fs/promises';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { Registry } from 'prom-client';
import { NbdServer } from '../../nbd/server.js';
import { COMMAND_LABELS, RESULT_LABELS, RequestStats } from '../../nbd/stats.js';
import { BlockCache } from '../../src/cache.js';
import { VolumeExports } from '../../src/exports.js';
import { DurationHistogram, LATENCY_BOUNDS_SECONDS } from '../../src/histogram.js';
import { LocalLeaseManager } from '../../src/lease/local.js';
import { silentLogger } from '../../src/log.js';
import { createMetricsRegistry, hydrationOf, storeLayers, type MetricsSources } from '../../src/metrics.js';
import { MetricsServer, Readiness, parseMetricsAddress } from '../../src/metrics-server.js';
import { FaultyObjectStore, InstrumentedObjectStore, RetryingObjectStore, STORE_OPS, STORE_OUTCOMES } from '../../src/store/decorators.js';
import { openStore } from '../../src/store/open.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { listAll } from '../../src/store/object-store.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import { keys } from '../../src/volume/format.js';
import { CMD, ERRNO, RawClient } from '../helpers/nbd-raw.js';
import { httpGet, parseExposition, total, type Exposition } from '../helpers/prom.js';

const MiB = 1024 * 1024;
const SIZE = 16 * MiB;

async function tempDir(t: ExecutionContext): Promise<string> {
  const dir = await fsp.mkdtemp(path.join(os.tmpdir(), 'baton-metrics-'));
  t.teardown(() => fsp.rm(dir, { recursive: true, force: true }));
  return dir;
}

/**
 * A serving stack as `serve --metrics` builds it, over a memory store with two counters: `wire`
 * (beneath everything: what reached the store) and `counted` (the layer the metrics export,
 * beneath the retry layer), with a fault injector between them.
 */
async function rig(t: ExecutionContext, volumes: string[]) {
  const dir = await tempDir(t);
  const memory = new MemoryObjectStore();
  const wire = new InstrumentedObjectStore(memory);
  const faulty = new FaultyObjectStore(wire, { seed: 1 });
  const counted = new InstrumentedObjectStore(faulty);
  const store = new RetryingObjectStore(counted, { sleep: async () => {}, random: () => 0 });
  const cache = BlockCache.open({ capacityBytes: 64 * MiB });
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => cache });
  for (const v of volumes) await catalog.create(v, SIZE);
  const leases = new LocalLeaseManager(path.join(dir, 'leases'), { ttlMs: 5000 });
  const exports = new VolumeExports(catalog, {
    readOnly: false, idleGraceMs: 60_000, log: silentLogger(), requestStats: true,
    lease: { manager: leases, hostId: 'A', onHeld: 'refuse', waitMs: 0 },
  });
  const server = new NbdServer(exports, { log: silentLogger() });
  exports.setDisconnector((name) => server.disconnectExport(name));
  const socket = path.join(dir, 'nbd.sock');
  await server.listen({ path: socket });
  t.teardown(async () => { await server.close(); await exports.close(); await leases.close(); });
  const sources: MetricsSources = { volumes: exports, store, cache: await cache, nbd: server, info: { hostId: 'A', store: 'memory:', version: 'test' } };
  const registry = createMetricsRegistry(sources);
  const scrape = async (): Promise<Exposition> => parseExposition(await registry.metrics());
  const attach = async (name: string): Promise<RawClient> => {
    const c = await RawClient.connect(socket);
    t.teardown(() => c.destroy());
    await c.handshakeGo(name);
    return c;
  };
  return { memory, wire, faulty, counted, store, exports, leases, registry, sources, scrape, attach };
}

let cookie = 1n;
async function ok(p: Promise<{ error: number }>): Promise<void> {
  const r = await p;
  if (r.error !== 0) throw new Error(`request failed with errno ${r.error}`);
}
const flush = (c: RawClient): Promise<{ error: number }> => c.command({ type: CMD.FLUSH, cookie: cookie++, offset: 0n, length: 0 });
const writeAt = (c: RawClient, off: number, data: Buffer): Promise<{ error: number }> => c.writeAt(cookie++, BigInt(off), data);
const readAt = async (c: RawClient, off: number, len: number): Promise<{ error: number }> => (await c.readAt(cookie++, BigInt(off), len)).reply;

// ------------------------------------------------------------------ the building blocks

test('DurationHistogram: a value on a bound counts in that bucket, past the last in +Inf, negative as 0', (t) => {
  const h = new DurationHistogram([0.001, 0.01, 0.1]);
  for (const v of [0, 0.001, 0.0011, 0.01, 0.05, 0.1, 0.2, 100, -5]) h.observe(v);
  t.deepEqual([...h.counts], [3, 2, 2, 2]); // <=0.001: 0, 0.001, -5; <=0.01: 0.0011, 0.01; <=0.1: 0.05, 0.1; +Inf: 0.2, 100
  t.is(h.count, 9);
  t.is(h.sum, 0 + 0.001 + 0.0011 + 0.01 + 0.05 + 0.1 + 0.2 + 100 + 0);
  t.throws(() => new DurationHistogram([0.1, 0.1]), { instanceOf: RangeError });
  t.is(LATENCY_BOUNDS_SECONDS[0], 0.0005);
  t.is(LATENCY_BOUNDS_SECONDS.at(-1), 0.0005 * 2 ** 16);
});

test('RequestStats: command and errno slots, bytes only on success, FLUSH timed only when it reached the backend', (t) => {
  const s = new RequestStats();
  s.done(CMD.WRITE, 0, 4096, -1);
  s.done(CMD.WRITE, ERRNO.EIO, 4096, -1); // failed: no bytes
  s.done(CMD.READ, 0, 512, -1);
  s.done(CMD.READ, ERRNO.EINVAL, 512, -1);
  s.done(CMD.FLUSH, 0, 0, performance.now());
  s.done(CMD.FLUSH, ERRNO.ESHUTDOWN, 0, -1); // refused before the backend: counted, not timed
  s.done(99, ERRNO.EINVAL, 0, -1); // unknown command
  s.done(CMD.TRIM, 77, 0, -1); // an errno NBD does not define
  s.done(CMD.TRIM, 100_000, 0, -1);
  t.is(s.count('write', 'ok'), 1);
  t.is(s.count('write', 'eio'), 1);
  t.is(s.writeBytes, 4096);
  t.is(s.readBytes, 512);
  t.is(s.count('read', 'einval'), 1);
  t.is(s.count('flush', 'ok'), 1);
  t.is(s.count('flush', 'eshutdown'), 1);
  t.is(s.flushSeconds.count, 1);
  t.is(s.count('other', 'einval'), 1);
  t.is(s.count('trim', 'other'), 2);
  t.is(s.requests.reduce((a, b) => a + b, 0), 9);
  t.is(COMMAND_LABELS[CMD.BLOCK_STATUS], 'block_status');
});

test('hydrationOf: a volume with hydrationStatus has progress, one without has none', (t) => {
  t.is(hydrationOf({}), null);
  t.is(hydrationOf({ hydrationStatus: null }), null);
  t.deepEqual(hydrationOf({ hydrationStatus: { state: 'running', plannedBytes: 10, fetchedBytes: 4, requests: 1 } }), { state: 'running', plannedBytes: 10, fetchedBytes: 4, requests: 1 });
});

// ------------------------------------------------------------------ the numbers are what happened

test('NBD series: bytes written and read, requests by command and result, one flush sample per FLUSH, connections', async (t) => {
  const r = await rig(t, ['v']);
  const c = await r.attach('v');
  const before = await r.scrape();
  t.is(total(before, 'baton_volume_connections', { volume: 'v' }), 1);
  t.is(total(before, 'baton_nbd_write_bytes_total', { volume: 'v' }), 0);
  let written = 0;
  for (const [off, len] of [[0, 4096], [1 * MiB, 65536], [5 * MiB, 512], [9 * MiB, 131072]] as const) {
    await ok(writeAt(c, off, Buffer.alloc(len, 7)));
    written += len;
  }
  for (let i = 0; i < 3; i++) await ok(flush(c));
  await ok(readAt(c, 0, 4096));
  await ok(readAt(c, 1 * MiB, 8192));
  t.is((await readAt(c, SIZE, 4096)).error, ERRNO.EINVAL); // past the end: refused by validation
  const e = await r.scrape();
  const v = { volume: 'v' };
  t.is(total(e, 'baton_nbd_write_bytes_total', v), written);
  t.is(total(e, 'baton_nbd_read_bytes_total', v), 4096 + 8192);
  t.is(total(e, 'baton_nbd_requests_total', { ...v, cmd: 'write', result: 'ok' }), 4);
  t.is(total(e, 'baton_nbd_requests_total', { ...v, cmd: 'read', result: 'ok' }), 2);
  t.is(total(e, 'baton_nbd_requests_total', { ...v, cmd: 'read', result: 'einval' }), 1);
  t.is(total(e, 'baton_nbd_requests_total', { ...v, cmd: 'flush', result: 'ok' }), 3);
  t.is(total(e, 'baton_nbd_requests_total', v), 4 + 3 + 3);
  t.is(total(e, 'baton_nbd_flush_duration_seconds_count', v), 3);
  t.is(total(e, 'baton_nbd_flush_duration_seconds_bucket', { ...v, le: '+Inf' }), 3);
  t.true(total(e, 'baton_nbd_flush_duration_seconds_sum', v) > 0);
  t.is(total(e, 'baton_nbd_connections'), 1);
  await c.disconnect();
  // The session ends (and releases its handle) once the server has seen DISC.
  const deadline = Date.now() + 5000;
  while (Date.now() < deadline && total(await r.scrape(), 'baton_volume_connections', v) !== 0) await new Promise((res) => setTimeout(res, 10));
  t.is(total(await r.scrape(), 'baton_volume_connections', v), 0);
});

test('engine and lease series: commit bytes are the objects the commits created; the lease is the one held', async (t) => {
  const r = await rig(t, ['v']);
  const c = await r.attach('v');
  const vol = r.exports.servedVolumes()[0]!.volume!;
  const commitKeys = async (): Promise<Map<string, number>> => new Map((await listAll(r.memory, keys.volumePrefix(vol.volumeId)))
    .filter((o) => o.key.startsWith(keys.logPrefix(vol.volumeId)) || o.key.includes('/seg/')).map((o) => [o.key, o.size]));
  const keysBefore = await commitKeys();
  const before = await r.scrape();
  await ok(writeAt(c, 0, randomBytes(9 * MiB))); // more than one 8 MiB segment: a segment and an inline tail (random: stored as written, plus frame headers)
  await ok(flush(c));
  await ok(writeAt(c, 12 * MiB, Buffer.alloc(4096, 2)));
  await ok(flush(c));
  const e = await r.scrape();
  const v = { volume: 'v' };
  let created = 0;
  for (const [k, size] of await commitKeys()) if (!keysBefore.has(k)) created += size;
  t.true(created > 9 * MiB);
  t.is(total(e, 'baton_volume_commit_bytes_total', v) - total(before, 'baton_volume_commit_bytes_total', v), created);
  t.is(total(e, 'baton_volume_commits_total', v) - total(before, 'baton_volume_commits_total', v), 2);
  t.is(total(e, 'baton_volume_commit_duration_seconds_count', v) - total(before, 'baton_volume_commit_duration_seconds_count', v), 2);
  t.is(total(e, 'baton_volume_dirty_bytes', v), 0);
  t.is(total(e, 'baton_volume_sealed_bytes', v), 0);
  t.is(total(e, 'baton_volume_size_bytes', v), SIZE);
  t.is(total(e, 'baton_volume_fenced', v), 0);
  t.true(total(e, 'baton_volume_extents', v) >= 2);
  // Unflushed writes show as dirty.
  await ok(writeAt(c, 14 * MiB, Buffer.alloc(8192, 3)));
  t.is(total(await r.scrape(), 'baton_volume_dirty_bytes', v), 8192);
  const held = await r.leases.inspect('v');
  t.is(total(e, 'baton_lease_held', v), 1);
  t.is(total(e, 'baton_lease_token', v), held!.token);
  const left = total(e, 'baton_lease_remaining_seconds', v);
  t.true(left > 0 && left <= 5, String(left));
  // No hydration in this engine: no hydration series (the extension point stays silent).
  t.is(e.samples.filter((s) => s.name.startsWith('baton_volume_hydration_')).length, 0);
});

test('store series equal a count taken beneath them, plus the injected failures; retries and bytes too', async (t) => {
  const r = await rig(t, ['v']);
  r.faulty.failNext(2, 'put'); // the next two puts (the takeover record's) fail before reaching the store
  const c = await r.attach('v');
  await ok(writeAt(c, 0, randomBytes(256 * 1024))); // random: lz4 would store zeroes in a few hundred bytes
  await ok(flush(c));
  await ok(readAt(c, 0, 4096));
  const e = await r.scrape();
  const wire = r.wire.stats();
  const injected: Record<string, number> = { put: 2 };
  for (const op of STORE_OPS) {
    t.is(total(e, 'baton_store_requests_total', { op }), wire[op].requests + (injected[op] ?? 0), op);
    t.is(total(e, 'baton_store_request_duration_seconds_count', { op }), wire[op].requests + (injected[op] ?? 0), op);
    // Failures the store itself gave (absent keys, create-only conflicts) are the wire's errors.
    const storeFailures = STORE_OUTCOMES.filter((o) => o !== 'ok' && o !== 'unavailable').reduce((n, outcome) => n + total(e, 'baton_store_requests_total', { op, outcome }), 0);
    t.is(storeFailures, wire[op].errors, op);
    t.is(total(e, 'baton_store_retries_total', { op }), injected[op] ?? 0, op);
  }
  t.is(total(e, 'baton_store_requests_total', { op: 'put', outcome: 'unavailable' }), 2);
  t.is(total(e, 'baton_store_sent_bytes_total'), wire.put.bytes);
  t.is(total(e, 'baton_store_received_bytes_total'), wire.get.bytes);
  t.true(wire.put.bytes >= 256 * 1024);
  t.is(total(e, 'baton_store_in_flight_requests'), 0);
});

test('cache and GC series come from their stats objects', async (t) => {
  const r = await rig(t, ['v']);
  r.sources.maintenance = { stats: { gcRuns: 3, gcFailures: 1, markedObjects: 5, markedBytes: 500, deletedObjects: 4, deletedBytes: 400, lastGcEndedAt: 1_700_000_000_000, lastGcSeconds: 2.5, compactedBytes: 1234 } };
  const cache = r.sources.cache!;
  cache.insertObject('k', Buffer.alloc(300 * 1024, 1)); // two 256 KiB blocks
  const e = await r.scrape();
  t.is(total(e, 'baton_gc_runs_total', { result: 'ok' }), 3);
  t.is(total(e, 'baton_gc_runs_total', { result: 'failed' }), 1);
  t.is(total(e, 'baton_gc_marked_objects_total'), 5);
  t.is(total(e, 'baton_gc_deleted_bytes_total'), 400);
  t.is(total(e, 'baton_gc_last_run_timestamp_seconds'), 1_700_000_000);
  t.is(total(e, 'baton_gc_last_run_duration_seconds'), 2.5);
  t.is(total(e, 'baton_compaction_rewritten_bytes_total'), 1234);
  t.is(total(e, 'baton_cache_bytes'), cache.stats.cachedBytes);
  t.true(cache.stats.cachedBytes >= 300 * 1024);
  t.is(total(e, 'baton_cache_capacity_bytes'), 64 * MiB);
  t.is(total(e, 'baton_info', { host_id: 'A', store: 'memory:', version: 'test' }), 1);
});

test('cache evictions are counted when a full cache makes room', async (t) => {
  const cache = await BlockCache.open({ capacityBytes: 16 * 256 * 1024 }); // the minimum: 16 blocks
  cache.insertObject('a', Buffer.alloc(16 * 256 * 1024, 1));
  t.is(cache.stats.evictions, 0);
  cache.insertObject('b', Buffer.alloc(3 * 256 * 1024, 2));
  t.is(cache.stats.evictions, 3);
  const e = parseExposition(await createMetricsRegistry({ cache }, { processMetrics: false }).metrics());
  t.is(total(e, 'baton_cache_evictions_total'), 3);
});

test('a file: store opened for metrics keeps its in-place access (else the engine would use its cache); in-place reads are counted by the store and exported as gets', async (t) => {
  const dir = await tempDir(t);
  const store = openStore(`file:${path.join(dir, 'store')}`, { instrument: true });
  t.teardown(() => store.close());
  t.truthy(storeLayers(store).instrumented, 'instrumented beneath the settings check');
  t.truthy(store.local, 'local passed on through the instrumented layer and the settings check');
  t.truthy(store.local!.reads);
  await store.local!.putParts('vol/x/seg/1', [Buffer.alloc(100, 1), Buffer.alloc(28, 2)]);
  const out = Buffer.alloc(16);
  await store.local!.read('vol/x/seg/1', 96, 8, out, 4);
  t.deepEqual([...out.subarray(4, 12)], [1, 1, 1, 1, 2, 2, 2, 2]);
  await t.throwsAsync(store.local!.read('vol/x/absent', 0, 1, out, 0));
  await t.throwsAsync(store.local!.read('vol/x/seg/1', 120, 16, out, 0)); // past the end
  t.deepEqual({ ...store.local!.reads! }, { ok: 1, notFound: 1, error: 1, bytes: 8 });
  const m = storeLayers(store).instrumented!.metrics();
  // The segment, and the settings the store records at its first write (probe.ts).
  t.is(m.put.outcomes.ok, 2);
  t.true(m.put.bytes > 128);
  const e = parseExposition(await createMetricsRegistry({ store }, { processMetrics: false }).metrics());
  t.is(total(e, 'baton_store_requests_total', { op: 'get', outcome: 'ok' }), 1 + m.get.outcomes.ok);
  t.is(total(e, 'baton_store_requests_total', { op: 'get', outcome: 'not_found' }), 1 + m.get.outcomes.not_found);
  t.is(total(e, 'baton_store_requests_total', { op: 'get', outcome: 'error' }), 1);
  t.is(total(e, 'baton_store_received_bytes_total'), 8 + m.get.bytes);
  t.is(total(e, 'baton_store_sent_bytes_total'), m.put.bytes);
  t.is(new InstrumentedObjectStore(new MemoryObjectStore()).local, undefined);
});

// ------------------------------------------------------------------ hygiene

/** Labels baton's own families may carry, and the values each may take (volume: the served names). */
const ALLOWED: Record<string, (v: string, family: string) => boolean> = {
  volume: () => true, // checked against the served names below
  cmd: (v) => (COMMAND_LABELS as readonly string[]).includes(v),
  result: (v, f) => (f === 'baton_gc_runs_total' ? ['ok', 'failed'].includes(v) : (RESULT_LABELS as readonly string[]).includes(v)),
  op: (v) => (STORE_OPS as readonly string[]).includes(v),
  outcome: (v) => (STORE_OUTCOMES as readonly string[]).includes(v),
  le: (v) => v === '+Inf' || Number.isFinite(Number(v)),
  host_id: () => true,
  store: () => true,
  version: () => true,
};

/** prom-client's process metrics (collectDefaultMetrics with our prefix): named by prom-client, checked less strictly. */
const isProcessFamily = (name: string): boolean => name.startsWith('baton_process_') || name.startsWith('baton_nodejs_');

function seriesKeys(e: Exposition): Set<string> {
  return new Set(e.samples.filter((s) => !isProcessFamily(s.name)).map((s) => `${s.name}{${Object.entries(s.labels).sort().map(([k, v]) => `${k}=${v}`).join(',')}}`));
}

test('every family is baton_*, named by Prometheus rules, documented, with bounded labels; traffic adds no series, a volume a fixed number', async (t) => {
  const r = await rig(t, ['a', 'b', 'c', 'd']);
  const a = await r.attach('a');
  const b = await r.attach('b');
  await r.attach('c'); // served, idle
  for (const c of [a, b]) {
    await ok(writeAt(c, 0, Buffer.alloc(4096, 1)));
    await ok(flush(c));
    await ok(readAt(c, 0, 4096));
    t.is((await readAt(c, SIZE, 512)).error, ERRNO.EINVAL);
  }
  const e = parseExposition(await r.registry.metrics());
  t.true(e.types.size > 40, `${e.types.size} families`);
  for (const [name, type] of e.types) {
    t.regex(name, /^baton_[a-z0-9_]+$/, name);
    t.notRegex(name, /__/, name);
    t.truthy(e.help.get(name), `${name} has help`);
    // Base units: seconds and bytes, never ms/us/KiB...
    t.notRegex(name, /_(ms|millis|milliseconds|us|micros|microseconds|ns|nanoseconds|minutes|hours|kb|kib|mb|mib|gb|gib)(_|$)/, name);
    if (isProcessFamily(name)) continue; // prom-client's names (some of its gauges end in _total: nodejs_active_handles_total)
    if (type === 'counter') t.regex(name, /_total$/, `${name}: a counter ends in _total`);
    else t.notRegex(name, /_total$/, `${name}: only counters end in _total`);
    if (type === 'histogram') t.regex(name, /_seconds$/, `${name}: our histograms are durations in seconds`);
    if (/bytes/.test(name)) t.regex(name, /_bytes(_total)?$/, `${name}: bytes are the unit suffix`);
  }
  const served = new Set(['a', 'b', 'c']);
  for (const s of e.samples) {
    const family = [...e.types.keys()].find((f) => s.name === f || (e.types.get(f) === 'histogram' && [`${f}_bucket`, `${f}_sum`, `${f}_count`].includes(s.name)));
    t.truthy(family, `${s.name} belongs to a declared family`);
    if (!family || isProcessFamily(family)) continue;
    for (const [k, v] of Object.entries(s.labels)) {
      t.truthy(ALLOWED[k], `${s.name}: label ${k} is one of the bounded ones`);
      t.true(ALLOWED[k]?.(v, family) ?? false, `${s.name}: ${k}="${v}"`);
      if (k === 'volume') t.true(served.has(v), `${s.name}: volume "${v}" is served`);
      if (k === 'le') t.is(s.name, `${family}_bucket`);
    }
  }
  const perVolume = (x: Exposition, name: string): number => [...seriesKeys(x)].filter((k) => k.includes(`volume=${name},`) || k.includes(`volume=${name}}`)).length;
  const idle = perVolume(e, 'c');
  t.true(idle > 20, `${idle} series per served volume`);
  // An error result adds its series once it happened (read/einval), and nothing else differs.
  t.is(perVolume(e, 'a'), idle + 1);
  t.is(perVolume(e, 'b'), idle + 1);

  // Much more traffic: new offsets, sizes, connections, store keys. Not one series more.
  const before = seriesKeys(e);
  const more = [await r.attach('a'), await r.attach('a'), await r.attach('b')];
  for (let i = 0; i < 60; i++) {
    const c = more[i % more.length]!;
    const off = ((i * 7919) % 4000) * 4096;
    await ok(writeAt(c, off, Buffer.alloc(512 * (1 + (i % 8)), i)));
    await ok(readAt(c, off, 512));
    if (i % 10 === 0) await ok(flush(c));
  }
  await r.store.put(`unrelated/${Date.now()}`, Buffer.alloc(1));
  await r.store.get('unrelated/none').catch(() => {}); // a not_found outcome: a bounded label value, once
  const after = seriesKeys(await r.scrape());
  t.deepEqual([...after].filter((k) => !before.has(k)), ['baton_store_requests_total{op=get,outcome=not_found}'].filter((k) => !before.has(k)));
  t.deepEqual([...before].filter((k) => !after.has(k)), []);

  // A fourth served volume adds exactly what an idle one has.
  await r.attach('d');
  const withD = seriesKeys(await r.scrape());
  t.is(withD.size - after.size, idle);
  t.is(perVolume(await r.scrape(), 'd'), idle);
});

// ------------------------------------------------------------------ the HTTP side

async function serveMetrics(t: ExecutionContext, registry: Registry, readiness: Readiness): Promise<number> {
  const server = new MetricsServer(registry, readiness, silentLogger());
  t.teardown(() => server.close());
  return (await server.listen('127.0.0.1', 0)).port;
}

test('/healthz, /readyz, /metrics; wrong paths 404, other methods 405', async (t) => {
  const readiness = new Readiness();
  readiness.set('store', true, 'memory:');
  readiness.set('listening', false, 'NBD is not listening yet');
  const port = await serveMetrics(t, createMetricsRegistry({}, { processMetrics: false }), readiness);
  const h = await httpGet(port, '/healthz');
  t.is(h.status, 200);
  t.is(h.body, 'ok\n');
  let ready = await httpGet(port, '/readyz');
  t.is(ready.status, 503);
  t.deepEqual(JSON.parse(ready.body), { ready: false, checks: { store: { ok: true, detail: 'memory:' }, listening: { ok: false, detail: 'NBD is not listening yet' } } });
  readiness.set('listening', true, 'unix');
  ready = await httpGet(port, '/readyz');
  t.is(ready.status, 200);
  t.is((JSON.parse(ready.body) as { ready: boolean }).ready, true);
  const m = await httpGet(port, '/metrics?x=1');
  t.is(m.status, 200);
  t.regex(m.body, /^# HELP baton_/m);
  for (const p of ['/', '/metric', '/metrics/', '/healthz/x', '/favicon.ico']) t.is((await httpGet(port, p)).status, 404, p);
  t.is((await httpGet(port, '/metrics', 'POST')).status, 405);
  const head = await httpGet(port, '/metrics', 'HEAD');
  t.is(head.status, 200);
  t.is(head.body, '');
});

test('/readyz: a failing probe and a probe that hangs each make it 503 with the reason; no check at all is not ready', async (t) => {
  t.false((await new Readiness().evaluate()).ready);
  const readiness = new Readiness();
  readiness.set('store', true);
  let fail = true;
  readiness.probe('lease', async () => { if (fail) throw new Error('cannot reach Redis at redis://x'); return 'redis'; });
  let r = await readiness.evaluate(100);
  t.false(r.ready);
  t.deepEqual(r.checks['lease'], { ok: false, detail: 'cannot reach Redis at redis://x' });
  fail = false;
  r = await readiness.evaluate(100);
  t.true(r.ready);
  t.deepEqual(r.checks['lease'], { ok: true, detail: 'redis' });
  readiness.probe('lease', () => new Promise(() => {}));
  const t0 = Date.now();
  r = await readiness.evaluate(100);
  t.false(r.ready);
  t.regex(r.checks['lease']!.detail, /no answer within 100 ms/);
  t.true(Date.now() - t0 < 2000);
});

test('/metrics answers 500 when collecting fails, and the next scrape works', async (t) => {
  let broken = true;
  const src: MetricsSources = { volumes: { servedVolumes: () => { if (broken) throw new Error('boom'); return []; } } };
  const readiness = new Readiness();
  readiness.set('x', true);
  const port = await serveMetrics(t, createMetricsRegistry(src, { processMetrics: false }), readiness);
  const bad = await httpGet(port, '/metrics');
  t.is(bad.status, 500);
  t.regex(bad.body, /boom/);
  t.is((await httpGet(port, '/healthz')).status, 200);
  broken = false;
  await new Promise((res) => setImmediate(res)); // the failed scrape's snapshot is dropped after its turn
  t.is((await httpGet(port, '/metrics')).status, 200);
});

test('listening on an address in use fails with a clear error; parseMetricsAddress', async (t) => {
  const blocker = net.createServer();
  await new Promise<void>((res) => blocker.listen(0, '127.0.0.1', res));
  t.teardown(() => blocker.close());
  const port = (blocker.address() as net.AddressInfo).port;
  const server = new MetricsServer(createMetricsRegistry({}, { processMetrics: false }), new Readiness(), silentLogger());
  await t.throwsAsync(server.listen('127.0.0.1', port), { message: new RegExp(`--metrics 127\\.0\\.0\\.1:${port}: cannot listen: the address is in use`) });
  t.deepEqual(parseMetricsAddress('9464'), { host: '127.0.0.1', port: 9464 });
  t.deepEqual(parseMetricsAddress('0.0.0.0:9464'), { host: '0.0.0.0', port: 9464 });
  t.deepEqual(parseMetricsAddress('[::1]:9464'), { host: '::1', port: 9464 });
  t.deepEqual(parseMetricsAddress('localhost:0'), { host: 'localhost', port: 0 });
  for (const bad of ['', 'x', ':9464', '70000', '1.2.3.4:', 'a:b', '9464 9465']) t.throws(() => parseMetricsAddress(bad), { message: /--metrics must be PORT or HOST:PORT/ }, bad);
});

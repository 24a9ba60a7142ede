/**
 * The served-volume lifecycle of VolumeExports (src/exports.ts): opening, serving, draining,
 * closed, fenced. Object-store volumes over the in-memory store (wrapped where a test needs
 * to slow, fail or count requests), local lease files in a temp directory, and a disconnector
 * that plays the NBD server: it releases the handles of the volume it is told to disconnect,
 * as the sessions do when their connections close.
 */
import test, { type ExecutionContext } from 'ava';
import * as fsp from 'node:fs/promises';
import * as os from 'node:os';
import * as path from 'node:path';
import { performance } from 'node:perf_hooks';
import { pino } from 'pino';
import type { ExportHandle } from '../../nbd/backend.js';
import { BlockCache } from '../../src/cache.js';
import { FencedError, LeaseHeldError, NotFoundError, ShutdownError, StoreUnavailableError } from '../../src/errors.js';
import { VolumeExports, type OnHeld } from '../../src/exports.js';
import type { Lease, LeaseManager, LeaseStatus } from '../../src/lease/lease.js';
import { LocalLeaseManager } from '../../src/lease/local.js';
import { silentLogger, type Logger } from '../../src/log.js';
import { FaultyObjectStore, InstrumentedObjectStore } from '../../src/store/decorators.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { listAll, type ListOptions, type ObjectInfo, type ObjectStore } from '../../src/store/object-store.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import { keys } from '../../src/volume/format.js';
import type { Volume } from '../../src/volume/volume.js';
import { FileCatalog, MemoryCatalog } from '../../src/volumes.js';

const MiB = 1024 * 1024;
const SIZE = 16 * MiB;
const fill = (n: number, byte: number): Buffer => Buffer.alloc(n, byte);
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** Waits for a condition; returns whether it held (the caller asserts). */
async function until(cond: () => boolean | Promise<boolean>, timeoutMs = 5000, stepMs = 5): Promise<boolean> {
  const end = performance.now() + timeoutMs;
  while (performance.now() < end) {
    if (await cond()) return true;
    await sleep(stepMs);
  }
  return cond();
}

async function tempDir(t: ExecutionContext): Promise<string> {
  const dir = await fsp.mkdtemp(path.join(os.tmpdir(), 'baton-exports-'));
  t.teardown(() => fsp.rm(dir, { recursive: true, force: true }));
  return dir;
}

interface LogLine { level: number; msg: string; volume?: string; [k: string]: unknown }

/** A pino logger whose lines the test can read (and wait for). */
function capturingLogger(): { log: Logger; lines: LogLine[]; next: (pred: (l: LogLine) => boolean) => Promise<LogLine> } {
  const lines: LogLine[] = [];
  const waiters: { pred: (l: LogLine) => boolean; resolve: (l: LogLine) => void }[] = [];
  const stream = {
    write(s: string): void {
      const l = JSON.parse(s) as LogLine;
      lines.push(l);
      for (const w of [...waiters]) if (w.pred(l)) { waiters.splice(waiters.indexOf(w), 1); w.resolve(l); }
    },
  };
  const log = pino({ level: 'debug' }, stream);
  const next = (pred: (l: LogLine) => boolean): Promise<LogLine> => {
    const seen = lines.find(pred);
    if (seen) return Promise.resolve(seen);
    return new Promise((resolve) => waiters.push({ pred, resolve }));
  };
  return { log, lines, next };
}

/** Parks listings of a volume's log until `open()`: a slow recovery (a long log to replay). */
class GatedStore implements ObjectStore {
  readonly description: string;
  private gate: { promise: Promise<void>; open: () => void } | null = null;
  /** Resolves when a listing is parked at the gate. */
  parked!: Promise<void>;
  private onParked: () => void = () => {};

  constructor(private readonly inner: ObjectStore) { this.description = inner.description; }

  /** Park log listings from now on (the store itself stays usable). */
  shut(): void {
    let open!: () => void;
    const promise = new Promise<void>((r) => { open = r; });
    this.gate = { promise, open };
    this.parked = new Promise((r) => { this.onParked = r; });
  }

  open(): void { const g = this.gate; this.gate = null; g?.open(); }

  get(key: string, range?: { offset: number; length: number }): Promise<Buffer> { return this.inner.get(key, range); }
  put(key: string, body: Buffer, o?: Parameters<ObjectStore['put']>[2]): Promise<void> { return this.inner.put(key, body, o); }
  head(key: string): ReturnType<ObjectStore['head']> { return this.inner.head(key); }
  delete(key: string): Promise<void> { return this.inner.delete(key); }
  close(): Promise<void> { this.open(); return this.inner.close(); }
  async *list(prefix: string, o?: ListOptions): AsyncIterable<ObjectInfo> {
    if (this.gate && /^vol\/[^/]+\/log\/$/.test(prefix)) {
      this.onParked();
      await this.gate.promise;
    }
    yield* this.inner.list(prefix, o);
  }
}

/** A lease manager whose leases record what they publish (setStatus). */
function recordingLeases(m: LeaseManager, statuses: LeaseStatus[]): LeaseManager {
  const wrapLease = (l: Lease): Lease => new Proxy(l, {
    get(target, prop) {
      if (prop === 'setStatus') return (s: LeaseStatus) => { statuses.push(s); target.setStatus(s); };
      const v = Reflect.get(target, prop) as unknown;
      return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
    },
  });
  return new Proxy(m, {
    get(target, prop) {
      if (prop === 'acquire') return async (...a: Parameters<LeaseManager['acquire']>) => wrapLease(await target.acquire(...a));
      const v = Reflect.get(target, prop) as unknown;
      return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
    },
  });
}

interface SetupOptions {
  store?: (inner: MemoryObjectStore) => ObjectStore;
  hostId?: string;
  onHeld?: OnHeld;
  idleGraceMs?: number;
  statuses?: LeaseStatus[];
  volumes?: string[];
}

async function setup(t: ExecutionContext, o: SetupOptions = {}) {
  const dir = await tempDir(t);
  const leases = new LocalLeaseManager(dir, { ttlMs: 3000 });
  t.teardown(() => leases.close());
  const inner = new MemoryObjectStore();
  const store = o.store ? o.store(inner) : inner;
  const cache = BlockCache.open({ capacityBytes: 64 * MiB });
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => cache });
  for (const v of o.volumes ?? ['v']) await catalog.create(v, SIZE);
  const captured = capturingLogger();
  const manager = o.statuses ? recordingLeases(leases, o.statuses) : leases;
  const exports = new VolumeExports(catalog, {
    readOnly: false, idleGraceMs: o.idleGraceMs ?? 60_000, log: captured.log,
    lease: { manager, hostId: o.hostId ?? 'A', onHeld: o.onHeld ?? 'refuse', waitMs: 2000 },
  });
  t.teardown(() => exports.close());
  // Plays the NBD server: disconnecting a volume closes its sessions, which release their handles.
  const handles = new Set<ExportHandle>();
  const disconnected: string[] = [];
  exports.setDisconnector((name) => {
    disconnected.push(name);
    for (const h of [...handles]) if (h.name === name) { handles.delete(h); h.release(); }
  });
  const attach = async (name: string): Promise<ExportHandle> => {
    const h = await exports.open(name);
    handles.add(h);
    return h;
  };
  return { leases, inner, store, catalog, exports, attach, disconnected, handles, ...captured };
}

const volumeOf = (h: ExportHandle): Volume => h.backend as Volume;

// ------------------------------------------------------------------ 17.1: handoff / loss while opening

test('17.1: a handoff asked for while the volume is opening: the client waiting for the open gets an error, never a handle, and the lease goes to the new host', async (t) => {
  let gated!: GatedStore;
  const { exports, leases, inner, catalog } = await setup(t, { store: (s) => (gated = new GatedStore(s)) });
  const id = (await catalog.record('v')).id;
  gated.shut();
  const waiting = exports.open('v').then((h) => h, (err: unknown) => err);
  await gated.parked; // lease held, recovery parked at the log listing
  t.is(exports.stateOf('v'), 'opening');
  await leases.requestHandoff('v', 'B');
  // With the fix the waiting open fails while recovery is still parked; give it time to notice.
  await until(() => exports.stateOf('v') !== 'opening', 5000);
  gated.open();
  const r = await waiting;
  t.true(r instanceof ShutdownError, `the waiting client gets an error, not a handle (got ${r instanceof Error ? r.message : 'a handle'})`);
  t.regex((r as Error).message, /handed over to B/);
  t.true(await until(() => exports.stateOf('v') === null), 'the volume is gone from this host');
  t.deepEqual((await listAll(inner, keys.logPrefix(id))).length, 0, 'the aborted open wrote no takeover record');
  t.deepEqual((await listAll(inner, keys.checkpointPrefix(id))).length, 0, 'and no checkpoint');
  const b = await leases.acquire('v', 'B'); // reserved for B: it acquires at once
  t.is(b.holder, 'B');
  await b.release();
});

test('17.1: a lease lost while the volume is opening: the waiting client gets an error, and the next attach opens it anew', async (t) => {
  let gated!: GatedStore;
  const { exports, leases } = await setup(t, { store: (s) => (gated = new GatedStore(s)) });
  gated.shut();
  const waiting = exports.open('v').then((h) => h, (err: unknown) => err);
  await gated.parked;
  t.true(await leases.revoke('v'));
  await until(() => exports.stateOf('v') !== 'opening', 5000);
  gated.open();
  const r = await waiting;
  t.true(r instanceof ShutdownError, `the waiting client gets an error, not a handle (got ${r instanceof Error ? r.message : 'a handle'})`);
  t.regex((r as Error).message, /lease lost/);
  t.true(await until(() => exports.stateOf('v') === null));
  const h = await exports.open('v');
  t.false(volumeOf(h).isFenced, 'a fresh volume');
  await h.backend.write(0, fill(4096, 1), false);
  await h.backend.flush();
  h.release();
});

test('17.1: a shutdown while the volume is opening: the waiting client gets an error, and nothing is left open or held', async (t) => {
  let gated!: GatedStore;
  const { exports, leases } = await setup(t, { store: (s) => (gated = new GatedStore(s)) });
  gated.shut();
  const waiting = exports.open('v').then((h) => h, (err: unknown) => err);
  await gated.parked;
  const closing = exports.close();
  const r = await waiting; // fails at once, while the recovery is still parked
  t.true(r instanceof ShutdownError, `the waiting client gets an error, not a handle (got ${r instanceof Error ? r.message : 'a handle'})`);
  t.regex((r as Error).message, /shutting down/);
  gated.open();
  await closing;
  t.is(exports.stateOf('v'), null);
  t.is(await leases.inspect('v'), null, 'the lease taken for the open is released');
});

// ------------------------------------------------------------------ 9.6: a volume that fences itself

test('9.6: a served volume that fences itself is dropped: clients disconnected, closed, lease released, error logged; the next attach recovers it from the store', async (t) => {
  const { exports, leases, catalog, attach, disconnected, lines } = await setup(t);
  const h1 = await attach('v');
  await h1.backend.write(0, fill(4096, 0x11), false);
  await h1.backend.flush();
  // Another writer takes the next log position (what a landed-late retry looks like to the engine).
  const other = (await catalog.open('v', { readOnly: false })).volume!;
  await other.takeover(100);
  await other.write(0, fill(4096, 0x22), false);
  await other.flush();
  await other.close();

  await h1.backend.write(4096, fill(4096, 0x33), false);
  await t.throwsAsync(h1.backend.flush(), { instanceOf: FencedError });
  t.true(await until(() => exports.stateOf('v') === null), 'the fenced volume is dropped');
  t.deepEqual(disconnected, ['v'], 'its clients were disconnected');
  t.is(await leases.inspect('v'), null, 'its lease was released');
  t.true(lines.some((l) => l.level === 50 && /fenced itself/.test(l.msg)), 'logged as an error');
  t.true(lines.some((l) => /fenced volume closed/.test(l.msg)));

  const h2 = await attach('v');
  t.not(h2.backend, h1.backend, 'opened anew');
  t.true((await h2.backend.read(0, 4096)).equals(fill(4096, 0x22)), 'recovered what landed in the store');
  await h2.backend.write(8192, fill(4096, 0x44), false);
  await h2.backend.flush();
  h2.release();
});

// ------------------------------------------------------------------ 9.4: removed and created again

test('9.4: a served volume removed and created again under its name: the next attach drops the old one and gets the new, empty volume', async (t) => {
  const { exports, leases, catalog, attach, disconnected } = await setup(t);
  const h1 = await attach('v');
  const oldId = volumeOf(h1).volumeId;
  await h1.backend.write(0, fill(4096, 0x11), false);
  await h1.backend.flush();
  const oldToken = (await leases.inspect('v'))!.token;

  await catalog.remove('v');
  await catalog.create('v', SIZE);

  const h2 = await attach('v');
  t.deepEqual(disconnected, ['v'], 'the old volume\'s clients were disconnected');
  t.true(volumeOf(h1).isFenced, 'the old volume writes nothing more');
  await t.throwsAsync(h1.backend.write(0, fill(4096, 0x55), false));
  t.not(volumeOf(h2).volumeId, oldId, 'the new volume is served');
  t.true((await h2.backend.read(0, 4096)).equals(fill(4096, 0)), 'it is empty');
  await h2.backend.write(0, fill(4096, 0x66), false);
  await h2.backend.flush();
  t.true((await leases.inspect('v'))!.token > oldToken, 'under a new lease');
  t.is(exports.stateOf('v'), 'serving');
  h2.release();

  // Removed and not created again: the next attach says so.
  await catalog.remove('v');
  await t.throwsAsync(exports.open('v'), { instanceOf: NotFoundError });
  t.true(await until(() => exports.stateOf('v') === null));
  t.is(await leases.inspect('v'), null, 'and its lease is not kept');
});

// ------------------------------------------------------------------ smaller items of issue 9

test('9 (smaller): a failed takeover closes the volume without writing a checkpoint, and releases the lease', async (t) => {
  let faulty!: FaultyObjectStore;
  const { exports, leases, catalog, inner } = await setup(t, { store: (s) => (faulty = new FaultyObjectStore(s)) });
  const id = (await catalog.record('v')).id;
  // A writer that crashed: log records after the last checkpoint, so a clean close would checkpoint.
  const w = (await catalog.open('v', { readOnly: false })).volume!;
  await w.takeover(1);
  await w.write(0, fill(4096, 1), false);
  await w.flush();
  w.fenceLocally('test: the writer crashed');
  await w.close();
  t.is((await listAll(inner, keys.checkpointPrefix(id))).length, 0);

  faulty.failNext(1, 'put'); // the takeover record's put
  await t.throwsAsync(exports.open('v'), { instanceOf: StoreUnavailableError });
  t.true(await until(() => exports.stateOf('v') === null));
  t.is((await listAll(inner, keys.checkpointPrefix(id))).length, 0, 'no checkpoint written without a takeover');
  t.is(await leases.inspect('v'), null, 'the lease is released');
});

test('9 (smaller): a failed final flush at shutdown is tried once, writes no checkpoint, is logged, and the lease is released', async (t) => {
  let faulty!: FaultyObjectStore;
  const { exports, leases, catalog, inner, lines } = await setup(t, { store: (s) => (faulty = new FaultyObjectStore(s)) });
  const id = (await catalog.record('v')).id;
  const h = await exports.open('v');
  await h.backend.write(0, fill(4096, 1), false);
  h.release(); // the sessions ended; the idle grace (60 s) has not run out
  const cps = (await listAll(inner, keys.checkpointPrefix(id))).length;
  faulty.setFaults({ errorRate: 1, ops: ['put'] });
  faulty.resetCounters();
  await exports.close();
  t.is(faulty.counters().put.requests, 1, 'one attempt: close() does not flush again after the final flush failed');
  t.is((await listAll(inner, keys.checkpointPrefix(id))).length, cps, 'no checkpoint');
  t.true(lines.some((l) => l.level === 50 && /final flush at shutdown failed/.test(l.msg)));
  t.is(await leases.inspect('v'), null, 'released: the unflushed writes die with the process either way');
});

test('9 (smaller): after a refused handoff the status timer runs again', async (t) => {
  const statuses: LeaseStatus[] = [];
  let faulty!: FaultyObjectStore;
  const { exports, leases, attach, next } = await setup(t, { store: (s) => (faulty = new FaultyObjectStore(s)), statuses });
  const h = await attach('v');
  await h.backend.write(0, fill(4096, 1), false);
  faulty.setFaults({ errorRate: 1, ops: ['put'] }); // the handoff's flush fails
  let atRefusal = -1;
  // Counted when the line is written, just before the volume is back to serving.
  const refused = next((l) => { const m = /handoff refused/.test(l.msg); if (m) atRefusal = statuses.length; return m; });
  await leases.requestHandoff('v', 'B');
  await refused;
  faulty.setFaults({ errorRate: 0 });
  await Promise.resolve();
  t.is(exports.stateOf('v'), 'serving', 'the volume keeps serving its unflushed data');
  t.true(statuses.length > atRefusal, 'status published again at once');
  const n = statuses.length;
  t.true(await until(() => statuses.length > n, 5000), 'and again by the timer');
  t.is(statuses[statuses.length - 1]!.dirtyBytes, 4096);
  const h2 = await attach('v');
  t.true((await h2.backend.read(0, 4096)).equals(fill(4096, 1)));
  await h2.backend.flush();
  h2.release();
});

test('9 (smaller): a client attaching on this host during a handoff waits for it, then goes through the normal acquire', async (t) => {
  let faulty!: FaultyObjectStore;
  const { exports, leases, attach } = await setup(t, { store: (s) => (faulty = new FaultyObjectStore(s)) });
  const h = await attach('v');
  await h.backend.write(0, fill(4096, 1), false);
  faulty.hang(); // the handoff's flush waits for the store
  await leases.requestHandoff('v', 'B');
  t.true(await until(() => exports.stateOf('v') === 'draining'), 'handoff in progress');
  t.true(await until(() => faulty.pendingHung > 0), 'its flush is waiting for the store');
  const attaching = exports.open('v').then((x) => x, (err: unknown) => err);
  await sleep(50);
  t.is(exports.stateOf('v'), 'draining', 'still handing off');
  faulty.unhang();
  const r = await attaching;
  t.true(r instanceof LeaseHeldError, `refused by the lease, after the handoff (got ${r instanceof Error ? r.message : 'a handle'})`);
  t.regex((r as Error).message, /handed over to B/);
  t.notRegex((r as Error).message, /already served under this host id/);
  const b = await leases.acquire('v', 'B');
  await b.release();
});

test('9 (smaller): with --on-held wait, a client attaching during a handoff to another host waits for the lease and then gets the volume', async (t) => {
  let faulty!: FaultyObjectStore;
  const { exports, leases, attach } = await setup(t, { store: (s) => (faulty = new FaultyObjectStore(s)), onHeld: 'wait' });
  const h = await attach('v');
  await h.backend.write(0, fill(4096, 7), false);
  faulty.hang();
  await leases.requestHandoff('v', 'B');
  t.true(await until(() => exports.stateOf('v') === 'draining'));
  const attaching = exports.open('v');
  faulty.unhang();
  // The lease is reserved for B; B takes it and gives it back; our waiting attach then gets it.
  t.true(await until(async () => (await leases.inspect('v'))?.reservedFor === 'B'));
  const b = await leases.acquire('v', 'B');
  await b.release();
  const h2 = await attaching;
  t.true((await h2.backend.read(0, 4096)).equals(fill(4096, 7)), 'the handed-off data, flushed');
  h2.release();
});

// ------------------------------------------------------------------ 17.6 / 17.8: cheap INFO and LIST

test('17.6: info() of a volume not served here costs one GET and one listing of its attribute records (a snapshot: one GET): no put, no lease, nothing opened', async (t) => {
  let counted!: InstrumentedObjectStore;
  const { exports, leases, catalog } = await setup(t, { store: (s) => (counted = new InstrumentedObjectStore(s)) });
  await catalog.snapshot('v', 'snap');
  counted.reset();
  const i = await exports.info('v');
  t.deepEqual(i, { name: 'v', size: SIZE, readOnly: false, description: 'baton volume v, 16 MiB' });
  const st = counted.stats();
  t.is(st.put.requests, 0, 'no store write');
  // Its size as `baton resize` left it: the record's, or its newest attribute record's
  // (attrs/<id>/, docs/rfc-lifecycle.md). The listing is of that prefix: usually empty.
  t.is(st.list.requests, 1, 'one listing (its attribute records)');
  t.is(st.total.requests, 2, 'one GET, one listing');
  t.is(await leases.inspect('v'), null, 'no lease taken');
  t.is(exports.stateOf('v'), null, 'nothing opened');
  counted.reset();
  t.like(await exports.info('v@snap'), { name: 'v@snap', readOnly: true, description: 'baton snapshot v@snap, 16 MiB' });
  t.is(counted.stats().total.requests, 1, 'a snapshot never changes size: one GET');
  await t.throwsAsync(exports.info('nope'), { instanceOf: NotFoundError });
  // Served here: answered from what is open, no request at all.
  const h = await exports.open('v');
  counted.reset();
  t.like(await exports.info('v'), { size: SIZE, readOnly: false });
  t.is(counted.stats().total.requests, 0);
  h.release();
});

test('17.8: list() and the empty export name cost one catalog listing, however many volumes and objects', async (t) => {
  let counted!: InstrumentedObjectStore;
  const { exports, catalog } = await setup(t, { store: (s) => (counted = new InstrumentedObjectStore(s)), volumes: ['a', 'b', 'c'] });
  for (const n of ['a', 'b', 'c']) {
    const h = await exports.open(n);
    await h.backend.write(0, fill(MiB, 1), false);
    await h.backend.flush();
    h.release();
  }
  await catalog.snapshot('a', 's1');
  counted.reset();
  const l = await exports.list();
  t.deepEqual(l, [
    { name: 'a', description: 'baton volume a' },
    { name: 'a@s1', description: 'baton snapshot a@s1' },
    { name: 'b', description: 'baton volume b' },
    { name: 'c', description: 'baton volume c' },
  ]);
  let st = counted.stats();
  t.is(st.list.requests, 1, 'one listing');
  t.is(st.total.requests, 1, 'and nothing else: no GET, no per-volume listing');
  t.is(st.list.items, 4, 'of the catalog records only');
  counted.reset();
  const err = await t.throwsAsync(exports.open(''), { instanceOf: NotFoundError });
  t.regex(err!.message, /there are 4 volumes.*a, a@s1, b, c/);
  st = counted.stats();
  t.is(st.total.requests, 1, 'the empty export name: one listing too');
});

test('names(): the local catalogs list names without reading records', async (t) => {
  const mem = new MemoryCatalog();
  await mem.create('b', 4096);
  await mem.create('a', 4096);
  t.deepEqual(await mem.names(), ['a', 'b']);
  const dir = await tempDir(t);
  const file = new FileCatalog(dir);
  t.deepEqual(await file.names(), [], 'no volumes directory yet');
  await file.create('x', 4096);
  await fsp.mkdir(path.join(dir, 'volumes', 'half-made')); // no record: not a volume
  t.deepEqual(await file.names(), ['x']);
});

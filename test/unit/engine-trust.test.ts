/**
 * Regression tests for the engine holes of the "every promise holds under faults" issue:
 * each scenario is played with the real Volume, catalog and GC over the in-memory store,
 * with store wrappers that stall, lose or delay exactly the request the scenario needs.
 */
import test from 'ava';
import * as v8 from 'node:v8';
import * as vm from 'node:vm';
import { BlockCache } from '../../src/cache.js';
import { StoreUnavailableError, FencedError, CorruptError, PreconditionFailedError } from '../../src/errors.js';
import { silentLogger } from '../../src/log.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { listAll, type ByteRange, type ListOptions, type ObjectHead, type ObjectInfo, type ObjectStore, type PutOptions } from '../../src/store/object-store.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import { encodeLogRecord, keys, type LogHeader } from '../../src/volume/format.js';
import { collectGarbage } from '../../src/volume/gc.js';
import { Volume } from '../../src/volume/volume.js';

const MiB = 1024 * 1024;
const M = 1000;
const G = 2 * M;
const fill = (n: number, byte: number) => Buffer.alloc(n, byte);

/** A store whose requests a test can intercept one by one. */
class HookedStore implements ObjectStore {
  onGet: ((key: string, range: ByteRange | undefined, next: () => Promise<Buffer>) => Promise<Buffer>) | null = null;
  onPut: ((key: string, body: Buffer, o: PutOptions | undefined, next: () => Promise<void>) => Promise<void>) | null = null;
  onHead: ((key: string, next: () => Promise<ObjectHead | null>) => Promise<ObjectHead | null>) | null = null;
  puts = 0;
  constructor(readonly inner: ObjectStore) {}
  get description(): string { return this.inner.description; }
  get(key: string, range?: ByteRange): Promise<Buffer> {
    const next = () => this.inner.get(key, range);
    return this.onGet ? this.onGet(key, range, next) : next();
  }
  put(key: string, body: Buffer, o?: PutOptions): Promise<void> {
    this.puts++;
    const next = () => this.inner.put(key, body, o);
    return this.onPut ? this.onPut(key, body, o, next) : next();
  }
  head(key: string): Promise<ObjectHead | null> {
    const next = () => this.inner.head(key);
    return this.onHead ? this.onHead(key, next) : next();
  }
  list(prefix: string, o?: ListOptions): AsyncIterable<ObjectInfo> { return this.inner.list(prefix, o); }
  delete(key: string): Promise<void> { return this.inner.delete(key); }
  close(): Promise<void> { return Promise.resolve(); }
}

function gate(): { wait: Promise<void>; open: () => void } {
  let open!: () => void;
  const wait = new Promise<void>((r) => { open = r; });
  return { wait, open };
}

function setup(volumeOpts: Record<string, number> = {}) {
  let now = Date.parse('2026-01-01T00:00:00Z');
  const mem = new MemoryObjectStore('memory:', () => new Date(now));
  const store = new HookedStore(mem);
  const cacheFor = () => BlockCache.open({ capacityBytes: 64 * MiB });
  const shared = cacheFor();
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => shared, volume: { maxOperationMs: M, segmentBytes: MiB, checkpointEvery: 4, ...volumeOpts } });
  /** A writer on its own "host": its own cold cache, the given lease token. */
  const host = async (name: string, token: number | null, opts: Record<string, number> = {}): Promise<Volume> => {
    const rec = await catalog.record(name);
    const v = await Volume.open(rec, { store, cache: await cacheFor(), log: silentLogger(), readOnly: false, maxOperationMs: M, segmentBytes: MiB, checkpointEvery: 4, ...volumeOpts, ...opts });
    if (token !== null) await v.takeover(token);
    return v;
  };
  const view = async (name: string): Promise<Volume> => Volume.open(await catalog.record(name), { store, cache: await cacheFor(), log: silentLogger(), readOnly: true, maxOperationMs: M });
  const advance = (ms: number): void => { now += ms; };
  const gcTwice = async () => {
    advance(G + 1);
    await collectGarbage(catalog, { graceMs: G, maxOperationMs: M });
    advance(G + 1);
    return collectGarbage(catalog, { graceMs: G, maxOperationMs: M });
  };
  return { mem, store, catalog, host, view, gcTwice };
}

test('9.1: a READ that fails leaves its buffer alone: a slower piece still in flight never writes into it after the error', async (t) => {
  const { store, catalog, host } = setup();
  await catalog.create('v', 4 * MiB);
  const w = await host('v', 1);
  await w.write(0, fill(64 * 1024, 0xaa), false);
  await w.flush(); // record 2 holds X
  await w.write(64 * 1024, fill(64 * 1024, 0xbb), false);
  await w.flush(); // record 3 holds Y
  await w.close();
  const r = await host('v', 2); // a cold cache: both pieces come from the store
  const slowY = gate();
  let yDone = false;
  store.onGet = async (key, range, next) => {
    if (key === keys.log(r.volumeId, 2)) throw new StoreUnavailableError('GET of X failed');
    if (key === keys.log(r.volumeId, 3)) { await slowY.wait; const b = await next(); yDone = true; return b; }
    return next();
  };
  const into = fill(128 * 1024, 0x55);
  setTimeout(slowY.open, 50); // Y's bytes arrive 50 ms after X failed
  const err = await t.throwsAsync(r.read(0, 128 * 1024, into));
  t.true(err instanceof StoreUnavailableError);
  const atError = Buffer.from(into);
  for (let i = 0; i < 50 && !yDone; i++) await new Promise((res) => setTimeout(res, 5));
  await new Promise((res) => setTimeout(res, 20));
  t.true(yDone, 'the slow GET finished');
  t.true(into.equals(atError), 'nothing wrote into the buffer after the READ failed');
});

test('9.2: a stale writer that re-creates a log position GC freed, and checkpoints it, is never seen by recovery or by an old view', async (t) => {
  const { store, catalog, host, view, gcTwice } = setup({ checkpointEvery: 1 });
  await catalog.create('v', 4 * MiB);
  const a = await host('v', 1); // record 1: A's takeover
  await a.write(0, fill(4096, 0x01), false);
  await a.flush(); // record 2
  const oldView = await view('v'); // a reader on another host, at position 2, that then goes quiet
  t.is((await oldView.read(0, 1))[0], 0x01);

  // A passes its checks and stalls just before the create-only put of position 3.
  const stalled = gate();
  const resumed = gate();
  let aPut = false;
  store.onPut = async (key, _b, o, next) => {
    if (!aPut && key === keys.log(a.volumeId, 3) && o?.ifNoneMatch) { aPut = true; resumed.open(); await stalled.wait; }
    return next();
  };
  await a.write(4096, fill(4096, 0x11), false);
  const aFlush = a.flush();
  await resumed.wait;
  store.onPut = null;

  // B takes over at position 3 and closes (checkpoint 3); C takes over at 4 and commits 5.
  const b = await host('v', 2);
  await b.close();
  const c = await host('v', 3, { checkpointEvery: 1000 }); // B's checkpoint 3 stays the newest
  await c.write(8192, fill(4096, 0x22), false);
  await c.flush();
  // GC frees position 3 (covered by a checkpoint, not the newest record).
  await gcTwice();
  t.false((await listAll(store, keys.logPrefix(a.volumeId))).some((o) => o.key === keys.log(a.volumeId, 3)), 'GC deleted record 3');

  // A resumes: its put of position 3 succeeds (the key is free again), it checkpoints.
  stalled.open();
  await aFlush.catch(() => {});
  await new Promise((res) => setTimeout(res, 20));

  const fresh = await view('v');
  t.is((await fresh.read(4096, 1))[0], 0, 'a fresh recovery never shows the stale writer\'s data');
  t.is((await fresh.read(8192, 1))[0], 0x22, 'and shows what C committed');
  await new Promise((res) => setTimeout(res, M / 2 + 10)); // the old view's map is now old enough to refresh
  t.is((await oldView.read(4096, 1))[0], 0, 'an old view catching up never splices the stale record in');
  t.is((await oldView.read(8192, 1))[0], 0x22);
  // And C, the real holder, still commits.
  await c.write(0, fill(4096, 0x33), false);
  await c.flush();
  const again = await view('v');
  t.is((await again.read(0, 1))[0], 0x33);
  t.is((await again.read(4096, 1))[0], 0);
});

test('9.6: a commit retried after a timed-out put that landed late is recognised as the same commit, not fenced', async (t) => {
  const { store, catalog, host, view } = setup();
  await catalog.create('v', 4 * MiB);
  const w = await host('v', 1);
  // The put of position 2 times out at once, but the request is still on its way and lands
  // later: after an existence check would have said "absent", before the retry's put.
  let late: (() => Promise<void>) | null = null;
  store.onPut = async (key, _b, o, next) => {
    if (key === keys.log(w.volumeId, 2) && o?.ifNoneMatch) {
      if (!late) { late = next; throw new StoreUnavailableError('request timed out'); }
      const landLate = late; late = async () => {};
      await landLate();
    }
    return next();
  };
  await w.write(0, fill(4096, 0x44), false);
  await t.throwsAsync(w.flush(), { instanceOf: StoreUnavailableError });
  await w.write(4096, fill(4096, 0x45), false);
  await w.flush(); // must land both writes
  t.false(w.isFenced);
  store.onPut = null;
  await w.close();
  const r = await view('v');
  t.is((await r.read(0, 1))[0], 0x44);
  t.is((await r.read(4096, 1))[0], 0x45);
});

test('9.6: a position taken by another writer still fences', async (t) => {
  const { catalog, host } = setup();
  await catalog.create('v', 4 * MiB);
  const a = await host('v', 1);
  const b = await host('v', 2);
  await a.write(0, fill(4096, 1), false);
  await t.throwsAsync(a.flush(), { instanceOf: FencedError });
  t.true(a.isFenced);
  await b.close();
});

test('simulator finding F5: a position taken and since garbage-collected fences the writer (not an error that leaves the commit ambiguous)', async (t) => {
  // Seen by the simulator: a stale writer paused before its put; meanwhile others wrote the
  // position and later ones, and GC freed it. Its put (a retry) got 412, and by the time it
  // looked, the record was gone. The log has moved past this writer: it must fence, not keep
  // the attempt ambiguous (a later try would re-create the freed position) nor answer NotFound.
  const { store, catalog, host } = setup();
  await catalog.create('v', 4 * MiB);
  const a = await host('v', 1);
  const pos = keys.log(a.volumeId, 2);
  store.onPut = async (key, _b, o, next) => {
    if (key === pos && o?.ifNoneMatch) throw new PreconditionFailedError(`put ${key}: object already exists`);
    return next();
  };
  store.onHead = async (key, next) => (key === pos ? null : next());
  await a.write(0, fill(4096, 7), false);
  await t.throwsAsync(a.flush(), { instanceOf: FencedError, message: /garbage-collected/ });
  t.true(a.isFenced);
  store.onPut = null;
  store.onHead = null;
  await a.close();
});

test('simulator finding F7 (seed 3443): an ambiguous commit that lands after the writer lost its lease is not acknowledged', async (t) => {
  // Seen by the simulator: a commit's put lost its answer (ambiguous); the writer stalled
  // before the retry; its lease ran out meanwhile and the volume fenced itself; the retry
  // then landed (at a position GC had freed, so recovery ignores it) and the flush waiting
  // for it succeeded: an acknowledged write that no later reader sees.
  const { store, catalog, host } = setup();
  await catalog.create('v', 4 * MiB);
  const a = await host('v', 1);
  let deadline = Infinity;
  a.setWriteDeadline(() => deadline);
  const pos = keys.log(a.volumeId, 2);
  let tries = 0;
  const held = gate();
  store.onPut = async (key, _b, o, next) => {
    if (key !== pos || !o?.ifNoneMatch) return next();
    tries++;
    if (tries === 1) throw new StoreUnavailableError('connection reset (the request may have been sent)');
    await held.wait; // the stall: the lease runs out before this try goes out
    return next();
  };
  await a.write(0, fill(4096, 9), false);
  await t.throwsAsync(a.flush(), { instanceOf: StoreUnavailableError });
  const flushing = a.flush(); // republishes the ambiguous attempt
  await new Promise((r) => setImmediate(r));
  deadline = 0; // the lease ran out during the stall
  a.fenceLocally('lease lost: could not renew');
  held.open();
  const err = await flushing.then(() => null, (e: unknown) => e as Error);
  t.truthy(err, 'the flush is not acknowledged');
  t.true(err instanceof FencedError || (err as { code?: string })?.code === 'BATON_ERR_LEASE_LOST', String(err));
  t.is(tries, 2, 'the ambiguous attempt was put again, and landed');
  store.onPut = null;
  await a.close();
});

test('9.7: reads cost the same after thousands of failed commits (no stack overflow)', async (t) => {
  const { store, catalog, host } = setup();
  await catalog.create('v', 4 * MiB);
  const w = await host('v', 1);
  await w.write(0, fill(4096, 0x66), false);
  await w.flush();
  store.onPut = async () => { throw new StoreUnavailableError('store is down'); };
  for (let i = 0; i < 12_000; i++) {
    await w.write(8192 + (i % 64) * 4096, fill(4096, i & 0xff), false);
    await w.flush().catch(() => {});
  }
  const b = await w.read(0, 16384);
  t.is(b[0], 0x66, 'committed data outside the buffer still reads');
  t.is(b[8192], (11_968) & 0xff, 'the newest buffered write wins');
  store.onPut = null;
  await w.flush();
  await w.close();
});

function heapUsed(): number {
  v8.setFlagsFromString('--expose-gc');
  const gc = vm.runInNewContext('gc') as () => void;
  gc(); gc();
  return v8.getHeapStatistics().used_heap_size;
}

test.serial('9.9: a served volume\'s memory follows its live map, not the number of commits it made', async (t) => {
  const { store, catalog, host } = setup({ checkpointEvery: 1_000_000 });
  await catalog.create('v', 4 * MiB);
  const w = await host('v', 1, { checkpointEvery: 1_000_000 });
  // The store keeps nothing (the test never reads back): only the volume's own memory counts.
  store.onPut = async () => {};
  const commit = async (n: number) => {
    for (let i = 0; i < n; i++) {
      await w.write(0, fill(512, i & 0xff), false);
      await w.flush();
    }
  };
  await commit(2_000);
  const before = heapUsed();
  await commit(30_000);
  const after = heapUsed();
  t.log(`heap growth over 30,000 commits of one block: ${((after - before) / 1024).toFixed(0)} KiB`);
  t.true(after - before < 1.5 * MiB, `heap grew ${after - before} bytes`);
  t.is(w.stats().extents, 1);
});

test('9 (smaller): close() whose final flush fails still stops the retry timer', async (t) => {
  const { store, catalog, host } = setup({ dirtySoftLimit: 64 * 1024, dirtyHardLimit: 64 * MiB });
  await catalog.create('v', 64 * MiB);
  const w = await host('v', 1);
  store.onPut = async () => { throw new StoreUnavailableError('store is down'); };
  await w.write(0, fill(128 * 1024, 1), false); // over the soft limit: background commit, then a retry timer
  await new Promise((res) => setTimeout(res, 50));
  await t.throwsAsync(w.close());
  const putsAtClose = store.puts;
  await new Promise((res) => setTimeout(res, 1200)); // the first retry would come after 500 ms
  t.is(store.puts, putsAtClose, 'no commit retried after close()');
});

test('9 (smaller): a writer without a lease commits records that later recoveries count', async (t) => {
  const { catalog, host, view } = setup();
  await catalog.create('v', 4 * MiB);
  const leased = await host('v', 5); // a lease holder's takeover with token 5
  await leased.close();
  const plain = await host('v', null); // no lease configured
  await plain.write(0, fill(4096, 0x77), false);
  await plain.flush();
  // The host dies right after the acknowledged flush (no closing checkpoint): recovery replays the record.
  t.is((await (await view('v')).read(0, 1))[0], 0x77);
});

test('9 (smaller): an ancestor\'s log is replayed from its checkpoint\'s fence, so a fork and its parent agree about a fenced record', async (t) => {
  const { mem, catalog, host, view } = setup({ checkpointEvery: 1 });
  await catalog.create('p', 4 * MiB);
  const w = await host('p', 2);
  await w.write(0, fill(4096, 0x01), false);
  await w.flush();
  await w.close(); // checkpoint at 2, fence 2
  // A fenced writer's record (token 1, below the fence) at position 3: recovery ignores it.
  const id = w.volumeId;
  const h: LogHeader = { v: 1, kind: 'commit', seq: 3, volumeId: id, token: 1, time: new Date().toISOString(), segments: [], extents: [[0, 4096, -1, 0]], inlineLength: 4096 };
  await mem.put(keys.log(id, 3), encodeLogRecord(h, [fill(4096, 0xee)]).body, { ifNoneMatch: true });
  t.is((await (await view('p')).read(0, 1))[0], 0x01, 'the parent ignores the fenced record');
  await catalog.fork('p', 'f');
  t.is((await (await view('f')).read(0, 1))[0], 0x01, 'so does the fork');
});

test('9 (smaller): a transient error reading the newest checkpoint fails the open; it does not fall back to an older one', async (t) => {
  const { store, catalog, host } = setup({ checkpointEvery: 1 });
  await catalog.create('v', 4 * MiB);
  const w = await host('v', 1);
  for (let i = 0; i < 3; i++) { await w.write(0, fill(4096, i), false); await w.flush(); }
  await w.close();
  const cps = await listAll(store, keys.checkpointPrefix(w.volumeId));
  t.true(cps.length >= 2);
  const newest = cps[cps.length - 1]!.key;
  store.onGet = async (key, _r, next) => { if (key === newest) throw new StoreUnavailableError('503 Slow Down'); return next(); };
  const err = await t.throwsAsync(host('v', 2));
  t.true(err instanceof StoreUnavailableError, `got ${err?.constructor.name}: ${err?.message}`);
  t.false(err instanceof CorruptError);
});

test('9 (smaller): GC keeps nothing of a removed volume its forks no longer need (not even its newest log record)', async (t) => {
  const { store, catalog, host, gcTwice } = setup();
  await catalog.create('p', 4 * MiB);
  const p = await host('p', 1);
  await p.write(0, fill(4096, 0x01), false);
  await p.flush();
  await p.close();
  await catalog.fork('p', 'f');
  const p2 = await host('p', 2); // a takeover record with no data: p's newest record
  await p2.write(4096, fill(4096, 0x02), false);
  await p2.flush();
  await p2.close();
  const pid = p.volumeId;
  const f = await host('f', 1); // the fork's first open flattens its map into its own checkpoint
  await f.close();
  await catalog.remove('p');
  await gcTwice();
  const left = (await listAll(store, keys.volumePrefix(pid))).map((o) => o.key);
  const logs = left.filter((k) => k.startsWith(keys.logPrefix(pid)));
  t.deepEqual(logs, [keys.log(pid, 2)], `only the record holding the fork's data is left (left: ${left.join(', ')})`);
  t.is((await (await host('f', 2)).read(0, 1))[0], 0x01);
});

test('F2 (simulator): a holder past its lease deadline answers no read (its map may miss what a new holder acknowledged)', async (t) => {
  const { catalog, host } = setup();
  await catalog.create('v', 4 * MiB);
  const a = await host('v', 1);
  let deadline = performance.now() + 60_000;
  a.setWriteDeadline(() => deadline);
  await a.write(0, fill(4096, 0x11), false);
  await a.flush();
  t.is((await a.read(0, 1))[0], 0x11); // inside the lease: answered
  deadline = performance.now() - 1; // A's renewals stopped reaching the lease service
  const b = await host('v', 2); // B took the lease over after A's deadline
  await b.write(0, fill(4096, 0x22), false);
  await b.flush(); // acknowledged on B
  // A's map still says 0x11: answering it would be older than B's acknowledged flush.
  const err = await t.throwsAsync(a.read(0, 4096));
  t.regex(err!.message, /lease expired/);
  await t.throwsAsync(a.blockStatus(0, 4096, 1));
  t.true(a.isFenced);
  await b.close();
});

test('F2 (simulator): a fenced writer answers no read', async (t) => {
  const { catalog, host } = setup();
  await catalog.create('v', 4 * MiB);
  const a = await host('v', 1);
  await a.write(0, fill(4096, 0x11), false);
  await a.flush();
  const b = await host('v', 2);
  await b.write(0, fill(4096, 0x22), false);
  await b.flush();
  await a.write(4096, fill(4096, 0x33), false);
  await t.throwsAsync(a.flush(), { instanceOf: FencedError });
  await t.throwsAsync(a.read(0, 4096), { instanceOf: FencedError });
  await b.close();
});

test('simulator seed 93471: a takeover through a map older than the log never lands in a position GC freed (its acknowledged writes would be in no chain)', async (t) => {
  const { catalog, host, view, gcTwice } = setup({ checkpointEvery: 2 });
  await catalog.create('v', 4 * MiB);
  const a = await host('v', null); // A opens v (its map: an empty log), then waits a long while to take over
  const b = await host('v', 1);
  for (let i = 0; i < 6; i++) { // B's commits move the log on; its checkpoints let GC free the positions below
    await b.write(i * 4096, fill(4096, 0x20 + i), false);
    await b.flush();
  }
  await b.close();
  await gcTwice();
  await a.takeover(5); // A's map says position 1 is next: GC freed it
  t.is((await a.read(0, 1))[0], 0x20, 'the new holder reads what B acknowledged');
  await a.write(8 * 4096, fill(4096, 0x55), false);
  await a.flush(); // acknowledged: a fresh recovery must see it
  await a.close();
  const fresh = await view('v');
  t.is((await fresh.read(8 * 4096, 1))[0], 0x55, 'A\'s acknowledged write is in the log everyone recovers');
  t.is((await fresh.read(5 * 4096, 1))[0], 0x25);
});

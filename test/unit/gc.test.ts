/**
 * Garbage collection and compaction over the in-memory store, with a store clock the test
 * drives (GC compares the store's lastModified stamps, never the host's clock).
 */
import test from 'ava';
import { BlockCache } from '../../src/cache.js';
import { InvalidArgumentError } from '../../src/errors.js';
import { silentLogger } from '../../src/log.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { listAll, type ObjectStore } from '../../src/store/object-store.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import { collectGarbage } from '../../src/volume/gc.js';
import type { Volume } from '../../src/volume/volume.js';

const MiB = 1024 * 1024;
const M = 1000; // max operation time for these tests (GC waits M/2 per run)
const G = 2 * M;

function setup() {
  let now = Date.parse('2026-01-01T00:00:00Z');
  const store = new MemoryObjectStore('memory:', () => new Date(now));
  const cache = BlockCache.open({ capacityBytes: 64 * MiB });
  // compress: false: stored bytes are the written bytes (and frame headers), so the byte counts below are the data's.
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => cache, volume: { maxOperationMs: M, segmentBytes: MiB, checkpointEvery: 4, compress: false } });
  let token = 0;
  const open = async (name: string, readOnly = false): Promise<Volume> => {
    const v = (await catalog.open(name, { readOnly })).backend as Volume;
    if (!readOnly) await v.takeover(++token); // each writer a new lease token, as the lease layer does
    return v;
  };
  const advance = (ms: number): void => { now += ms; };
  const gc = (o: { dryRun?: boolean } = {}) => collectGarbage(catalog, { graceMs: G, maxOperationMs: M, ...o });
  /** Two runs a grace apart: the second deletes what the first marked. */
  const gcTwice = async () => {
    advance(G + 1);
    const first = await gc();
    advance(G + 1);
    const second = await gc();
    return { first, second };
  };
  const storedBytes = async (prefix = 'vol/') => (await listAll(store, prefix)).reduce((n, o) => n + o.size, 0);
  return { store, catalog, open, advance, gc, gcTwice, storedBytes };
}

const fill = (n: number, byte: number) => Buffer.alloc(n, byte);

test('overwritten data is deleted after two runs a grace apart, and what is live still reads', async (t) => {
  const { catalog, open, gc, gcTwice, advance, storedBytes } = setup();
  await catalog.create('v', 64 * MiB);
  const v = await open('v');
  await v.write(0, fill(4 * MiB, 1), false);
  await v.flush();
  await v.write(0, fill(4 * MiB, 2), false);
  await v.flush();
  const before = await storedBytes();
  t.true(before >= 8 * MiB);

  // Right away nothing is old enough: no mark, nothing deleted.
  const early = await gc();
  t.is(early.deletedObjects, 0);
  t.is(early.markedObjects, 0);
  t.true(early.youngUnreferenced > 0);

  const { first, second } = await gcTwice();
  t.true(first.markedObjects >= 4, 'the first old-enough run only marks');
  t.is(first.deletedObjects, 0);
  t.true(second.deletedBytes >= 4 * MiB, `second run deletes the overwritten 4 MiB (deleted ${second.deletedBytes})`);
  t.true((await v.read(0, 4 * MiB)).equals(fill(4 * MiB, 2)));
  const reopened = await open('v', true);
  t.true((await reopened.read(0, 4 * MiB)).equals(fill(4 * MiB, 2)), 'a fresh recovery after GC reads the live data');
  t.true(await storedBytes() < before - 4 * MiB + 64 * 1024);
  advance(G + 1);
  const third = await gc();
  t.is(third.deletedObjects, 0, 'nothing more to delete');
});

test('a dry run deletes nothing and writes no mark', async (t) => {
  const { store, catalog, open, gc, advance } = setup();
  await catalog.create('v', 16 * MiB);
  const v = await open('v');
  await v.write(0, fill(2 * MiB, 1), false);
  await v.flush();
  await v.write(0, fill(2 * MiB, 2), false);
  await v.flush();
  advance(G + 1);
  const r = await gc({ dryRun: true });
  t.true(r.dryRun);
  t.is((await listAll(store, 'gc/marks/')).length, 0);
  advance(G + 1);
  const r2 = await gc({ dryRun: true });
  t.is(r2.deletedObjects, 0, 'without a mark nothing is deletable');
});

test('objects a fork or snapshot still maps survive the parent overwriting them and GC', async (t) => {
  const { catalog, open, gcTwice } = setup();
  await catalog.create('p', 32 * MiB);
  const p = await open('p');
  await p.write(0, fill(3 * MiB, 7), false);
  await p.flush();
  await catalog.fork('p', 'f');
  await catalog.snapshot('p', 's');
  await p.write(0, fill(3 * MiB, 8), false);
  await p.flush();
  await p.close();
  const p2 = await open('p'); // a new holder: checkpoint and takeover, older records superseded
  await p2.write(3 * MiB, fill(MiB, 9), false);
  await p2.flush();
  await gcTwice();
  const f = await open('f', true);
  t.true((await f.read(0, 3 * MiB)).equals(fill(3 * MiB, 7)), 'the fork still reads the data the parent overwrote');
  const s = await open('p@s', true);
  t.true((await s.read(0, 3 * MiB)).equals(fill(3 * MiB, 7)), 'so does the snapshot');
  t.true((await p2.read(0, 3 * MiB)).equals(fill(3 * MiB, 8)));
});

test('dropping forks and GC give their exclusive bytes back; the survivor still reads', async (t) => {
  const { catalog, open, gcTwice, storedBytes } = setup();
  await catalog.create('base', 32 * MiB);
  const base = await open('base');
  await base.write(0, fill(4 * MiB, 1), false);
  await base.flush();
  await base.close();
  for (const [i, name] of ['a', 'b', 'c'].entries()) {
    await catalog.fork('base', name);
    const f = await open(name);
    await f.write(4 * MiB, fill(4 * MiB, 10 + i), false);
    await f.flush();
    await f.close();
  }
  const acc = new Map((await catalog.listWithAccounting()).map((v) => [v.name, v]));
  t.is(acc.get('a')!.exclusiveBytes, 4 * MiB);
  const before = await storedBytes();
  await catalog.remove('a');
  await catalog.remove('b');
  await gcTwice();
  const after = await storedBytes();
  t.true(before - after >= 8 * MiB, `removed forks' 8 MiB are gone (${before} -> ${after})`);
  const c = await open('c', true);
  t.true((await c.read(0, 4 * MiB)).equals(fill(4 * MiB, 1)));
  t.true((await c.read(4 * MiB, 4 * MiB)).equals(fill(4 * MiB, 12)));
});

test('a removed parent with a live fork: GC keeps what the fork maps and the ancestry, deletes the rest', async (t) => {
  const { catalog, open, gcTwice, store } = setup();
  await catalog.create('p', 32 * MiB);
  const p = await open('p');
  await p.write(0, fill(2 * MiB, 1), false);
  await p.write(8 * MiB, fill(2 * MiB, 2), false);
  await p.flush();
  await p.close();
  await catalog.fork('p', 'f');
  const f = await open('f');
  await f.write(8 * MiB, fill(2 * MiB, 3), false); // the parent's second extent is dead for f
  await f.flush();
  await f.close();
  t.true((await catalog.remove('p')).keptForRelatives);
  await gcTwice();
  const f2 = await open('f', true);
  t.true((await f2.read(0, 2 * MiB)).equals(fill(2 * MiB, 1)));
  t.true((await f2.read(8 * MiB, 2 * MiB)).equals(fill(2 * MiB, 3)));
  const rec = await catalog.record('f');
  t.truthy(await store.head(`vol/${rec.parent!.id}/meta`), 'the ancestor meta stays while a descendant exists');
  // rm of the fork still finds no descendants and deletes its own objects.
  await catalog.remove('f');
});

test('compaction rewrites mostly-dead objects; after GC the store holds about the live data', async (t) => {
  const { catalog, open, gcTwice, storedBytes } = setup();
  await catalog.create('v', 64 * MiB);
  const v = await open('v');
  // 16 MiB in 1 MiB segments, then overwrite 3/4 of every segment in small pieces.
  await v.write(0, fill(16 * MiB, 1), false);
  await v.flush();
  for (let off = 0; off < 16 * MiB; off += MiB) {
    await v.write(off, fill(768 * 1024, 2), false);
    await v.flush();
  }
  const r = await v.compact({ below: 0.5 });
  t.is(r.objects, 16, 'every 1 MiB segment is 25 % live');
  t.is(r.rewrittenBytes, 4 * MiB);
  await v.close();
  const v2 = await open('v');
  await v2.close(); // a checkpoint at the newest record: older records are only data now
  await gcTwice();
  const live = 16 * MiB;
  const stored = await storedBytes();
  t.true(stored <= 1.25 * live, `space amplification ${(stored / live).toFixed(2)}x`);
  const check = await open('v', true);
  for (let off = 0; off < 16 * MiB; off += MiB) {
    const b = await check.read(off, MiB);
    t.true(b.subarray(0, 768 * 1024).equals(fill(768 * 1024, 2)) && b.subarray(768 * 1024).equals(fill(256 * 1024, 1)), `data at ${off}`);
  }
});

test('compaction never overwrites a client write that lands while it reads', async (t) => {
  const { catalog, open } = setup();
  await catalog.create('v', 16 * MiB);
  const v = await open('v');
  await v.write(0, fill(MiB, 1), false);
  await v.flush();
  await v.write(0, fill(768 * 1024, 2), false);
  await v.flush();
  const compacting = v.compact({ below: 0.5 });
  await v.write(768 * 1024, fill(4096, 3), false); // lands while compaction reads the old object
  await compacting;
  await v.flush();
  const b = await v.read(0, MiB);
  t.true(b.subarray(768 * 1024, 768 * 1024 + 4096).equals(fill(4096, 3)), 'the client write wins');
  t.true(b.subarray(768 * 1024 + 4096).equals(fill(MiB - 768 * 1024 - 4096, 1)));
});

test('TRIM turns into reclaimed bytes after GC', async (t) => {
  const { catalog, open, gcTwice, storedBytes } = setup();
  await catalog.create('v', 64 * MiB);
  const v = await open('v');
  await v.write(0, fill(32 * MiB, 5), false);
  await v.flush();
  await v.trim(0, 30 * MiB, false);
  await v.flush();
  await v.close();
  await gcTwice();
  const stored = await storedBytes();
  t.true(stored <= 1.25 * 2 * MiB + 64 * 1024, `stored ${stored} bytes for 2 MiB live`);
  const check = await open('v', true);
  t.true((await check.read(30 * MiB, 2 * MiB)).equals(fill(2 * MiB, 5)));
  t.true((await check.read(0, MiB)).equals(Buffer.alloc(MiB)));
});

test('a read-only view of a live volume follows the log, so GC never pulls data from under it', async (t) => {
  const { catalog, open, gcTwice } = setup();
  await catalog.create('v', 16 * MiB);
  const w = await open('v');
  await w.write(0, fill(2 * MiB, 1), false);
  await w.flush();
  const reader = await open('v', true);
  t.true((await reader.read(0, MiB)).equals(fill(MiB, 1)));
  await w.write(0, fill(2 * MiB, 2), false);
  await w.flush();
  await gcTwice(); // the reader's old map names deleted objects now
  await new Promise((r) => setTimeout(r, M)); // its map is older than M/2: the next read refreshes
  t.true((await reader.read(0, 2 * MiB)).equals(fill(2 * MiB, 2)));
});

test('a grace shorter than twice the longest operation is refused', async (t) => {
  const { catalog } = setup();
  const err = await t.throwsAsync(collectGarbage(catalog, { graceMs: 1000, maxOperationMs: 60_000 }));
  t.true(err instanceof InvalidArgumentError);
  t.regex(err!.message, /at least twice/);
});

test('a fork slower than half the max operation time is undone and made again; always slow, nothing is created', async (t) => {
  const inner = new MemoryObjectStore();
  let slowPuts = 1;
  const slow = new Proxy(inner, {
    get(target, prop) {
      if (prop === 'put') {
        return async (key: string, body: Buffer, o?: object) => {
          if (key.startsWith('volumes/') && slowPuts > 0) { slowPuts--; await new Promise((r) => setTimeout(r, M / 2 + 50)); }
          return target.put(key, body, o);
        };
      }
      const v = Reflect.get(target, prop) as unknown;
      return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
    },
  });
  const cache = BlockCache.open({ capacityBytes: 16 * MiB });
  const catalog = new StoreCatalog({ store: slow, log: silentLogger(), cache: () => cache, volume: { maxOperationMs: M } });
  await catalog.create('src', 16 * MiB);
  slowPuts = 1;
  const f = await catalog.fork('src', 'f1');
  t.is(f.name, 'f1');
  t.deepEqual((await catalog.list()).map((v) => v.name).sort(), ['f1', 'src'], 'one fork, made on the second try');
  slowPuts = 3;
  const err = await t.throwsAsync(catalog.snapshot('src', 's'));
  t.regex(err!.message, /too long.*nothing was created/);
  t.deepEqual((await catalog.list()).map((v) => v.name).sort(), ['f1', 'src']);
  t.is((await listAll(inner, 'vol/')).filter((o) => o.key.endsWith('/meta')).length, 2, 'no meta left behind by the undone attempts');
});

test('two hosts\' runs do not mark the same objects twice (one mark, one DELETE each)', async (t) => {
  const { catalog, open, gc, advance } = setup();
  await catalog.create('v', 16 * MiB);
  const v = await open('v');
  await v.write(0, fill(2 * MiB, 1), false);
  await v.flush();
  await v.write(0, fill(2 * MiB, 2), false);
  await v.flush();
  advance(G + 1);
  const hostA = await gc();
  t.true(hostA.markedObjects > 0, 'the first run marks the overwritten data');
  const hostB = await gc(); // another host, moments later
  t.is(hostB.markedObjects, 0, 'what a younger mark names is not marked again');
  advance(G + 1);
  const later = await gc();
  t.is(later.deletedObjects, hostA.markedObjects, 'the one mark deletes each object once');
  t.true((await v.read(0, 2 * MiB)).equals(fill(2 * MiB, 2)));
});

test('accounting of one volume loads only its relatives\' maps and agrees with accounting over every map', async (t) => {
  const { catalog, open, store } = setup();
  for (const name of ['base', 'other']) {
    await catalog.create(name, 32 * MiB);
    const v = await open(name);
    await v.write(0, fill(4 * MiB, 1), false);
    await v.flush();
    await v.close();
  }
  await catalog.fork('base', 'a');
  const a = await open('a');
  await a.write(4 * MiB, fill(2 * MiB, 2), false);
  await a.flush();
  await a.close();
  await catalog.snapshot('base', 's');
  const all = new Map((await catalog.listWithAccounting()).map((v) => [v.name, v]));
  // Which volumes' logs a call lists (loading a map lists its log; describing one lists only its prefix).
  const listed: string[] = [];
  const list = store.list.bind(store);
  store.list = (prefix, o) => { if (/\/log\/$/.test(prefix)) listed.push(prefix.split('/')[1]!); return list(prefix, o); };
  const otherId = (await catalog.record('other')).id;
  for (const name of ['base', 'a', 'base@s']) {
    listed.length = 0;
    const one = await catalog.infoWithAccounting(name);
    const want = all.get(name)!;
    t.deepEqual([one.writtenBytes, one.exclusiveBytes, one.sharedBytes], [want.writtenBytes, want.exclusiveBytes, want.sharedBytes], name);
    t.false(listed.includes(otherId), `info ${name} loaded the unrelated volume's map`);
  }
  listed.length = 0;
  const other = await catalog.infoWithAccounting('other');
  t.is(other.exclusiveBytes, 4 * MiB);
  t.deepEqual([...new Set(listed)], [otherId], 'a volume without relatives loads only its own map');
});

test('a record listed but gone when GC reads it makes GC list the records again: a fork that landed meanwhile keeps what its removed source held (reviewed finding)', async (t) => {
  // GC lists volumes/ (S is there), a fork S -> F lands, rm S keeps S's data for F, then GC's
  // GET of S's record finds it gone. Without another listing F was never computed, and S's
  // meta, checkpoint and segments were marked (a later run that misses them the same way deletes them).
  const Mq = 400;
  const Gq = 2 * Mq;
  let now = Date.parse('2026-01-01T00:00:00Z');
  const inner = new MemoryObjectStore('memory:', () => new Date(now));
  let gateKey: string | null = null;
  let held: (() => void) | null = null;
  let release: (() => void) | null = null;
  const gated: ObjectStore = {
    description: 'gated',
    async get(k, r, i) {
      if (k === gateKey) { gateKey = null; await new Promise<void>((res) => { release = res; held?.(); }); }
      return inner.get(k, r, i);
    },
    put: (k, b, o) => inner.put(k, b, o), head: (k) => inner.head(k), list: (p, o) => inner.list(p, o),
    delete: (k) => inner.delete(k), close: () => inner.close(),
  };
  const cache = BlockCache.open({ capacityBytes: 64 * MiB });
  const opts = { log: silentLogger(), cache: () => cache, volume: { maxOperationMs: Mq, segmentBytes: MiB } };
  const admin = new StoreCatalog({ store: inner, ...opts });
  const gcCatalog = new StoreCatalog({ store: gated, ...opts });
  await admin.create('S', 16 * MiB);
  const v = (await admin.open('S', { readOnly: false })).backend as Volume;
  await v.takeover(1);
  await v.write(0, Buffer.alloc(2 * MiB, 7), false);
  await v.flush();
  await v.close();
  const sId = (await admin.rawRecord('S')).id;
  now += 3 * Gq; // everything is old enough to be a candidate
  gateKey = 'volumes/S';
  const heldP = new Promise<void>((r) => { held = r; });
  const run = collectGarbage(gcCatalog, { graceMs: Gq, maxOperationMs: Mq });
  await heldP; // GC listed volumes/ (S), its GET of S's record waits
  await admin.fork('S', 'F');
  const rm = await admin.remove('S');
  t.true(rm.keptForRelatives, 'rm kept S\'s data for F');
  release!();
  const res = await run;
  t.true(res.recordListings >= 2, `the records listed again (${res.recordListings} listings)`);
  const marked: string[] = [];
  for (const m of await listAll(inner, 'gc/marks/')) marked.push(...(JSON.parse((await inner.get(m.key)).toString()) as { keys: string[] }).keys);
  const needed = marked.filter((k) => k.startsWith(`vol/${sId}/`) && !k.includes('/log/'));
  t.deepEqual(needed, [], 'nothing of S that F maps is marked (its log below the checkpoint may be)');
  const f = await admin.open('F', { readOnly: true });
  t.true((await f.backend.read(0, 4096)).equals(Buffer.alloc(4096, 7)), 'F reads S\'s data');
  await (f.backend as Volume).close();
});

/**
 * GC whose work grows with what changed (issue 12): a run reuses the contribution to R of
 * every record whose inputs (what its recovery listed, with etags, and the metas it read)
 * are unchanged in the run's listing, and reads nothing of it. Requests are counted by what
 * they name, through a store that logs every request.
 */
import test from 'ava';
import { BlockCache } from '../../src/cache.js';
import { systemWorld, type World } from '../../src/clock.js';
import { silentLogger } from '../../src/log.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { listAll, type ByteRange, type ListOptions, type ObjectHead, type ObjectInfo, type ObjectStore, type PutOptions } from '../../src/store/object-store.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import { collectGarbage, type GcResult } from '../../src/volume/gc.js';
import { GC_STATE_KEY, ListingIndex, decodeGcState, encodeGcState, type Contribution } from '../../src/volume/gc-state.js';
import type { Volume } from '../../src/volume/volume.js';

const MiB = 1024 * 1024;
const M = 1000;
const G = 2 * M;

/** Every request, as "op key-or-prefix". */
class LoggingStore implements ObjectStore {
  readonly requests: string[] = [];
  constructor(private readonly next: ObjectStore) {}
  get description(): string { return this.next.description; }
  get(key: string, range?: ByteRange): Promise<Buffer> { this.requests.push(`get ${key}`); return this.next.get(key, range); }
  put(key: string, body: Buffer, options?: PutOptions): Promise<void> { this.requests.push(`put ${key}`); return this.next.put(key, body, options); }
  head(key: string): Promise<ObjectHead | null> { this.requests.push(`head ${key}`); return this.next.head(key); }
  list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> { this.requests.push(`list ${prefix}`); return this.next.list(prefix, options); }
  delete(key: string): Promise<void> { this.requests.push(`delete ${key}`); return this.next.delete(key); }
  close(): Promise<void> { return this.next.close(); }
}

function setup() {
  let now = Date.parse('2026-01-01T00:00:00Z');
  const memory = new MemoryObjectStore('memory:', () => new Date(now));
  const store = new LoggingStore(memory);
  const cache = BlockCache.open({ capacityBytes: 64 * MiB });
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => cache, volume: { maxOperationMs: M, segmentBytes: MiB, checkpointEvery: 4 } });
  let token = 0;
  const open = async (name: string, readOnly = false): Promise<Volume> => {
    const v = (await catalog.open(name, { readOnly })).backend as Volume;
    if (!readOnly) await v.takeover(++token);
    return v;
  };
  const advance = (ms: number): void => { now += ms; };
  /** One run; the requests it made. `duringWait` runs once, when the run starts its first wait (after its `vol/` listing). */
  const gc = async (o: { dryRun?: boolean; duringWait?: () => Promise<void> } = {}): Promise<{ r: GcResult; requests: string[] }> => {
    const from = store.requests.length;
    let hook = o.duringWait;
    const world: World = {
      ...systemWorld,
      setTimeout: (fn, ms) => {
        const h = hook;
        hook = undefined;
        if (!h) return systemWorld.setTimeout(fn, ms);
        return systemWorld.setTimeout(() => { void h().then(fn); }, 0);
      },
    };
    const r = await collectGarbage(catalog, { graceMs: G, maxOperationMs: M, dryRun: o.dryRun ?? false, world });
    return { r, requests: store.requests.slice(from) };
  };
  return { memory, store, catalog, open, advance, gc };
}

/** The volume ids and names a run's requests touched one by one (not the store-wide listings). */
function perVolume(requests: string[]): string[] {
  return requests.filter((q) => /^(get|head|list) (vol\/[^/]+\/|volumes\/.)/.test(q));
}

async function idOf(catalog: StoreCatalog, name: string): Promise<string> {
  return (await catalog.record(name)).id;
}

/** A store of `n` volumes, each written and flushed (some twice, so some have checkpoints), plus a fork and a snapshot. */
async function fleet(s: ReturnType<typeof setup>, n: number): Promise<void> {
  for (let i = 0; i < n; i++) {
    await s.catalog.create(`v${i}`, 16 * MiB);
    const v = await s.open(`v${i}`);
    for (let k = 0; k <= i % 6; k++) {
      await v.write(k * 64 * 1024, Buffer.alloc(64 * 1024, i + k + 1), false);
      await v.flush();
    }
    await v.close();
  }
  await s.catalog.fork('v1', 'f1');
  await s.catalog.snapshot('v2', 'snap');
}

test('a run after no change reads no record, map, checkpoint or log of any volume', async (t) => {
  const s = setup();
  await fleet(s, 12);
  const first = await s.gc();
  t.is(first.r.reusedRecords, 0, 'nothing to reuse the first time');
  t.true(perVolume(first.requests).length >= 14 * 2, 'the first run reads every record');
  s.advance(G + 1);
  const second = await s.gc();
  t.is(second.r.records, 14);
  t.is(second.r.reusedRecords, 14, 'every record reused');
  t.deepEqual(perVolume(second.requests), [], 'no request names one volume');
  // What is left: the store-wide listings, the clock, the state, the marks.
  const lists = second.requests.filter((q) => q.startsWith('list '));
  t.deepEqual([...new Set(lists)].sort(), ['list gc/marks/', 'list vol/', 'list volumes/']);
  // One listing of the records per run, reused or not (gc.ts "One listing of the records").
  t.is(first.requests.filter((q) => q === 'list volumes/').length, 1, 'the first run lists the records once');
  t.is(second.requests.filter((q) => q === 'list volumes/').length, 1, 'so does the second');
  t.deepEqual([first.r.liveRecords, first.r.recordListings, second.r.liveRecords, second.r.recordListings], [0, 1, 0, 1]);
  t.deepEqual(second.requests.filter((q) => q.startsWith('get ')), [`get ${GC_STATE_KEY}`]);
  t.is(second.r.referencedObjects, first.r.referencedObjects, 'the same reference set');
});

test('a run after a few volumes were written reads only those (and a fork of a written one keeps its reuse)', async (t) => {
  const s = setup();
  await fleet(s, 12);
  await s.gc();
  // Write v1 (the fork f1's parent) and v2 (the snapshot's), and v7.
  for (const name of ['v1', 'v2', 'v7']) {
    const v = await s.open(name);
    await v.write(0, Buffer.alloc(64 * 1024, 0xee), false);
    await v.flush();
    await v.close();
  }
  s.advance(G + 1);
  const { r, requests } = await s.gc();
  const touched = new Set(perVolume(requests).map((q) => q.split(' ')[1]!.split('/').slice(0, 2).join('/')));
  const written = new Set(await Promise.all(['v1', 'v2', 'v7'].map(async (n) => `vol/${await idOf(s.catalog, n)}`)));
  // Recomputed records are read again by name? No: a record is read only when its etag changed.
  for (const k of touched) t.true(written.has(k), `only written volumes are read (read ${k})`);
  t.is(touched.size, 3);
  t.is(r.reusedRecords, r.records - 3, 'the fork and the snapshot of written volumes reuse theirs: their recovery stops at the fork point');
  // And the set is what a run without any state computes.
  await s.memory.delete(GC_STATE_KEY);
  const full = await s.gc({ dryRun: true });
  t.is(full.r.reusedRecords, 0);
  t.is(full.r.referencedObjects, r.referencedObjects);
  t.is(full.r.referencedBytes, r.referencedBytes);
});

/**
 * Volume `a` with one flushed write and left open (no checkpoint covers its newest log record,
 * so recovery reads it), and a way to replace that record with the same bytes under a new put
 * (only its etag tells the two versions apart).
 */
async function openLogVolume(s: ReturnType<typeof setup>): Promise<{ a: Volume; id: string; top: string; replaceTop: () => Promise<void> }> {
  await s.catalog.create('a', 16 * MiB);
  const a = await s.open('a');
  await a.write(0, Buffer.alloc(4096, 1), false);
  await a.flush();
  const id = await idOf(s.catalog, 'a');
  const logs = await listAll(s.memory, `vol/${id}/log/`);
  const top = logs[logs.length - 1]!.key;
  const replaceTop = async (): Promise<void> => {
    const body = await s.memory.get(top);
    await s.memory.delete(top);
    await s.memory.put(top, body);
  };
  return { a, id, top, replaceTop };
}

test('a log position re-created with other bytes (same key, new etag) makes its record computed again', async (t) => {
  const s = setup();
  const { a, top, replaceTop } = await openLogVolume(s);
  await s.gc();
  await replaceTop();
  s.advance(G + 1);
  const { r, requests } = await s.gc();
  t.is(r.reusedRecords, 0, 'not reused');
  // Recovered again, as of the run's listing: its listings come from that listing, and the
  // record read is checked to be the listed version (a HEAD after the GET).
  t.true(requests.includes(`get ${top}`) && requests.includes(`head ${top}`), 'recovered again');
  t.is(r.liveRecords, 0, 'as of the listing');
  t.is(r.recordListings, 1);
  await a.close();
});

test('a volume made while the run waits is loaded live, and then the records are listed again', async (t) => {
  const s = setup();
  await fleet(s, 3);
  await s.gc();
  s.advance(G + 1);
  const { r, requests } = await s.gc({
    duringWait: async () => {
      // After the vol/ listing: their metas are not in it.
      await s.catalog.create('late', 16 * MiB);
      await s.catalog.fork('v1', 'late-fork');
    },
  });
  t.is(r.records, 7);
  t.is(r.liveRecords, 2, 'the two new records, loaded live');
  t.is(r.recordListings, 2, 'and the fixed point listed the records again');
  t.is(requests.filter((q) => q === 'list volumes/').length, 2);
  t.is(r.reusedRecords, 5, 'the others as before');
});

test('a log record replaced after the listing makes its record loaded live (the GET is checked against the listed etag)', async (t) => {
  const s = setup();
  const { a, id, replaceTop } = await openLogVolume(s);
  const { r, requests } = await s.gc({ duringWait: replaceTop }); // after the run's listing
  t.is(r.liveRecords, 1, 'not computed as of the listing');
  t.is(r.recordListings, 2);
  t.true(requests.includes(`list vol/${id}/log/`), 'recovered live');
  await a.close();
});

test('an unreadable or foreign state is ignored: the run computes everything and replaces it', async (t) => {
  const s = setup();
  await fleet(s, 4);
  await s.gc();
  await s.memory.put(GC_STATE_KEY, Buffer.from('{"format":"baton-gc-state","v":1,"keys":3,"records":1}\n["x"]\n'));
  const { r } = await s.gc();
  t.is(r.reusedRecords, 0);
  const again = await s.gc();
  t.is(again.r.reusedRecords, again.r.records, 'the state was written again');
  await s.memory.put(GC_STATE_KEY, Buffer.from('{"format":"baton-gc-state","v":999,"keys":0,"records":0}\n'));
  t.is((await s.gc()).r.reusedRecords, 0, 'another version\'s state is not trusted');
});

test('a dry run writes no state', async (t) => {
  const s = setup();
  await fleet(s, 3);
  await s.gc({ dryRun: true });
  t.is(await s.memory.head(GC_STATE_KEY), null);
});

test('ListingIndex: a listing input matches only the same keys with the same etags within its bounds', (t) => {
  const o = (key: string, etag?: string): ObjectInfo => ({ key, size: 1, lastModified: new Date(0), ...(etag !== undefined ? { etag } : {}) });
  const idx = new ListingIndex([o('vol/a/log/1', 'e1'), o('vol/a/log/2', 'e2'), o('vol/a/log/3', 'e3'), o('vol/a/meta', 'm'), o('vol/b/log/1', 'x')]);
  const l = (after: string | null, end: string | null, keys: [string, string][]) => ({ prefix: 'vol/a/log/', after, end, keys });
  t.true(idx.sameAs(l(null, null, [['vol/a/log/1', 'e1'], ['vol/a/log/2', 'e2'], ['vol/a/log/3', 'e3']])));
  t.true(idx.sameAs(l('vol/a/log/1', 'vol/a/log/2', [['vol/a/log/2', 'e2']])), 'after and end bound it');
  t.false(idx.sameAs(l('vol/a/log/1', null, [['vol/a/log/2', 'e2']])), 'a key added after it');
  t.false(idx.sameAs(l(null, null, [['vol/a/log/1', 'e1'], ['vol/a/log/2', 'OTHER'], ['vol/a/log/3', 'e3']])), 'another etag');
  t.false(idx.sameAs(l(null, null, [['vol/a/log/1', 'e1'], ['vol/a/log/2', 'e2'], ['vol/a/log/3', 'e3'], ['vol/a/log/4', 'e4']])), 'a key gone');
  t.true(idx.sameAs({ prefix: 'vol/c/log/', after: null, end: null, keys: [] }), 'an empty listing');
  const noEtag = new ListingIndex([o('vol/a/log/1')]);
  t.false(noEtag.sameAs(l(null, null, [['vol/a/log/1', '']])), 'a listing without etags never matches');
  const c = (metas: [string, boolean][]): Contribution => ({ name: 'a', etag: 'r', record: { format: 'baton-volume-1', name: 'a', id: 'a', size: 1, createdAt: '' }, lists: [], metas, refs: [] });
  t.true(idx.unchanged(c([['vol/a/meta', true], ['vol/z/meta', false]])));
  t.false(idx.unchanged(c([['vol/z/meta', true]])), 'a meta gone');
  t.false(idx.unchanged(c([['vol/a/meta', false]])), 'a meta that appeared');
});

test('the state round-trips, sharing keys between records, and a damaged one is CorruptError', async (t) => {
  const rec = (name: string) => ({ format: 'baton-volume-1' as const, name, id: name, size: 4096, createdAt: 'x' });
  const cs: Contribution[] = Array.from({ length: 600 }, (_, i) => ({
    name: `n${i}`, etag: `"e${i}"`, record: rec(`n${i}`),
    lists: [{ prefix: `vol/n${i}/log/`, after: i % 2 ? `vol/n${i}/log/1` : null, end: null, keys: [[`vol/n${i}/log/2`, `"l${i}"`]] }],
    metas: [[`vol/n${i}/meta`, true], ['vol/gone/meta', false]],
    refs: [`vol/n${i}/log/2`, 'vol/shared/seg/1'],
  }));
  let pauses = 0;
  const body = await encodeGcState(cs, async () => { pauses++; });
  t.true(pauses >= 2, 'the encoder lets the event loop turn');
  t.is(body.toString().split('vol/shared/seg/1').length - 1, 1, 'a shared key is stored once');
  const back = await decodeGcState(body, async () => {});
  t.deepEqual([...back!.values()], cs);
  await t.throwsAsync(decodeGcState(body.subarray(0, body.length - 40), async () => {}), { code: 'BATON_ERR_CORRUPT' });
  await t.throwsAsync(decodeGcState(Buffer.from('not json\n'), async () => {}), { code: 'BATON_ERR_CORRUPT' });
});

test('info with accounting reads only the relatives\' records and maps, found through fork markers, with or without a GC run', async (t) => {
  const s = setup();
  await fleet(s, 8); // v1 has a fork f1, v2 a snapshot
  // A grandchild through f1 (written first: a fork of a fork with no log of its own points
  // at the volume that has one), then f1 removed: v1's family goes on through f1's markers.
  const f1 = await s.open('f1');
  await f1.write(128 * 1024, Buffer.alloc(64 * 1024, 0x55), false);
  await f1.flush();
  await f1.close();
  await s.catalog.fork('f1', 'f1a');
  t.is((await s.catalog.record('f1a')).parent?.id, await idOf(s.catalog, 'f1'));
  await s.catalog.remove('f1');
  const check = async (when: string): Promise<void> => {
    const from = s.store.requests.length;
    const info = await s.catalog.infoWithAccounting('v1');
    const requests = s.store.requests.slice(from);
    const records = requests.filter((q) => q.startsWith('get volumes/')).sort();
    t.deepEqual(records, ['get volumes/f1', 'get volumes/f1a', 'get volumes/v1'], `${when}: its own record and its relatives' (f1 is gone: its name is looked up)`);
    t.false(requests.some((q) => q === 'list volumes/'), `${when}: no listing of every record`);
    t.false(requests.includes(`get ${GC_STATE_KEY}`), `${when}: no GC state`);
    const all = (await s.catalog.listWithAccounting()).find((v) => v.name === 'v1')!;
    t.true(info.sharedBytes! > 0, `${when}: f1a shares v1's data`);
    t.deepEqual([info.writtenBytes, info.exclusiveBytes, info.sharedBytes], [all.writtenBytes, all.exclusiveBytes, all.sharedBytes], `${when}: the numbers of accounting over every map`);
  };
  await check('before any GC run');
  s.advance(G + 1);
  await s.gc();
  s.advance(G + 1);
  await s.gc(); // the first run's marks are old now: whatever it marked is deleted
  await check('after GC runs (the markers of f1, removed, and of f1a were kept)');
  // A snapshot's info finds the volume it is of among its relatives.
  const snap = await s.catalog.infoWithAccounting('v2@snap');
  t.is(snap.snapshotOf?.volume, 'v2');
});

test('a family made before fork markers (its root without forksMarked) is found through every record', async (t) => {
  const s = setup();
  await fleet(s, 4);
  // Make v1's records look like an older baton's: no forksMarked, no markers.
  const v1 = await s.catalog.record('v1');
  const { forksMarked: _, ...old } = v1;
  const body = Buffer.from(JSON.stringify(old));
  await s.memory.put(`volumes/v1`, body);
  await s.memory.put(`vol/${v1.id}/meta`, body);
  for (const o of await listAll(s.memory, `vol/${v1.id}/forks/`)) await s.memory.delete(o.key);
  const from = s.store.requests.length;
  const info = await s.catalog.infoWithAccounting('v1');
  t.true(s.store.requests.slice(from).includes('list volumes/'), 'every record');
  t.true(info.sharedBytes! > 0, 'the fork f1 found without its marker');
});

test('GC keeps a fork marker while its child is there, and deletes it with the child\'s meta', async (t) => {
  const s = setup();
  await fleet(s, 3);
  const v1 = await idOf(s.catalog, 'v1');
  const f1 = await idOf(s.catalog, 'f1');
  const marker = `vol/${v1}/forks/${f1}/f1`;
  t.truthy(await s.memory.head(marker), 'the fork put its marker');
  s.advance(G + 1);
  await s.gc();
  s.advance(G + 1);
  await s.gc();
  t.truthy(await s.memory.head(marker), 'kept while f1 is there');
  await s.catalog.remove('f1');
  for (let i = 0; i < 2; i++) { s.advance(G + 1); await s.gc(); }
  t.is(await s.memory.head(marker), null, 'gone with f1');
});

test('a fork that lands after the records were listed, made from a volume loaded live, is found by the next round: its data is not marked', async (t) => {
  const s = setup();
  await s.catalog.create('y', 16 * MiB);
  const y = await s.open('y');
  await y.write(0, Buffer.alloc(2 * MiB, 7), false); // large enough for a segment (small writes go inline in the log)
  await y.flush();
  await y.close();
  const yId = await idOf(s.catalog, 'y');
  const segs = (await listAll(s.memory, `vol/${yId}/seg/`)).map((o) => o.key);
  t.true(segs.length >= 1);
  s.advance(G + 1); // y's segment is old enough to be a candidate
  // f's own catalog holds its name put until GC has listed the records (and lets it land then).
  let release!: () => void;
  const gate = new Promise<void>((r) => { release = r; });
  let held!: () => void;
  const holding = new Promise<void>((r) => { held = r; });
  class GatedStore extends LoggingStore {
    override put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
      if (key !== 'volumes/f') return super.put(key, body, options);
      held();
      return gate.then(() => super.put(key, body, options));
    }
  }
  const fCache = BlockCache.open({ capacityBytes: 16 * MiB });
  const fCatalog = new StoreCatalog({ store: new GatedStore(s.memory), log: silentLogger(), cache: () => fCache, volume: { maxOperationMs: M, segmentBytes: MiB, checkpointEvery: 4 } });
  let forkF: Promise<unknown> = Promise.resolve();
  const { r } = await s.gc({
    duringWait: async () => {
      // After the run's vol/ listing: x's meta is not in it, so x is loaded live.
      await s.catalog.fork('y', 'x');
      await s.catalog.remove('y'); // x maps y's data: kept for it
      forkF = fCatalog.fork('x', 'f'); // reads x's fork point now, while x maps y's segment...
      await holding; // ...and is about to land its name
      const x = await s.open('x');
      await x.write(0, Buffer.alloc(2 * MiB, 9), false); // now x maps it no more
      await x.flush();
      await x.close();
      const from = s.store.requests.length;
      void (async () => {
        while (!s.store.requests.slice(from).includes('list volumes/')) await new Promise((res) => setTimeout(res, 1));
        setTimeout(release, 20); // f lands after this round's listing of the records
      })();
    },
  });
  await forkF;
  t.truthy(await s.catalog.record('f'), 'f was made');
  t.true(r.liveRecords >= 1 && r.recordListings >= 2, 'x was loaded live, so the records were listed again');
  const marks = await listAll(s.memory, 'gc/marks/');
  const marked = (await Promise.all(marks.map(async (m) => (JSON.parse((await s.memory.get(m.key)).toString('utf8')) as { keys: string[] }).keys))).flat();
  for (const seg of segs) t.false(marked.includes(seg), `f maps y's segment ${seg}: not a candidate`);
});

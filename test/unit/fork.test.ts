/**
 * Forks and snapshots over the in-memory store: O(1) creation, exact point in time (last
 * acknowledged flush, nothing unflushed), independent divergence, deep chains, diff and
 * space accounting from the maps.
 */
import test from 'ava';
import { accountMaps, diffMaps } from '../../cow/diff.js';
import { BlockCache } from '../../src/cache.js';
import { silentLogger } from '../../src/log.js';
import { InstrumentedObjectStore } from '../../src/store/decorators.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import type { Volume } from '../../src/volume/volume.js';

const MiB = 1024 * 1024;

function catalogOn(store = new MemoryObjectStore()) {
  const cache = BlockCache.open({ capacityBytes: 64 * MiB });
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => cache });
  const open = async (name: string, readOnly = false): Promise<Volume> => (await catalog.open(name, { readOnly })).backend as Volume;
  return { catalog, open, store };
}

test('a fork of a live volume has every flushed write and nothing unflushed; then they diverge', async (t) => {
  const { catalog, open } = catalogOn();
  await catalog.create('src', 64 * MiB);
  const src = await open('src');
  await src.takeover(1);
  await src.write(0, Buffer.alloc(4096, 1), false);
  await src.flush();
  await src.write(4096, Buffer.alloc(4096, 2), false); // not flushed when the fork is made
  await catalog.fork('src', 'dst');
  const dst = await open('dst');
  await dst.takeover(1);
  t.true((await dst.read(0, 4096)).equals(Buffer.alloc(4096, 1)));
  t.true((await dst.read(4096, 4096)).equals(Buffer.alloc(4096)), 'unflushed write not in the fork');
  await dst.write(0, Buffer.alloc(4096, 9), false);
  await dst.flush();
  await src.flush();
  const src2 = await open('src', true);
  t.true((await src2.read(0, 4096)).equals(Buffer.alloc(4096, 1)), 'fork writes never show in the parent');
  t.true((await src2.read(4096, 4096)).equals(Buffer.alloc(4096, 2)));
  const dst2 = await open('dst', true);
  t.true((await dst2.read(0, 4096)).equals(Buffer.alloc(4096, 9)));
  t.true((await dst2.read(4096, 4096)).equals(Buffer.alloc(4096)), 'parent writes after the fork never show in the fork');
});

test('fork costs the same requests for a big and a small volume (no data copied)', async (t) => {
  const inst = new InstrumentedObjectStore(new MemoryObjectStore());
  const { catalog, open } = catalogOn(inst as unknown as MemoryObjectStore);
  for (const [name, size, writes] of [['small', 64 * MiB, 4], ['big', 1024 ** 4, 64]] as const) {
    await catalog.create(name, size);
    const v = await open(name);
    await v.takeover(1);
    for (let i = 0; i < writes; i++) { await v.write(i * 16 * MiB, Buffer.alloc(65536, i), false); await v.flush(); }
    // Closed, so that its background checkpoint (written a chunk at a time, after the flush
    // returned) is not counted among the fork's requests.
    await v.close();
  }
  const counts: number[] = [];
  for (const name of ['small', 'big']) {
    inst.reset();
    await catalog.fork(name, `${name}-fork`);
    counts.push(inst.stats().total.requests);
    t.is(inst.stats().put.bytes < 4096, true, 'only small records are written');
  }
  t.is(counts[0], counts[1]);
});

test('snapshots are read-only points in time, servable and forkable', async (t) => {
  const { catalog, open } = catalogOn();
  await catalog.create('vol', 64 * MiB);
  const v = await open('vol');
  await v.takeover(1);
  await v.write(0, Buffer.alloc(512, 7), false);
  await v.flush();
  await catalog.snapshot('vol', 's1');
  await v.write(0, Buffer.alloc(512, 8), false);
  await v.flush();
  const snap = await open('vol@s1');
  t.true(snap.readOnly);
  t.true((await snap.read(0, 512)).equals(Buffer.alloc(512, 7)));
  await t.throwsAsync(snap.write(0, Buffer.alloc(1), false));
  await catalog.fork('vol@s1', 'back');
  const back = await open('back');
  t.true((await back.read(0, 512)).equals(Buffer.alloc(512, 7)));
  const diff = await catalog.diff('vol@s1', 'vol');
  t.deepEqual(diff, [{ offset: 0, length: 512 }]);
});

test('50 generations deep: reads see the right data, the map stays the size of what was written', async (t) => {
  const { catalog, open } = catalogOn();
  await catalog.create('g0', 64 * MiB);
  let v = await open('g0');
  await v.takeover(1);
  await v.write(0, Buffer.alloc(4096, 100), false);
  await v.flush();
  for (let g = 1; g <= 50; g++) {
    await catalog.fork(`g${g - 1}`, `g${g}`);
    v = await open(`g${g}`);
    await v.takeover(1); // also writes the flattening checkpoint
    await v.write(g * 4096, Buffer.alloc(4096, g), false);
    await v.flush();
    await v.close();
  }
  const deepest = await open('g50', true);
  t.true((await deepest.read(0, 4096)).equals(Buffer.alloc(4096, 100)));
  for (const g of [1, 25, 50]) t.true((await deepest.read(g * 4096, 4096)).equals(Buffer.alloc(4096, g)), `generation ${g}`);
  t.true(deepest.stats().extents <= 51 + 2, `extents ${deepest.stats().extents}`);
});

test('rm of a parent keeps the data its forks still map; rm of a leaf deletes its objects', async (t) => {
  const { catalog, open } = catalogOn();
  await catalog.create('p', 64 * MiB);
  const p = await open('p');
  await p.takeover(1);
  await p.write(0, Buffer.alloc(8192, 3), false);
  await p.flush();
  await p.close();
  await catalog.fork('p', 'child');
  const r1 = await catalog.remove('p');
  t.true(r1.keptForRelatives);
  const child = await open('child', true);
  t.true((await child.read(0, 8192)).equals(Buffer.alloc(8192, 3)), 'the fork still reads its inherited data');
  const r2 = await catalog.remove('child');
  t.false(r2.keptForRelatives);
});

test('diffMaps and accountMaps on hand-made maps', (t) => {
  const a = [{ offset: 0, length: 100, key: 'o1', off: 0 }, { offset: 200, length: 50, key: null, off: 0 }];
  const b = [{ offset: 0, length: 40, key: 'o1', off: 0 }, { offset: 40, length: 20, key: 'o2', off: 0 }, { offset: 60, length: 40, key: 'o1', off: 60 }];
  t.deepEqual(diffMaps(a, b), [{ offset: 40, length: 20 }], 'a zero extent equals a gap');
  t.deepEqual(diffMaps(b, []), [{ offset: 0, length: 100 }]);
  const acc = accountMaps(new Map([['a', a], ['b', b]]));
  // Raw objects (no ratio): stored bytes are the logical bytes.
  t.deepEqual(acc.get('a'), { writtenBytes: 100, exclusiveBytes: 20, sharedBytes: 80, writtenStoredBytes: 100, exclusiveStoredBytes: 20, sharedStoredBytes: 80 });
  t.deepEqual(acc.get('b'), { writtenBytes: 100, exclusiveBytes: 20, sharedBytes: 80, writtenStoredBytes: 100, exclusiveStoredBytes: 20, sharedStoredBytes: 80 });
  // Framed objects that compressed to a quarter: stored bytes are a quarter of theirs.
  const q = accountMaps(new Map([['a', a.map((e) => ({ ...e, ratio: 0.25 }))], ['b', b.map((e) => ({ ...e, ratio: 0.25 }))]]));
  t.deepEqual(q.get('a'), { writtenBytes: 100, exclusiveBytes: 20, sharedBytes: 80, writtenStoredBytes: 25, exclusiveStoredBytes: 5, sharedStoredBytes: 20 });
});

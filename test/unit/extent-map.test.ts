import test from 'ava';
import { ExtentMap, REGION_SIZE } from '../../cow/extent-map.js';
import { seededRandom } from '../../src/store/decorators.js';

// Values are "source offsets": the byte at volume offset x of an extent set with value v
// at offset o has source v + (x - o). A byte array model checks every operation.
type V = number;
const slice = (v: V, d: number): V => v + d;

function model(size: number): Int32Array {
  return new Int32Array(size).fill(-1);
}

function check(t: import('ava').ExecutionContext, m: ExtentMap<V>, ref: Int32Array): void {
  const got = new Int32Array(ref.length).fill(-1);
  let prevEnd = -1;
  for (const e of m.entries()) {
    t.true(e.offset >= prevEnd, 'extents are sorted and do not overlap');
    t.true(e.length > 0);
    for (let i = 0; i < e.length; i++) got[e.offset + i] = e.value + i;
    prevEnd = e.offset + e.length;
  }
  t.deepEqual(got, ref);
}

test('random sets and deletes match a byte model, across region boundaries', (t) => {
  const rnd = seededRandom(7);
  // A small address space that still spans several regions: scale offsets by region size.
  const size = 4096;
  const m = new ExtentMap<V>(slice, { regionSize: 512 }); // 8 regions over the model's 4096 bytes
  const ref = model(size);
  for (let i = 0; i < 600; i++) {
    const off = Math.floor(rnd() * size);
    const len = 1 + Math.floor(rnd() * Math.min(600, size - off));
    if (rnd() < 0.2) {
      m.delete(off, len);
      for (let k = 0; k < len; k++) ref[off + k] = -1;
    } else {
      const v = Math.floor(rnd() * 1e6);
      m.set(off, len, v);
      for (let k = 0; k < len; k++) ref[off + k] = v + k;
    }
  }
  check(t, m, ref);
  // Lookup returns gaps and values covering exactly the range.
  const pieces = m.lookup(100, 3000);
  let pos = 100;
  for (const p of pieces) {
    t.is(p.offset, pos);
    for (let k = 0; k < p.length; k++) t.is(p.value === undefined ? -1 : p.value + k, ref[pos + k]!);
    pos += p.length;
  }
  t.is(pos, 3100);
});

test('extents never cross a region boundary and lookups over regions are seamless', (t) => {
  const m = new ExtentMap<V>(slice);
  m.set(REGION_SIZE - 10, 30, 1000);
  const all = [...m.entries()];
  t.is(all.length, 2);
  t.deepEqual(all.map((e) => [e.offset, e.length, e.value]), [[REGION_SIZE - 10, 10, 1000], [REGION_SIZE, 20, 1010]]);
  const p = m.lookup(REGION_SIZE - 20, 50);
  t.deepEqual(p.map((x) => [x.offset, x.length, x.value]), [
    [REGION_SIZE - 20, 10, undefined], [REGION_SIZE - 10, 10, 1000], [REGION_SIZE, 20, 1010], [REGION_SIZE + 20, 10, undefined],
  ]);
});

test('a huge sparse map (1 TiB address space) costs only what is written', (t) => {
  const m = new ExtentMap<V>(slice);
  const TiB = 1024 ** 4;
  for (let i = 0; i < 1000; i++) m.set(Math.floor((i / 1000) * (TiB / 4096 - 1)) * 4096, 4096, i);
  t.is(m.size, 1000);
  const last = m.lookup(TiB - 8192, 8192);
  t.true(last.length >= 1);
  const c = m.clone();
  c.set(0, 4096, 42);
  t.is(m.lookup(0, 1)[0]!.value, 0, 'clone is independent');
  t.is(c.lookup(0, 1)[0]!.value, 42);
});

// Values are source offsets: B continues A when A's source plus A's length is B's source.
const join = (a: V, n: number, b: V): V | undefined => (a + n === b ? a : undefined);

test('with join, contiguous sets merge: 100 MiB written in 4 KiB pieces is one extent per region', (t) => {
  const m = new ExtentMap<V>(slice, { join });
  const MiB = 1024 * 1024;
  for (let off = 0; off < 100 * MiB; off += 4096) m.set(off, 4096, 5_000_000 + off);
  t.is(m.size, 25, '100 MiB over 4 MiB regions');
  t.deepEqual(m.lookup(4096, 8192).map((p) => [p.offset, p.length, p.value]), [[4096, 8192, 5_000_000 + 4096]]);
  // Pieces of other sources do not merge, and a write into the middle splits as before.
  m.set(8192, 4096, 1);
  t.is(m.size, 27);
  m.set(8192, 4096, 5_000_000 + 8192);
  t.is(m.size, 25, 'writing the continuing value back merges the three again');
});

test('with join, random sets and deletes still match the byte model, and no two neighbours are left joinable', (t) => {
  const rnd = seededRandom(11);
  const size = 4096;
  const m = new ExtentMap<V>(slice, { join, regionSize: 512 });
  const ref = model(size);
  for (let i = 0; i < 3000; i++) {
    const off = Math.floor(rnd() * size);
    const len = 1 + Math.floor(rnd() * Math.min(300, size - off));
    const r = rnd();
    if (r < 0.15) {
      m.delete(off, len);
      for (let k = 0; k < len; k++) ref[off + k] = -1;
    } else {
      // Often the value that continues the bytes before: the case merging is for.
      const v = r < 0.6 && off > 0 && ref[off - 1]! >= 0 ? ref[off - 1]! + 1 : Math.floor(rnd() * 1e6);
      m.set(off, len, v);
      for (let k = 0; k < len; k++) ref[off + k] = v + k;
    }
  }
  check(t, m, ref);
  const all = [...m.entries()];
  for (let i = 1; i < all.length; i++) {
    const a = all[i - 1]!;
    const b = all[i]!;
    const sameRegion = Math.floor(a.offset / 512) === Math.floor(b.offset / 512);
    if (sameRegion && a.offset + a.length === b.offset) t.is(join(a.value, a.length, b.value), undefined, `joinable neighbours at ${a.offset} and ${b.offset}`);
  }
  t.is(m.size, all.length);
});

test('a frozen view keeps the map as it was while the map changes, and append builds what set builds', async (t) => {
  const rnd = seededRandom(12);
  const size = 8192;
  const m = new ExtentMap<V>(slice, { join, regionSize: 512 });
  for (let i = 0; i < 500; i++) {
    const off = Math.floor(rnd() * size);
    m.set(off, 1 + Math.floor(rnd() * Math.min(200, size - off)), Math.floor(rnd() * 1e6));
  }
  const before = [...m.entries()].map((e) => ({ ...e }));
  const view = m.freeze();
  t.is(view.size, before.length);
  for (let i = 0; i < 500; i++) {
    const off = Math.floor(rnd() * size);
    const len = 1 + Math.floor(rnd() * Math.min(600, size - off));
    if (rnd() < 0.3) m.delete(off, len); else m.set(off, len, Math.floor(rnd() * 1e6));
  }
  const seen: { offset: number; length: number; value: V }[] = [];
  let pauses = 0;
  for await (const region of view.regions(async () => {
    pauses++;
    // The map changes between chunks too: the view must not.
    const off = Math.floor(rnd() * size);
    m.set(off, 1 + Math.floor(rnd() * Math.min(600, size - off)), Math.floor(rnd() * 1e6));
    if (rnd() < 0.5) m.delete(Math.floor(rnd() * size), 100);
  }, 3)) for (const e of region) seen.push({ ...e });
  t.true(pauses > 10);
  t.deepEqual(seen, before, 'the view is the map at freeze time');
  view.close();
  // Built by append from the frozen extents, the map equals the one that was frozen.
  const rebuilt = new ExtentMap<V>(slice, { join, regionSize: 512 });
  for (const e of before) rebuilt.append(e.offset, e.length, e.value);
  t.deepEqual([...rebuilt.entries()], before);
  t.throws(() => rebuilt.append(before[0]!.offset, 1, 0), { instanceOf: RangeError }, 'append refuses to go back');
});

import test from 'ava';
import { ExtentMap, REGION_SIZE } from '../../cow/extent-map.js';
import { PackedExtentMap, RegionTable, TABLE_SPAN, type LocationCodec } from '../../cow/packed-map.js';
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
  await view.walk((offset, length, value) => { seen.push({ offset, length, value }); }, async () => {
    pauses++;
    // The map changes between chunks too: the view must not.
    const off = Math.floor(rnd() * size);
    m.set(off, 1 + Math.floor(rnd() * Math.min(600, size - off)), Math.floor(rnd() * 1e6));
    if (rnd() < 0.5) m.delete(Math.floor(rnd() * size), 100);
  }, 3);
  t.true(pauses > 10);
  t.deepEqual(seen, before, 'the view is the map at freeze time');
  view.close();
  // Built by append from the frozen extents, the map equals the one that was frozen.
  const rebuilt = new ExtentMap<V>(slice, { join, regionSize: 512 });
  for (const e of before) rebuilt.append(e.offset, e.length, e.value);
  t.deepEqual([...rebuilt.entries()], before);
  t.throws(() => rebuilt.append(before[0]!.offset, 1, 0), { instanceOf: RangeError }, 'append refuses to go back');
});

// ------------------------------------------------------------------ PackedExtentMap
//
// Values like the committed map's: zeroes of two kinds (constants) or "object key at off"
// (locations). Every operation goes to the packed map, to an ExtentMap with the slice and
// join the packed map does in arithmetic, and to a byte model (per byte: what holds it and
// where in it). The packed map must equal the ExtentMap extent for extent (same splits, same
// merges) and the model byte for byte, and pass its own verify() (sorted, within regions,
// nothing left joinable, the source table's counts) after every step.

type L = { key: string; off: number; size: number } | { zero: true; hole: boolean };
const isZ = (v: L): v is { zero: true; hole: boolean } => 'zero' in v;
const HOLE_L: L = { zero: true, hole: true };
const ZERO_L: L = { zero: true, hole: false };
const sliceL = (v: L, d: number): L => (isZ(v) ? v : { key: v.key, off: v.off + d, size: v.size });
const joinL = (a: L, n: number, b: L): L | undefined => {
  if (isZ(a) || isZ(b)) return isZ(a) && isZ(b) && a.hole === b.hole ? a : undefined;
  return a.key === b.key && a.off + n === b.off ? a : undefined;
};
const CODEC: LocationCodec<L> = {
  constant: (v) => (isZ(v) ? (v.hole ? -1 : -2) : 0),
  ofConstant: (c) => (c === -1 ? HOLE_L : ZERO_L),
  source: (v) => (v as { key: string }).key,
  at: (v) => (v as { off: number }).off,
  locate: (first, off) => ({ key: (first as { key: string }).key, off, size: (first as { size: number }).size }),
};
const sizeOf = (key: string): number => 1000 + key.length;
const loc = (key: string, off: number): L => ({ key, off, size: sizeOf(key) });

/** Every key the tests use gets a number, for the model. */
const keyNumbers = new Map<string, number>();
const keyNames: string[] = [];
function keyIndex(key: string): number {
  let i = keyNumbers.get(key);
  if (i === undefined) { i = keyNames.length; keyNumbers.set(key, i); keyNames.push(key); }
  return i;
}

/** Per byte: -1 never written, -2 hole, -3 zero, else the index of the key; and the offset in it. */
class Model {
  readonly src: Int32Array;
  readonly at: Float64Array;
  constructor(readonly size: number) { this.src = new Int32Array(size).fill(-1); this.at = new Float64Array(size); }
  set(off: number, len: number, v: L | undefined): void {
    for (let k = 0; k < len; k++) {
      if (v === undefined) { this.src[off + k] = -1; this.at[off + k] = 0; }
      else if (isZ(v)) { this.src[off + k] = v.hole ? -2 : -3; this.at[off + k] = 0; }
      else { this.src[off + k] = keyIndex(v.key); this.at[off + k] = v.off + k; }
    }
  }
  clone(): Model { const m = new Model(this.size); m.src.set(this.src); m.at.set(this.at); return m; }
}

/** The model of an extent list (entries, a frozen walk): every byte as the model has it. */
function modelOf(extents: Iterable<{ offset: number; length: number; value: L }>, size: number): Model {
  const m = new Model(size);
  let prevEnd = -1;
  for (const e of extents) {
    if (!(e.offset >= prevEnd && e.length > 0)) throw new Error(`extents out of order or empty at ${e.offset}`);
    m.set(e.offset, e.length, e.value);
    prevEnd = e.offset + e.length;
  }
  return m;
}

function sameAsModel(t: import('ava').ExecutionContext, got: Model, want: Model, what: string): void {
  // One assertion per map (a mismatch names its first byte), not one per byte.
  let i = 0;
  while (i < want.size && got.src[i] === want.src[i] && got.at[i] === want.at[i]) i++;
  t.is(i, want.size, i < want.size ? `${what}: byte ${i} is (${got.src[i]}, ${got.at[i]}), the model says (${want.src[i]}, ${want.at[i]})` : what);
}

interface Pair { packed: PackedExtentMap<L>; plain: ExtentMap<L>; model: Model }

/** One random step on a pair: a set (often continuing the byte before it, or a constant), a delete, or an append; new values name `keys`. */
function randomStep(p: Pair, rnd: () => number, keys: string[], maxLen: number, regionSize: number): void {
  const size = p.model.size;
  const off = Math.floor(rnd() * size);
  const len = 1 + Math.floor(rnd() * Math.min(maxLen, size - off));
  const r = rnd();
  if (r < 0.12) {
    p.packed.delete(off, len);
    p.plain.delete(off, len);
    p.model.set(off, len, undefined);
    return;
  }
  if (r < 0.22) {
    // Append after the last extent of the region `off` falls in (possibly running into later regions).
    const base = Math.floor(off / regionSize) * regionSize;
    let start = base;
    for (let i = base; i < Math.min(size, base + regionSize); i++) if (p.model.src[i] !== -1) start = i + 1;
    if (start === base + regionSize) return; // the region ends written: nothing goes after it here
    // Free bytes from there, into later regions only if they hold nothing (append goes after
    // everything in every region it touches).
    const emptyRegion = (b: number): boolean => { for (let i = b; i < Math.min(size, b + regionSize); i++) if (p.model.src[i] !== -1) return false; return true; };
    let free = 0;
    while (start + free < size && free < maxLen && p.model.src[start + free] === -1) {
      if (free > 0 && (start + free) % regionSize === 0 && !emptyRegion(start + free)) break;
      free++;
    }
    if (free === 0) return;
    const n = 1 + Math.floor(rnd() * free);
    const v = pickValue(p.model, start, rnd, keys);
    p.packed.append(start, n, v);
    p.plain.append(start, n, v);
    p.model.set(start, n, v);
    return;
  }
  const v = pickValue(p.model, off, rnd, keys);
  p.packed.set(off, len, v);
  p.plain.set(off, len, v);
  p.model.set(off, len, v);
}

/** Often what continues the byte before `off` (the case merging is for), else any key or a constant. */
function pickValue(model: Model, off: number, rnd: () => number, keys: string[]): L {
  const r = rnd();
  const before = off > 0 ? model.src[off - 1]! : -1;
  if (r < 0.4 && before !== -1) return before === -2 ? HOLE_L : before === -3 ? ZERO_L : loc(keyNames[before]!, model.at[off - 1]! + 1);
  if (r < 0.55) return rnd() < 0.5 ? HOLE_L : ZERO_L;
  return loc(keys[Math.floor(rnd() * keys.length)]!, Math.floor(rnd() * 5000));
}

function checkPair(t: import('ava').ExecutionContext, p: Pair, what: string): void {
  p.packed.verify();
  const packed = [...p.packed.entries()];
  t.deepEqual(packed, [...p.plain.entries()], `${what}: the packed map splits and merges as ExtentMap does`);
  t.is(p.packed.size, packed.length);
  sameAsModel(t, modelOf(packed, p.model.size), p.model, what);
}

test('packed: random sets, deletes and appends match ExtentMap and a byte model, across region boundaries', (t) => {
  const rnd = seededRandom(21);
  const keys = Array.from({ length: 12 }, (_, i) => `vol/x/seg-${i}`);
  const regionSize = 512;
  const p: Pair = { packed: new PackedExtentMap<L>(CODEC, { regionSize }), plain: new ExtentMap<L>(sliceL, { join: joinL, regionSize }), model: new Model(4096) };
  for (let i = 0; i < 4000; i++) {
    randomStep(p, rnd, keys, i % 7 === 0 ? 1500 : 200, regionSize);
    if (i % 50 === 0) p.packed.verify();
    if (i % 500 === 499) checkPair(t, p, `step ${i}`);
  }
  checkPair(t, p, 'end');
  // Lookups of random ranges return the pieces ExtentMap returns, covering exactly the range.
  for (let i = 0; i < 300; i++) {
    const off = Math.floor(rnd() * 4096);
    const len = 1 + Math.floor(rnd() * (4096 - off));
    t.deepEqual(p.packed.lookup(off, len), p.plain.lookup(off, len), `lookup(${off}, ${len})`);
  }
  t.deepEqual(p.packed.lookup(5000, 600), [{ offset: 5000, length: 600, value: undefined }], 'past everything: one gap');
});

test('packed: a frozen view is the map at freeze time while sets, deletes and appends change it between chunks, with sources dropped and new ones made', async (t) => {
  const rnd = seededRandom(22);
  const regionSize = 256;
  let keys = Array.from({ length: 30 }, (_, i) => `old-${i}`);
  const p: Pair = { packed: new PackedExtentMap<L>(CODEC, { regionSize }), plain: new ExtentMap<L>(sliceL, { join: joinL, regionSize }), model: new Model(8192) };
  for (let i = 0; i < 1500; i++) randomStep(p, rnd, keys, 300, regionSize);
  for (let round = 0; round < 3; round++) {
    const frozen = p.model.clone();
    const size = p.packed.size;
    const view = p.packed.freeze();
    const second = round === 1 ? p.packed.freeze() : undefined; // two views at once
    t.is(view.size, size);
    // From now on only new sources: the old ones lose every reference while the view still
    // names them; their table entries must not be reused until it closes.
    keys = Array.from({ length: 30 }, (_, i) => `r${round}-${i}`);
    const seen: { offset: number; length: number; value: L }[] = [];
    let pauses = 0;
    await view.walk((offset, length, value) => { seen.push({ offset, length, value }); }, async () => {
      pauses++;
      for (let k = 0; k < 20; k++) randomStep(p, rnd, keys, 600, regionSize);
      p.packed.verify();
    }, 5);
    t.true(pauses > 10, `${pauses} pauses`);
    sameAsModel(t, modelOf(seen, frozen.size), frozen, `round ${round}: the view`);
    if (second) {
      const seen2: { offset: number; length: number; value: L }[] = [];
      view.close();
      for (let k = 0; k < 200; k++) randomStep(p, rnd, keys, 600, regionSize);
      await second.walk((offset, length, value) => { seen2.push({ offset, length, value }); }, async () => {}, 5);
      sameAsModel(t, modelOf(seen2, frozen.size), frozen, `round ${round}: the second view, after the first closed`);
      second.close();
    } else {
      view.close();
    }
    p.packed.verify();
    checkPair(t, p, `round ${round}: the map`);
    await t.throwsAsync(() => view.walk(() => {}, async () => {}, 5), { message: /after it was closed/ });
  }
  // A walk can stop early.
  const v = p.packed.freeze();
  let n = 0;
  await v.walk(() => (++n === 3 ? false : undefined), async () => {}, 2);
  t.is(n, 3);
  v.close();
});

test('packed: a clone is independent, and append builds what set builds', (t) => {
  const rnd = seededRandom(23);
  const keys = Array.from({ length: 8 }, (_, i) => `k${i}`);
  const regionSize = 512;
  const p: Pair = { packed: new PackedExtentMap<L>(CODEC, { regionSize }), plain: new ExtentMap<L>(sliceL, { join: joinL, regionSize }), model: new Model(4096) };
  for (let i = 0; i < 800; i++) randomStep(p, rnd, keys, 300, regionSize);
  const before = [...p.packed.entries()];
  const view = p.packed.freeze(); // the clone must not keep what only this view keeps
  const c: Pair = { packed: p.packed.clone(), plain: p.plain.clone(), model: p.model.clone() };
  for (let i = 0; i < 800; i++) randomStep(c, rnd, keys, 300, regionSize);
  checkPair(t, c, 'the clone after changes');
  t.deepEqual([...p.packed.entries()], before, 'the original is unchanged');
  p.packed.verify();
  view.close();
  // Appending the extents in order (a checkpoint being read) gives the same map.
  const rebuilt = new PackedExtentMap<L>(CODEC, { regionSize });
  for (const e of before) rebuilt.append(e.offset, e.length, e.value);
  rebuilt.verify();
  t.deepEqual([...rebuilt.entries()], before);
  t.throws(() => rebuilt.append(before[0]!.offset, 1, HOLE_L), { instanceOf: RangeError }, 'append refuses to go back');
  rebuilt.verify();
  t.throws(() => rebuilt.set(0.5, 10, HOLE_L), { instanceOf: RangeError }, 'fractions of bytes are refused, not truncated');
});

test('packed: the source table follows what the map names now, and what views name until they close', (t) => {
  const m = new PackedExtentMap<L>(CODEC, { regionSize: 4096 });
  // 10,000 objects written over the same 64 KiB, each replacing the last: one is named at the end.
  for (let i = 0; i < 10_000; i++) m.set((i % 16) * 4096, 4096, loc(`obj-${i}`, 0));
  t.is(m.sources, 16);
  m.set(0, 65536, loc('last', 0));
  t.is(m.sources, 1);
  t.is(m.size, 16, 'one extent per region');
  m.verify();
  const view = m.freeze();
  m.set(0, 65536, ZERO_L);
  t.is(m.sources, 1, 'kept while a view may still name it');
  m.set(0, 4096, loc('last', 0)); // taken up again: the same entry
  m.set(4096, 4096, loc('other', 0));
  m.verify();
  view.close();
  t.is(m.sources, 2);
  m.delete(0, 65536);
  t.is(m.sources, 0);
  t.is(m.size, 0);
  m.verify();
  t.deepEqual(m.lookup(0, 100), [{ offset: 0, length: 100, value: undefined }]);
});

test('packed: in a 4 MiB region of 4 KiB extents, updates and lookups stay exact (a fully fragmented region, and regions growing and shrinking)', (t) => {
  const rnd = seededRandom(24);
  const m = new PackedExtentMap<L>(CODEC);
  const plain = new ExtentMap<L>(sliceL, { join: joinL });
  const blocks = (2 * REGION_SIZE) / 4096;
  for (let i = 0; i < blocks; i++) {
    const v = i % 2 ? HOLE_L : loc(`o${i % 7}`, i * 4096 + 1);
    m.set(i * 4096, 4096, v);
    plain.set(i * 4096, 4096, v);
  }
  t.is(m.size, blocks);
  for (let i = 0; i < 3000; i++) {
    const off = Math.floor(rnd() * 2 * REGION_SIZE);
    const len = 1 + Math.floor(rnd() * 300_000);
    if (rnd() < 0.5) { m.delete(off, len); plain.delete(off, len); } else { m.set(off, len, ZERO_L); plain.set(off, len, ZERO_L); }
  }
  m.verify();
  t.deepEqual([...m.entries()], [...plain.entries()]);
  t.deepEqual(m.lookup(REGION_SIZE - 10_000, 20_000), plain.lookup(REGION_SIZE - 10_000, 20_000));
});

test('packed: appends in order build what ExtentMap builds, extents running across several regions included', (t) => {
  const rnd = seededRandom(25);
  const keys = Array.from({ length: 5 }, (_, i) => `seg-${i}`);
  const regionSize = 512;
  for (let run = 0; run < 20; run++) {
    const p: Pair = { packed: new PackedExtentMap<L>(CODEC, { regionSize }), plain: new ExtentMap<L>(sliceL, { join: joinL, regionSize }), model: new Model(32_768) };
    let pos = Math.floor(rnd() * 700);
    let appended = 0;
    while (pos < p.model.size) {
      const len = Math.min(p.model.size - pos, 1 + Math.floor(rnd() * 1600)); // up to 3+ regions
      const v = pickValue(p.model, pos, rnd, keys);
      p.packed.append(pos, len, v);
      p.plain.append(pos, len, v);
      p.model.set(pos, len, v);
      appended++;
      pos += len + (rnd() < 0.5 ? 0 : Math.floor(rnd() * 600));
    }
    t.true(appended > 20);
    checkPair(t, p, `run ${run}`);
    // Then the map goes on changing as usual.
    for (let i = 0; i < 200; i++) randomStep(p, rnd, keys, 900, regionSize);
    checkPair(t, p, `run ${run}, after changes`);
  }
});

test('packed: the pool gives memory back: blocks grow, shrink and merge, and pages free again are released', (t) => {
  const rnd = seededRandom(26);
  const regionSize = 64 * 1024;
  const m = new PackedExtentMap<L>(CODEC, { regionSize });
  // 200k extents of 512 bytes with gaps, over 3,200 regions of up to 64 extents.
  for (let i = 0; i < 200_000; i++) m.set(i * 1024, 512, i % 3 ? ZERO_L : loc(`o${i % 50}`, i));
  t.is(m.size, 200_000);
  m.verify();
  const full = m.poolBytes;
  t.true(full >= 200_000 * 20 && full <= 200_000 * 20 * 4.5, `${full} bytes of pool for 200k extents`);
  // A view keeps the blocks of the regions that change while it is open, then lets them go.
  const view = m.freeze();
  for (let i = 0; i < 2000; i++) m.delete(Math.floor(rnd() * 200_000) * 1024, 100_000);
  t.true(m.poolBytes > full / 2, 'the view keeps what it may still read');
  view.close();
  m.verify();
  for (let i = 0; i < 200_000; i += 1) m.delete(i * 1024, 1024);
  m.verify();
  t.is(m.size, 0);
  t.true(m.poolBytes <= 65536 * 20, `${m.poolBytes} bytes left: at most one spare page`);
  // And it is reused.
  for (let i = 0; i < 1000; i++) m.set(i * 4096, 512, ZERO_L);
  m.verify();
  t.is(m.size, 1000);
});

test('a frozen walk also pauses when `due` says the chunk took long enough, before `chunk` extents', async (t) => {
  const packed = new PackedExtentMap<L>(CODEC, { regionSize: 512 });
  const plain = new ExtentMap<L>(sliceL, { join: joinL, regionSize: 512 });
  for (let i = 0; i < 100; i++) { packed.set(i * 512, 100, ZERO_L); plain.set(i * 512, 100, ZERO_L); } // 100 regions of one extent
  for (const m of [packed, plain]) {
    const view = m.freeze();
    let pauses = 0;
    let seen = 0;
    await view.walk(() => { seen++; }, async () => { pauses++; }, 1_000_000, () => true);
    t.is(seen, 100);
    t.true(pauses >= 100, `${pauses} pauses: one after each region`);
    pauses = 0;
    await view.walk(() => {}, async () => { pauses++; }, 1_000_000, () => false);
    t.is(pauses, 0, 'never due, chunk never reached');
    view.close();
  }
});

test('packed: the region table is a Map of bounded Maps (no rehash grows with the volume): random sets and deletes match a Map, iteration while it changes visits every region that stays', (t) => {
  const table = new RegionTable();
  const model = new Map<number, number>();
  const rnd = seededRandom(12);
  for (let i = 0; i < 20_000; i++) {
    const r = Math.floor(rnd() * 6 * TABLE_SPAN);
    if (rnd() < 0.3) t.is(table.delete(r), model.delete(r));
    else { table.set(r, i); model.set(r, i); }
  }
  t.is(table.size, model.size);
  for (const [r, a] of model) t.is(table.get(r), a);
  t.deepEqual([...table.keys()].sort((a, b) => a - b), [...model.keys()].sort((a, b) => a - b));
  const shape = table.shape();
  t.true(shape.largest <= TABLE_SPAN && shape.tables >= 6, `no Map holds more than ${TABLE_SPAN} regions (${JSON.stringify(shape)})`);
  // Iterating while regions are deleted (emptying whole inner tables) and added: the ones that stay are all seen.
  const stay = new Set([...model.keys()].filter((r) => r % 3 === 0));
  const seen = new Set<number>();
  let step = 0;
  for (const r of table.keys()) {
    seen.add(r);
    if (++step % 7 === 0) for (const d of [...model.keys()].slice(0, 50)) if (!stay.has(d)) { table.delete(d); model.delete(d); }
    if (step % 11 === 0) table.set(6 * TABLE_SPAN + step, step);
  }
  for (const r of stay) t.true(seen.has(r), `region ${r} was in the table throughout`);
});

test('packed: a map of many regions keeps each Map of its region table within TABLE_SPAN regions', (t) => {
  const m = new PackedExtentMap<L>(CODEC, { regionSize: 4096 });
  for (let r = 0; r < 3 * TABLE_SPAN + 5; r++) m.append(r * 4096, 4096, r % 2 ? loc('a', r * 4096 + 1) : ZERO_L);
  m.verify();
  const rt = m.regionTable;
  t.is(rt.regions, 3 * TABLE_SPAN + 5);
  t.true(rt.largest <= TABLE_SPAN, `largest Map ${rt.largest}`);
});

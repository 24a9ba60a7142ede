/**
 * readCheckpointInRanges (format.ts): a big checkpoint read a range at a time while its
 * extents are walked. It must give what a whole read gives, and never let a damaged or
 * truncated checkpoint walk to its end without a CorruptError.
 */
import test from 'ava';
import { CorruptError } from '../../src/errors.js';
import { SRC_HOLE, SRC_ZERO, decodeCheckpoint, encodeCheckpoint, readCheckpointInRanges, type CheckpointData, type CheckpointRanges } from '../../src/volume/format.js';

const header = { volumeId: 'vid', seq: 12, token: 4, lastId: 'last', time: new Date(0).toISOString() };

/** A checkpoint of `n` extents over `objects` objects (keys of `keyLen` characters), with a working set. */
async function checkpoint(n: number, objects = 5, keyLen = 20): Promise<Buffer> {
  const key = (i: number): string => `vol/vid/seg/${String(i).padStart(keyLen, '0')}`;
  return encodeCheckpoint(header, async (fn) => {
    for (let i = 0; i < n; i++) {
      const off = i * 8192;
      if (i % 3 === 0) fn(off, 4096, null, i % 2 ? SRC_HOLE : SRC_ZERO, 0, 0, null);
      else fn(off, 4096, key(i % objects), 0, i * 4096, 1 << 30, null);
    }
  }, async () => {}, { chunkBytes: 256 * 1024, chunks: [7, 3, 1] });
}

/** The store's side: ranges of `b`, counted. */
function ranges(b: Buffer): CheckpointRanges & { reads: Array<[number, number]> } {
  const reads: Array<[number, number]> = [];
  return {
    size: b.length,
    reads,
    read: async (offset, length) => {
      reads.push([offset, length]);
      if (offset < 0 || offset + length > b.length) throw new RangeError(`range [${offset}, +${length}) outside ${b.length} bytes`);
      return Buffer.from(b.subarray(offset, offset + length));
    },
  };
}

async function extents(c: CheckpointData): Promise<number[][]> {
  const out: number[][] = [];
  await c.forEachExtent(2 ** 40, (o, l, s, so) => { out.push([o, l, s, so]); }, async () => {}, 100);
  return out;
}

test('a checkpoint read in ranges is the checkpoint read whole: header, objects, working set, every extent; only two ranges of extents are read at a time', async (t) => {
  const b = await checkpoint(1000);
  const whole = decodeCheckpoint(b, 'cp');
  const want = await extents(whole);
  for (const rangeBytes of [24, 100, 24 * 7, 4096, 1 << 20]) {
    const src = ranges(b);
    const c = (await readCheckpointInRanges(src, 'cp', rangeBytes))!;
    t.truthy(c);
    t.deepEqual([c.v, c.volumeId, c.seq, c.token, c.lastId, c.extentCount], [5, 'vid', 12, 4, 'last', 1000]);
    t.deepEqual(c.objects, whole.objects);
    t.deepEqual(c.workingSet, whole.workingSet);
    const before = src.reads.length;
    t.deepEqual(await extents(c), want, `ranges of ${rangeBytes} bytes`);
    const perRange = Math.max(1, Math.floor(rangeBytes / 24));
    t.is(src.reads.length - before, Math.ceil(1000 / perRange), 'one read per range of extents');
    t.true(src.reads.slice(before).every(([, len]) => len <= perRange * 24), 'no read is longer than a range');
  }
});

test('a checkpoint whose head does not fit the first read is read again with a longer one', async (t) => {
  // 8,000 objects named, keys of ~160 bytes: an object table of ~1.4 MiB, past the first 1 MiB read.
  const b = await checkpoint(24_000, 12_000, 150);
  const src = ranges(b);
  const c = (await readCheckpointInRanges(src, 'cp', 1 << 20))!;
  t.is(c.objects.length, 8_000, 'every object an extent names (every third extent is zeroes or a hole)');
  t.true(src.reads[0]![1] < src.reads[1]![1] && src.reads[1]![0] === 0, 'the head was read again, longer');
  t.deepEqual(await extents(c), await extents(decodeCheckpoint(b, 'cp')));
});

test('a damaged checkpoint read in ranges never walks to its end: every flipped byte, a truncation, a range that comes back short', async (t) => {
  const b = await checkpoint(40);
  let refused = 0;
  for (let i = 0; i < b.length; i++) {
    const bad = Buffer.from(b);
    bad[i]! ^= 1 << (i % 8);
    try {
      const c = await readCheckpointInRanges(ranges(bad), 'cp', 48);
      if (c === null) { t.true(i < 8, `byte ${i}: only the magic makes it "not a v5 checkpoint"`); refused++; continue; }
      await extents(c);
      t.fail(`byte ${i} flipped: walked to the end`);
    } catch (err) {
      if (!(err instanceof CorruptError)) throw err;
      refused++;
    }
  }
  t.is(refused, b.length);
  await t.throwsAsync(async () => { await readCheckpointInRanges(ranges(b.subarray(0, b.length - 1)), 'cp', 48); }, { instanceOf: CorruptError });
  const short = ranges(b);
  const c = (await readCheckpointInRanges({ size: b.length, read: async (o, l) => (l === 48 && o > 200 ? (await short.read(o, l)).subarray(0, 24) : short.read(o, l)) }, 'cp', 48))!;
  await t.throwsAsync(extents(c), { instanceOf: CorruptError, message: /came back 24 bytes/ });
});

test('older checkpoints (v3, v4) are not read in ranges: null, read them whole', async (t) => {
  const walk = async (fn: (o: number, l: number, k: string | null, s: number, so: number, size: number) => void): Promise<void> => { fn(0, 4096, 'vol/x/seg/a', 0, 0, 1 << 20); };
  t.is(await readCheckpointInRanges(ranges(await encodeCheckpoint(header, walk, async () => {}, undefined, 3)), 'cp', 24), null);
  t.is(await readCheckpointInRanges(ranges(await encodeCheckpoint(header, walk, async () => {}, { chunkBytes: 4096, chunks: [1] }, 4)), 'cp', 24), null);
});

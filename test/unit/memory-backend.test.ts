/**
 * The sparse memory backend (`ram:`): pages come from slabs and are reused after a whole-page
 * trim, so a page's bytes are undefined until written: everything a write does not cover must
 * read as zeroes, also for writes delivered as unaligned pieces and for reused pages.
 */
import test from 'ava';
import { MemoryBackend } from '../../src/backends/memory.js';

const PAGE = 64 * 1024;

test('a new page reads as zeroes wherever no write landed (write and unaligned writeLent)', async (t) => {
  const b = new MemoryBackend(16 * PAGE);
  await b.write(PAGE + 1000, Buffer.alloc(100, 0xaa));
  const page = await b.read(PAGE, PAGE);
  t.is(page.subarray(0, 1000).filter((x) => x !== 0).length, 0, 'before the write');
  t.is(page.subarray(1000, 1100).filter((x) => x !== 0xaa).length, 0, 'the write');
  t.is(page.subarray(1100).filter((x) => x !== 0).length, 0, 'after the write');
  // A write spanning pages in pieces that do not line up with them.
  const pieces = [Buffer.alloc(3, 1), Buffer.alloc(PAGE, 2), Buffer.alloc(5000, 3)];
  await b.writeLent(3 * PAGE + 10, pieces);
  const got = await b.read(3 * PAGE, 3 * PAGE);
  const want = Buffer.alloc(3 * PAGE);
  Buffer.concat(pieces).copy(want, 10);
  t.true(got.equals(want));
});

test('a page freed by a whole-page trim and reused is zero where the new write does not land', async (t) => {
  const b = new MemoryBackend(16 * PAGE);
  await b.write(0, Buffer.alloc(4 * PAGE, 0xff));
  await b.trim(0, 4 * PAGE); // four pages back to the free list, their bytes still 0xff
  t.is(b.allocatedBytes, 0);
  await b.write(8 * PAGE + 7, Buffer.from([9])); // takes a reused page
  const page = await b.read(8 * PAGE, PAGE);
  const want = Buffer.alloc(PAGE);
  want[7] = 9;
  t.true(page.equals(want));
});

test('readLent: lent pages keep their bytes through writes, zeroes and trims until released, and are not reused before', async (t) => {
  const b = new MemoryBackend(16 * PAGE);
  await b.write(0, Buffer.alloc(4 * PAGE, 1));
  const lent = await b.readLent(PAGE / 2, 3 * PAGE); // pieces of pages 0-3
  const hole = await b.readLent(8 * PAGE, PAGE + 10); // never written
  t.true(Buffer.concat(hole.chunks).equals(Buffer.alloc(PAGE + 10)));
  await b.write(PAGE / 2, Buffer.alloc(PAGE, 2)); // the second half of page 0, the first of page 1
  await b.zero(2 * PAGE + 100, 100, { fua: false, mayTrim: true, fastZero: false }); // part of page 2
  await b.trim(3 * PAGE, PAGE); // page 3 whole: out of the volume, still lent
  await b.write(10 * PAGE + 100, Buffer.alloc(10, 3)); // a new page, zeroed around the write: must not be the lent page 3
  t.true(Buffer.concat(lent.chunks).equals(Buffer.alloc(3 * PAGE, 1)), 'the lent bytes are as they were when lent');
  const want = Buffer.alloc(4 * PAGE, 1);
  want.fill(2, PAGE / 2, PAGE / 2 + PAGE);
  want.fill(0, 2 * PAGE + 100, 2 * PAGE + 200);
  want.fill(0, 3 * PAGE);
  t.true((await b.read(0, 4 * PAGE)).equals(want), 'the volume has the new bytes');
  lent.release();
  hole.release();
  t.is(b.allocatedBytes, 4 * PAGE);
  // Freed pages are reused now: a partial write into one reads as zeroes around it.
  await b.write(12 * PAGE + 5, Buffer.from([9]));
  const page = Buffer.alloc(PAGE);
  page[5] = 9;
  t.true((await b.read(12 * PAGE, PAGE)).equals(page));
});

test('a backend filled slab after slab takes slabs prefaulted by the worker; they read back as written, zeroes elsewhere', async (t) => {
  const SLAB_PAGES = 256;
  const b = new MemoryBackend(5 * SLAB_PAGES * PAGE);
  const before = MemoryBackend.prefaultedSlabs;
  for (let p = 0; p < 4 * SLAB_PAGES; p++) {
    await b.writeLent(p * PAGE + 7, [Buffer.from([p & 0xff, 0xee])]);
    // Past the first slab the worker is asked for more: give it time to make them.
    if (p % SLAB_PAGES === SLAB_PAGES - 1) await new Promise((r) => setTimeout(r, 500));
  }
  t.true(MemoryBackend.prefaultedSlabs > before, 'prefaulted slabs were used');
  for (const p of [0, 255, 256, 511, 512, 700, 1023]) {
    const want = Buffer.alloc(PAGE);
    want[7] = p & 0xff;
    want[8] = 0xee;
    t.true((await b.read(p * PAGE, PAGE)).equals(want), `page ${p}`);
  }
});

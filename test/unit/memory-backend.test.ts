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

/**
 * A sparse in-memory backend (like `nbdkit memory`): for tests, benchmarks of the protocol
 * layer, and `--store memory:`. Pages that were never written, or were trimmed or zeroed
 * whole, hold no memory and report as holes. Nothing survives the process: flush has
 * nothing to make durable, and says so by doing nothing.
 */

import { Worker } from 'node:worker_threads';
import type { BlockBackend, Extent, Lent, ZeroOptions } from '../../nbd/backend.js';
import { NBD_STATE_HOLE, NBD_STATE_ZERO } from '../../nbd/constants.js';

const PAGE = 64 * 1024;
/** Pages one BLOCK_STATUS looks at, at most (1 GiB of range). */
const MAX_STATUS_PAGES = 16 * 1024;

/** The pieces of [offset, offset+length) by page: page index, offset in page, length, offset in the range. */
function* pages(offset: number, length: number): IterableIterator<[number, number, number, number]> {
  let pos = offset;
  const end = offset + length;
  while (pos < end) {
    const idx = Math.floor(pos / PAGE);
    const inPage = pos - idx * PAGE;
    const n = Math.min(PAGE - inPage, end - pos);
    yield [idx, inPage, n, pos - offset];
    pos += n;
  }
}

/**
 * Pages are carved out of slabs of this size and reused once trimmed or zeroed whole: one
 * allocation per 256 pages instead of one zero-filled Buffer each (allocating 1 GiB as
 * separate 64 KiB buffers cost more than copying the data into them, and every external
 * allocation nudges V8 towards a full garbage collection). Slabs are never given back: what
 * a volume once held stays allocated for it, as the pages did before.
 */
const SLAB = 256 * PAGE;

/** Prefaulted slabs ready or being made, at most (each costs its memory at once). */
const PREFAULT_AHEAD = 2;

/**
 * Slabs whose memory is already faulted in, made by a worker thread. The first write to a
 * page of fresh memory costs a page fault in which the kernel finds and zeroes the page: in a
 * 1 GiB sequential write that was 0.6-0.7 s of the event loop's time on a 2-core VM, more
 * than copying the data, while nbdkit memory takes its faults on the threads serving the
 * requests, in parallel. The worker touches every page of a new slab and hands it over (the
 * ArrayBuffer is transferred, not copied); the event loop takes a slab only when one is
 * ready and otherwise allocates as before, so nothing ever waits for the worker.
 */
class Prefaulter {
  private worker: Worker | null = null;
  private failed = false;
  private readonly ready: Buffer[] = [];
  private inFlight = 0;
  /** Slabs handed out so far. */
  taken = 0;

  /** A ready slab, if any; orders more so that up to `wanted` (capped) are ready or on the way. */
  take(wanted: number): Buffer | undefined {
    const slab = this.ready.shift();
    if (slab) this.taken++;
    const target = Math.min(wanted, PREFAULT_AHEAD);
    while (!this.failed && this.ready.length + this.inFlight < target) {
      const w = this.worker ?? this.start();
      if (!w) break;
      this.inFlight++;
      w.postMessage(SLAB);
    }
    return slab;
  }

  private start(): Worker | null {
    try {
      const w = new Worker(PREFAULT_WORKER, { eval: true });
      w.on('message', (ab: ArrayBuffer) => { this.inFlight--; this.ready.push(Buffer.from(ab)); });
      // Without the worker, slabs are allocated on the event loop as they were before it.
      w.on('error', () => { this.failed = true; });
      w.on('exit', () => { this.failed = true; this.worker = null; this.inFlight = 0; });
      w.unref(); // never keeps the process alive; after on('message'), which refs it again
      this.worker = w;
    } catch {
      this.failed = true;
    }
    return this.worker;
  }
}

/** Writes a byte into every 4 KiB of a new (zeroed) ArrayBuffer, then transfers it. */
const PREFAULT_WORKER = `
const { parentPort } = require('node:worker_threads');
parentPort.on('message', (size) => {
  const ab = new ArrayBuffer(size);
  const bytes = new Uint8Array(ab);
  for (let i = 0; i < size; i += 4096) bytes[i] = 0;
  parentPort.postMessage(ab, [ab]);
});
`;

const prefaulter = new Prefaulter();

/** What a hole reads as in readLent's pieces; never written. */
const ZERO_PAGE = Buffer.alloc(PAGE);

export class MemoryBackend implements BlockBackend {
  private readonly pages = new Map<number, Buffer>();
  private readonly freePages: Buffer[] = [];
  private slab: Buffer = Buffer.alloc(0);
  private slabUsed = 0;
  /** Bytes of all slabs this backend took. */
  private slabBytes = 0;
  /**
   * Pages lent by readLent and not yet released, with how many loans each. A lent page is
   * never written: a write, zero or trim of it replaces it in `pages` by a copy (copy on
   * write) and it becomes an orphan, freed when its last loan is released.
   */
  private readonly loans = new Map<Buffer, number>();
  private readonly orphans = new Set<Buffer>();

  constructor(readonly size: number, readonly readOnly = false) {}

  /** Prefaulted slabs taken by all backends of this process so far (tests, diagnostics). */
  static get prefaultedSlabs(): number { return prefaulter.taken; }

  /** Bytes of memory held by written pages. */
  get allocatedBytes(): number { return this.pages.size * PAGE; }

  async read(offset: number, length: number, into?: Buffer): Promise<Buffer> {
    return this.readSync(offset, length, into);
  }

  readSync(offset: number, length: number, into?: Buffer): Buffer {
    const out = into ?? Buffer.allocUnsafe(length); // every byte is written below: copied or zero-filled
    for (const [idx, inPage, n, at] of pages(offset, length)) {
      const page = this.pages.get(idx);
      if (page) page.copy(out, at, inPage, inPage + n);
      else out.fill(0, at, at + n);
    }
    return out;
  }

  /**
   * The pages themselves, no copy (BlockBackend.readLent): a hole is a piece of a shared
   * zero page. Each lent page stays as it is until released (see `loans`).
   */
  async readLent(offset: number, length: number): Promise<Lent> {
    const chunks: Buffer[] = [];
    const lent: Buffer[] = [];
    for (const [idx, inPage, n] of pages(offset, length)) {
      const page = this.pages.get(idx);
      if (!page) { chunks.push(ZERO_PAGE.subarray(0, n)); continue; }
      chunks.push(page.subarray(inPage, inPage + n));
      this.loans.set(page, (this.loans.get(page) ?? 0) + 1);
      lent.push(page);
    }
    let released = false;
    return {
      chunks,
      release: () => {
        if (released) return;
        released = true;
        for (const page of lent) this.unlend(page);
      },
    };
  }

  private unlend(page: Buffer): void {
    const n = this.loans.get(page)! - 1;
    if (n > 0) { this.loans.set(page, n); return; }
    this.loans.delete(page);
    if (this.orphans.delete(page)) this.freePages.push(page);
  }

  /** The page at `idx` (which exists) to modify: a copy of it if it is lent. */
  private writablePage(idx: number): Buffer {
    const page = this.pages.get(idx)!;
    if (this.loans.size === 0 || !this.loans.has(page)) return page;
    const copy = this.newPage();
    page.copy(copy);
    this.pages.set(idx, copy);
    this.orphans.add(page);
    return copy;
  }

  /** Take the page at `idx` out of the volume; it is free once no loan holds it. */
  private dropPage(idx: number, page: Buffer): void {
    this.pages.delete(idx);
    if (this.loans.has(page)) this.orphans.add(page);
    else this.freePages.push(page);
  }

  async write(offset: number, data: Buffer): Promise<void> {
    this.writeSync(offset, data);
  }

  writeSync(offset: number, data: Buffer): void {
    this.allocate(offset, data.length);
    this.copyIn(offset, data);
  }

  /** Give every page of [offset, offset+length) that has none one, zero outside the range. */
  private allocate(offset: number, length: number): void {
    for (const [idx, inPage, n] of pages(offset, length)) {
      if (this.pages.has(idx)) continue;
      const page = this.newPage();
      // What the write does not cover reads as zeroes, as a never-written page did.
      if (inPage > 0) page.fill(0, 0, inPage);
      if (inPage + n < PAGE) page.fill(0, inPage + n);
      this.pages.set(idx, page);
    }
  }

  /** Copy into pages that exist (allocate first). */
  private copyIn(offset: number, data: Buffer): void {
    for (const [idx, inPage, n, at] of pages(offset, data.length)) data.copy(this.writablePage(idx), inPage, at, at + n);
  }

  /** A page of undefined contents: a freed one, or the next of the current slab. */
  private newPage(): Buffer {
    const free = this.freePages.pop();
    if (free) return free;
    if (this.slabUsed === this.slab.length) {
      // Past its first slab a backend is being filled: it asks for prefaulted slabs, as many
      // as it still has room for (a small backend, as in tests, never starts the worker).
      const room = Math.floor((this.size - this.slabBytes) / SLAB) - 1;
      this.slab = (this.slabBytes > 0 ? prefaulter.take(room) : undefined) ?? Buffer.allocUnsafeSlow(SLAB);
      this.slabBytes += SLAB;
      this.slabUsed = 0;
    }
    const page = this.slab.subarray(this.slabUsed, this.slabUsed + PAGE);
    this.slabUsed += PAGE;
    return page;
  }

  /** Copies the pieces before it returns (BlockBackend.writeLent): the session reuses their memory. */
  async writeLent(offset: number, chunks: readonly Buffer[]): Promise<void> {
    // Pages for the whole write first: its pieces are not page-aligned, and a new page must
    // not be zeroed where a later piece of the same write lands anyway.
    let length = 0;
    for (const c of chunks) length += c.length;
    this.allocate(offset, length);
    let pos = offset;
    for (const c of chunks) { this.copyIn(pos, c); pos += c.length; }
  }

  async flush(): Promise<void> {}

  async trim(offset: number, length: number): Promise<void> {
    this.zeroSync(offset, length);
  }

  async zero(offset: number, length: number, _options: ZeroOptions): Promise<void> {
    // Zeroing is a map operation here, so FAST_ZERO is always satisfied.
    this.zeroSync(offset, length);
  }

  private zeroSync(offset: number, length: number): void {
    for (const [idx, inPage, n] of pages(offset, length)) {
      const page = this.pages.get(idx);
      if (!page) continue;
      if (n === PAGE) this.dropPage(idx, page);
      else this.writablePage(idx).fill(0, inPage, inPage + n);
    }
  }

  async blockStatus(offset: number, length: number, maxExtents: number): Promise<Extent[]> {
    // Bounded work (BlockBackend.blockStatus): at most maxExtents extents and
    // MAX_STATUS_PAGES pages looked at, however long the range; the reply may cover less.
    const out: Extent[] = [];
    let pos = offset;
    const end = offset + length;
    for (let visited = 0; pos < end && visited < MAX_STATUS_PAGES; visited++) {
      const idx = Math.floor(pos / PAGE);
      const n = Math.min((idx + 1) * PAGE, end) - pos;
      const flags = this.pages.has(idx) ? 0 : NBD_STATE_HOLE | NBD_STATE_ZERO;
      const last = out[out.length - 1];
      if (last && last.flags === flags) last.length += n;
      else if (out.length >= (maxExtents >= 1 ? maxExtents : 1)) break;
      else out.push({ length: n, flags });
      pos += n;
    }
    return out;
  }

  async cache(): Promise<void> {}
}

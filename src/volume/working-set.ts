/**
 * The working set: which parts of a volume its holder read or wrote lately, most recently used
 * first, so that the next host to open the volume (a takeover, a handoff, a fork's first
 * attach, a restart that lost its cache) fetches those parts before the guest asks for them
 * (src/volume/hydrate.ts).
 *
 * Coarse on purpose: the volume is cut into chunks of `chunkBytes` (256 KiB, the read cache's
 * block size), and the record is the list of chunk indices touched, each once, in recency
 * order, at most `maxChunks` of them (65,536: 16 GiB of volume, 256 KiB in a checkpoint). A
 * touch costs a Map delete + set per chunk; the oldest chunk goes when the list is full.
 *
 * It is a hint and never a source of data: it names volume offsets (not objects), which the
 * hydrating host resolves through its own map, and the block cache it fills is keyed by
 * immutable object keys. A wrong or stale working set costs bandwidth, never correctness. It
 * travels in checkpoints (format.ts, v4), so it costs no store request of its own and GC's
 * reference set is unchanged.
 */

import type { WorkingSetData } from './format.js';

export const WORKING_SET_CHUNK = 256 * 1024;
export const WORKING_SET_MAX_CHUNKS = 65_536;
/** Chunks of a recorded working set taken over between two pauses (load). */
const LOAD_SLICE = 4096;

export class WorkingSet {
  /** Chunk index -> nothing; Map insertion order is recency order, least recently used first. */
  private readonly lru = new Map<number, true>();
  /** The most recently touched chunk (a repeated touch of it costs nothing). */
  private newest = -1;
  /** Chunks that entered the record since the last checkpoint took it (markSaved). */
  private added = 0;

  constructor(readonly chunkBytes = WORKING_SET_CHUNK, readonly maxChunks = WORKING_SET_MAX_CHUNKS) {
    if (!(chunkBytes >= 4096 && (chunkBytes & (chunkBytes - 1)) === 0)) throw new RangeError(`working set chunk size ${chunkBytes} is not a power of two of at least 4 KiB`);
    if (!(Number.isSafeInteger(maxChunks) && maxChunks > 0)) throw new RangeError(`working set bound ${maxChunks} is not a positive whole number`);
  }

  /** Chunks recorded. */
  get size(): number { return this.lru.size; }

  /** Chunks that entered the record since markSaved() (how much a new checkpoint would add). */
  get addedSinceSaved(): number { return this.added; }

  /** [offset, offset + length) was read or written just now. */
  touch(offset: number, length: number): void {
    if (length <= 0) return;
    const first = Math.floor(offset / this.chunkBytes);
    const last = Math.floor((offset + length - 1) / this.chunkBytes);
    if (first === last && first === this.newest) return;
    for (let c = first; c <= last; c++) this.touchChunk(c);
  }

  private touchChunk(c: number): void {
    if (this.lru.has(c)) this.lru.delete(c);
    else this.added++;
    this.lru.set(c, true);
    this.newest = c;
    if (this.lru.size > this.maxChunks) this.lru.delete(this.lru.keys().next().value!);
  }

  /** The record for a checkpoint: chunk indices, most recently used first. */
  snapshot(): WorkingSetData {
    const chunks = [...this.lru.keys()].reverse();
    return { chunkBytes: this.chunkBytes, chunks };
  }

  /** A checkpoint holding the record as it is now was written (or started: see Volume.maybeCheckpoint). */
  markSaved(): void { this.added = 0; }

  /**
   * Take over a recorded working set (a checkpoint's) as the oldest part of this one: what this
   * host touches later is more recent. Chunks past `volumeSize` are dropped (a checkpoint is
   * trusted only as a hint), and a record of another chunk size is mapped onto ours.
   *
   * `pause` is awaited every LOAD_SLICE chunks: a full record (65,536 chunks, each a Map
   * delete + set) took 6-11 ms in one go quiet and 20-26 ms in a recovery under load, at the
   * end of a recovery that otherwise leaves the event loop free every few ms (bench/scale.ts,
   * profiled). Nothing touches the record meanwhile: it is loaded before the volume serves.
   */
  async load(ws: WorkingSetData, volumeSize: number, pause: () => Promise<void> = async () => {}): Promise<void> {
    const limit = Math.ceil(volumeSize / this.chunkBytes);
    const older: number[] = [];
    let since = 0;
    const step = async (): Promise<void> => { if (++since >= LOAD_SLICE) { since = 0; await pause(); } };
    for (const c of ws.chunks) {
      await step();
      const from = Math.floor((c * ws.chunkBytes) / this.chunkBytes);
      const to = Math.floor(((c + 1) * ws.chunkBytes - 1) / this.chunkBytes);
      for (let x = from; x <= to && x < limit; x++) older.push(x);
    }
    // `older` is most recent first; the Map wants least recent first, before what is already here.
    const mine = [...this.lru.keys()];
    this.lru.clear();
    for (let i = older.length - 1; i >= 0; i--) {
      await step();
      const c = older[i]!;
      if (this.lru.has(c)) this.lru.delete(c);
      this.lru.set(c, true);
    }
    for (const c of mine) {
      if (this.lru.has(c)) this.lru.delete(c);
      this.lru.set(c, true);
    }
    while (this.lru.size > this.maxChunks) this.lru.delete(this.lru.keys().next().value!);
    this.newest = -1;
    for (const c of this.lru.keys()) this.newest = c;
  }

  /** Chunk ranges [offset, length), most recently used first (what hydration fetches, in order). */
  *ranges(volumeSize: number): IterableIterator<{ offset: number; length: number }> {
    const chunks = [...this.lru.keys()];
    for (let i = chunks.length - 1; i >= 0; i--) {
      const offset = chunks[i]! * this.chunkBytes;
      if (offset >= volumeSize) continue;
      yield { offset, length: Math.min(this.chunkBytes, volumeSize - offset) };
    }
  }
}

/**
 * A backend over one local file (like `nbdkit file`): reads and writes at offsets, FLUSH is
 * fdatasync, so an acknowledged flush is on this machine's disk (and dies with it: the
 * object-store volume is what outlives a host). TRIM is a hint we may ignore and do, since
 * Node has no portable hole punching; WRITE_ZEROES writes zeroes. Block status reports
 * everything as data, which is always a correct answer.
 */

import * as fsp from 'node:fs/promises';
import type { BlockBackend, Extent, ZeroOptions } from '../../nbd/backend.js';
import { IoError } from '../errors.js';

const ZERO_CHUNK = Buffer.alloc(1024 * 1024);

/** A write or zero in flight: its byte range, and a promise that settles (never rejects) when it is done. */
interface Mutation { start: number; end: number; settled: Promise<unknown> }

export class FileBackend implements BlockBackend {
  /**
   * Writes and zeroes in flight. The backend contract says writes apply in call order, and
   * libuv's thread pool runs the pwrites of two calls in whichever order its threads get to
   * them: a call that overlaps one in flight starts once that one is done (others start at
   * once, so disjoint writes still run in parallel).
   */
  private readonly inflight = new Set<Mutation>();

  private constructor(private readonly fh: fsp.FileHandle, readonly size: number, readonly readOnly: boolean, private readonly path: string) {}

  /** Run `op` on [offset, offset + length) after every earlier mutation of an overlapping range. */
  private async ordered(offset: number, length: number, op: () => Promise<void>): Promise<void> {
    const end = offset + length;
    const earlier: Promise<unknown>[] = [];
    for (const m of this.inflight) if (m.start < end && offset < m.end) earlier.push(m.settled);
    const run = earlier.length === 0 ? op() : Promise.all(earlier).then(op);
    const m: Mutation = { start: offset, end, settled: run.catch(() => {}) };
    this.inflight.add(m);
    try {
      await run;
    } finally {
      this.inflight.delete(m);
    }
  }

  static async open(path: string, size: number, readOnly = false): Promise<FileBackend> {
    try {
      const fh = await fsp.open(path, readOnly ? 'r' : 'r+');
      return new FileBackend(fh, size, readOnly, path);
    } catch (err) {
      throw new IoError(`cannot open ${path}: ${(err as Error).message}`, { cause: err });
    }
  }

  private wrap(op: string, err: unknown): never {
    throw new IoError(`${op} on ${this.path} failed: ${(err as Error).message}`, { cause: err });
  }

  async read(offset: number, length: number, into?: Buffer): Promise<Buffer> {
    const out = into ?? Buffer.allocUnsafe(length);
    let done = 0;
    try {
      while (done < length) {
        const { bytesRead } = await this.fh.read(out, done, length - done, offset + done);
        if (bytesRead === 0) break;
        done += bytesRead;
      }
    } catch (err) { this.wrap('read', err); }
    if (done < length) out.fill(0, done); // past EOF of a short file reads as zeroes
    return out;
  }

  async write(offset: number, data: Buffer, fua: boolean): Promise<void> {
    await this.ordered(offset, data.length, async () => {
      try {
        let done = 0;
        while (done < data.length) {
          const { bytesWritten } = await this.fh.write(data, done, data.length - done, offset + done);
          done += bytesWritten;
        }
      } catch (err) { this.wrap('write', err); }
    });
    if (fua) await this.flush();
  }

  async flush(): Promise<void> {
    try { await this.fh.datasync(); } catch (err) { this.wrap('flush', err); }
  }

  async trim(): Promise<void> {}

  async zero(offset: number, length: number, options: ZeroOptions): Promise<void> {
    await this.ordered(offset, length, async () => {
      try {
        let pos = offset;
        const end = offset + length;
        while (pos < end) {
          const n = Math.min(ZERO_CHUNK.length, end - pos);
          await this.fh.write(ZERO_CHUNK, 0, n, pos);
          pos += n;
        }
      } catch (err) { this.wrap('zero', err); }
    });
    if (options.fua) await this.flush();
  }

  async blockStatus(_offset: number, length: number, _maxExtents: number): Promise<Extent[]> {
    // One extent, whatever the range: O(1), and "data" is always a correct answer.
    return [{ length, flags: 0 }];
  }

  async cache(): Promise<void> {}

  async close(): Promise<void> {
    await this.fh.close();
  }
}

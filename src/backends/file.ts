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

export class FileBackend implements BlockBackend {
  private constructor(private readonly fh: fsp.FileHandle, readonly size: number, readonly readOnly: boolean, private readonly path: string) {}

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
    try {
      let done = 0;
      while (done < data.length) {
        const { bytesWritten } = await this.fh.write(data, done, data.length - done, offset + done);
        done += bytesWritten;
      }
      if (fua) await this.fh.datasync();
    } catch (err) { this.wrap('write', err); }
  }

  async flush(): Promise<void> {
    try { await this.fh.datasync(); } catch (err) { this.wrap('flush', err); }
  }

  async trim(): Promise<void> {}

  async zero(offset: number, length: number, options: ZeroOptions): Promise<void> {
    try {
      let pos = offset;
      const end = offset + length;
      while (pos < end) {
        const n = Math.min(ZERO_CHUNK.length, end - pos);
        await this.fh.write(ZERO_CHUNK, 0, n, pos);
        pos += n;
      }
      if (options.fua) await this.fh.datasync();
    } catch (err) { this.wrap('zero', err); }
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

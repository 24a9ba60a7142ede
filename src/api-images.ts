/**
 * Disk images in and out (Deployment.importImage / exportImage, `baton import` / `baton export`).
 *
 * Import makes a NEW volume from an image. A raw image is read in 1 MiB pieces and only pieces
 * that are not all zeroes are written (a new volume reads as zeroes: skipping them stores
 * nothing for them, and a sparse or mostly empty image costs only its data). The volume is
 * written under its lease, as an attach would (VolumeExports), and flushed every 256 MiB and
 * at the end; the import succeeds only once the last flush landed. Another format (qcow2,
 * vmdk, vdi, vhdx...) is first converted by `qemu-img convert -O raw` into a sparse temporary
 * file next to the image, which is then imported the same way. A failed or aborted import
 * removes the volume it created (nothing of the image is half there).
 *
 * Export writes a volume (or NAME@SNAP) as of its last acknowledged flush, read-only without
 * a lease (a read-only view, as `diff` uses): the output file is sized to the volume and only
 * the mapped ranges are written, so holes stay holes. `format: 'qcow2'` converts that raw file
 * with `qemu-img convert -O qcow2`.
 */

import { execFile } from 'node:child_process';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import { promisify } from 'node:util';
import { checkAborted, ByteMeter, type Deployment, type LongOperation } from './api.js';
import { AlreadyExistsError, BatonError, InvalidArgumentError, NotSupportedError, errorMessage, isBatonError } from './errors.js';
import { VolumeExports } from './exports.js';

const run = promisify(execFile);
const PIECE = 1024 * 1024;
const FLUSH_EVERY = 256 * 1024 * 1024;
const ZERO = Buffer.alloc(PIECE);

export interface ImportOptions extends LongOperation {
  /** The image's format: detected by qemu-img when absent (raw without it). */
  format?: string;
  /** The volume's size; default the image's (virtual) size rounded up to 4 KiB. At least that. */
  size?: number;
  /** The new volume expires this long from now. */
  expiresInMs?: number;
}

export interface ImportResult { name: string; size: number; format: string; imageBytes: number; writtenBytes: number; ms: number }

export interface ExportOptions extends LongOperation {
  /** raw (default) or qcow2 (needs qemu-img). */
  format?: 'raw' | 'qcow2';
  /** Replace an existing file. */
  overwrite?: boolean;
}

export interface ExportResult { name: string; size: number; format: string; writtenBytes: number; ms: number }

async function hasQemuImg(): Promise<boolean> {
  try { await run('qemu-img', ['--version']); return true; } catch { return false; }
}

/** What qemu-img says the image is, or null without qemu-img. */
async function probeImage(file: string): Promise<{ format: string; virtualSize: number } | null> {
  if (!(await hasQemuImg())) return null;
  try {
    const { stdout } = await run('qemu-img', ['info', '--output=json', file], { maxBuffer: 16 * 1024 * 1024 });
    const j = JSON.parse(stdout) as { format: string; 'virtual-size': number };
    return { format: j.format, virtualSize: j['virtual-size'] };
  } catch (err) {
    throw new InvalidArgumentError(`qemu-img cannot read ${file} as a disk image: ${errorMessage(err).split('\n').slice(-2).join(' ').trim()}`);
  }
}

const roundUp = (n: number): number => Math.ceil(n / 4096) * 4096;

export async function importImage(d: Deployment, name: string, file: string, o: ImportOptions = {}): Promise<ImportResult> {
  const what = `import ${name}`;
  const t0 = performance.now();
  checkAborted(o.signal, what);
  const catalog = d.storeCatalog('import');
  let st;
  try { st = await fsp.stat(file); } catch (err) { throw new InvalidArgumentError(`cannot read ${file}: ${errorMessage(err)}`); }
  if (!st.isFile()) throw new InvalidArgumentError(`${file} is not a regular file (import reads a disk image file)`);
  const probe = await probeImage(file);
  let format = o.format ?? probe?.format ?? 'raw';
  if (!probe && format === 'raw') {
    const head = Buffer.alloc(4);
    const fh = await fsp.open(file, 'r');
    try { await fh.read(head, 0, 4, 0); } finally { await fh.close(); }
    if (head.equals(Buffer.from('QFI\xfb', 'latin1'))) throw new NotSupportedError(`${file} is a qcow2 image: install qemu-img (Debian: apt install qemu-utils) to import it, or convert it to raw first`);
  }
  if (format !== 'raw' && !probe) throw new NotSupportedError(`importing a ${format} image needs qemu-img (Debian: apt install qemu-utils); without it only raw images are imported`);
  const imageSize = format === 'raw' ? st.size : probe!.virtualSize;
  const size = o.size ?? roundUp(Math.max(imageSize, 4096));
  if (size < imageSize) throw new InvalidArgumentError(`--size ${size} is smaller than the image (${imageSize} bytes): leave it out, or give at least that`);
  // Convert first (before the volume exists): a failure here leaves nothing behind.
  let raw = file;
  let tmp: string | null = null;
  if (format !== 'raw') {
    o.onProgress?.({ operation: 'import', phase: `converting ${format} to raw with qemu-img` });
    tmp = path.join(path.dirname(path.resolve(file)), `.${path.basename(file)}.baton-import-${process.pid}.raw`);
    try {
      await run('qemu-img', ['convert', '-f', format, '-O', 'raw', file, tmp], { maxBuffer: 16 * 1024 * 1024 });
    } catch (err) {
      await fsp.rm(tmp, { force: true });
      throw new BatonError('BATON_ERR_IO', `qemu-img could not convert ${file} (${format}) to raw: ${errorMessage(err).split('\n').slice(-2).join(' ').trim()}`);
    }
    raw = tmp;
  }
  try {
    checkAborted(o.signal, what);
    await d.create(name, { size, ...(o.expiresInMs !== undefined ? { expiresInMs: o.expiresInMs } : {}) });
    let written = 0;
    try {
      written = await writeRaw(d, name, raw, imageSize, o);
    } catch (err) {
      // Ours, made a moment ago and never complete: remove it (nobody else may have it).
      await d.rm(name).catch((rmErr: unknown) => {
        throw new BatonError(isBatonError(err) ? err.code : 'BATON_ERR_IO', `${what} failed (${errorMessage(err)}), and removing the partial volume failed too (${errorMessage(rmErr)}): remove it with baton rm ${name}`);
      });
      throw isBatonError(err) ? err : new BatonError('BATON_ERR_IO', `${what} failed: ${errorMessage(err)}; the partial volume was removed`, { cause: err });
    }
    return { name, size, format, imageBytes: imageSize, writtenBytes: written, ms: Math.round(performance.now() - t0) };
  } finally {
    if (tmp) await fsp.rm(tmp, { force: true });
  }
}

/** Write the non-zero 1 MiB pieces of a raw file into the (new, all-zero) volume, under its lease. */
async function writeRaw(d: Deployment, name: string, file: string, bytes: number, o: ImportOptions): Promise<number> {
  const what = `import ${name}`;
  const exports = new VolumeExports(d.storeCatalog('import'), { readOnly: false, idleGraceMs: 0, log: d.log, lease: { manager: await d.leaseManager(), hostId: d.hostId, onHeld: 'refuse', waitMs: 0 } });
  const meter = new ByteMeter('import', name, bytes, o.onProgress);
  const fh = await fsp.open(file, 'r');
  let written = 0;
  try {
    const h = await exports.open(name);
    try {
      meter.report(false);
      let sinceFlush = 0;
      for (let off = 0; off < bytes; off += PIECE) {
        checkAborted(o.signal, what);
        const len = Math.min(PIECE, bytes - off);
        const buf = Buffer.allocUnsafe(len); // the backend owns it after write()
        const { bytesRead } = await fh.read(buf, 0, len, off);
        if (bytesRead !== len) throw new BatonError('BATON_ERR_IO', `${file} ended at ${off + bytesRead} bytes while being read (was it changed during the import?)`);
        // Sectors of the image: writes go in whole 512-byte sectors (the last piece is padded).
        const zero = len === PIECE ? buf.equals(ZERO) : buf.equals(ZERO.subarray(0, len));
        if (!zero) {
          const padded = len % 512 === 0 ? buf : Buffer.concat([buf, Buffer.alloc(512 - (len % 512))]);
          await h.backend.write(off, padded, false);
          written += padded.length;
          sinceFlush += padded.length;
          if (sinceFlush >= FLUSH_EVERY) { await h.backend.flush(); sinceFlush = 0; }
        }
        meter.add(len);
      }
      await h.backend.flush();
      meter.report(true);
    } finally {
      h.release();
    }
  } finally {
    await fh.close();
    await exports.close(); // checkpoint, lease given back
  }
  return written;
}

export async function exportImage(d: Deployment, name: string, file: string, o: ExportOptions = {}): Promise<ExportResult> {
  const what = `export ${name}`;
  const t0 = performance.now();
  checkAborted(o.signal, what);
  const format = o.format ?? 'raw';
  if (format !== 'raw' && format !== 'qcow2') throw new InvalidArgumentError(`export writes raw or qcow2, not ${String(format)}`);
  if (format === 'qcow2' && !(await hasQemuImg())) throw new NotSupportedError('exporting qcow2 needs qemu-img (Debian: apt install qemu-utils); without it, export raw');
  if (!o.overwrite) {
    const exists = await fsp.stat(file).then(() => true, () => false);
    if (exists) throw new AlreadyExistsError(`${file} exists: remove it, pick another path, or add --force to overwrite it`);
  }
  const view = await d.storeCatalog('export').loadMap(name);
  const out = format === 'raw' ? file : path.join(path.dirname(path.resolve(file)), `.${path.basename(file)}.baton-export-${process.pid}.raw`);
  let written = 0;
  try {
    const ranges: { offset: number; length: number }[] = [];
    await view.forEachCommitted((e) => {
      if (e.key === null) return; // a hole or zeroes: left as a hole in the file
      const last = ranges[ranges.length - 1];
      if (last && last.offset + last.length === e.offset) last.length += e.length;
      else ranges.push({ offset: e.offset, length: e.length });
    });
    const total = ranges.reduce((n, r) => n + r.length, 0);
    const meter = new ByteMeter('export', name, total, o.onProgress);
    const fh = await fsp.open(out, 'w');
    try {
      await fh.truncate(view.size); // sparse: only mapped ranges get blocks
      meter.report(false);
      for (const r of ranges) {
        for (let off = r.offset; off < r.offset + r.length; off += PIECE) {
          checkAborted(o.signal, what);
          const len = Math.min(PIECE, r.offset + r.length - off);
          const buf = await view.read(off, len);
          await fh.write(buf, 0, len, off);
          written += len;
          meter.add(len);
        }
      }
      await fh.sync();
    } finally {
      await fh.close();
    }
    if (format === 'qcow2') {
      o.onProgress?.({ operation: 'export', phase: 'converting raw to qcow2 with qemu-img' });
      await run('qemu-img', ['convert', '-f', 'raw', '-O', 'qcow2', out, file], { maxBuffer: 16 * 1024 * 1024 });
    }
    meter.report(true);
    return { name, size: view.size, format, writtenBytes: written, ms: Math.round(performance.now() - t0) };
  } catch (err) {
    if (format === 'raw' || !o.overwrite) await fsp.rm(file, { force: true }).catch(() => {});
    throw err;
  } finally {
    await view.close();
    if (out !== file) await fsp.rm(out, { force: true });
  }
}

/**
 * Volumes by name, and the ExportProvider that serves them over NBD.
 *
 * A VolumeCatalog creates, lists, describes, removes and opens volumes in one store. This
 * is the seam where the object-store volume engine plugs in; today's catalogs are:
 * - FileCatalog (`file:DIR`): one sparse file per volume under DIR/volumes/NAME/.
 * - MemoryCatalog (`memory:`): volumes live as long as the process (tests, benchmarks).
 *
 * VolumeExports opens a volume on a client's first attach and shares the one backend
 * object among every connection to it (CAN_MULTI_CONN needs one cache and one flush path);
 * the last connection's release starts a grace period after which the volume is flushed and
 * closed, so a quick reconnect (INFO then GO, nbdinfo's second connection) reuses it.
 */

import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import type { BlockBackend, ExportHandle, ExportProvider, ExportSummary } from '../nbd/backend.js';
import { FileBackend } from './backends/file.js';
import { MemoryBackend } from './backends/memory.js';
import { AlreadyExistsError, InvalidArgumentError, NotFoundError, ShutdownError, errorMessage } from './errors.js';
import type { Logger } from './log.js';
import { formatSize } from './size.js';

export interface VolumeInfo {
  name: string;
  size: number;
  createdAt: string;
  /** Bytes the store holds for this volume. */
  storedBytes: number;
}

export interface OpenVolume {
  backend: BlockBackend;
  close(): Promise<void>;
}

export interface VolumeCatalog {
  readonly description: string;
  create(name: string, size: number): Promise<VolumeInfo>;
  list(): Promise<VolumeInfo[]>;
  info(name: string): Promise<VolumeInfo>;
  remove(name: string): Promise<void>;
  open(name: string, options: { readOnly: boolean }): Promise<OpenVolume>;
}

const NAME_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;

export function checkVolumeName(name: string): void {
  if (!NAME_RE.test(name)) {
    throw new InvalidArgumentError(`invalid volume name "${name}": use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit`);
  }
}

export function checkVolumeSize(size: number): void {
  if (!Number.isSafeInteger(size) || size <= 0) throw new InvalidArgumentError('volume size must be a positive number of bytes');
  if (size % 4096 !== 0) throw new InvalidArgumentError(`volume size ${size} is not a multiple of 4096 bytes`);
}

// ------------------------------------------------------------------ file:DIR

interface VolumeRecord {
  format: 'baton-file-volume-1';
  name: string;
  size: number;
  createdAt: string;
}

export class FileCatalog implements VolumeCatalog {
  readonly description: string;
  private readonly volumesDir: string;

  constructor(readonly dir: string) {
    this.description = `file:${dir}`;
    this.volumesDir = path.join(dir, 'volumes');
  }

  private volDir(name: string): string {
    checkVolumeName(name);
    return path.join(this.volumesDir, name);
  }

  async create(name: string, size: number): Promise<VolumeInfo> {
    checkVolumeSize(size);
    const dir = this.volDir(name);
    await fsp.mkdir(this.volumesDir, { recursive: true });
    try {
      await fsp.mkdir(dir);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'EEXIST') throw new AlreadyExistsError(`volume "${name}" already exists in ${this.description}`);
      throw err;
    }
    const fh = await fsp.open(path.join(dir, 'disk.img'), 'wx');
    try {
      await fh.truncate(size);
      await fh.sync();
    } finally {
      await fh.close();
    }
    const rec: VolumeRecord = { format: 'baton-file-volume-1', name, size, createdAt: new Date().toISOString() };
    // The record is written last and atomically: a directory without it is a half-made volume.
    const tmp = path.join(dir, 'volume.json.tmp');
    await fsp.writeFile(tmp, JSON.stringify(rec, null, 2) + '\n');
    const th = await fsp.open(tmp, 'r');
    await th.sync();
    await th.close();
    await fsp.rename(tmp, path.join(dir, 'volume.json'));
    await syncDir(dir);
    await syncDir(this.volumesDir);
    return this.info(name);
  }

  async list(): Promise<VolumeInfo[]> {
    let names: string[];
    try {
      names = await fsp.readdir(this.volumesDir);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'ENOENT') return [];
      throw err;
    }
    const out: VolumeInfo[] = [];
    for (const n of names.sort()) {
      if (!NAME_RE.test(n)) continue;
      try { out.push(await this.info(n)); } catch (err) { if (!(err instanceof NotFoundError)) throw err; }
    }
    return out;
  }

  async info(name: string): Promise<VolumeInfo> {
    const dir = this.volDir(name);
    let rec: VolumeRecord;
    try {
      rec = JSON.parse(await fsp.readFile(path.join(dir, 'volume.json'), 'utf8')) as VolumeRecord;
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'ENOENT') throw new NotFoundError(`no volume "${name}" in ${this.description} (see: baton ls --store ${this.description})`);
      throw err;
    }
    const st = await fsp.stat(path.join(dir, 'disk.img'));
    return { name: rec.name, size: rec.size, createdAt: rec.createdAt, storedBytes: st.blocks * 512 };
  }

  async remove(name: string): Promise<void> {
    await this.info(name);
    const dir = this.volDir(name);
    // Remove the record first: from then on the volume does not exist, whatever is left.
    await fsp.rm(path.join(dir, 'volume.json'));
    await fsp.rm(dir, { recursive: true, force: true });
    await syncDir(this.volumesDir);
  }

  async open(name: string, options: { readOnly: boolean }): Promise<OpenVolume> {
    const info = await this.info(name);
    const backend = await FileBackend.open(path.join(this.volDir(name), 'disk.img'), info.size, options.readOnly);
    return { backend, close: () => backend.close() };
  }
}

async function syncDir(dir: string): Promise<void> {
  const fd = fs.openSync(dir, 'r');
  try { fs.fsyncSync(fd); } finally { fs.closeSync(fd); }
}

// ------------------------------------------------------------------ memory:

export class MemoryCatalog implements VolumeCatalog {
  readonly description = 'memory:';
  private readonly volumes = new Map<string, { info: VolumeInfo; backend: MemoryBackend }>();

  async create(name: string, size: number): Promise<VolumeInfo> {
    checkVolumeName(name);
    checkVolumeSize(size);
    if (this.volumes.has(name)) throw new AlreadyExistsError(`volume "${name}" already exists in memory:`);
    const v = { info: { name, size, createdAt: new Date().toISOString(), storedBytes: 0 }, backend: new MemoryBackend(size) };
    this.volumes.set(name, v);
    return { ...v.info };
  }

  async list(): Promise<VolumeInfo[]> {
    return [...this.volumes.keys()].sort().map((n) => this.infoSync(n));
  }

  private infoSync(name: string): VolumeInfo {
    const v = this.volumes.get(name);
    if (!v) throw new NotFoundError(`no volume "${name}" in memory:`);
    return { ...v.info, storedBytes: v.backend.allocatedBytes };
  }

  async info(name: string): Promise<VolumeInfo> { return this.infoSync(name); }

  async remove(name: string): Promise<void> {
    this.infoSync(name);
    this.volumes.delete(name);
  }

  async open(name: string, options: { readOnly: boolean }): Promise<OpenVolume> {
    const v = this.volumes.get(name);
    if (!v) throw new NotFoundError(`no volume "${name}" in memory:`);
    const b = v.backend;
    const backend: BlockBackend = options.readOnly ? readOnlyView(b) : b;
    return { backend, close: async () => {} };
  }
}

function readOnlyView(b: BlockBackend): BlockBackend {
  return {
    size: b.size,
    readOnly: true,
    read: (o, l, into) => b.read(o, l, into),
    write: () => Promise.reject(new InvalidArgumentError('read-only')),
    flush: async () => {},
    trim: () => Promise.reject(new InvalidArgumentError('read-only')),
    zero: () => Promise.reject(new InvalidArgumentError('read-only')),
    blockStatus: (o, l) => b.blockStatus(o, l),
    cache: (o, l) => b.cache(o, l),
  };
}

// ------------------------------------------------------------------ the NBD provider

interface Served {
  name: string;
  refs: number;
  opening: Promise<OpenVolume>;
  idleTimer: NodeJS.Timeout | null;
}

export interface VolumeExportsOptions {
  readOnly: boolean;
  /** How long a volume stays open after its last client left. */
  idleGraceMs: number;
  log: Logger;
}

export class VolumeExports implements ExportProvider {
  private readonly served = new Map<string, Served>();
  private closing = false;

  constructor(private readonly catalog: VolumeCatalog, private readonly opts: VolumeExportsOptions) {}

  async list(): Promise<ExportSummary[]> {
    const vols = await this.catalog.list();
    return vols.map((v) => ({ name: v.name, description: describe(v) }));
  }

  /** "" (nbd-client without -N) means the only volume, if there is exactly one. */
  private async resolve(name: string): Promise<string> {
    if (name !== '') return name;
    const vols = await this.catalog.list();
    if (vols.length === 1) return vols[0]!.name;
    throw new NotFoundError(vols.length === 0
      ? `no volumes in ${this.catalog.description}; create one with: baton create NAME --size 10G`
      : `no export name given and there are ${vols.length} volumes; name one (nbd-client -N NAME, nbd://host/NAME): ${vols.map((v) => v.name).join(', ')}`);
  }

  async open(requested: string): Promise<ExportHandle> {
    if (this.closing) throw new ShutdownError('server is shutting down');
    const name = await this.resolve(requested);
    checkVolumeName(name);
    let s = this.served.get(name);
    if (!s) {
      const opening = this.catalog.open(name, { readOnly: this.opts.readOnly });
      s = { name, refs: 0, opening, idleTimer: null };
      this.served.set(name, s);
      opening.catch(() => { if (this.served.get(name) === s) this.served.delete(name); });
      opening.then(() => this.opts.log.info({ volume: name }, 'volume opened'), () => {});
    }
    s.refs++;
    if (s.idleTimer) { clearTimeout(s.idleTimer); s.idleTimer = null; }
    let vol: OpenVolume;
    try {
      vol = await s.opening;
    } catch (err) {
      s.refs--;
      throw err;
    }
    const info = await this.catalog.info(name).catch(() => null);
    let released = false;
    const served = s;
    return {
      name,
      description: info ? describe(info) : name,
      backend: vol.backend,
      release: () => {
        if (released) return;
        released = true;
        served.refs--;
        if (served.refs === 0) served.idleTimer = setTimeout(() => void this.closeIdle(served), this.opts.idleGraceMs);
      },
    };
  }

  private async closeIdle(s: Served): Promise<void> {
    if (s.refs > 0 || this.served.get(s.name) !== s) return;
    this.served.delete(s.name);
    await this.closeVolume(s);
  }

  private async closeVolume(s: Served): Promise<void> {
    try {
      const vol = await s.opening;
      if (!vol.backend.readOnly) await vol.backend.flush();
      await vol.close();
      this.opts.log.info({ volume: s.name }, 'volume closed');
    } catch (err) {
      this.opts.log.error({ volume: s.name, err: errorMessage(err) }, 'closing volume failed');
    }
  }

  /** Flush and close every open volume (server shutdown, after the sessions ended). */
  async close(): Promise<void> {
    this.closing = true;
    const all = [...this.served.values()];
    this.served.clear();
    for (const s of all) if (s.idleTimer) clearTimeout(s.idleTimer);
    await Promise.all(all.map((s) => this.closeVolume(s)));
  }
}

function describe(v: VolumeInfo): string {
  return `baton volume ${v.name}, ${formatSize(v.size)}`;
}

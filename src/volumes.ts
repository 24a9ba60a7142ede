/**
 * Volumes by name, and the ExportProvider that serves them over NBD.
 *
 * A VolumeCatalog creates, lists, describes, removes and opens volumes in one store. This
 * is the seam where the object-store volume engine plugs in; today's catalogs are:
 * - FileCatalog (`file:DIR`): one sparse file per volume under DIR/volumes/NAME/.
 * - MemoryCatalog (`memory:`): volumes live as long as the process (tests, benchmarks).
 *
 * src/exports.ts serves them over NBD.
 */

import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import type { BlockBackend } from '../nbd/backend.js';
import { FileBackend } from './backends/file.js';
import { MemoryBackend } from './backends/memory.js';
import { AlreadyExistsError, InvalidArgumentError, NotFoundError, ReadOnlyError } from './errors.js';
import type { HydrateOptions } from './volume/hydrate.js';
import type { Volume } from './volume/volume.js';

export interface VolumeInfo {
  name: string;
  size: number;
  createdAt: string;
  /** Bytes the store holds under this volume's own prefix. */
  storedBytes: number;
  kind?: 'volume' | 'snapshot';
  /** For forks and snapshots: the volume id and log position they started from. */
  parent?: { id: string; seq: number };
  /** Space accounting from the maps (object-store volumes): data bytes mapped... */
  writtenBytes?: number;
  /** ...of which no other volume or snapshot maps the same stored bytes... */
  exclusiveBytes?: number;
  /** ...and of which at least one relative maps them too. */
  sharedBytes?: number;
  /** The same three in stored bytes (after compression: cow/diff.ts Accounting). */
  writtenStoredBytes?: number;
  exclusiveStoredBytes?: number;
  sharedStoredBytes?: number;
  /** How it stores data (object-store volumes): format, compression, and whether it is encrypted (with which master key id). */
  data?: { format: string; compression: string; encrypted: boolean; keyId?: string };
}

export interface OpenVolume {
  backend: BlockBackend;
  close(): Promise<void>;
  /** Set for object-store volumes: the engine, which takes part in leases and fencing. */
  volume?: Volume;
}

export interface RemoveResult { deletedObjects: number; keptForRelatives: boolean }

/** What one record says about a volume (object-store catalogs): enough to serve it, nothing counted. */
export interface VolumeIdentity {
  /** The store identity: a volume removed and created again under the same name has another id. */
  id: string;
  size: number;
  snapshot?: boolean;
}

export interface VolumeCatalog {
  readonly description: string;
  /** `data`: how an object-store volume stores its data (compression, encryption); plain backends store raw bytes and refuse encryption. */
  create(name: string, size: number, data?: { compression?: 'lz4' | 'none'; encrypt?: boolean; format?: 'framed' | 'raw' }): Promise<VolumeInfo>;
  /** Every volume with its figures (may cost requests per volume: for `baton ls`, not for NBD). */
  list(): Promise<VolumeInfo[]>;
  /**
   * The names of every volume and snapshot, sorted: at most one listing, no per-volume
   * request. What NBD_OPT_LIST and the empty export name need; an unauthenticated client
   * can ask for it as often as it likes.
   */
  names(): Promise<string[]>;
  /**
   * Object-store catalogs: the volume's record alone (one GET, no listing). NotFoundError if
   * there is none. Without it, callers use info() (cheap for the local catalogs).
   */
  record?(name: string): Promise<VolumeIdentity>;
  info(name: string): Promise<VolumeInfo>;
  /** Removes the volume; says whether its stored data had to stay for relatives (forks). */
  remove(name: string): Promise<RemoveResult>;
  open(name: string, options: { readOnly: boolean }): Promise<OpenVolume>;
  /**
   * Object-store catalogs: start fetching the volume's working set from its newest checkpoint
   * into the read cache, without opening it for serving (no lease, reads only): what a host
   * does while it waits for another host to hand the volume over. Best effort, in the
   * background; stop() ends it (the served volume's own hydration then takes over).
   */
  prehydrate?(name: string, options: HydrateOptions): { stop(): void };
}

const NAME_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;

export function checkVolumeName(name: string): void {
  if (!NAME_RE.test(name)) {
    throw new InvalidArgumentError(`invalid volume name "${name}": use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit`);
  }
}

/** A volume name, or a snapshot name NAME@SNAP (both parts volume-name shaped). */
export function checkExportName(name: string): void {
  const at = name.indexOf('@');
  if (at < 0) { checkVolumeName(name); return; }
  checkVolumeName(name.slice(0, at));
  const snap = name.slice(at + 1);
  if (!NAME_RE.test(snap)) throw new InvalidArgumentError(`invalid snapshot name "${snap}" in "${name}": use letters, digits, '.', '_' or '-'`);
}

export function isSnapshotName(name: string): boolean {
  return name.includes('@');
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

  async create(name: string, size: number, data: { encrypt?: boolean } = {}): Promise<VolumeInfo> {
    if (data.encrypt) throw new InvalidArgumentError(`${this.description} stores plain bytes: encryption needs an object store (file:DIR, s3://)`);
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
    const out: VolumeInfo[] = [];
    for (const n of await this.names()) {
      try { out.push(await this.info(n)); } catch (err) { if (!(err instanceof NotFoundError)) throw err; }
    }
    return out;
  }

  /** One readdir, then one stat per entry (a local directory, not a store). */
  async names(): Promise<string[]> {
    let names: string[];
    try {
      names = await fsp.readdir(this.volumesDir);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'ENOENT') return [];
      throw err;
    }
    const out: string[] = [];
    for (const n of names.sort()) {
      if (!NAME_RE.test(n)) continue;
      // A directory without its record is a half-made (or half-removed) volume: not listed.
      try { await fsp.access(path.join(this.volumesDir, n, 'volume.json')); out.push(n); } catch { /* not a volume */ }
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

  async remove(name: string): Promise<RemoveResult> {
    await this.info(name);
    const dir = this.volDir(name);
    // Remove the record first: from then on the volume does not exist, whatever is left.
    await fsp.rm(path.join(dir, 'volume.json'));
    await fsp.rm(dir, { recursive: true, force: true });
    await syncDir(this.volumesDir);
    return { deletedObjects: 1, keptForRelatives: false };
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

  async create(name: string, size: number, data: { encrypt?: boolean } = {}): Promise<VolumeInfo> {
    if (data.encrypt) throw new InvalidArgumentError(`${this.description} stores plain bytes: encryption needs an object store (file:DIR, s3://)`);
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

  async names(): Promise<string[]> {
    return [...this.volumes.keys()].sort();
  }

  private infoSync(name: string): VolumeInfo {
    const v = this.volumes.get(name);
    if (!v) throw new NotFoundError(`no volume "${name}" in memory:`);
    return { ...v.info, storedBytes: v.backend.allocatedBytes };
  }

  async info(name: string): Promise<VolumeInfo> { return this.infoSync(name); }

  async remove(name: string): Promise<RemoveResult> {
    this.infoSync(name);
    this.volumes.delete(name);
    return { deletedObjects: 0, keptForRelatives: false };
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
    write: () => Promise.reject(new ReadOnlyError('volume is served read-only')),
    flush: async () => {},
    trim: () => Promise.reject(new ReadOnlyError('volume is served read-only')),
    zero: () => Promise.reject(new ReadOnlyError('volume is served read-only')),
    blockStatus: (o, l, max) => b.blockStatus(o, l, max),
    cache: (o, l) => b.cache(o, l),
  };
}

/**
 * StoreCatalog: volumes in an object store (the engine behind `file:DIR` and `s3://`).
 * A volume exists exactly when its record `volumes/<name>` exists; the record is created
 * with a create-only put, so two hosts creating the same name cannot both succeed.
 */

import { randomBytes } from 'node:crypto';
import type { BlockCache } from '../cache.js';
import { AlreadyExistsError, NotFoundError, PreconditionFailedError } from '../errors.js';
import type { Logger } from '../log.js';
import { listAll, type ObjectStore } from '../store/object-store.js';
import { checkVolumeName, checkVolumeSize, type OpenVolume, type VolumeCatalog, type VolumeInfo } from '../volumes.js';
import { decodeVolumeRecord, encodeVolumeRecord, keys, type VolumeRecord } from './format.js';
import { mapLimit, Volume, type VolumeOptions } from './volume.js';

export interface StoreCatalogOptions {
  store: ObjectStore;
  log: Logger;
  /** The process-wide read cache, made on first open. */
  cache: () => Promise<BlockCache>;
  volume?: Partial<Omit<VolumeOptions, 'store' | 'cache' | 'log' | 'readOnly'>>;
}

export class StoreCatalog implements VolumeCatalog {
  readonly description: string;
  constructor(private readonly opts: StoreCatalogOptions) {
    this.description = opts.store.description;
  }

  get store(): ObjectStore { return this.opts.store; }

  async create(name: string, size: number): Promise<VolumeInfo> {
    checkVolumeName(name);
    checkVolumeSize(size);
    const rec: VolumeRecord = { format: 'baton-volume-1', name, id: randomBytes(8).toString('hex'), size, createdAt: new Date().toISOString() };
    try {
      await this.opts.store.put(keys.volumeRecord(name), encodeVolumeRecord(rec), { ifNoneMatch: true });
    } catch (err) {
      if (err instanceof PreconditionFailedError) throw new AlreadyExistsError(`volume "${name}" already exists in ${this.description}`);
      throw err;
    }
    return { name, size, createdAt: rec.createdAt, storedBytes: 0 };
  }

  async record(name: string): Promise<VolumeRecord> {
    checkVolumeName(name);
    const key = keys.volumeRecord(name);
    try {
      return decodeVolumeRecord(await this.opts.store.get(key), key);
    } catch (err) {
      if (err instanceof NotFoundError) throw new NotFoundError(`no volume "${name}" in ${this.description} (list them with: baton ls --store ${this.description})`);
      throw err;
    }
  }

  private async describe(rec: VolumeRecord): Promise<VolumeInfo> {
    const objs = await listAll(this.opts.store, keys.volumePrefix(rec.id));
    return { name: rec.name, size: rec.size, createdAt: rec.createdAt, storedBytes: objs.reduce((n, o) => n + o.size, 0) };
  }

  async list(): Promise<VolumeInfo[]> {
    const recs = await listAll(this.opts.store, keys.volumesPrefix);
    const infos = await mapLimit(recs, 8, async (o) => {
      try {
        return await this.describe(decodeVolumeRecord(await this.opts.store.get(o.key), o.key));
      } catch (err) {
        if (err instanceof NotFoundError) return null; // removed while we listed
        throw err;
      }
    });
    return infos.filter((v): v is VolumeInfo => v !== null);
  }

  async info(name: string): Promise<VolumeInfo> {
    return this.describe(await this.record(name));
  }

  async remove(name: string): Promise<void> {
    const rec = await this.record(name);
    // The record goes first: from then on the volume does not exist, whatever is left.
    await this.opts.store.delete(keys.volumeRecord(name));
    const objs = await listAll(this.opts.store, keys.volumePrefix(rec.id));
    await mapLimit(objs, 16, (o) => this.opts.store.delete(o.key));
  }

  async open(name: string, options: { readOnly: boolean }): Promise<OpenVolume> {
    const rec = await this.record(name);
    const vol = await Volume.open(rec, { ...this.opts.volume, store: this.opts.store, cache: await this.opts.cache(), log: this.opts.log, readOnly: options.readOnly });
    return { backend: vol, close: () => vol.close(), volume: vol };
  }
}

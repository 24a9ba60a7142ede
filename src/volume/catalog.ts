/**
 * StoreCatalog: volumes in an object store (the engine behind `file:DIR` and `s3://`).
 * A volume exists exactly when its record `volumes/<name>` exists; the record is created
 * with a create-only put, so two hosts creating the same name cannot both succeed.
 */

import { randomBytes } from 'node:crypto';
import type { BlockCache } from '../cache.js';
import { AlreadyExistsError, InvalidArgumentError, NotFoundError, PreconditionFailedError, TimeoutError } from '../errors.js';
import { accountMaps, diffMaps, type MappedExtent, type Range } from '../../cow/diff.js';
import type { Logger } from '../log.js';
import { listAll, type ObjectStore } from '../store/object-store.js';
import { checkExportName, checkVolumeName, checkVolumeSize, type OpenVolume, type RemoveResult, type VolumeCatalog, type VolumeInfo } from '../volumes.js';
import { decodeVolumeRecord, encodeVolumeRecord, keys, maxOperationMs, seqFromKey, type VolumeRecord } from './format.js';
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
    await this.putRecord(rec);
    return { name, size, createdAt: rec.createdAt, storedBytes: 0, kind: 'volume' };
  }

  /** The id-keyed copy first (harmless if the name then turns out taken), then the name. */
  private async putRecord(rec: VolumeRecord): Promise<void> {
    await this.opts.store.put(keys.meta(rec.id), encodeVolumeRecord(rec), { ifNoneMatch: true });
    try {
      await this.opts.store.put(keys.volumeRecord(rec.name), encodeVolumeRecord(rec), { ifNoneMatch: true });
    } catch (err) {
      await this.opts.store.delete(keys.meta(rec.id)).catch(() => {});
      if (err instanceof PreconditionFailedError) throw new AlreadyExistsError(`${rec.snapshot ? 'snapshot' : 'volume'} "${rec.name}" already exists in ${this.description}`);
      throw err;
    }
  }

  /**
   * The log position a fork made now starts from: the last record in the source's log. Every
   * flush acknowledged before this call is in the log (a flush is acknowledged only after
   * its record's put was), so the fork includes it; nothing unflushed can be in the log.
   * Cost: two LISTs, whatever the volume's size.
   */
  private async forkPoint(src: VolumeRecord): Promise<{ id: string; seq: number }> {
    if (src.snapshot) return src.parent!; // a snapshot is already a fixed point
    const cps = await listAll(this.opts.store, keys.checkpointPrefix(src.id));
    const lastCp = cps.length > 0 ? seqFromKey(cps[cps.length - 1]!.key) : 0;
    const logs = await listAll(this.opts.store, keys.logPrefix(src.id), lastCp > 0 ? { startAfter: keys.log(src.id, lastCp) } : {});
    const seq = logs.length > 0 ? seqFromKey(logs[logs.length - 1]!.key) : lastCp;
    if (seq === 0 && src.parent) return src.parent; // nothing written since it was forked itself
    return { id: src.id, seq };
  }

  /**
   * Write-then-check against a concurrent `rm` of the source: rm deletes the source's
   * record first and only then looks for descendants; we write our record first and only
   * then check that the source's record is still there. Whatever the interleaving, either
   * rm sees our record (and keeps the data) or we see the source gone (and undo the fork).
   */
  private async confirmSource(srcName: string, src: VolumeRecord, rec: VolumeRecord): Promise<void> {
    const still = await this.record(srcName).catch((err) => { if (err instanceof NotFoundError) return null; throw err; });
    if (still && still.id === src.id) return;
    await this.undo(rec);
    throw new NotFoundError(`${srcName} was removed while ${rec.name} was being made from it; nothing was created`);
  }

  private async undo(rec: VolumeRecord): Promise<void> {
    await this.opts.store.delete(keys.volumeRecord(rec.name)).catch(() => {});
    await this.opts.store.delete(keys.meta(rec.id)).catch(() => {});
  }

  /**
   * Make a fork or snapshot `name` of `srcName` at its last acknowledged flush. GC safety:
   * between reading the fork point and landing the record, the objects the point names are
   * protected only by GC's grace period (>= 2x maxOperationMs, see gc.ts); an attempt slower
   * than half of that is undone and made again, never trusted.
   */
  private async derive(srcName: string, name: string, snapshot: boolean): Promise<VolumeRecord> {
    const src = await this.record(srcName);
    for (let attempt = 1; ; attempt++) {
      const t0 = performance.now();
      const parent = await this.forkPoint(src);
      const rec: VolumeRecord = {
        format: 'baton-volume-1', name, id: randomBytes(8).toString('hex'), size: src.size, createdAt: new Date().toISOString(), parent,
        ...(snapshot ? { snapshot: true } : {}),
      };
      await this.putRecord(rec);
      await this.confirmSource(srcName, src, rec);
      const ms = performance.now() - t0;
      if (ms <= this.maxOpMs / 2) return rec;
      await this.undo(rec);
      if (attempt >= 3) throw new TimeoutError(`making ${name} took ${Math.round(ms)} ms (${attempt} tries), too long to be sure garbage collection left its source alone; nothing was created: is the store slow? try again`);
      this.opts.log.warn({ name, ms: Math.round(ms), attempt }, 'fork took too long to trust against GC; undone, trying again');
    }
  }

  private get maxOpMs(): number { return this.opts.volume?.maxOperationMs ?? maxOperationMs(); }

  /** O(1) fork: a new writable volume whose map starts as SRC's (a volume or NAME@SNAP) at its last acknowledged flush. */
  async fork(srcName: string, dstName: string): Promise<VolumeInfo> {
    checkExportName(srcName);
    checkVolumeName(dstName);
    const rec = await this.derive(srcName, dstName, false);
    return { name: dstName, size: rec.size, createdAt: rec.createdAt, storedBytes: 0, kind: 'volume', parent: rec.parent! };
  }

  /** A read-only point-in-time snapshot NAME@SNAP of a volume's last acknowledged flush. */
  async snapshot(volumeName: string, snapName: string): Promise<VolumeInfo> {
    checkVolumeName(volumeName);
    const name = `${volumeName}@${snapName}`;
    checkExportName(name);
    const rec = await this.derive(volumeName, name, true);
    return { name, size: rec.size, createdAt: rec.createdAt, storedBytes: 0, kind: 'snapshot', parent: rec.parent! };
  }

  async record(name: string): Promise<VolumeRecord> {
    checkExportName(name);
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
    return {
      name: rec.name, size: rec.size, createdAt: rec.createdAt, storedBytes: objs.reduce((n, o) => n + o.size, 0),
      kind: rec.snapshot ? 'snapshot' : 'volume', ...(rec.parent ? { parent: rec.parent } : {}),
    };
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

  /**
   * Remove a volume or snapshot. The record goes first: from then on it does not exist. Its
   * objects are deleted only if no fork or snapshot descends from it (they may map its
   * objects); otherwise they stay for garbage collection, which knows who still needs them.
   */
  async remove(name: string): Promise<RemoveResult> {
    const rec = await this.record(name);
    await this.opts.store.delete(keys.volumeRecord(name));
    if (await this.hasDescendants(rec.id)) return { deletedObjects: 0, keptForRelatives: true };
    const objs = await listAll(this.opts.store, keys.volumePrefix(rec.id));
    // meta last: while any object is left, the id still explains what it belongs to.
    const meta = keys.meta(rec.id);
    await mapLimit(objs.filter((o) => o.key !== meta), 16, (o) => this.opts.store.delete(o.key));
    await this.opts.store.delete(meta);
    return { deletedObjects: objs.length, keptForRelatives: false };
  }

  /** Does any existing volume or snapshot have `id` among its ancestors? */
  private async hasDescendants(id: string): Promise<boolean> {
    const recs = await this.allRecords();
    const metaCache = new Map<string, VolumeRecord | null>();
    const parentOf = async (vid: string): Promise<string | undefined> => {
      if (!metaCache.has(vid)) metaCache.set(vid, await this.opts.store.get(keys.meta(vid)).then((b) => decodeVolumeRecord(b, vid), () => null));
      return metaCache.get(vid)?.parent?.id;
    };
    for (const r of recs) {
      let p = r.parent?.id;
      for (let depth = 0; p && depth < 10_000; depth++) {
        if (p === id) return true;
        p = await parentOf(p);
      }
    }
    return false;
  }

  async allRecords(): Promise<VolumeRecord[]> {
    const objs = await listAll(this.opts.store, keys.volumesPrefix);
    const recs = await mapLimit(objs, 8, (o) => this.opts.store.get(o.key).then((b) => decodeVolumeRecord(b, o.key), (err) => {
      if (err instanceof NotFoundError) return null;
      throw err;
    }));
    return recs.filter((r): r is VolumeRecord => r !== null);
  }

  /** Byte ranges where two volumes/snapshots differ, from their maps (no data read). */
  async diff(a: string, b: string): Promise<Range[]> {
    const [va, vb] = await Promise.all([this.loadMap(a), this.loadMap(b)]);
    if (va.size !== vb.size) throw new InvalidArgumentError(`${a} and ${b} have different sizes (${va.size} and ${vb.size})`);
    return diffMaps(va.committedExtents(), vb.committedExtents());
  }

  /** Every volume and snapshot with space accounting (loads every map: O(total extents)). */
  async listWithAccounting(): Promise<VolumeInfo[]> {
    const infos = await this.list();
    const maps = new Map<string, MappedExtent[]>();
    await mapLimit(infos, 4, async (v) => { maps.set(v.name, [...(await this.loadMap(v.name)).committedExtents()]); });
    const acc = accountMaps(maps);
    return infos.map((v) => ({ ...v, ...acc.get(v.name) }));
  }

  /** Load a volume's map without serving it (read-only; no lease, no cache reads). */
  async loadMap(name: string): Promise<Volume> {
    return this.openView(await this.record(name));
  }

  /** A read-only view of a record's map, optionally recovered through another store (GC tracks what recovery reads). */
  async openView(rec: VolumeRecord, store: ObjectStore = this.opts.store, quiet = false): Promise<Volume> {
    const log = quiet ? this.opts.log.child({}, { level: 'warn' }) : this.opts.log;
    return Volume.open(rec, { ...this.opts.volume, store, cache: await this.opts.cache(), log, readOnly: true });
  }

  /**
   * Names of every volume and snapshot, from the keys of one listing of `volumes/` (no GET, no
   * per-volume listing): what NBD_OPT_LIST and the empty export name cost.
   */
  async names(): Promise<string[]> {
    const recs = await listAll(this.opts.store, keys.volumesPrefix);
    return recs.map((o) => o.key.slice(keys.volumesPrefix.length)).filter((n) => {
      try { checkExportName(n); return true; } catch { return false; } // a stray key is not a volume
    });
  }

  get logger(): Logger { return this.opts.log; }

  async open(name: string, options: { readOnly: boolean }): Promise<OpenVolume> {
    const rec = await this.record(name);
    const vol = await Volume.open(rec, { ...this.opts.volume, store: this.opts.store, cache: await this.opts.cache(), log: this.opts.log, readOnly: options.readOnly || !!rec.snapshot });
    return { backend: vol, close: () => vol.close(), volume: vol };
  }
}

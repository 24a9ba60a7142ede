/**
 * StoreCatalog: volumes in an object store (the engine behind `file:DIR` and `s3://`).
 * A volume exists exactly when its record `volumes/<name>` exists; the record is created
 * with a create-only put, so two hosts creating the same name cannot both succeed, and
 * creating it is all or nothing (putRecord). A snapshot belongs to the volume identity it
 * was taken of (`of`), and a volume with snapshots is not removed without them. `rm`
 * deletes data only when it knows nothing descends from it (remove, hasDescendants).
 */

import { randomId, systemWorld, type World } from '../clock.js';
import type { BlockCache } from '../cache.js';
import { AlreadyExistsError, BatonError, CorruptError, InvalidArgumentError, NotFoundError, PreconditionFailedError, StoreUnavailableError, TimeoutError, errorMessage } from '../errors.js';
import { accountMaps, diffMaps, type MappedExtent, type Range } from '../../cow/diff.js';
import type { Logger } from '../log.js';
import { keysOf, listAll, type ObjectInfo, type ObjectStore } from '../store/object-store.js';
import { checkExportName, checkVolumeName, checkVolumeSize, type OpenVolume, type RemoveResult, type VolumeCatalog, type VolumeInfo } from '../volumes.js';
import { DEFAULT_DATA, dataSettings, decodeAttrsRecord, decodeVolumeRecord, encodeVolumeRecord, forkMarkerOf, keys, maxOperationMs, seqFromKey, timeBounds, type AttrsRecord, type DataSettings, type VolumeRecord } from './format.js';
import { GC_STATE_KEY, decodeGcState } from './gc-state.js';
import type { HydrateOptions } from './hydrate.js';
import { derivedEncryption, frameKeysFor, newEncryption, type MasterKey } from './keys.js';
import { mapLimit, Volume, type VolumeOptions } from './volume.js';

export interface StoreCatalogOptions {
  store: ObjectStore;
  log: Logger;
  /** The process-wide read cache, made on first open. */
  cache: () => Promise<BlockCache>;
  volume?: Partial<Omit<VolumeOptions, 'store' | 'cache' | 'log' | 'readOnly' | 'frameKeys'>>;
  /**
   * The master key of encrypted volumes (keys.ts), asked for only when one is needed: to create
   * an encrypted volume, fork one, or open one (null: none was given; those are then refused).
   */
  masterKey?: () => MasterKey | null;
}

/** How a new volume stores its data (format.ts DataSettings); defaults: framed, lz4. */
export interface CreateOptions {
  format?: DataSettings['format'];
  compression?: DataSettings['compression'];
  /** Encrypt its data with a data key of its own, wrapped by the master key (keys.ts). */
  encrypt?: boolean;
  /** When it expires (ISO time; docs/rfc-lifecycle.md). */
  expiresAt?: string;
}

/** Attempts at a name record's put whose earlier attempts provably did not land. */
const PUT_RECORD_ATTEMPTS = 3;
/** Attempts at making a record whose earlier attempts were too slow to trust (undone: landRecord). */
const SLOW_ATTEMPTS = 3;
const MAX_ANCESTRY = 10_000;
/** Keys in one page of an S3 listing: reading past that many costs another round trip (forkPoint). */
const LIST_PAGE_KEYS = 1000;

/** For a snapshot: the volume identity it was taken of; `volume` is null when that volume is gone. */
export interface SnapshotOf {
  /** The id of the volume it was taken of (null: an old record without `of`, whose volume is gone). */
  id: string | null;
  /** The name of that volume, while it exists (a volume created later under the same name is another one). */
  volume: string | null;
}

export interface StoreVolumeInfo extends VolumeInfo {
  snapshotOf?: SnapshotOf;
  /** When it expires (ISO time); GC removes it after that unless a host serves it. */
  expiresAt?: string;
}

export interface RemoveOptions {
  /** Remove the volume's snapshots with it (otherwise a volume with snapshots is refused). */
  snapshots?: boolean;
}

export interface StoreRemoveResult extends RemoveResult {
  /** Snapshots removed first (with `snapshots`). */
  removedSnapshots: string[];
}

/** "work" for "work@monday". */
function volumeNameOf(snapshotName: string): string {
  return snapshotName.slice(0, snapshotName.indexOf('@'));
}

/** Is `snap` a snapshot of `vol` (by identity; records without `of`, by name)? */
function isSnapshotOf(snap: VolumeRecord, vol: VolumeRecord): boolean {
  if (!snap.snapshot || vol.snapshot || volumeNameOf(snap.name) !== vol.name) return false;
  return snap.of === undefined || snap.of === vol.id;
}

/** The same kind of error (same code, so the CLI's exit code and retry decisions hold) with a message that says what happened. */
function rewrap(err: unknown, message: string): BatonError {
  if (err instanceof StoreUnavailableError) return new StoreUnavailableError(message, { cause: err });
  if (err instanceof CorruptError) return new CorruptError(message);
  if (err instanceof BatonError) return new BatonError(err.code, message, { cause: err });
  return new BatonError('BATON_ERR_IO', message, { cause: err });
}

export class StoreCatalog implements VolumeCatalog {
  readonly description: string;
  constructor(private readonly opts: StoreCatalogOptions) {
    this.description = opts.store.description;
  }

  get store(): ObjectStore { return this.opts.store; }

  /** The process-wide read cache (made on first use; `serve` makes it at start, so a bad cache directory is reported then, not at every attach). */
  readCache(): Promise<BlockCache> { return this.opts.cache(); }

  async create(name: string, size: number, opts: CreateOptions = {}): Promise<StoreVolumeInfo> {
    checkVolumeName(name);
    checkVolumeSize(size);
    const data: DataSettings = { format: opts.format ?? DEFAULT_DATA.format, compression: opts.compression ?? DEFAULT_DATA.compression };
    if (opts.encrypt && data.format !== 'framed') throw new InvalidArgumentError('encryption needs framed data (--data-format framed)');
    const master = opts.encrypt ? this.masterKey() : null;
    const rec = await this.landRecord(name, 'create', async () => {
      const id = randomId(this.world, 8);
      const enc = opts.encrypt ? { encryption: newEncryption(master, name, id, this.world) } : {};
      return { format: 'baton-volume-1', name, id, size, createdAt: this.world.wallTime().toISOString(), data: { ...data, ...enc }, ...(opts.expiresAt ? { expiresAt: opts.expiresAt } : {}), forksMarked: true, settles: true };
    }, 'if it is there, it was created; if not, nothing needs cleaning up');
    return { name, size, createdAt: rec.createdAt, storedBytes: 0, kind: 'volume', ...(rec.expiresAt ? { expiresAt: rec.expiresAt } : {}) };
  }

  /**
   * Land a new record through one time-bounded step, the same for create, fork and snapshot.
   * `make` does the attempt's dependent read (a fork's fork point; nothing for a create) and
   * returns the record; then come its meta and its name (putName). The step runs from before
   * `make` (the fork-point read; for a create, the meta put) to the name put's reply, and is
   * trusted only if that took at most `forkBudgetMs` (M/2, format.ts timeBounds):
   * - a fork or snapshot: between the fork-point read and the landing of its record, the
   *   objects the point names are protected only by GC's grace and fixed point (gc.ts case 2);
   * - a create: until its name lands nothing names its meta, which GC deletes once it is older
   *   than the grace (>= 2M); a name that lands within M/2 of the meta put is in every GC
   *   listing that could find the meta old (gc.ts case 6).
   * The reply bounds the landing (the put that was answered landed before its answer; other
   * tries of it inside a retrying store then meet the name taken, 412, and change nothing).
   * A slower attempt is undone and waited out (abandon), then made again under the same name
   * with a new id, at most SLOW_ATTEMPTS times, then TimeoutError: nothing was created.
   * An attempt whose name put stays unresolved (StoreUnavailable from putName) within the
   * budget fails as putName says: whatever of it lands, lands within M of being issued, so
   * within the grace of its meta; past the budget it is undone like a slow one.
   */
  private async landRecord(name: string, verb: 'create' | 'fork' | 'snapshot', make: (window: { start: number }) => Promise<VolumeRecord>, advice: string, confirm?: (rec: VolumeRecord) => Promise<void>): Promise<VolumeRecord> {
    const budgetMs = timeBounds(this.maxOpMs).forkBudgetMs;
    for (let attempt = 1; ; attempt++) {
      // The step's start; `make` moves it later when it reads its fork point again (derive).
      const window = { start: this.world.now() };
      const rec = await make(window);
      const t0 = window.start;
      // Ids are random: nobody else writes this key, and a meta nothing names is garbage.
      let metaThere = true;
      // A fork or snapshot marks itself under its parent's id with its meta, before its name
      // exists (format.ts forkMarker: accounting finds descendants through it). A plain put:
      // the key is this attempt's alone, and a marker whose name never lands is GC's.
      const marker = rec.parent ? this.opts.store.put(keys.forkMarker(rec.parent.id, rec.id, rec.name), Buffer.alloc(0)) : null;
      marker?.catch(() => { /* awaited below */ });
      try {
        await this.opts.store.put(keys.meta(rec.id), encodeVolumeRecord(rec), { ifNoneMatch: true });
      } catch (err) {
        if (!(err instanceof PreconditionFailedError)) throw err;
        // "Already exists" can only be an earlier try of this very put (its reply lost). The
        // retrying store's read-back then finds it, unless it is gone again: GC deleted it as
        // an unnamed meta older than its grace (simulator F6: a host stalled between the
        // tries). Look: a name must never be put for a meta that is not there.
        metaThere = (await this.opts.store.head(keys.meta(rec.id))) !== null;
      }
      await marker;
      let landed = metaThere; // (a meta that went missing: undone below, its name never put)
      let uncertain = false;
      if (metaThere) {
        try {
          uncertain = await this.putName(rec, advice);
        } catch (err) {
          if (!(err instanceof StoreUnavailableError) || this.world.now() - t0 <= budgetMs) throw err;
          landed = false; // unresolved, and too late to trust if it did land: undone below
        }
      }
      const ms = this.world.now() - t0;
      if (landed && ms <= budgetMs) {
        await confirm?.(rec);
        if (uncertain) await this.settle(rec, verb);
        await this.markSettled(rec, verb);
        return rec;
      }
      await this.abandon(rec, landed, verb);
      if (attempt >= SLOW_ATTEMPTS) {
        const between = verb === 'create' ? 'writing its id record and landing its name, or garbage collection could delete the id record' : 'reading its fork point and landing its record, or garbage collection could delete data it needs';
        throw new TimeoutError(`${verb === 'create' ? 'creating' : 'making'} ${name} took too long on each of ${attempt} tries (the last ${Math.round(ms)} ms; `
          + `at most ${Math.round(budgetMs)} ms may pass between ${between}): nothing was created; is the store slow or unreachable? try again`);
      }
      this.opts.log.warn({ name, ms: Math.round(ms), budgetMs: Math.round(budgetMs), attempt, landed }, `${verb === 'create' ? 'create' : 'fork'} took too long to trust against GC; undone, trying again`);
    }
  }

  /**
   * A record that landed while an earlier try of its name put may still be on its way (a try
   * that timed out or lost its reply, inside the retrying store or in putName's own loop):
   * return only once that try can no longer land, M after the last try was sent (the
   * operation bound, see abandon). Else an `rm` right after the call returned could be undone
   * by it: the late try finds the name free again and brings it back without its meta
   * (simulator finding F4). Before then it meets the name taken (412) and changes nothing.
   * Costs M only after a put that needed a retry.
   */
  private async settle(rec: VolumeRecord, verb: string): Promise<void> {
    this.opts.log.info({ name: rec.name, id: rec.id, waitMs: this.maxOpMs },
      `${verb} of ${rec.name} landed after a retry: waiting until the earlier try can no longer land (M, BATON_MAX_OPERATION_MS), so that a quick rm cannot be undone by it`);
    await this.wait(this.maxOpMs);
  }

  /**
   * The record stands for good: nothing of this attempt will undo it. Until this lands, a fork
   * of the record checks the record's own source as well (confirmSource), because an attempt
   * is undone after its name landed when its source went first, and a fork made of it in
   * between would map data that rm deleted (reviewed finding). Best effort: a record whose
   * marker never lands is still whole; forks of it then keep checking its source.
   */
  private async markSettled(rec: VolumeRecord, verb: string): Promise<void> {
    try {
      await this.opts.store.put(keys.settled(rec.id), Buffer.alloc(0));
    } catch (err) {
      this.opts.log.warn({ name: rec.name, id: rec.id, err: errorMessage(err) }, `${verb} of ${rec.name} done, but its settled marker could not be put: forks of it will also check its source while that is missing`);
    }
  }

  /**
   * A source without its settled marker whose own source is gone: either its maker is undoing
   * it right now (its source went before its name landed), or it stood and the marker never
   * landed (its maker crashed, or the put failed; the simulator found such a volume that no
   * fork or snapshot could be made of, ever). Its maker decides within two store requests of
   * its name's landing (the check's read and the undo's delete, each landing within M of
   * being sent: format.ts timeBounds): a name the store stamped more than 3M before ours
   * (both stamps from the store's clock) stands, and the marker is put on its behalf.
   */
  private async settledByAge(srcName: string, src: VolumeRecord, ourName: string): Promise<boolean> {
    const [its, ours] = await Promise.all([this.opts.store.head(keys.volumeRecord(srcName)), this.opts.store.head(keys.volumeRecord(ourName))]);
    if (!its || !ours || ours.lastModified.getTime() - its.lastModified.getTime() <= 3 * this.maxOpMs) return false;
    await this.markSettled(src, 'a check');
    return true;
  }

  /**
   * Undo an attempt of landRecord that cannot be trusted, or whose source went (confirmSource;
   * `landed`: its name put was answered, else its outcome is unknown), and return only once
   * nothing it sent can land any more, so that the next attempt's record under the same name
   * is neither removed by this attempt's delete nor shadowed by a late copy of its name put
   * (both land after their client gave up: a timed-out try, or a try a retrying store gave
   * up on and made again), and "nothing was created" stays true.
   *
   * Why waiting M is enough: the design bounds every store request: it lands within M
   * (maxOperationMs) of being issued, or never (format.ts timeBounds; GC's argument relies on
   * it too, gc.ts case 6). Every request this attempt made on its name (each try of its put,
   * each try of the undo's delete, inside a retrying store too) was issued before the call
   * that made it returned. So once M has passed since the last of those calls returned, none
   * is still on its way, and a read of the name tells its final state as far as this attempt
   * goes:
   * - it holds this attempt's id: a put of it landed after our delete (or, unknown, at all):
   *   delete it again and wait again. At most twice: after one full wait no put is left;
   * - it is absent: nothing of this attempt is there or can arrive; its meta goes (nothing
   *   will ever name it) and the next attempt may put the name;
   * - another id: someone else made the name meanwhile: AlreadyExists (our meta goes too).
   * The meta goes last, once the name is known never to name it: a late put re-creating the
   * name after the meta went would be a volume without its meta.
   * Waiting from the first request's issue would not do: a retrying store issues later tries
   * of the same delete up to the moment it returns.
   */
  private async abandon(rec: VolumeRecord, landed: boolean, verb: string, why = 'took too long to be trusted'): Promise<void> {
    const key = keys.volumeRecord(rec.name);
    const failed = (err: unknown): BatonError => rewrap(err, `${verb === 'create' ? 'creating' : 'making'} ${rec.name} ${why} and undoing it failed (${errorMessage(err)}): `
      + `see baton info ${rec.name}: if it is there, remove it (baton rm ${rec.name}) and make it again; if not, nothing needs cleaning up (an id record left behind is deleted by baton gc)`);
    let ours = landed;
    let everNamed = landed; // its name was seen naming it at some point: a fork of it may exist
    let since = this.world.now(); // every request of the attempt on the name was issued by now
    for (let round = 1; ; round++) {
      if (ours) {
        try { await this.opts.store.delete(key); } catch (err) { throw failed(err); }
        since = this.world.now();
      }
      const waitMs = since + this.maxOpMs - this.world.now();
      if (waitMs > 0) {
        this.opts.log.info({ name: rec.name, id: rec.id, waitMs: Math.round(waitMs), maxOperationMs: this.maxOpMs },
          `${verb} undone: waiting until no request of the undone attempt can still land (M after the last was issued), so that none removes or re-creates ${rec.name} after it is made again`);
        await this.wait(waitMs);
      }
      let holder: VolumeRecord | null;
      try { holder = await this.recordOrNull(rec.name); } catch (err) { throw failed(err); }
      if (holder === null || holder.id !== rec.id) {
        // Its name landed, so a fork of it may have been made before it went (such a fork
        // checked this record's source, confirmSource): that fork's ancestry runs through this
        // meta, which then stays for GC (which keeps it while anything descends from it).
        const forked = everNamed ? await this.hasDescendants(rec.id).catch(() => true) : false;
        if (!forked) await this.opts.store.delete(keys.meta(rec.id)).catch(() => {}); // never named: if this fails, GC deletes it
        if (holder !== null) throw new AlreadyExistsError(`${rec.snapshot ? 'snapshot' : 'volume'} "${rec.name}" already exists in ${this.description} (made by someone else while ours was being undone)`);
        return;
      }
      if (round >= 3) throw failed(new TimeoutError(`a request of the undone attempt landed more than ${this.maxOpMs} ms (BATON_MAX_OPERATION_MS) after it was issued`));
      this.opts.log.warn({ name: rec.name, id: rec.id }, `${verb} undone, but a late copy of its name put landed afterwards; undoing it again`);
      ours = true;
      everNamed = true;
    }
  }

  /**
   * Put a record's name, all or nothing (its id-keyed copy, `meta`, was put first: landRecord).
   * Returns whether an earlier try of the put may still be on its way (landRecord settles it).
   *
   * The name's create-only put is the commit point. Its outcome must be KNOWN before the
   * meta may go: a put that failed ambiguously (a 503, a timeout, a lost reply, a local
   * fsync that failed after the link) may have landed, and a name record without its meta
   * is a broken volume (a fork of it cannot be opened, and `rm` of its ancestors cannot
   * follow its ancestry). So after an ambiguous failure we read the name back:
   * - it holds our id: the put landed, the create succeeded;
   * - it holds another id: the name is taken (AlreadyExists); our meta is left for GC, as
   *   our record may have landed, been forked from and removed in between;
   * - it is absent: the put did not land (yet): put again (a late landing of the earlier
   *   attempt then shows as a 412 followed by our id on the next read);
   * - unreadable, or still unresolved after a few tries: fail, leaving the meta in place.
   *   A meta that no record names is harmless (nothing reads it) and GC deletes it.
   * The meta is deleted only after a 412 that no ambiguous attempt of ours preceded: the
   * name was someone else's before we wrote (the retrying store resolves a 412 that follows
   * its own lost reply by reading the put id back), so nothing can ever name our id.
   */
  private async putName(rec: VolumeRecord, advice: string): Promise<boolean> {
    const what = `${rec.snapshot ? 'snapshot' : 'volume'} "${rec.name}"`;
    const body = encodeVolumeRecord(rec);
    let ambiguous: unknown = null;
    let retried = false; // a try inside the retrying store may still be on its way (settle)
    const onRetry = (): void => { retried = true; };
    for (let attempt = 1; attempt <= PUT_RECORD_ATTEMPTS; attempt++) {
      try {
        await this.opts.store.put(keys.volumeRecord(rec.name), body, { ifNoneMatch: true, onRetry });
        return retried || ambiguous !== null;
      } catch (err) {
        if (err instanceof PreconditionFailedError && ambiguous === null) {
          await this.opts.store.delete(keys.meta(rec.id)).catch(() => {}); // never named: see above
          throw new AlreadyExistsError(`${what} already exists in ${this.description}`);
        }
        if (err instanceof InvalidArgumentError) {
          if (ambiguous === null) await this.opts.store.delete(keys.meta(rec.id)).catch(() => {}); // refused before it was sent
          throw err;
        }
        if (!(err instanceof PreconditionFailedError)) ambiguous = err;
      }
      // Ambiguous so far: what does the name hold now?
      let holder: string | null;
      try {
        holder = (await this.rawRecord(rec.name)).id;
      } catch (err) {
        if (!(err instanceof NotFoundError)) { ambiguous = err; break; }
        holder = null;
      }
      // An earlier attempt landed: only an attempt before it, or a retry inside the store, can still be on its way.
      if (holder === rec.id) return retried || attempt > 1;
      if (holder !== null) throw new AlreadyExistsError(`${what} already exists in ${this.description}`); // our meta is left for GC
      this.opts.log.warn({ name: rec.name, attempt, err: errorMessage(ambiguous) }, 'creating a record failed and it did not land; trying again');
    }
    throw new StoreUnavailableError(
      `could not tell whether ${what} was created in ${this.description} (${errorMessage(ambiguous)}): `
      + `see baton info ${rec.name}: ${advice} (an id record left behind is deleted by baton gc)`,
      { cause: ambiguous },
    );
  }

  /**
   * The log position a fork made now starts from: the last record in the source's log. Every
   * flush acknowledged before this call is in the log (a flush is acknowledged only after
   * its record's put was), so the fork includes it; nothing unflushed can be in the log.
   * Cost: one round trip, whatever the volume's size: its checkpoints and its log are listed
   * together. The log is listed from its start: GC deletes the records below the newest
   * checkpoint that nothing needs, so one page usually holds all of it. A listing that read
   * a page and is still below the newest checkpoint, once that is known (a long log GC has
   * not caught up with), is started again after it, as it would have been had it waited.
   */
  private async forkPoint(src: VolumeRecord): Promise<{ id: string; seq: number }> {
    if (src.snapshot) return src.parent!; // a snapshot is already a fixed point
    // Keys only (keysOf): a `file:` store then lists without a stat per key.
    let newestCp: number | null = null; // known once the checkpoints are listed
    const cps = (async () => {
      let last = 0;
      for await (const k of keysOf(this.opts.store, keys.checkpointPrefix(src.id))) last = seqFromKey(k);
      newestCp = last;
      return last;
    })();
    cps.catch(() => { /* awaited below */ });
    let newestLog = 0;
    let listed = 0;
    let behind = false;
    for await (const k of keysOf(this.opts.store, keys.logPrefix(src.id))) {
      newestLog = seqFromKey(k);
      if (++listed >= LIST_PAGE_KEYS && newestCp !== null && newestLog < newestCp) { behind = true; break; }
    }
    const lastCp = await cps;
    if (behind) {
      newestLog = 0;
      for await (const k of keysOf(this.opts.store, keys.logPrefix(src.id), { startAfter: keys.log(src.id, lastCp) })) newestLog = seqFromKey(k);
    }
    // Records below the newest checkpoint may be left (GC keeps what forks need): the point is the newer of the two.
    const seq = Math.max(newestLog, lastCp);
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
    const named = (name: string, id: string): Promise<VolumeRecord | null> => this.rawRecord(name).then((r) => (r.id === id ? r : null), (err) => { if (err instanceof NotFoundError) return null; throw err; });
    const marked = (id: string): Promise<boolean> => this.opts.store.head(keys.settled(id)).then((h) => h !== null);
    // Whether a record may still be undone: its maker puts a marker (`settles`), it has a
    // source that could have gone, and the marker is not there.
    const unsettled = (r: VolumeRecord, hasMarker: boolean): boolean => r.settles === true && r.source !== undefined && !hasMarker;
    // A source that is not settled yet may itself still be undone (its own source went before
    // its name landed). Its maker's check is repeated here, after our record landed: its source
    // named as it read it. Then either that source's rm sees our record (through our ancestry)
    // and keeps the data, or we see it gone and undo ourselves; and if the source is undone
    // anyway later, its meta stays for us (abandon). That source may itself be unsettled: the
    // walk goes on up until a settled record, or one made without a source (a create, or a
    // record from before markers), one round trip per unsettled level (reviewed finding: a
    // check one level deep let a fork of a fork of an undone fork through).
    const needsMarker = src.settles === true && src.source !== undefined;
    const [first, srcMarked] = await Promise.all([named(srcName, src.id), needsMarker ? marked(src.id) : Promise.resolve(true)]);
    let ok = first !== null;
    let level: VolumeRecord = src;
    let open = unsettled(src, srcMarked);
    let gone: string | null = null;
    for (let depth = 0; ok && open; depth++) {
      if (depth >= MAX_ANCESTRY) throw new CorruptError(`the sources of ${srcName} are more than ${MAX_ANCESTRY} unsettled records deep (a cycle?)`);
      const up = level.source!;
      const [upRec, upMarked] = await Promise.all([named(up.name, up.id), marked(up.id)]);
      if (upRec === null) { gone = up.name; ok = false; break; }
      level = upRec;
      open = unsettled(upRec, upMarked);
    }
    if (!ok && first !== null) ok = await this.settledByAge(srcName, src, rec.name);
    if (ok) return;
    await this.abandon(rec, true, rec.snapshot ? 'snapshot' : 'fork', `lost its source ${srcName}`); // waited out: no late try of our put re-creates it
    throw new NotFoundError(first !== null
      ? `${srcName} was still being made from ${gone}, which was removed meanwhile, so ${srcName} may be undone; nothing was created (try again in a few minutes: once ${srcName} is settled, or ${Math.round(3 * this.maxOpMs / 1000)} s old, a fork of it needs nothing of ${gone})`
      : `${srcName} was removed while ${rec.name} was being made from it; nothing was created`);
  }

  /**
   * Make a fork or snapshot `name` of `srcName` at its last acknowledged flush. GC safety:
   * between reading the fork point and landing the record, the objects the point names are
   * protected only by GC's grace period (>= 2x maxOperationMs, see gc.ts); an attempt slower
   * than half of that is undone and made again, never trusted (landRecord).
   *
   * Round trips in sequence (each a store request's time): 6. (1) the source's record; (2) its
   * attribute records, checkpoints and log, listed together (forkPoint); (3) the meta and the
   * fork marker; (4) the name; (5) the check that the source is still there (confirmSource,
   * which must follow the name's landing: GC's argument, gc.ts case (c), relies on a fork
   * that lands naming a source that was still there when it landed), with whether the source
   * is settled; (6) our settled marker (markSettled). A source not settled yet costs one more
   * (its own source's record, after (5)).
   * A source that was resized or given an expiry (attribute records) costs two more: their
   * bodies, then the fork point again, so that those reads never widen the window above.
   */
  private async derive(srcName: string, name: string, snapshot: boolean, opts: { expiresAt?: string } = {}): Promise<VolumeRecord> {
    const raw = await this.rawRecord(srcName);
    // A fork of an encrypted volume gets a data key of its own: the master key is needed (now, not after the fork point is read).
    const master = raw.data?.encryption && !snapshot ? this.masterKey() : null;
    return this.landRecord(name, snapshot ? 'snapshot' : 'fork', async (window) => {
      // Its size as it is now (attribute records applied); the largest size its log ever had
      // goes along, so the fork can replay the source's records up to the fork point. A
      // snapshot has no attribute records (never resized, never expires).
      const [attrs, first] = await Promise.all([raw.snapshot ? Promise.resolve([]) : listAll(this.opts.store, keys.attrsPrefix(raw.id)), this.forkPoint(raw)]);
      let src = raw;
      let parent = first;
      if (attrs.length > 0) {
        src = await this.effective(raw, attrs);
        window.start = this.world.now();
        parent = await this.forkPoint(raw);
      }
      const id = randomId(this.world, 8);
      const enc = src.data?.encryption;
      // It stores data as its source does (a record made before issue 16 has no settings: neither has its fork).
      const data = src.data ? { data: { ...src.data, ...(enc ? { encryption: derivedEncryption(enc, master, name, srcName, id, snapshot, this.world) } : {}) } } : {};
      return {
        format: 'baton-volume-1' as const, name, id, size: src.size, createdAt: this.world.wallTime().toISOString(), parent,
        ...data,
        // A snapshot belongs to one volume identity, not to a name that may be reused.
        ...(snapshot ? { snapshot: true, of: src.id } : {}),
        ...(src.recoverySize !== undefined && src.recoverySize > src.size ? { recoverySize: src.recoverySize } : {}),
        ...(opts.expiresAt ? { expiresAt: opts.expiresAt } : {}),
        forksMarked: true as const,
        settles: true as const,
        source: { name: srcName, id: raw.id },
      };
    },
    // A record that may land after we gave up could land later than GC allows (landRecord).
    `if it is there, remove it (baton rm ${name}) and make it again, since it cannot be trusted against garbage collection; if not, nothing needs cleaning up`,
    (rec) => this.confirmSource(srcName, raw, rec));
  }

  /** Time passing on the injected World (the simulator's clock in tests). */
  private wait(ms: number): Promise<void> { return new Promise((r) => { this.world.setTimeout(r, ms); }); }

  private get maxOpMs(): number { return this.opts.volume?.maxOperationMs ?? maxOperationMs(); }

  /** The master key, if this process was given one (loaded on first need: keys.ts). */
  private masterKey(): MasterKey | null { return this.opts.masterKey?.() ?? null; }
  private get world(): World { return this.opts.volume?.world ?? systemWorld; }

  /** O(1) fork: a new writable volume whose map starts as SRC's (a volume or NAME@SNAP) at its last acknowledged flush. */
  async fork(srcName: string, dstName: string, opts: { expiresAt?: string } = {}): Promise<StoreVolumeInfo> {
    checkExportName(srcName);
    checkVolumeName(dstName);
    const rec = await this.derive(srcName, dstName, false, opts);
    return { name: dstName, size: rec.size, createdAt: rec.createdAt, storedBytes: 0, kind: 'volume', parent: rec.parent!, ...(rec.expiresAt ? { expiresAt: rec.expiresAt } : {}) };
  }

  /** A read-only point-in-time snapshot NAME@SNAP of a volume's last acknowledged flush. */
  async snapshot(volumeName: string, snapName: string): Promise<VolumeInfo> {
    checkVolumeName(volumeName);
    const name = `${volumeName}@${snapName}`;
    checkExportName(name);
    const rec = await this.derive(volumeName, name, true);
    return { name, size: rec.size, createdAt: rec.createdAt, storedBytes: 0, kind: 'snapshot', parent: rec.parent! };
  }

  /** The checks of rename that need no store: two volume names (not snapshots), not the same. */
  checkRename(from: string, to: string): void {
    for (const n of [from, to]) {
      if (n.includes('@')) throw new InvalidArgumentError(`rename gives a volume another name; ${n} is a snapshot: fork it into a volume instead (baton fork ${n} NEW-NAME)`);
    }
    checkVolumeName(from);
    checkVolumeName(to);
    if (from === to) throw new InvalidArgumentError(`${from} already has that name: rename needs two different names`);
  }

  /**
   * Give volume `from` the name `to`; with `replace`, `to`'s current volume is removed first.
   * The argument is docs/rfc-lifecycle.md; in short, a rename is made only of steps whose safety
   * the catalog already argues, each leaving a catalog where every name names one whole
   * volume:
   * 1. (replace) Remove `to`'s record, as rm does: its descendants are looked for first (if
   *    that cannot be told, nothing is changed), and its record is deleted only if the name
   *    still names the id we read. Its data is not touched yet.
   * 2. Land `to` as an O(1) fork of `from` at its last acknowledged flush (derive: the
   *    create-only name put is the commit point, time-bounded against GC, confirmed against
   *    a concurrent rm of `from`). A concurrent create or rename onto `to` makes exactly one
   *    of them land (the other gets AlreadyExists and undoes its own fork). The new volume has
   *    a new id whose map starts as `from`'s: no two names ever share an id, which the rest
   *    of the catalog relies on (rm deletes an id's objects once no OTHER record descends
   *    from it: two names on one id would let rm of one delete the other's data).
   * 3. Delete `from`'s record (again only while it names the id we forked): its data stays,
   *    since `to` now descends from it (GC keeps what `to` maps).
   * 4. (replace) Delete the old `to`'s objects, as rm's step (3) does, only if nothing
   *    descended from it before step 1 and nothing does now; else they stay for GC.
   * A failure between 1 and 2 leaves `to` absent and `from` unchanged; between 2 and 3 both
   * names exist (`to` a fork of `from`): the error says which and what to run.
   *
   * What keeps other hosts from writing either volume while this runs (a served `from` would
   * go on taking writes the new `to` does not have) is the caller holding both names' leases
   * (Deployment.rename); `leased()` throws once they cannot be trusted any more, and is
   * called before each step that changes a name.
   */
  async rename(from: string, to: string, opts: { replace: boolean; onStep?: (step: string) => void; leased?: () => void }): Promise<{ from: string; to: string; id: string; expiresAt?: string; replaced: { keptForRelatives: boolean; deletedObjects: number } | null }> {
    this.checkRename(from, to);
    const step = (s: string): void => opts.onStep?.(s);
    const src = await this.record(from);
    const all = await this.allRecords();
    const snapsOf = (rec: VolumeRecord): string[] => all.filter((r) => isSnapshotOf(r, rec)).map((r) => r.name);
    const srcSnaps = snapsOf(src);
    if (srcSnaps.length > 0) {
      throw new InvalidArgumentError(`${from} has snapshots (${srcSnaps.join(', ')}), which are named after it and belong to it: remove them first (baton rm NAME@SNAP), or fork the volume under the new name instead (baton fork ${from} ${to})`);
    }
    const dst = await this.recordOrNull(to);
    if (dst && !opts.replace) {
      throw new AlreadyExistsError(`volume "${to}" already exists in ${this.description}: add --replace to make ${from} the new ${to} (the current ${to} is removed; its data stays while forks or snapshots use it), or pick another name`);
    }
    let dstHadDescendants = false;
    if (dst) {
      const dstSnaps = snapsOf(dst);
      if (dstSnaps.length > 0) {
        throw new InvalidArgumentError(`${to} has snapshots (${dstSnaps.join(', ')}), which belong to the volume being replaced: remove them first (baton rm NAME@SNAP), then run the rename again`);
      }
      step(`removing the current ${to}`);
      dstHadDescendants = await this.descendantsBeforeRemoving(dst);
      opts.leased?.();
      // Only the volume we decided to replace: a name made again meanwhile is someone else's.
      const now = await this.recordOrNull(to);
      if (now?.id !== dst.id) throw new PreconditionFailedError(`${to} was removed or made again while it was being replaced; nothing was changed: run the rename again`);
      // A try of this delete still on its way would remove the new `to` landed next: wait it out first (settleDeletes).
      const late = { until: 0 };
      await this.deleteName(to, late);
      await this.settleDeletes(to, late.until);
    }
    step(`landing ${to}`);
    opts.leased?.();
    let rec: VolumeRecord;
    try {
      // The same volume under another name: its expiry goes with it (derive takes its size).
      rec = await this.derive(from, to, false, src.expiresAt ? { expiresAt: src.expiresAt } : {});
    } catch (err) {
      if (dst) throw rewrap(err, `the old ${to} was removed, but ${from} could not be given its name (${errorMessage(err)}): ${from} is unchanged; run baton rename ${from} ${to} again (${to} is free now)`);
      throw err;
    }
    step(`removing the name ${from}`);
    const both = `${to} now holds ${from}'s data, and ${from} is still there too (a fork of it is what ${to} is): remove it with baton rm ${from}`;
    try {
      opts.leased?.();
      const still = await this.recordOrNull(from);
      if (still?.id === src.id) {
        // `from` may be made again right after the rename returns (settleDeletes).
        const late = { until: 0 };
        await this.deleteName(from, late);
        await this.settleDeletes(from, late.until);
      }
    } catch (err) {
      throw rewrap(err, `${errorMessage(err)}; ${both}`);
    }
    // A grow or expiry change may have landed on `from` after derive read it (a grow takes no
    // lease). Its write-then-check saw `from`'s name until the delete above, so it landed
    // before this read: carry it over to `to`, then drop `from`'s attributes.
    try {
      const later = await this.effective(src);
      const change: { size?: number; expiresAt?: string | null } = {};
      if (later.size > rec.size) change.size = later.size;
      if ((later.expiresAt ?? null) !== (rec.expiresAt ?? null)) change.expiresAt = later.expiresAt ?? null;
      if (Object.keys(change).length > 0) await this.putAttrs(to, rec, change);
      await this.deleteAttrs(src.id);
    } catch (err) {
      throw rewrap(err, `${to} now holds ${from}'s data, but a resize or expiry change made to ${from} during the rename may not have reached it (${errorMessage(err)}): check baton info ${to}`);
    }
    let replaced: { keptForRelatives: boolean; deletedObjects: number } | null = null;
    if (dst) {
      step(`deleting the data of the old ${to}`);
      replaced = await this.deleteDataIfUnused(dst, dstHadDescendants);
    }
    return { from, to, id: rec.id, ...(rec.expiresAt ? { expiresAt: rec.expiresAt } : {}), replaced };
  }

  /**
   * A volume's record as its size and expiry are now: the record with its attribute records
   * applied (attrsOf). What every reader of a size uses: serving (NBD_OPT_INFO, the per-attach
   * check), opening, forking, ls and info. One GET and one LIST.
   */
  async record(name: string): Promise<VolumeRecord> {
    return this.effective(await this.rawRecord(name));
  }

  /** The record with its attribute records applied (see AttrsRecord in format.ts). */
  async effective(rec: VolumeRecord, listed?: ObjectInfo[]): Promise<VolumeRecord> {
    if (rec.snapshot) return rec; // never resized, never expires: no attribute records to look for
    const a = await this.attrsOf(rec, listed);
    const out: VolumeRecord = { ...rec, size: a.size };
    if (a.recoverySize > a.size) out.recoverySize = a.recoverySize;
    if (a.expiresAt) out.expiresAt = a.expiresAt; else delete out.expiresAt;
    return out;
  }

  /**
   * What a record's attribute records make of it: the newest size and expiry each sets (in
   * position order), the largest size it ever had, and the next free position. Attribute
   * records are small and few (one per resize or expiry change). `listed`: their listing, if
   * the caller has it.
   */
  private async attrsOf(rec: VolumeRecord, listed?: ObjectInfo[]): Promise<{ size: number; expiresAt: string | null; recoverySize: number; next: number }> {
    const objs = listed ?? await listAll(this.opts.store, keys.attrsPrefix(rec.id));
    let size = rec.size;
    let expiresAt: string | null = rec.expiresAt ?? null;
    let recoverySize = Math.max(rec.size, rec.recoverySize ?? 0);
    let next = 1;
    const bodies = await mapLimit(objs, 8, (o) => this.opts.store.get(o.key).then((b) => decodeAttrsRecord(b, o.key), (err) => {
      if (err instanceof NotFoundError) return null; // its volume is being removed
      throw err;
    }));
    for (const [i, a] of bodies.entries()) {
      next = Math.max(next, seqFromKey(objs[i]!.key) + 1);
      if (!a) continue;
      if (a.size !== undefined) { size = a.size; recoverySize = Math.max(recoverySize, a.size); }
      if (a.expiresAt !== undefined) expiresAt = a.expiresAt;
    }
    return { size, expiresAt, recoverySize, next };
  }

  /**
   * Land an attribute record for `rec` at its next free position (create-only: a 412 means
   * another change took it; look again and take the next), then check that `name` still names
   * `rec.id` (write-then-check, as confirmSource; a rename's final re-read of the attributes
   * is the other half: docs/rfc-lifecycle.md, "Resize", races). Throws if it does not: the
   * change landed on a volume that was renamed or removed meanwhile.
   */
  private async putAttrs(name: string, rec: VolumeRecord, change: Omit<AttrsRecord, 'format' | 'time'>): Promise<void> {
    const body = Buffer.from(JSON.stringify({ format: 'baton-attrs-1', ...change, time: this.world.wallTime().toISOString() } satisfies AttrsRecord));
    for (let attempt = 1; ; attempt++) {
      const { next } = await this.attrsOf(rec);
      try {
        await this.opts.store.put(keys.attrs(rec.id, next), body, { ifNoneMatch: true });
        break;
      } catch (err) {
        if (!(err instanceof PreconditionFailedError) || attempt >= 20) throw err;
      }
    }
    const now = await this.recordOrNull(name);
    if (now?.id !== rec.id) {
      throw new PreconditionFailedError(`${name} was renamed or removed while it was being changed; see baton ls and baton info: if the volume you meant has another name now, run the command again on that name`);
    }
  }

  /**
   * Resize a volume (docs/rfc-lifecycle.md, "Resize"). Growing needs nothing else; shrinking
   * (`shrink`) must be done under the volume's lease (the caller holds it, `leased` checks it)
   * and is refused while data is mapped at or past the new end: the committed map is read
   * with nobody writing, so the check stays true until the attribute record lands.
   */
  async resize(name: string, size: number, opts: { shrink?: boolean; leased?: () => void } = {}): Promise<{ name: string; from: number; to: number }> {
    checkVolumeName(name);
    checkVolumeSize(size);
    const rec = await this.record(name);
    if (rec.snapshot) throw new InvalidArgumentError(`${name} is a snapshot, which never changes: fork it and resize the fork`);
    if (size === rec.size) return { name, from: rec.size, to: size };
    if (size < rec.size) {
      if (!opts.shrink) throw new InvalidArgumentError(`${name} is ${rec.size} bytes; ${size} would shrink it: add --shrink (refused while data is mapped past the new end)`);
      const view = await this.openView(rec);
      let highest = 0;
      try {
        await view.forEachCommitted((e) => { if (e.key !== null) highest = Math.max(highest, e.offset + e.length); });
      } finally {
        await view.close();
      }
      if (highest > size) {
        throw new InvalidArgumentError(`${name} has data mapped up to byte ${highest}, past the new end ${size}: shrink the filesystem first (resize2fs DEVICE SIZE) and trim what is past the end (fstrim, or blkdiscard --offset ${size}), or pick a size of at least ${highest}`);
      }
      opts.leased?.();
    }
    await this.putAttrs(name, rec, { size });
    return { name, from: rec.size, to: size };
  }

  /** Set (an ISO time) or clear (null) a volume's expiry. */
  async setExpiry(name: string, expiresAt: string | null): Promise<void> {
    checkVolumeName(name);
    const rec = await this.rawRecord(name);
    await this.putAttrs(name, rec, { expiresAt });
  }

  /** Delete an id's attribute records (its name is gone; forks carry their own values). */
  private async deleteAttrs(id: string): Promise<void> {
    const objs = await listAll(this.opts.store, keys.attrsPrefix(id));
    await mapLimit(objs, 16, (o) => this.opts.store.delete(o.key));
  }

  async rawRecord(name: string): Promise<VolumeRecord> {
    checkExportName(name);
    const key = keys.volumeRecord(name);
    try {
      return decodeVolumeRecord(await this.opts.store.get(key), key);
    } catch (err) {
      if (err instanceof NotFoundError) throw new NotFoundError(`no volume "${name}" in ${this.description} (list them with: baton ls --store ${this.description})`);
      throw err;
    }
  }

  /** The volume record `name` names, or null if there is none (a definite NotFound, nothing else). */
  private async recordOrNull(name: string): Promise<VolumeRecord | null> {
    try {
      return await this.rawRecord(name);
    } catch (err) {
      if (err instanceof NotFoundError) return null;
      throw err;
    }
  }

  /**
   * What a snapshot is of: `of` names the volume's identity, so a volume created later under
   * the same name never inherits it (`volume: null`: the volume it was taken of is gone).
   * Records made before `of` existed are attributed by name, as they were then.
   */
  private snapshotOf(snap: VolumeRecord, volumeNow: VolumeRecord | null): SnapshotOf {
    const volume = volumeNow !== null && isSnapshotOf(snap, volumeNow) ? volumeNow.name : null;
    return { id: snap.of ?? (volume !== null ? volumeNow!.id : null), volume };
  }

  private async describe(raw: VolumeRecord, volumeNow: VolumeRecord | null): Promise<StoreVolumeInfo> {
    const [objs, rec] = await Promise.all([listAll(this.opts.store, keys.volumePrefix(raw.id)), this.effective(raw)]);
    const d = dataSettings(rec);
    return {
      name: rec.name, size: rec.size, createdAt: rec.createdAt, storedBytes: objs.reduce((n, o) => n + o.size, 0),
      ...(rec.expiresAt ? { expiresAt: rec.expiresAt } : {}),
      kind: rec.snapshot ? 'snapshot' : 'volume', ...(rec.parent ? { parent: rec.parent } : {}),
      data: { format: d.format, compression: d.compression, encrypted: d.encryption !== undefined, ...(d.encryption ? { keyId: d.encryption.keyId } : {}) },
      ...(rec.snapshot ? { snapshotOf: this.snapshotOf(rec, volumeNow) } : {}),
    };
  }

  async list(): Promise<StoreVolumeInfo[]> {
    const recs = await this.allRecordsKnown();
    const byName = new Map(recs.map((r) => [r.name, r]));
    return mapLimit(recs, 8, (r) => this.describe(r, r.snapshot ? byName.get(volumeNameOf(r.name)) ?? null : null));
  }

  async info(name: string): Promise<StoreVolumeInfo> {
    const rec = await this.rawRecord(name);
    return this.describe(rec, rec.snapshot ? await this.recordOrNull(volumeNameOf(name)) : null);
  }

  /**
   * Remove a volume or snapshot. A volume with snapshots is refused unless `snapshots` is
   * set; then they are removed first (a snapshot belongs to one volume identity and must not
   * outlive it to be taken for a later volume's under the same name).
   *
   * For each record: (1) find out whether anything descends from it, BEFORE anything is
   * deleted: if that cannot be told (a store error, an ancestry that cannot be followed),
   * nothing is removed. (2) Delete the record: from then on it does not exist. (3) Look
   * again, now that no new fork can start from it (the write-then-check with confirmSource),
   * and delete its objects only if nothing descends from it; descendants may map its
   * objects, which then stay for garbage collection, which knows who still needs them.
   */
  async remove(name: string, opts: RemoveOptions = {}): Promise<StoreRemoveResult> {
    const rec = await this.rawRecord(name);
    const snaps = rec.snapshot ? [] : (await this.allRecords()).filter((r) => isSnapshotOf(r, rec));
    if (snaps.length > 0 && !opts.snapshots) {
      throw new InvalidArgumentError(`volume ${name} has ${snaps.length} snapshot${snaps.length > 1 ? 's' : ''}: ${snaps.map((r) => r.name).join(', ')}; `
        + `remove ${snaps.length > 1 ? 'them' : 'it'} first (baton rm NAME@SNAP), or together with the volume: baton rm ${name} --snapshots`);
    }
    // With snapshots to remove first: make sure the volume's own check can be done at all,
    // so that a transient error removes nothing rather than only the snapshots.
    if (snaps.length > 0) await this.descendantsBeforeRemoving(rec);
    const removedSnapshots: string[] = [];
    const late = { until: 0 };
    try {
      for (const s of snaps) {
        try {
          await this.removeRecord(s, late);
        } catch (err) {
          throw rewrap(err, `${errorMessage(err)}${removedSnapshots.length ? ` (already removed: ${removedSnapshots.join(', ')})` : ''}; ${name} was not removed`);
        }
        removedSnapshots.push(s.name);
      }
      return { ...(await this.removeRecord(rec, late)), removedSnapshots };
    } finally {
      await this.settleDeletes(name, late.until);
    }
  }

  /**
   * Delete a record's name. `late.until` becomes the time until which an earlier try of this
   * delete may still land, if the retrying store had to send it again (settleDeletes).
   */
  private async deleteName(name: string, late: { until: number }): Promise<void> {
    let retried = false;
    await this.opts.store.delete(keys.volumeRecord(name), { onRetry: () => { retried = true; } });
    // Every try was issued before the call returned; each lands within M of being issued or never.
    if (retried) late.until = Math.max(late.until, this.world.now() + this.maxOpMs);
  }

  /**
   * Return only once no try of a record delete of ours can land any more. A name may be made
   * again the moment rm returns (`rm work` then `create work`; rename --replace): a try of the
   * old record's delete still on its way (timed out or lost its reply inside the retrying
   * store, which then tried again) would land on the new volume's record and remove it, and
   * its data, named by nothing, would go with the next GC (simulator, a name used again; the
   * test "rm whose record delete was retried" in catalog-sim-findings). The design bounds
   * every request: it lands within M of being issued, or never (format.ts timeBounds). Costs
   * M only after a delete that needed a retry, as settle does for puts.
   */
  private async settleDeletes(name: string, until: number): Promise<void> {
    const waitMs = until - this.world.now();
    if (waitMs <= 0) return;
    this.opts.log.info({ name, waitMs: Math.round(waitMs), maxOperationMs: this.maxOpMs },
      `the delete of ${name}'s record needed a retry: waiting until the earlier try can no longer land (M, BATON_MAX_OPERATION_MS), so that it cannot remove a volume made under the same name next`);
    await this.wait(waitMs);
  }

  /** Step (1) of remove: true/false if it can be told, else an error saying nothing was removed. */
  private async descendantsBeforeRemoving(rec: VolumeRecord): Promise<boolean> {
    try {
      return await this.hasDescendants(rec.id);
    } catch (err) {
      throw rewrap(err, `cannot tell whether forks or snapshots of ${rec.name} still need its data, so nothing was removed: ${errorMessage(err)}; try again`);
    }
  }

  private async removeRecord(rec: VolumeRecord, late: { until: number }): Promise<RemoveResult> {
    const before = await this.descendantsBeforeRemoving(rec);
    await this.deleteName(rec.name, late);
    // Nobody reads a nameless id's attributes (forks carry their own size and expiry).
    await this.deleteAttrs(rec.id);
    return this.deleteDataIfUnused(rec, before);
  }

  /**
   * Step (3) of remove, for a record already deleted: delete its objects only if nothing
   * descended from it before the record went (`before`) and nothing does now.
   */
  private async deleteDataIfUnused(rec: VolumeRecord, before: boolean): Promise<RemoveResult> {
    if (before) return { deletedObjects: 0, keptForRelatives: true }; // descendants do not vanish by themselves
    let after: boolean;
    try {
      after = await this.hasDescendants(rec.id);
    } catch (err) {
      throw rewrap(err, `${rec.name} was removed, but whether forks or snapshots still need its data could not be told (${errorMessage(err)}); `
        + 'its data stays in the store, and baton gc deletes it once nothing needs it');
    }
    if (after) return { deletedObjects: 0, keptForRelatives: true };
    const objs = await listAll(this.opts.store, keys.volumePrefix(rec.id));
    // meta last: while any object is left, the id still explains what it belongs to.
    const meta = keys.meta(rec.id);
    await mapLimit(objs.filter((o) => o.key !== meta), 16, (o) => this.opts.store.delete(o.key));
    await this.opts.store.delete(meta);
    return { deletedObjects: objs.length, keptForRelatives: false };
  }

  /**
   * Does any existing volume or snapshot have `id` among its ancestors? Answers false only
   * when it KNOWS: every record's ancestry was followed to its root (a meta without a
   * parent). "Does not exist" is trusted only as a definite NotFound, and only where it
   * means what it says:
   * - a record listed and then NotFound was removed meanwhile: it descends from nothing;
   * - an ancestor's meta NotFound while the record naming it still exists: the chain is
   *   broken (a meta lost by some earlier failure), so whether the record descends from
   *   `id` cannot be told; a record whose own name is gone by then was being undone.
   * Any other error (a 503, a timeout, an unreadable meta) is "cannot tell" too. A definite
   * "yes" from one record outweighs a "cannot tell" from another (keeping data is safe).
   */
  private async hasDescendants(id: string): Promise<boolean> {
    const recs = await this.allRecords();
    const metas = new Map<string, VolumeRecord | null>();
    const metaOf = async (vid: string): Promise<VolumeRecord | null> => {
      if (!metas.has(vid)) {
        const key = keys.meta(vid);
        try {
          metas.set(vid, decodeVolumeRecord(await this.opts.store.get(key), key));
        } catch (err) {
          if (!(err instanceof NotFoundError)) throw rewrap(err, `reading ${key} failed: ${errorMessage(err)}`);
          metas.set(vid, null);
        }
      }
      return metas.get(vid)!;
    };
    let unknown: unknown = null;
    for (const r of recs) {
      if (r.id === id) continue;
      try {
        let p = r.parent?.id;
        for (let depth = 0; p !== undefined; depth++) {
          if (p === id) return true;
          if (depth >= MAX_ANCESTRY) throw new CorruptError(`the ancestry of ${r.name} is deeper than ${MAX_ANCESTRY} (a cycle?)`);
          const m = await metaOf(p);
          if (m === null) {
            const still = await this.recordOrNull(r.name);
            if (still === null || still.id !== r.id) break; // r itself is gone: it descends from nothing
            throw new CorruptError(`${r.name} names ancestor ${p}, whose record ${keys.meta(p)} is gone, so its ancestry cannot be followed`);
          }
          p = m.parent?.id;
        }
      } catch (err) {
        unknown ??= err;
      }
    }
    if (unknown !== null) throw unknown;
    return false;
  }

  async allRecords(): Promise<VolumeRecord[]> {
    const objs = await listAll(this.opts.store, keys.volumesPrefix);
    const recs = await mapLimit(objs, 8, (o) => this.opts.store.get(o.key).then((b) => decodeVolumeRecord(b, o.key), (err) => {
      if (err instanceof NotFoundError) return null; // removed while we listed
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

  /**
   * Do two volumes/snapshots share history (one volume id in both ancestries, themselves
   * included)? If not, a diff's ranges are simply everything either has written.
   */
  async shareHistory(a: string, b: string): Promise<boolean> {
    const [ra, rb] = await Promise.all([this.rawRecord(a), this.rawRecord(b)]);
    const [ia, ib] = await Promise.all([this.lineage(ra), this.lineage(rb)]);
    return ia.some((x) => ib.includes(x));
  }

  /**
   * Every record under `volumes/` as of one listing, reading only the records garbage
   * collection has not already read: the bytes of a record the last GC run read under the
   * same etag are in its state (`gc/state`, gc-state.ts; an etag names one version's bytes,
   * and a name made again is a new put with another etag). Without a usable state, every
   * record is read as allRecords does. The listing and the state's GET go out together.
   */
  async allRecordsKnown(): Promise<VolumeRecord[]> {
    const [objs, known] = await Promise.all([
      listAll(this.opts.store, keys.volumesPrefix, { etags: true }),
      // Any trouble with the state (none yet, unreadable, another version) only costs GETs.
      this.opts.store.get(GC_STATE_KEY).then((b) => decodeGcState(b, () => this.world.yield())).catch(() => null),
    ]);
    const recs = await mapLimit(objs, 8, async (o) => {
      const k = known?.get(o.key.slice(keys.volumesPrefix.length));
      if (k !== undefined && o.etag !== undefined && k.etag === o.etag) return k.record;
      return this.opts.store.get(o.key).then((b) => decodeVolumeRecord(b, o.key), (err) => {
        if (err instanceof NotFoundError) return null; // removed while we listed
        throw err;
      });
    });
    return recs.filter((r): r is VolumeRecord => r !== null);
  }

  /**
   * A record's id and its ancestors' ids, nearest first (as far as their metas go). `metas`
   * caches what an ancestor's meta says across calls (many relatives share ancestors); an
   * ancestor that still has a record needs no meta read (the meta is a copy of the record).
   */
  private async lineage(rec: VolumeRecord, metas = new Map<string, Promise<VolumeRecord | null>>()): Promise<string[]> {
    const ids = [rec.id];
    for (let p = rec.parent?.id; p !== undefined && ids.length <= MAX_ANCESTRY;) {
      ids.push(p);
      const id = p;
      let m = metas.get(id);
      if (m === undefined) {
        const key = keys.meta(id);
        m = this.opts.store.get(key).then((buf) => decodeVolumeRecord(buf, key), (err) => {
          if (err instanceof NotFoundError) return null;
          throw err;
        });
        metas.set(id, m);
      }
      p = (await m)?.parent?.id;
    }
    return ids;
  }

  /**
   * One volume or snapshot with space accounting, from the maps of its relatives only: the
   * records whose ancestry shares an id with its own (itself included). That is exact, not an
   * estimate: a map names only objects of the ids in its own ancestry (forks inherit them,
   * compaction rewrites only a volume's own), so any map sharing an object with this one
   * shares that object's id with it, and the relatives are the descendants of its root
   * ancestor. Parent links point up; fork markers (format.ts keys.forkMarker) point down:
   * when the root was made by a baton that marks forks (`forksMarked`), the relatives are
   * found from the root through the markers (a listing per relative, and its record), and
   * nothing of an unrelated volume is read. A family whose root predates the markers is
   * found through every record (one listing, and the records GC's state does not hold:
   * allRecordsKnown). Only the relatives' maps are loaded.
   */
  async infoWithAccounting(name: string): Promise<StoreVolumeInfo> {
    const rec = await this.rawRecord(name);
    const metas = new Map<string, Promise<VolumeRecord | null>>([[rec.id, Promise.resolve(rec)]]);
    const line = await this.lineage(rec, metas);
    const root = await metas.get(line[line.length - 1]!);
    const family = root?.forksMarked && root.parent === undefined
      ? await this.familyByMarkers(rec, line, metas)
      : await this.familyByRecords(rec, metas);
    const maps = new Map<string, MappedExtent[]>();
    await mapLimit(family, 4, async (r) => { maps.set(r.name, await this.mappedExtents(r)); });
    const acc = accountMaps(maps).get(rec.name);
    // The volume a snapshot is of is its parent, among its relatives: no second GET when there.
    const info = await this.describe(rec, rec.snapshot
      ? family.find((r) => r.name === volumeNameOf(name)) ?? await this.recordOrNull(volumeNameOf(name))
      : null);
    return { ...info, ...acc };
  }

  /** `rec`'s relatives through every record (families made before fork markers). */
  private async familyByRecords(rec: VolumeRecord, metas: Map<string, Promise<VolumeRecord | null>>): Promise<VolumeRecord[]> {
    const recs = await this.allRecordsKnown();
    for (const r of recs) if (!metas.has(r.id)) metas.set(r.id, Promise.resolve(r));
    const mine = new Set(await this.lineage(rec, metas));
    const family = (await mapLimit(recs, 8, async (r) => ((await this.lineage(r, metas)).some((id) => mine.has(id)) ? r : null)))
      .filter((r): r is VolumeRecord => r !== null);
    if (!family.some((r) => r.name === rec.name)) family.push(rec);
    return family;
  }

  /**
   * `rec`'s relatives through the fork markers: every id below the root of `line` (its ids,
   * nearest first), each with the name it was made under; a relative is a record under that
   * name holding that id (a name removed or made again since holds another, or none). A
   * removed volume's markers stay while its descendants live (GC keeps a marker as long as its
   * child's meta), so the walk passes through it.
   */
  private async familyByMarkers(rec: VolumeRecord, line: string[], metas: Map<string, Promise<VolumeRecord | null>>): Promise<VolumeRecord[]> {
    const names = new Map<string, string>();
    for (const id of line) {
      const m = await metas.get(id);
      if (m) names.set(id, m.name);
    }
    let level = [line[line.length - 1]!];
    const seen = new Set(level);
    while (level.length > 0) {
      const next: string[] = [];
      await mapLimit(level, 8, async (id) => {
        for await (const o of this.opts.store.list(keys.forksPrefix(id))) {
          const f = forkMarkerOf(o.key);
          if (f === null || f.parent !== id || seen.has(f.child)) continue;
          seen.add(f.child);
          names.set(f.child, f.name);
          next.push(f.child);
        }
      });
      level = next;
    }
    const family = await mapLimit([...names], 8, async ([id, n]) => (id === rec.id ? rec : (await this.recordOrNull(n).then((r) => (r?.id === id ? r : null)))));
    return family.filter((r): r is VolumeRecord => r !== null);
  }

  /** The committed map of a volume or snapshot as plain extents (accounting's input). */
  private async mappedExtents(rec: VolumeRecord): Promise<MappedExtent[]> {
    const view = await this.openView(rec);
    try {
      const extents: MappedExtent[] = [];
      await view.forEachCommitted((e) => { extents.push({ offset: e.offset, length: e.length, key: e.key, off: e.off, ...(e.fr && e.fr.logical > 0 ? { ratio: e.fr.stored / e.fr.logical } : {}) }); });
      return extents;
    } finally {
      await view.close();
    }
  }

  /** Every volume and snapshot with space accounting (loads every map: O(total extents)). */
  async listWithAccounting(): Promise<StoreVolumeInfo[]> {
    const infos = await this.list();
    const maps = new Map<string, MappedExtent[]>();
    await mapLimit(infos, 4, async (v) => { maps.set(v.name, await this.mappedExtents(await this.rawRecord(v.name))); });
    const acc = accountMaps(maps);
    return infos.map((v) => ({ ...v, ...acc.get(v.name) }));
  }

  /** Load a volume's map without serving it (read-only; no lease, no cache reads). */
  async loadMap(name: string): Promise<Volume> {
    return this.openView(await this.rawRecord(name));
  }

  /** A read-only view of a record's map, optionally recovered through another store (GC tracks what recovery reads). */
  async openView(rec: VolumeRecord, store: ObjectStore = this.opts.store, quiet = false): Promise<Volume> {
    const log = quiet ? this.opts.log.child({}, { level: 'warn' }) : this.opts.log;
    rec = await this.effective(rec); // its size now, and the largest its log may name
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

  /**
   * VolumeCatalog.prehydrate: a read-only view of the volume (its newest checkpoint and the log
   * after it, as any reader may load it while another host writes) hydrates the read cache.
   * Safe whoever writes the volume meanwhile: it only reads immutable objects into a cache
   * keyed by them, and it never serves a byte; an object garbage collection deleted meanwhile
   * is a failed prefetch, nothing more.
   */
  prehydrate(name: string, options: HydrateOptions): { stop(): void } {
    let stopped = false;
    let view: Volume | null = null;
    const run = async (): Promise<void> => {
      const rec = await this.rawRecord(name);
      if (stopped) return;
      view = await this.openView(rec);
      if (stopped) return;
      this.opts.log.info({ volume: name }, 'hydrating from the newest checkpoint while the volume is handed over');
      await view.startHydration(options)?.done;
    };
    void run().catch((err: unknown) => {
      this.opts.log.info({ volume: name, err: errorMessage(err) }, 'hydration ahead of the handoff failed; the served volume hydrates once it is open');
    }).finally(() => { void view?.close(); });
    return {
      stop: () => {
        stopped = true;
        void (view as Volume | null)?.close();
      },
    };
  }

  async open(name: string, options: { readOnly: boolean }): Promise<OpenVolume> {
    const rec = await this.record(name);
    // An encrypted volume without its key (or with another) is refused here, at attach (KeyError), never as an EIO on a first read.
    const frameKeys = frameKeysFor(rec, rec.data?.encryption ? this.masterKey() : null);
    const vol = await Volume.open(rec, { ...this.opts.volume, store: this.opts.store, cache: await this.opts.cache(), log: this.opts.log, readOnly: options.readOnly || !!rec.snapshot, frameKeys });
    return { backend: vol, close: () => vol.close(), volume: vol };
  }
}

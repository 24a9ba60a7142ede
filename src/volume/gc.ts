/**
 * Garbage collection: delete the objects no volume, fork, snapshot or reader can need any
 * more. Compaction (Volume.compact) turns mostly-dead objects into dead ones; this deletes them.
 *
 * ## The reference set R (computed from the store, nothing else)
 * For every record under `volumes/` (volumes and snapshots), GC recovers its map exactly the
 * way a host opening it would (Volume.open through a store that notes every key it reads):
 * - every object the map points at (segments, log records holding inline data);
 * - every object recovery read: the newest checkpoint, the log records after it, and for a
 *   fork without its own checkpoint the ancestor's checkpoint and records up to the fork point;
 * plus, for every volume id reachable from a record through `parent` links, its `meta` (`rm`
 * walks those links to find descendants), and every fork marker of such an id
 * (`vol/<parent>/forks/<id>/<name>`, format.ts: accounting walks those down; no data is read
 * through them, so they matter to nothing else); and for the id of every existing volume (the ids
 * someone may write), its newest log record (the top position of a writable log is never
 * freed for reuse: see "The log is a chain" in volume.ts) and every segment uploaded for a
 * position after it (a commit in flight: its record is not written yet). A removed volume's
 * id keeps only what its descendants' recoveries read: nobody writes or recovers it again.
 * `volumes/` records are never touched.
 *
 * ## Two phases and a grace period G
 * A run marks its candidates (objects not in R and older than G) in `gc/marks/<run>`; an
 * object is deleted only by a later run that finds it in a mark at least G old AND still not
 * in its own R. All times are the store's own clock (lastModified), never the host's.
 *
 * ## Why nothing needed is ever deleted
 * Let run 1 mark X at W1 (its reference set was computed just before) and run 2 delete it,
 * with its computation starting at S2 >= W1 + G. Who could read X after S2?
 * 1. A map recovered from the store at S2: X is not in run 2's R, which is exactly such a map
 *    for every record listed at S2.
 * 2. A record created while run 2 computed (a fork or snapshot in creation): its map is its
 *    source's map at the fork point P, and it lands within M/2 of the start of the attempt
 *    that read P (slower attempts are undone, waited out so that none of their requests
 *    lands later, and made again: catalog.ts landRecord, abandon). Run 2 computes its
 *    source's map as of its `vol/` listing, or loads it live; either way the fork is found
 *    or names nothing the source's computed map does not: "One listing of the records"
 *    below. Run 1 did the same, so from W1 on no map, existing or in creation, names X.
 * 3. A commit in flight: its segments are uploaded before the record that names them, and
 *    they are named for the position that record will take (seg/<seq>-...). GC lists the
 *    store before it loads the maps: a segment whose record was in that listing is in the
 *    maps if still used, and a segment for a position after the listing's newest record
 *    is kept, however long the upload takes. If that position is taken by another writer instead, the segments'
 *    writer is fenced and never names them; if it is taken by the same writer's later attempt
 *    (pipelined commits: an attempt packed behind one that then did not land is dropped, and
 *    its layer is packed again with new segment names), nothing names them either. Either way
 *    they are garbage once the log passes their position, like any failed commit's. A stale writer (paused past its lease) may
 *    re-create a log position GC freed, with a create-only put that succeeds: deleting a
 *    record frees its position. Its record is never part of any map: positions GC frees
 *    lie at or below a checkpoint, which recovery starts from; checkpoints are create-only;
 *    and every replay checks that each record names its predecessor, which the stale one
 *    does not (volume.ts, "The log is a chain"). So it is garbage like any other object.
 * 4. A reader on another host with an older map: read-only views of live volumes refresh
 *    their map when it is older than M/2 before reading (volume.ts), so every map read
 *    through after S2 was loaded after S2 - M/2 > W1, when no map named X any more. (Reads
 *    that arrive during a refresh wait for it. A refresh that finds log records after its
 *    position collected, as a gap or as a record gone before it could read it, reloads
 *    from the newest checkpoint into a new map and swaps it in whole.)
 * 5. Recovery in progress (a host opening a volume from a checkpoint GC has since superseded):
 *    the map it ends with is the current one (checkpoint + every later record), so it names
 *    nothing deleted; if a record it meant to replay is gone, recovery fails with a clear
 *    error instead of guessing (the log must be contiguous) and the next attempt starts
 *    from the newest checkpoint.
 * 6. The meta of a record in creation (create, fork or snapshot put `vol/<id>/meta` first,
 *    the name after): no record names it yet, so it is in no R; its age protects it. The
 *    name put is issued within M/2 of the meta put (slower attempts are undone: landRecord)
 *    and lands within M of being issued or never (the bound on a request, format.ts), so
 *    before the meta is G >= 2M old: a run that finds the meta old enough to be a candidate
 *    took its clock after that, lists the records after that, sees the name and puts the
 *    meta in R. An undone attempt's meta goes only once its name is known gone for good.
 * So G >= 2M suffices (the bounds are in one place, format.ts timeBounds, which asserts that
 * they fit); G is checked against this process's M, and every host must run with the same M
 * (BATON_MAX_OPERATION_MS, default 60 s). Any error while computing R aborts the run before
 * anything is deleted.
 *
 * Concurrent runs (two hosts) are safe: each deletion is justified by one old mark and one
 * fresh computation, whoever wrote the mark.
 *
 * ## Reusing a record's contribution (why a run reads nothing of an unchanged volume)
 * A record's contribution to R (the keys in R because of it, above) is a function of the
 * bytes of the record and of the objects its recovery reads, and of what its listings
 * return. A run notes, per record, every listing its recovery made (prefix, StartAfter, the
 * end bound, and each key with its etag), every meta read and whether it was there, and the
 * record's own etag; it saves them with the contribution in `gc/state` (gc-state.ts). The
 * next run lists `vol/` and `volumes/` with etags anyway, and takes a record's contribution
 * from the state, reading nothing of it, iff (ListingIndex.unchanged) the record's etag is the
 * saved one and, in this run's `vol/` listing, every saved listing would return exactly the
 * same keys with the same etags and every saved meta is there or not as it was.
 * Why that is the contribution a recovery at this run's listing would compute:
 * - Recovery is deterministic: which keys it lists next and reads depends only on what it
 *   listed and read before (the newest checkpoint, the log after it, an ancestor's up to the
 *   fork point; ReadTrackingStore refuses to vouch for anything else it reads: a head, a
 *   key no listing of its own returned). So the same answers give the same map and reads.
 * - The same etag is the same bytes. A key's bytes change only by a delete and a new put
 *   (objects are immutable), and every store gives a new put a new etag, except S3, whose
 *   etag of a plain put is the MD5 of its bytes (the same etag, the same bytes). A version
 *   once gone never comes back with the etag it had: its key is a log position or a
 *   checkpoint freed by GC (a stale writer's record there has another id, so other bytes), or
 *   a name made again (a new id). So a version a recovery read between its listing and its
 *   GET (a key replaced meanwhile) cannot match a later listing under the etag it was listed
 *   with, and its record is computed again. A meta's bytes are fixed by its key (a random id,
 *   written once by the attempt that drew it): only its presence is compared.
 * - Bounds: an ancestor's listings stop at the fork point (endAt), which is all recovery
 *   uses, so a fork or snapshot whose parent goes on being written keeps its contribution.
 * - When: the state is matched against this run's `vol/` listing, so a reused contribution
 *   is its record's map as of that listing, as a recovery through ListedView computes it;
 *   why that is enough is the next section. Records of later rounds are always loaded live.
 * A state that cannot be read, or was written for another GC_STATE_VERSION, is ignored (the
 * run computes every record, as without it); nothing in it is ever trusted without the match
 * above. Saving it is a plain put after R was computed; a run that fails writes none.
 *
 * ## One listing of the records (maps as of the `vol/` listing)
 * The run lists `vol/` first; the listing ends at L. It lists `volumes/` once, at
 * T1 >= L + M/2 (fixedPointWaitMs), and computes each record listed there *as of the
 * listing*: reused from the state (above), or recovered through ListedView, whose listings
 * are the run's listing and whose GETs fail unless they returned the listed version. Only a
 * record whose meta is in the listing is computed so. One whose meta is not (made after the
 * listing began: as of the listing it did not exist), or whose computation through the
 * listing fails (an object it needs was deleted or replaced since), is loaded live; after any
 * live load the records are listed again M/2 after the last live load, and new ones are
 * loaded live, until a listing brings nothing new (the fixed point). So a run that loads
 * nothing live lists the records once.
 * Why the maps as of the listing are enough. Write map_L(S) for S's map recovered from the
 * listing: its newest listed checkpoint and its log records listed after it, which the chain
 * makes S's map at its newest listed log position n_L.
 * (a) S's live map at any time after L names only objects map_L(S) names, objects the
 *     listing does not hold, or segments for positions after n_L. S's log grows one position
 *     at a time and a record is create-only; records after n_L were put after S's log was
 *     listed, and they name only new objects (inline data in themselves; segments for their
 *     own positions, uploaded before them: listed or not, case 3 keeps every listed segment
 *     of a writable id for a position after its newest listed record). Maps gain references
 *     only through commits, which name new objects, and forks. Objects the listing does not
 *     hold are never candidates of this run.
 * (b) A fork or snapshot F of S whose attempt started at a < L lands before L + M/2 <= T1
 *     (or is undone): it is in the listing of the records and is computed, as of the listing
 *     if its meta is listed (its map is S's at the fork point, read from listed keys), else
 *     live.
 * (c) F whose attempt started at a >= L read S's map after L: by (a) it names nothing that is
 *     a candidate and not in map_L(S). If S's record is listed at T1, map_L(S) is in R (or S
 *     was loaded live at L_S: then F with a < L_S lands before L_S + M/2, which the next
 *     round's listing finds; F with a >= L_S names only what S's live map names or new
 *     objects, as in the fixed point before). If S was removed before T1, F landed after T1
 *     (it is not listed), so F's confirmSource (catalog.ts), which reads S's record after F
 *     landed, finds it gone and undoes F: it is never acknowledged and no volume maps it.
 *     (Nor one made of F before F's check ran: F is not settled then, so such a fork repeats
 *     the check of F and of every unsettled record above it after it landed, catalog.ts
 *     confirmSource, and undoes itself too; an undone record whose name was seen keeps its
 *     meta while a fork descends from it, abandon. Not covered: settledByAge's assumption.)
 *     If S's record is listed at T1 but gone when read, map_L(S) is not in R: F (listed or
 *     not) landed before S's record went (its confirmSource found S after it landed), so
 *     before our read found it gone; the run then lists the records again, as after a live
 *     load, and that listing holds F (listRecords' `vanished`).
 * (d) A map a host recovers, or a writer holds, at any time after L is covered by (a). Maps
 *     computed as of the listing are therefore never less than the live loads after L that
 *     runs made before this change (what those kept among the candidates, these keep).
 * (e) A record made again under a name after the listing has a new id whose meta is not
 *     listed: loaded live. A record whose meta is listed but whose name landed after L is a
 *     create (an empty map; its records are new objects) or a fork with a < L (in (b)).
 * Case 6 is unchanged: the run's clock is taken before the listing, and the records are
 * listed after it.
 *
 * Not covered: a host still serving a volume (read-only) after `baton rm` removed it reads
 * objects GC may delete; removing a volume is the user's decision that nobody needs it.
 */

import { randomId, systemWorld, type World } from '../clock.js';
import { CorruptError, InvalidArgumentError, NotFoundError, errorMessage } from '../errors.js';
import type { Logger } from '../log.js';
import { listAll, type ByteRange, type ListOptions, type ObjectHead, type ObjectInfo, type ObjectStore} from '../store/object-store.js';
import { compareKeys } from '../store/memory.js';
import type { StoreCatalog } from './catalog.js';
import { GC_STATE_KEY, ListingIndex, decodeGcState, encodeGcState, type Contribution, type ListInput } from './gc-state.js';
import { decodeVolumeRecord, forkMarkerOf, keys, maxOperationMs, segmentSeq, seqFromKey, timeBounds, type VolumeRecord } from './format.js';
import { mapLimit } from './volume.js';

export const DEFAULT_GC_GRACE_MS = 60 * 60 * 1000;
const MARKS_PREFIX = 'gc/marks/';
const CLOCK_KEY = 'gc/clock';

export interface GcOptions {
  /** G: objects younger than this are never candidates; a mark must be this old before its objects go. */
  graceMs?: number;
  /** Compute and report, delete nothing, write no mark. */
  dryRun?: boolean;
  /** M (defaults to maxOperationMs()); the grace must be at least 2M. */
  maxOperationMs?: number;
  /** Time (src/clock.ts): the fixed point's waits run on it. */
  world?: World;
  log?: Logger;
}

export interface GcResult {
  dryRun: boolean;
  graceMs: number;
  /** Volume and snapshot records whose maps were computed or reused. */
  records: number;
  /** Of those, records unchanged since the previous run, whose contribution was reused (nothing of theirs read). */
  reusedRecords: number;
  /** Of those, records whose maps had to be loaded live (made after the `vol/` listing, or changed under it); 0 means one listing of the records. */
  liveRecords: number;
  /** Listings of `volumes/` the run made: 1, plus one per fixed-point round after live loads. */
  recordListings: number;
  /** Everything under vol/ when the run listed it. */
  objects: number;
  storedBytes: number;
  referencedObjects: number;
  referencedBytes: number;
  /** Unreferenced, older than the grace: marked by this run (deleted by a later one). */
  markedObjects: number;
  markedBytes: number;
  /** Deleted (or, in a dry run, deletable now). */
  deletedObjects: number;
  deletedBytes: number;
  /** Unreferenced but younger than the grace (a commit or fork in flight, or just freed). */
  youngUnreferenced: number;
  /** Candidates a younger mark already names: a later run deletes them once that mark is old. */
  awaitingMarkAge: number;
  failedDeletes: number;
}

/**
 * Records what recovery reads, so that the reference set is exactly what an opener needs,
 * and what it read it from (every listing with its keys and etags, every meta and whether
 * it was there), so that a later run can tell the record's contribution is unchanged.
 */
class ReadTrackingStore implements ObjectStore {
  readonly read = new Set<string>();
  readonly lists: ListInput[] = [];
  readonly metas = new Map<string, boolean>();
  /** False once something was read that the inputs cannot vouch for (then nothing is reused). */
  reusable = true;
  constructor(private readonly inner: ObjectStore) {}
  get description(): string { return this.inner.description; }
  async get(key: string, range?: ByteRange): Promise<Buffer> {
    this.read.add(key);
    try {
      const body = await this.inner.get(key, range);
      if (isMetaKey(key)) this.metas.set(key, true);
      return body;
    } catch (err) {
      if (err instanceof NotFoundError && isMetaKey(key)) this.metas.set(key, false);
      throw err;
    }
  }
  head(key: string): Promise<ObjectHead | null> {
    // Recovery never heads; if it ever does, the listing inputs do not cover it.
    this.read.add(key);
    this.reusable = false;
    return this.inner.head(key);
  }
  async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    const input: ListInput = { prefix, after: options?.startAfter ?? null, end: options?.endAt ?? null, keys: [] };
    let complete = false;
    try {
      for await (const o of this.inner.list(prefix, { ...options, etags: true })) {
        // What the caller uses ends at endAt (a store may list further; recovery filters).
        if (input.end === null || compareKeys(o.key, input.end) <= 0) {
          if (o.etag === undefined) this.reusable = false; // a store that does not tell versions apart
          input.keys.push([o.key, o.etag ?? '']);
        }
        yield o;
      }
      complete = true;
    } finally {
      if (complete) this.lists.push(input); else this.reusable = false;
    }
  }
  put(): Promise<void> { return Promise.reject(new Error('GC views never write')); }
  delete(): Promise<void> { return Promise.reject(new Error('GC views never delete')); }
  close(): Promise<void> { return Promise.resolve(); }

  /** Every object read is a meta or was listed by this recovery (so its etag is in the inputs). */
  coversReads(): boolean {
    if (!this.reusable) return false;
    const listed = new Set<string>();
    for (const l of this.lists) for (const [k] of l.keys) listed.add(k);
    for (const k of this.read) if (!isMetaKey(k) && !listed.has(k)) return false;
    return true;
  }
}

/** A read through ListedView found the store no longer as its listing showed it. */
class ListingOutdated extends Error {}

/**
 * The store as this run's `vol/` listing showed it: listings are answered from that listing
 * (with its etags), and a GET returns the version the listing named or fails. A record
 * recovered through it gets its map as of the listing (see "One listing of the records"):
 * - a key the listing does not hold is NotFound (it did not exist then, for this run);
 * - a listed key is read from the store, then HEADed: the bytes read are the listed version
 *   iff the HEAD still shows the listed etag (a version once gone never comes back with its
 *   etag, "Reusing a record's contribution", so the key held that version from the listing to
 *   the HEAD, the GET included). A meta's bytes are fixed by its key: no HEAD. A listed key
 *   gone, or with another etag, is ListingOutdated: the caller computes the record live.
 */
class ListedView implements ObjectStore {
  constructor(private readonly inner: ObjectStore, private readonly listing: ListingIndex) {}
  get description(): string { return this.inner.description; }
  async get(key: string, range?: ByteRange): Promise<Buffer> {
    const listed = this.listing.info(key);
    if (listed === undefined) throw new NotFoundError(`${key} is not in this run's listing`);
    let body: Buffer;
    try {
      body = await this.inner.get(key, range);
    } catch (err) {
      if (err instanceof NotFoundError) throw new ListingOutdated(`${key} was deleted after the listing`);
      throw err;
    }
    if (!isMetaKey(key)) {
      const now = await this.inner.head(key);
      if (listed.etag === undefined || now?.etag !== listed.etag) throw new ListingOutdated(`${key} changed after the listing`);
    }
    return body;
  }
  head(key: string): Promise<ObjectHead | null> {
    // Recovery never heads (ReadTrackingStore): not answerable as of the listing.
    return Promise.reject(new ListingOutdated(`head ${key}`));
  }
  async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    yield* this.listing.range(prefix, options?.startAfter ?? null, options?.endAt ?? null);
  }
  put(): Promise<void> { return Promise.reject(new Error('GC views never write')); }
  delete(): Promise<void> { return Promise.reject(new Error('GC views never delete')); }
  close(): Promise<void> { return Promise.resolve(); }
}

function isMetaKey(key: string): boolean {
  return /^vol\/[^/]+\/meta$/.test(key);
}

/** The store's current time: GC compares the store's own lastModified stamps, never this host's clock. */
async function storeNow(store: ObjectStore, world: World): Promise<number> {
  await store.put(CLOCK_KEY, Buffer.from(world.wallTime().toISOString()));
  const h = await store.head(CLOCK_KEY);
  if (!h) throw new NotFoundError(`${CLOCK_KEY} vanished right after it was written: is the store read-after-write consistent?`);
  return h.lastModified.getTime();
}

/** Every settled marker's key ends so (format.ts keys.settled): the GC pass tests this before parsing a key. */
const SETTLED_SUFFIX = '/settled';

/** A record as listed under `volumes/`, and the etag it was listed with (null: the store gave none). */
interface ListedRecord { rec: VolumeRecord; etag: string | null }

/**
 * Every record under `volumes/`: one listing, and a GET only for the records whose etag is
 * not the one the previous run read (a record's bytes never change under one etag; a name
 * removed and made again is a new put with another etag).
 */
async function listRecords(store: ObjectStore, previous: Map<string, Contribution> | null): Promise<{ records: ListedRecord[]; vanished: number }> {
  const objs = await listAll(store, keys.volumesPrefix, { etags: true });
  const recs = await mapLimit(objs, 8, async (o): Promise<ListedRecord | null> => {
    const prev = previous?.get(o.key.slice(keys.volumesPrefix.length));
    if (prev !== undefined && o.etag !== undefined && prev.etag === o.etag) return { rec: prev.record, etag: o.etag };
    try {
      return { rec: decodeVolumeRecord(await store.get(o.key), o.key), etag: o.etag ?? null };
    } catch (err) {
      if (err instanceof NotFoundError) return null; // removed after it was listed: see referenceSet
      throw err;
    }
  });
  const records = recs.filter((r): r is ListedRecord => r !== null);
  return { records, vanished: recs.length - records.length };
}

interface ReferenceSet {
  refs: Set<string>;
  records: number;
  writableIds: Set<string>;
  /** Every record's contribution that a later run may reuse (see "Reusing a record's contribution"). */
  contributions: Contribution[];
  reused: number;
  /** Records whose maps were loaded live (made after the listing, or not computable as of it): each makes the run list the records again. */
  live: number;
  /** Listings of `volumes/` this run made (1 when nothing was loaded live). */
  recordListings: number;
}

/**
 * The reference set R: every key a live map or its recovery needs ("One listing of the
 * records" in the header). `listing` is this run's `vol/` listing, which ended at
 * `listedAt` (world.now()); the records are listed `fixedPointWaitMs` after that, and each is
 * computed as of the listing: from the previous run's state when its inputs are unchanged,
 * else recovered through the listing (ListedView). Only a record that cannot be computed so
 * (its meta is not in the listing, or the store changed under it) is loaded live, and then the
 * records are listed again `fixedPointWaitMs` after the last live load, until a listing brings
 * nothing new (the fixed point).
 */
async function referenceSet(catalog: StoreCatalog, maxOpMs: number, log: Logger | undefined, world: World, listing: ListingIndex, listedAt: number, previous: Promise<Map<string, Contribution> | null>): Promise<ReferenceSet> {
  const bounds = timeBounds(maxOpMs);
  const writableIds = new Set<string>();
  const store = catalog.store;
  const asListed = new ListedView(store, listing);
  const refs = new Set<string>();
  const contributions: Contribution[] = [];
  let reused = 0;
  let live = 0;
  let lastLiveLoad = -Infinity;
  // A meta's bytes are fixed by its key; whether it is there depends on when we look.
  const metas = new Map<ObjectStore, Map<string, VolumeRecord | null>>();
  const metaOf = async (via: ObjectStore, id: string): Promise<VolumeRecord | null> => {
    let seen = metas.get(via);
    if (!seen) metas.set(via, seen = new Map());
    if (!seen.has(id)) {
      const key = keys.meta(id);
      seen.set(id, await via.get(key).then((b) => decodeVolumeRecord(b, key), (err) => {
        if (err instanceof NotFoundError) return null;
        throw err;
      }));
    }
    return seen.get(id)!;
  };
  /** The record's contribution through `via` (the store as listed, or live); null if it was removed meanwhile. */
  const compute = async (rec: VolumeRecord, etag: string | null, via: ObjectStore): Promise<Set<string> | null> => {
    const tracking = new ReadTrackingStore(via);
    let view;
    try {
      view = await catalog.openView(rec, tracking, true);
    } catch (err) {
      // Removed while we looked (rm deletes the record first): nobody needs its map.
      if (via === store && err instanceof NotFoundError && !(await store.head(keys.volumeRecord(rec.name)))) return null;
      throw err;
    }
    const mine = new Set<string>(tracking.read);
    await view.forEachCommitted((e) => { if (e.key !== null) mine.add(e.key); });
    await view.close();
    // Its id and every ancestor's: their meta records explain the ancestry to rm and to forks.
    mine.add(keys.meta(rec.id));
    const walked = new Map(tracking.metas);
    let p = rec.parent?.id;
    for (let depth = 0; p && depth < 10_000; depth++) {
      mine.add(keys.meta(p));
      const m = await metaOf(via, p);
      walked.set(keys.meta(p), m !== null);
      p = m?.parent?.id;
    }
    if (etag !== null && tracking.coversReads()) {
      contributions.push({ name: rec.name, etag, record: rec, lists: tracking.lists, metas: [...walked], refs: [...mine] });
    }
    return mine;
  };
  const computed = new Set<string>();
  const addRecord = async ({ rec, etag }: ListedRecord, round: number, prior: Map<string, Contribution> | null): Promise<void> => {
    if (!rec.snapshot) writableIds.add(rec.id);
    // As of the listing only in the first round, and only for a record whose meta the listing holds.
    const asOfListing = round === 0 && listing.has(keys.meta(rec.id));
    const prev = asOfListing && etag !== null ? prior?.get(rec.name) : undefined;
    if (prev !== undefined && prev.etag === etag && listing.unchanged(prev)) {
      for (const k of prev.refs) refs.add(k);
      contributions.push(prev);
      reused++;
      return;
    }
    let mine: Set<string> | null = null;
    if (asOfListing) {
      mine = await compute(rec, etag, asListed).catch((err: unknown) => {
        log?.debug({ volume: rec.name, err: errorMessage(err) }, 'gc: not computable as of the listing; loading it live');
        return null;
      });
    }
    if (mine === null) {
      live++;
      try {
        mine = await compute(rec, etag, store);
      } catch (err) {
        throw new Error(`cannot compute what ${rec.name} needs (${errorMessage(err)}); nothing was deleted`);
      } finally {
        lastLiveLoad = world.now();
      }
      if (mine === null) return;
    }
    for (const k of mine) refs.add(k);
    log?.debug({ volume: rec.name, refs: refs.size }, 'gc: map computed');
  };
  const waitUntil = async (t: number): Promise<void> => {
    const ms = t - world.now();
    if (ms <= 0) return;
    log?.info({ waitMs: Math.round(ms) }, 'gc: waiting for forks and snapshots in creation');
    await new Promise<void>((r) => { world.setTimeout(r, ms); });
  };
  let recordListings = 0;
  for (let round = 0; ; round++) {
    // Round 0 lists the records fixedPointWaitMs after the vol/ listing ended; later rounds,
    // that long after the last live load.
    await waitUntil((round === 0 ? listedAt : lastLiveLoad) + bounds.fixedPointWaitMs);
    const prior = await previous;
    recordListings++;
    const listed = await listRecords(store, prior);
    const fresh = listed.records.filter((r) => !computed.has(r.rec.id));
    // A record listed but gone when read is no map in R: a fork of it that landed after the
    // listing (so is not in it) and confirmed its source before the source went needs what
    // that map held, and (c) in the header no longer covers it. It landed before our read
    // found the source gone, so the next listing holds it: a vanished record counts as a
    // live load (reviewed finding: without this GC marked, and a later run deleted, a
    // removed source's objects its fork's child maps).
    if (listed.vanished > 0) lastLiveLoad = world.now();
    if (round > 0 && fresh.length === 0 && listed.vanished === 0) break;
    if (round >= 20) throw new Error('records keep appearing (forks created non-stop?); try again later; nothing was deleted');
    for (const r of fresh) computed.add(r.rec.id);
    await mapLimit(fresh, 4, (r) => addRecord(r, round, prior));
    if (live === 0 && listed.vanished === 0) break; // every map is as of the listing: no later listing can add a need (header)
  }
  return { refs, records: computed.size, writableIds, contributions, reused, live, recordListings };
}

/** The previous run's contributions, or null (none, another version's, or unreadable: then everything is computed). */
async function loadState(store: ObjectStore, world: World, log: Logger | undefined): Promise<Map<string, Contribution> | null> {
  let body: Buffer;
  try {
    body = await store.get(GC_STATE_KEY);
  } catch (err) {
    if (err instanceof NotFoundError) return null;
    throw err;
  }
  try {
    return await decodeGcState(body, () => world.yield());
  } catch (err) {
    if (!(err instanceof CorruptError)) throw err;
    log?.warn({ key: GC_STATE_KEY, err: errorMessage(err) }, 'gc: the previous run\'s state is unreadable; computing every record');
    return null;
  }
}

function idOf(key: string): string | null {
  const m = /^vol\/([^/]+)\//.exec(key);
  return m ? m[1]! : null;
}

export async function collectGarbage(catalog: StoreCatalog, opts: GcOptions = {}): Promise<GcResult> {
  const store = catalog.store;
  const log = opts.log;
  const graceMs = opts.graceMs ?? DEFAULT_GC_GRACE_MS;
  const m = opts.maxOperationMs ?? maxOperationMs();
  if (!(graceMs >= timeBounds(m).minGraceMs)) {
    throw new InvalidArgumentError(`the GC grace period (${graceMs} ms) must be at least twice the longest operation (${m} ms, BATON_MAX_OPERATION_MS): a shorter one could delete data a fork in creation or a reader on another host still needs`);
  }
  const dryRun = opts.dryRun ?? false;
  const world = opts.world ?? systemWorld;
  const now = await storeNow(store, world);
  const cutoff = now - graceMs;

  // List first, then compute the maps: whatever a commit landed before the listing names is
  // then in the maps, and what lands after it is not in the listing, so not a candidate.
  // With etags: the listing is also what a reused contribution is checked against.
  const objects = await listAll(store, 'vol/', { etags: true });
  const t0 = world.now(); // the listing has ended
  const previous = loadState(store, world, log); // while referenceSet waits
  previous.catch(() => { /* awaited in referenceSet */ });
  const { refs, records, writableIds, contributions, reused, live, recordListings } = await referenceSet(catalog, m, log, world, new ListingIndex(objects), t0, previous);
  log?.info({ records, reused, live, recordListings, referenced: refs.size, ms: Math.round(world.now() - t0) }, 'gc: reference set computed');
  if (!dryRun) {
    // A cache for the next run: failing to write it costs that run time, never safety.
    await encodeGcState(contributions, () => world.yield())
      .then((body) => store.put(GC_STATE_KEY, body))
      .catch((err) => log?.warn({ err: errorMessage(err) }, 'gc: could not save this run\'s state; the next run computes every record'));
  }

  const newestLog = new Map<string, string>();
  for (const o of objects) {
    const id = idOf(o.key);
    if (id && writableIds.has(id) && o.key.startsWith(keys.logPrefix(id))) newestLog.set(id, o.key); // listed in order: the last one wins
  }
  for (const k of newestLog.values()) refs.add(k);
  // A fork marker lives as long as its child's meta: while the child, or a descendant of it,
  // exists (its meta is then in R), the marker leads accounting from the parent to it.
  for (const o of objects) {
    const f = forkMarkerOf(o.key);
    if (f !== null && refs.has(keys.meta(f.child))) refs.add(o.key);
    // Likewise a record's settled marker (catalog.ts markSettled) lives as long as its meta.
    if (o.key.endsWith(SETTLED_SUFFIX)) {
      const id = idOf(o.key);
      if (id !== null && o.key === keys.settled(id) && refs.has(keys.meta(id))) refs.add(o.key);
    }
  }
  for (const o of objects) {
    const id = idOf(o.key);
    const seq = segmentSeq(o.key);
    if (seq === null || id === null || !writableIds.has(id)) continue;
    const top = newestLog.get(id);
    if (seq > (top ? seqFromKey(top) : 0)) refs.add(o.key);
  }

  const result: GcResult = {
    dryRun, graceMs, records, reusedRecords: reused, liveRecords: live, recordListings, objects: objects.length, storedBytes: 0, referencedObjects: 0, referencedBytes: 0,
    markedObjects: 0, markedBytes: 0, deletedObjects: 0, deletedBytes: 0, youngUnreferenced: 0, awaitingMarkAge: 0, failedDeletes: 0,
  };
  const candidates = new Map<string, number>();
  for (const o of objects) {
    result.storedBytes += o.size;
    if (refs.has(o.key)) { result.referencedObjects++; result.referencedBytes += o.size; continue; }
    if (o.lastModified.getTime() > cutoff) { result.youngUnreferenced++; continue; }
    candidates.set(o.key, o.size);
  }

  // Phase two: what an old enough mark already named and is still a candidate now.
  const marks = await listAll(store, MARKS_PREFIX);
  const oldMarks = marks.filter((mk) => mk.lastModified.getTime() <= cutoff);
  const deletable: [string, number][] = [];
  const marked = new Set<string>();
  // Candidates a younger mark (another host's run, or our own last one) already names are
  // not marked again: that mark deletes them once it is old enough. Marking them again made
  // two hosts mark, and then delete, the same objects (twice the DELETEs, and each run
  // counting bytes the other freed). Safe: deletion still needs an old mark AND this run's R.
  const pending = new Set<string>();
  await mapLimit(marks, 8, async (mk) => {
    const body = await store.get(mk.key).catch((err) => { if (err instanceof NotFoundError) return null; throw err; });
    if (!body) return; // another run consumed it
    const into = mk.lastModified.getTime() <= cutoff ? marked : pending;
    for (const k of parseMark(body, mk.key)) into.add(k);
  });
  for (const [k, size] of candidates) if (marked.has(k)) deletable.push([k, size]);
  const toMark = [...candidates].filter(([k]) => !marked.has(k) && !pending.has(k));
  result.awaitingMarkAge = [...candidates.keys()].filter((k) => !marked.has(k) && pending.has(k)).length;
  result.markedObjects = toMark.length;
  result.markedBytes = toMark.reduce((n, [, s]) => n + s, 0);

  if (dryRun) {
    result.deletedObjects = deletable.length;
    result.deletedBytes = deletable.reduce((n, [, s]) => n + s, 0);
    return result;
  }
  if (toMark.length > 0) {
    // The suffix only keeps two runs' marks apart; drawn from the World, so that a simulated
    // run replays exactly (Math.random made the simulator's replay of a seed differ).
    const name = `${MARKS_PREFIX}${String(now).padStart(15, '0')}-${randomId(world, 4)}`;
    await store.put(name, Buffer.from(JSON.stringify({ v: 1, graceMs, keys: toMark.map(([k]) => k) })));
  }
  let done = 0;
  await mapLimit(deletable, 16, async ([k, size]) => {
    try {
      await store.delete(k);
      result.deletedObjects++;
      result.deletedBytes += size;
    } catch (err) {
      result.failedDeletes++;
      log?.warn({ key: k, err: errorMessage(err) }, 'gc: delete failed; a later run tries again');
    }
    if (++done % 1000 === 0) log?.info({ deleted: done, of: deletable.length }, 'gc: deleting');
  });
  // Every key of an old mark is now deleted or referenced again: the mark is spent. Keep
  // it if a delete failed, so the next run can delete without waiting another grace.
  if (result.failedDeletes === 0) await mapLimit(oldMarks, 16, (mk) => store.delete(mk.key));
  log?.info({ ...result }, 'gc: done');
  return result;
}

function parseMark(body: Buffer, key: string): string[] {
  try {
    const m = JSON.parse(body.toString('utf8')) as { v?: number; keys?: unknown };
    if (m.v === 1 && Array.isArray(m.keys)) return m.keys.filter((k): k is string => typeof k === 'string');
  } catch { /* fall through */ }
  // An unreadable mark names nothing: deleting less is always safe.
  return [];
}

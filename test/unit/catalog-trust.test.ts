/**
 * The catalog keeps its promises under faults (issues 9.3, 9.5, 17.2):
 * - `rm` deletes a volume's objects only when it KNOWS nothing descends from it: one 503 on
 *   a relative's meta, or an ancestry that cannot be followed to its root, aborts instead;
 * - creating a record is all or nothing: a name put that landed but whose reply was lost
 *   (or that failed ambiguously) is resolved before anything is deleted;
 * - a snapshot belongs to the volume identity it was taken of: a volume with snapshots is
 *   not removed without them, and a later volume of the same name never inherits them.
 * The faults are injected by a small wrapper around the in-memory store (deterministic).
 */
import test from 'ava';
import { BlockCache } from '../../src/cache.js';
import { AlreadyExistsError, CorruptError, InvalidArgumentError, NotFoundError, StoreUnavailableError, isBatonError } from '../../src/errors.js';
import { silentLogger } from '../../src/log.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { listAll, type ByteRange, type ListOptions, type ObjectHead, type ObjectInfo, type ObjectStore, type PutOptions } from '../../src/store/object-store.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import { encodeVolumeRecord, keys, type VolumeRecord } from '../../src/volume/format.js';
import type { Volume } from '../../src/volume/volume.js';

const MiB = 1024 * 1024;

type Hook = (key: string) => Promise<void> | void;

/** Passes everything to a memory store; a test sets one-shot hooks that run before (or after) an op on a key. */
class HookedStore implements ObjectStore {
  readonly inner = new MemoryObjectStore();
  readonly description = 'memory:';
  beforeGet: Hook | null = null;
  /** Runs around a put: `before` may throw (the put never happens), `after` runs once it landed (and may throw: a lost reply). */
  beforePut: Hook | null = null;
  afterPut: Hook | null = null;
  async get(key: string, range?: ByteRange): Promise<Buffer> { await this.beforeGet?.(key); return this.inner.get(key, range); }
  async put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    await this.beforePut?.(key);
    await this.inner.put(key, body, options);
    await this.afterPut?.(key);
  }
  head(key: string): Promise<ObjectHead | null> { return this.inner.head(key); }
  list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> { return this.inner.list(prefix, options); }
  delete(key: string): Promise<void> { return this.inner.delete(key); }
  close(): Promise<void> { return Promise.resolve(); }
}

/** A hook that throws `err()` the first `times` times `match(key)` holds, then does nothing. */
function failing(match: (key: string) => boolean, err: () => Error, times = 1): Hook {
  let left = times;
  return (key) => {
    if (left > 0 && match(key)) { left--; throw err(); }
  };
}

const unavailable = (): Error => new StoreUnavailableError('injected 503 Service Unavailable');

function setup() {
  const store = new HookedStore();
  const cache = BlockCache.open({ capacityBytes: 64 * MiB });
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => cache, volume: { segmentBytes: MiB } });
  let token = 0;
  const open = async (name: string, readOnly = false): Promise<Volume> => {
    const v = (await catalog.open(name, { readOnly })).backend as Volume;
    if (!readOnly) await v.takeover(++token);
    return v;
  };
  const write = async (name: string, offset: number, byte: number, length = 2 * MiB): Promise<void> => {
    const v = await open(name);
    await v.write(offset, Buffer.alloc(length, byte), false);
    await v.flush();
    await v.close();
  };
  const reads = async (name: string, offset: number, byte: number, length = 2 * MiB): Promise<boolean> => {
    const v = await open(name, true);
    try {
      return (await v.read(offset, length)).equals(Buffer.alloc(length, byte));
    } finally {
      await v.close();
    }
  };
  const objectsOf = async (name: string): Promise<string[]> => (await listAll(store.inner, keys.volumePrefix((await catalog.record(name)).id))).map((o) => o.key);
  return { store, catalog, open, write, reads, objectsOf };
}

/** root (data) -> child (its own writes) -> grandchild; the child removed but kept for the grandchild. */
async function threeGenerations(s: ReturnType<typeof setup>): Promise<{ rootId: string; childId: string; rootObjects: string[] }> {
  await s.catalog.create('root', 64 * MiB);
  await s.write('root', 0, 0x11);
  await s.catalog.fork('root', 'child');
  await s.write('child', 8 * MiB, 0x22);
  await s.catalog.fork('child', 'grandchild');
  const rootId = (await s.catalog.record('root')).id;
  const childId = (await s.catalog.record('child')).id;
  t_assert((await s.catalog.record('grandchild')).parent?.id === childId, 'the grandchild is forked from the child, not from the root');
  t_assert((await s.catalog.remove('child')).keptForRelatives, 'the child is kept for the grandchild');
  return { rootId, childId, rootObjects: await s.objectsOf('root') };
}

function t_assert(cond: boolean, what: string): void {
  if (!cond) throw new Error(`setup: ${what}`);
}

// ------------------------------------------------------------------ 9.3 / 17.2: rm and descendants

test('rm root meets one 503 on the removed child\'s meta: it aborts and deletes nothing; the grandchild keeps reading', async (t) => {
  const s = setup();
  const { childId, rootObjects } = await threeGenerations(s);
  s.store.beforeGet = failing((k) => k === keys.meta(childId), unavailable);
  const err = await t.throwsAsync(s.catalog.remove('root'));
  t.true(err instanceof StoreUnavailableError, `a transient error stays one (the caller may retry): ${err?.name}`);
  t.regex(err!.message, /cannot tell whether forks or snapshots of root still need its data, so nothing was removed/);
  t.regex(err!.message, /injected 503/);
  t.deepEqual(await s.objectsOf('root'), rootObjects, 'every object of root is still there, and so is its record');
  t.true(await s.reads('grandchild', 0, 0x11), 'the grandchild still reads what it inherited from root');
  t.true(await s.reads('grandchild', 8 * MiB, 0x22));
  // Once the store answers, rm knows and keeps the data for the grandchild.
  t.like(await s.catalog.remove('root'), { keptForRelatives: true, deletedObjects: 0 });
  t.true(await s.reads('grandchild', 0, 0x11));
});

test('rm with a relative\'s ancestry broken (its meta gone, v -> F -> G): "cannot tell", nothing removed', async (t) => {
  const s = setup();
  const { childId, rootObjects } = await threeGenerations(s);
  await s.store.inner.delete(keys.meta(childId)); // as the create bug of 17.2 left it
  const err = await t.throwsAsync(s.catalog.remove('root'));
  t.true(err instanceof CorruptError, `${err?.name}: ${err?.message}`);
  t.regex(err!.message, /grandchild names ancestor [0-9a-f]+, whose record vol\/[0-9a-f]+\/meta is gone, so its ancestry cannot be followed/);
  t.regex(err!.message, /nothing was removed/);
  t.deepEqual(await s.objectsOf('root'), rootObjects, 'root is untouched');
  t.true(await s.reads('grandchild', 0, 0x11), 'the grandchild reads root\'s data (from its own checkpoint)');
});

test('a record that is gone by the time its broken ancestry is found (a fork undoing itself) does not block rm', async (t) => {
  const s = setup();
  const { childId } = await threeGenerations(s);
  await s.store.inner.delete(keys.meta(childId));
  // The grandchild's record disappears while rm walks its ancestry (an undo, or another rm).
  s.store.beforeGet = async (k) => { if (k === keys.meta(childId)) { s.store.beforeGet = null; await s.store.inner.delete(keys.volumeRecord('grandchild')); } };
  t.like(await s.catalog.remove('root'), { keptForRelatives: false });
});

test('a 503 on the check after the record went: the volume is removed but its data stays, and rm says so', async (t) => {
  const s = setup();
  await s.catalog.create('x', 64 * MiB);
  await s.write('x', 0, 0x33);
  // An unrelated chain: its meta reads fine for the first check and fails for the second.
  await s.catalog.create('y', 64 * MiB);
  await s.write('y', 0, 0x44);
  await s.catalog.fork('y', 'y2');
  const yId = (await s.catalog.record('y')).id;
  const xObjects = await s.objectsOf('x');
  let metaReads = 0;
  s.store.beforeGet = (k) => { if (k === keys.meta(yId) && ++metaReads === 2) throw unavailable(); };
  const err = await t.throwsAsync(s.catalog.remove('x'));
  t.true(err instanceof StoreUnavailableError, err?.message);
  t.regex(err!.message, /x was removed, but whether forks or snapshots still need its data could not be told .*its data stays in the store, and baton gc deletes it/);
  await t.throwsAsync(s.catalog.record('x'), { instanceOf: NotFoundError });
  const xId = xObjects[0]!.split('/')[1]!;
  t.deepEqual((await listAll(s.store.inner, keys.volumePrefix(xId))).map((o) => o.key), xObjects, 'nothing of x was deleted');
});

// ------------------------------------------------------------------ 17.2: creating a record is all or nothing

test('the name put lands but its reply is lost (503): create succeeds, and the volume is whole', async (t) => {
  const s = setup();
  s.store.afterPut = failing((k) => k === keys.volumeRecord('v'), unavailable);
  const v = await s.catalog.create('v', 64 * MiB);
  t.is(v.name, 'v');
  const rec = await s.catalog.record('v');
  t.truthy(await s.store.inner.head(keys.meta(rec.id)), 'its meta is there');
  await t.throwsAsync(s.catalog.create('v', 64 * MiB), { instanceOf: AlreadyExistsError });
  await s.write('v', 0, 0x55);
  await s.catalog.fork('v', 'f');
  await s.write('f', 4 * MiB, 0x66);
  t.true(await s.reads('f', 0, 0x55), 'a fork of it opens and reads (its ancestry is whole)');
  t.like(await s.catalog.remove('f'), { keptForRelatives: false });
  t.like(await s.catalog.remove('v'), { keptForRelatives: false });
  t.deepEqual((await listAll(s.store.inner, 'vol/')).map((o) => o.key), [], 'rm of both leaves nothing behind');
});

test('the name put lands, its reply is lost and the name cannot be read back: create fails saying so, and the store stays consistent', async (t) => {
  const s = setup();
  s.store.afterPut = failing((k) => k === keys.volumeRecord('v'), unavailable);
  s.store.beforeGet = failing((k) => k === keys.volumeRecord('v'), unavailable);
  const err = await t.throwsAsync(s.catalog.create('v', 64 * MiB));
  t.true(err instanceof StoreUnavailableError, err?.message);
  t.regex(err!.message, /could not tell whether volume "v" was created .*see baton info v/);
  // Whatever happened, the name and its meta agree: it is a whole volume.
  const rec = await s.catalog.record('v');
  t.truthy(await s.store.inner.head(keys.meta(rec.id)), 'the meta was not deleted under a record that landed');
  await s.catalog.fork('v', 'f');
  t.true(await s.reads('f', 0, 0));
  t.like(await s.catalog.remove('f'), { keptForRelatives: false });
  t.like(await s.catalog.remove('v'), { keptForRelatives: false });
});

test('the name put fails before it lands (503): create resolves it (absent) and puts again', async (t) => {
  const s = setup();
  s.store.beforePut = failing((k) => k === keys.volumeRecord('v'), unavailable);
  await s.catalog.create('v', 64 * MiB);
  const rec = await s.catalog.record('v');
  t.truthy(await s.store.inner.head(keys.meta(rec.id)));
  t.is((await listAll(s.store.inner, 'vol/')).filter((o) => o.key.endsWith('/meta')).length, 1, 'one meta: ours');
});

test('an ambiguous failure while another host created the same name: AlreadyExists, and the other volume is untouched', async (t) => {
  const s = setup();
  const theirs: VolumeRecord = { format: 'baton-volume-1', name: 'v', id: 'feedfacefeedface', size: 64 * MiB, createdAt: new Date().toISOString() };
  s.store.beforePut = async (k) => {
    if (k !== keys.volumeRecord('v')) return;
    s.store.beforePut = null;
    await s.store.inner.put(keys.meta(theirs.id), encodeVolumeRecord(theirs), { ifNoneMatch: true });
    await s.store.inner.put(k, encodeVolumeRecord(theirs), { ifNoneMatch: true });
    throw unavailable();
  };
  await t.throwsAsync(s.catalog.create('v', 64 * MiB), { instanceOf: AlreadyExistsError });
  t.is((await s.catalog.record('v')).id, theirs.id);
  await s.write('v', 0, 0x77);
  t.true(await s.reads('v', 0, 0x77));
});

test('a plain "already exists" still deletes the meta it wrote (nothing can name it)', async (t) => {
  const s = setup();
  await s.catalog.create('v', 64 * MiB);
  await t.throwsAsync(s.catalog.create('v', 64 * MiB), { instanceOf: AlreadyExistsError });
  t.is((await listAll(s.store.inner, 'vol/')).filter((o) => o.key.endsWith('/meta')).length, 1);
});

test('a fork whose name put lands but whose reply is lost: the fork succeeds and opens', async (t) => {
  const s = setup();
  await s.catalog.create('v', 64 * MiB);
  await s.write('v', 0, 0x12);
  s.store.afterPut = failing((k) => k === keys.volumeRecord('f'), unavailable);
  await s.catalog.fork('v', 'f');
  t.true(await s.reads('f', 0, 0x12));
  s.store.afterPut = failing((k) => k === keys.volumeRecord('v@s'), unavailable);
  await s.catalog.snapshot('v', 's');
  t.true(await s.reads('v@s', 0, 0x12));
});

// ------------------------------------------------------------------ 9.5: snapshots belong to one volume identity

test('rm of a volume with snapshots is refused, listing them; with snapshots: true they go first', async (t) => {
  const s = setup();
  await s.catalog.create('v', 64 * MiB);
  await s.write('v', 0, 0x21);
  await s.catalog.snapshot('v', 'monday');
  await s.catalog.snapshot('v', 'tuesday');
  await s.catalog.create('other', 64 * MiB);
  await s.catalog.snapshot('other', 'monday');
  const err = await t.throwsAsync(s.catalog.remove('v'), { instanceOf: InvalidArgumentError });
  t.regex(err!.message, /volume v has 2 snapshots: v@monday, v@tuesday; .*baton rm v --snapshots/);
  t.deepEqual((await s.catalog.list()).map((x) => x.name).sort(), ['other', 'other@monday', 'v', 'v@monday', 'v@tuesday'], 'nothing was removed');
  const r = await s.catalog.remove('v', { snapshots: true });
  t.deepEqual(r.removedSnapshots.sort(), ['v@monday', 'v@tuesday']);
  t.false(r.keptForRelatives);
  t.deepEqual((await s.catalog.list()).map((x) => x.name).sort(), ['other', 'other@monday']);
  // A later volume named v starts with no snapshots.
  await s.catalog.create('v', 64 * MiB);
  t.deepEqual((await s.catalog.list()).map((x) => x.name).sort(), ['other', 'other@monday', 'v']);
  t.like(await s.catalog.remove('v'), { removedSnapshots: [] });
});

test('a snapshot names the volume id it was taken of; one left by a removed volume is never attributed to a later volume of that name', async (t) => {
  const s = setup();
  await s.catalog.create('v', 64 * MiB);
  const oldId = (await s.catalog.record('v')).id;
  await s.catalog.snapshot('v', 'old');
  t.is((await s.catalog.record('v@old')).of, oldId);
  t.deepEqual((await s.catalog.info('v@old')).snapshotOf, { id: oldId, volume: 'v' });
  // As an older baton (or an rm racing a snapshot) left it: the volume's record gone, its snapshot not.
  await s.store.inner.delete(keys.volumeRecord('v'));
  await s.catalog.create('v', 64 * MiB);
  const listed = new Map((await s.catalog.list()).map((x) => [x.name, x]));
  t.deepEqual(listed.get('v@old')?.snapshotOf, { id: oldId, volume: null }, 'shown as the snapshot of a removed volume');
  t.deepEqual((await s.catalog.info('v@old')).snapshotOf, { id: oldId, volume: null });
  t.is(listed.get('v')?.snapshotOf, undefined);
  // rm of the new v is not refused for a snapshot that is not its own, and leaves it alone.
  t.like(await s.catalog.remove('v'), { removedSnapshots: [] });
  t.truthy(await s.catalog.record('v@old'));
});

test('snapshot records from before `of` existed are attributed by name, as before', async (t) => {
  const s = setup();
  await s.catalog.create('v', 64 * MiB);
  await s.catalog.snapshot('v', 'legacy');
  const rec = await s.catalog.record('v@legacy');
  const { of: _of, ...legacy } = rec;
  await s.store.inner.delete(keys.volumeRecord('v@legacy'));
  await s.store.inner.put(keys.volumeRecord('v@legacy'), encodeVolumeRecord(legacy));
  const vId = (await s.catalog.record('v')).id;
  t.deepEqual((await s.catalog.info('v@legacy')).snapshotOf, { id: vId, volume: 'v' });
  await t.throwsAsync(s.catalog.remove('v'), { instanceOf: InvalidArgumentError, message: /v@legacy/ });
});

// ------------------------------------------------------------------ 9 (diff): shared history

test('shareHistory: forks and snapshots share history with their source; unrelated volumes do not', async (t) => {
  const s = setup();
  await s.catalog.create('a', 64 * MiB);
  await s.write('a', 0, 1);
  await s.catalog.create('b', 64 * MiB);
  await s.catalog.fork('a', 'a1');
  await s.write('a1', 0, 2);
  await s.catalog.fork('a1', 'a2');
  await s.catalog.snapshot('a', 's');
  t.false(await s.catalog.shareHistory('a', 'b'));
  t.false(await s.catalog.shareHistory('a2', 'b'));
  t.true(await s.catalog.shareHistory('a', 'a1'));
  t.true(await s.catalog.shareHistory('a2', 'a'));
  t.true(await s.catalog.shareHistory('a@s', 'a2'));
  t.true(await s.catalog.shareHistory('a', 'a'));
});

test('error codes survive rewrapping (the CLI picks exit codes and retries by code)', async (t) => {
  const s = setup();
  await s.catalog.create('v', 64 * MiB);
  await s.catalog.fork('v', 'f');
  const vId = (await s.catalog.record('v')).id;
  s.store.beforeGet = failing((k) => k === keys.meta(vId), () => new Error('socket hang up'));
  await s.catalog.create('w', 64 * MiB);
  // f's parent is v itself, so rm w must follow f to its root (v's meta): that read fails.
  const err = await t.throwsAsync(s.catalog.remove('w'));
  t.true(isBatonError(err), 'an unknown error becomes a BatonError with a message');
  t.regex(err!.message, /cannot tell .* of w .*socket hang up/);
  t.truthy(await s.catalog.record('w'));
});

/** A memory store whose requests can be held: `hold(op, key)` holds the next matching request (`reached` once it is held) until `open()`. */
class HoldingStore implements ObjectStore {
  readonly description = 'holding';
  private readonly holds: { op: string; key: string; gate: Promise<void>; reached: () => void }[] = [];
  constructor(readonly inner: MemoryObjectStore) {}
  hold(op: string, key: string): { open: () => void; reached: Promise<void> } {
    let open!: () => void;
    let reached!: () => void;
    const r = new Promise<void>((res) => { reached = res; });
    this.holds.push({ op, key, gate: new Promise<void>((res) => { open = res; }), reached });
    return { open, reached: r };
  }
  private async pass(op: string, key: string): Promise<void> {
    const i = this.holds.findIndex((h) => h.op === op && h.key === key);
    if (i < 0) return;
    const [h] = this.holds.splice(i, 1);
    h!.reached();
    await h!.gate;
  }
  async get(key: string, range?: ByteRange, into?: Buffer): Promise<Buffer> { await this.pass('get', key); return this.inner.get(key, range, into); }
  async put(key: string, body: Buffer, o?: PutOptions): Promise<void> { await this.pass('put', key); return this.inner.put(key, body, o); }
  async head(key: string): Promise<ObjectHead | null> { await this.pass('head', key); return this.inner.head(key); }
  list(prefix: string, o?: ListOptions): AsyncIterable<ObjectInfo> { return this.inner.list(prefix, o); }
  async delete(key: string): Promise<void> { await this.pass('delete', key); return this.inner.delete(key); }
  close(): Promise<void> { return this.inner.close(); }
}

/** Volume `name` (X) of 16 MiB whose first MiB holds 7s, flushed and closed. */
async function sourceWithData(catalog: StoreCatalog, name = 'X'): Promise<void> {
  await catalog.create(name, 16 * MiB);
  const v = (await catalog.open(name, { readOnly: false })).backend as Volume;
  await v.takeover(1);
  await v.write(0, Buffer.alloc(MiB, 7), false);
  await v.flush();
  await v.close();
}

test('a fork of a fork that has not settled yet, while rm removes the first fork\'s source: the second fork is never left mapping deleted data (reviewed finding)', async (t) => {
  // fork X F reads X; rm X finds no descendant (F's name has not landed) and deletes X's
  // objects; F's name lands; before F's check finds X gone (and undoes F), fork F F2 checked
  // only F's name: F2 was acknowledged, mapping X's deleted data, and every later rm and GC
  // run failed on its broken ancestry.
  const inner = new MemoryObjectStore();
  const store = new HoldingStore(inner);
  const cache = BlockCache.open({ capacityBytes: 64 * MiB });
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => cache, volume: { maxOperationMs: 1000, segmentBytes: MiB } });
  await sourceWithData(catalog);
  const name = store.hold('put', keys.volumeRecord('F'));
  const f = catalog.fork('X', 'F').then(() => 'made', (e: unknown) => (e instanceof NotFoundError ? 'undone' : `failed: ${String(e)}`));
  await name.reached; // F read X and its fork point, put its meta: its name put waits
  const rm = await catalog.remove('X');
  t.false(rm.keptForRelatives, 'rm saw no descendant and deleted X\'s data (F\'s name had not landed)');
  const confirm = store.hold('get', keys.volumeRecord('X')); // F's check of its source
  name.open();
  await confirm.reached; // F's name landed; its check waits
  const f2 = await catalog.fork('F', 'F2').then(() => 'made', (e: unknown) => (e instanceof NotFoundError ? 'undone' : `failed: ${String(e)}`));
  confirm.open();
  t.is(await f, 'undone', 'F found X gone and was undone');
  t.is(f2, 'undone', 'F2 found F unsettled and F\'s source gone: undone, nothing was created');
  t.deepEqual((await listAll(inner, 'volumes/')).map((o) => o.key), [], 'no name left');
  await catalog.create('Y', MiB);
  await t.notThrowsAsync(catalog.remove('Y'), 'rm of another volume still works');
});

test('a settled fork of a removed source can be forked: its settled marker says its source check is done', async (t) => {
  const inner = new MemoryObjectStore();
  const cache = BlockCache.open({ capacityBytes: 64 * MiB });
  const catalog = new StoreCatalog({ store: inner, log: silentLogger(), cache: () => cache, volume: { maxOperationMs: 1000, segmentBytes: MiB } });
  await sourceWithData(catalog);
  await catalog.fork('X', 'F');
  const fId = (await catalog.rawRecord('F')).id;
  t.truthy(await inner.head(keys.settled(fId)), 'F is settled');
  t.true((await catalog.remove('X')).keptForRelatives);
  await catalog.fork('F', 'F2');
  const f2 = (await catalog.open('F2', { readOnly: true })).backend as Volume;
  t.true((await f2.read(0, 4096)).equals(Buffer.alloc(4096, 7)));
  await f2.close();
});

const outcome = (p: Promise<unknown>): Promise<string> => p.then(() => 'made', (e: unknown) => (e instanceof NotFoundError ? 'undone' : `failed: ${String(e)}`));

test('the check walks up every unsettled source: a fork of a fork of a fork whose source rm deleted is undone (reviewed finding)', async (t) => {
  // W -> X (unsettled, to be undone: rm W deleted W's data before X's name landed) -> F
  // (unsettled) -> F2. A check one level deep found X named and let F2 through.
  const inner = new MemoryObjectStore();
  const store = new HoldingStore(inner);
  const cache = BlockCache.open({ capacityBytes: 64 * MiB });
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => cache, volume: { maxOperationMs: 1000, segmentBytes: MiB } });
  await sourceWithData(catalog, 'W');
  const xName = store.hold('put', keys.volumeRecord('X'));
  const x = outcome(catalog.fork('W', 'X'));
  await xName.reached;
  t.false((await catalog.remove('W')).keptForRelatives);
  const xCheck = store.hold('get', keys.volumeRecord('W'));
  xName.open();
  await xCheck.reached; // X named, its check waits
  const xId = (await catalog.rawRecord('X')).id;
  const fCheck = store.hold('head', keys.settled(xId));
  const f = outcome(catalog.fork('X', 'F'));
  await fCheck.reached; // F named, its check waits
  t.is(await outcome(catalog.fork('F', 'F2')), 'undone', 'F2: F unsettled, X unsettled, W gone');
  xCheck.open();
  fCheck.open();
  t.is(await x, 'undone');
  t.is(await f, 'undone');
  t.deepEqual((await listAll(inner, 'volumes/')).map((o) => o.key), []);
  await catalog.create('Y', MiB);
  await t.notThrowsAsync(catalog.remove('Y'));
});

test('an attempt undone after its name was seen (a put whose reply was lost) keeps its meta when a fork of it was made meanwhile (reviewed finding)', async (t) => {
  const inner = new MemoryObjectStore();
  const holding = new HoldingStore(inner);
  let failNamePut = false;
  let failReadBack = false;
  const store: ObjectStore = Object.assign(Object.create(holding) as ObjectStore, {
    async put(key: string, body: Buffer, o?: PutOptions) {
      await holding.put(key, body, o);
      if (failNamePut && key === keys.volumeRecord('F')) {
        failNamePut = false;
        await new Promise((r) => setTimeout(r, 600)); // past the fork's budget (M/2)
        throw new StoreUnavailableError('injected: the reply was lost after the put landed');
      }
    },
    async get(key: string, range?: ByteRange, into?: Buffer) {
      if (failReadBack && key === keys.volumeRecord('F')) { failReadBack = false; throw new StoreUnavailableError('injected: the read-back failed'); }
      return holding.get(key, range, into);
    },
  });
  const cache = BlockCache.open({ capacityBytes: 64 * MiB });
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => cache, volume: { maxOperationMs: 1000, segmentBytes: MiB } });
  await sourceWithData(catalog);
  failNamePut = true;
  failReadBack = true;
  const del = holding.hold('delete', keys.volumeRecord('F')); // the undo's delete of F's name, once it found F named
  const f = catalog.fork('X', 'F').then(() => 'made', () => 'failed');
  await del.reached;
  const v = (await catalog.open('F', { readOnly: false })).backend as Volume; // F is visible meanwhile: written, then forked
  await v.takeover(1);
  await v.write(0, Buffer.alloc(MiB, 9), false);
  await v.flush();
  await v.close();
  t.is(await outcome(catalog.fork('F', 'F2')), 'made');
  del.open();
  await f;
  const f2 = (await catalog.open('F2', { readOnly: true })).backend as Volume;
  t.true((await f2.read(0, 4096)).equals(Buffer.alloc(4096, 9)), 'F2 reads what F held');
  await f2.close();
  await catalog.create('Y', MiB);
  await t.notThrowsAsync(catalog.remove('Y'), 'no broken ancestry');
});

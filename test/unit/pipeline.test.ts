/**
 * Pipelined commits (Volume.commit, "Pipelined commits"): the next commit uploads while the
 * one before it publishes its record, records still land one position at a time, chained,
 * and a commit that does not land takes the ones after it down without losing a byte.
 */
import test, { type ExecutionContext } from 'ava';
import { BlockCache } from '../../src/cache.js';
import { StoreUnavailableError } from '../../src/errors.js';
import { silentLogger } from '../../src/log.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { listAll, type ByteRange, type ListOptions, type ObjectHead, type ObjectInfo, type ObjectStore, type PutOptions } from '../../src/store/object-store.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import { decodeLogHeader } from '../../src/volume/format.js';
import type { Volume } from '../../src/volume/volume.js';

const MiB = 1024 * 1024;
const SEG = 256 * 1024;

/** A store whose puts can be held (by a predicate) and failed; every put is logged when it starts. */
class GatedStore implements ObjectStore {
  readonly started: string[] = [];
  private held: { key: string; go: () => void }[] = [];
  hold: (key: string) => boolean = () => false;
  fail: (key: string) => Error | null = () => null;
  constructor(readonly next: ObjectStore) {}
  get description(): string { return this.next.description; }
  get(key: string, range?: ByteRange): Promise<Buffer> { return this.next.get(key, range); }
  head(key: string): Promise<ObjectHead | null> { return this.next.head(key); }
  list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> { return this.next.list(prefix, options); }
  delete(key: string): Promise<void> { return this.next.delete(key); }
  close(): Promise<void> { return Promise.resolve(); }
  async put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    this.started.push(key);
    if (this.hold(key)) await new Promise<void>((go) => { this.held.push({ key, go }); });
    const err = this.fail(key);
    if (err) throw err;
    return this.next.put(key, body, options);
  }
  /** Let every held put go on. */
  release(): void { for (const h of this.held.splice(0)) h.go(); }
  heldKeys(): string[] { return this.held.map((h) => h.key); }
}

async function setup(t: ExecutionContext) {
  const memory = new MemoryObjectStore();
  const store = new GatedStore(memory);
  const catalog = new StoreCatalog({
    store, log: silentLogger(), cache: () => BlockCache.open({ capacityBytes: 64 * MiB }),
    volume: { segmentBytes: SEG, dirtySoftLimit: MiB, dirtyHardLimit: 64 * MiB, uploadConcurrency: 16 },
  });
  await catalog.create('v', 64 * MiB);
  let token = 0;
  const open = async (): Promise<Volume> => {
    const v = (await catalog.open('v', { readOnly: false })).backend as Volume;
    await v.takeover(++token);
    return v;
  };
  const v = await open();
  t.teardown(() => { store.release(); });
  return { memory, store, catalog, v, open };
}

const fill = (n: number, byte: number): Buffer => Buffer.alloc(n, byte);
const until = async (cond: () => boolean, what: string): Promise<void> => {
  for (let i = 0; i < 2000 && !cond(); i++) await new Promise((r) => setImmediate(r));
  if (!cond()) throw new Error(`timed out waiting for ${what}`);
};
const isLog = (k: string): boolean => k.includes('/log/');
const isSeg = (k: string): boolean => k.includes('/seg/');

/** The log as recovery reads it: every record names the one before it. */
async function checkChain(t: ExecutionContext, memory: MemoryObjectStore, id: string): Promise<number> {
  const logs = await listAll(memory, `vol/${id}/log/`);
  let prev = '';
  for (const o of logs) {
    const { header } = decodeLogHeader(await memory.get(o.key), o.key);
    t.is(header.prev, prev, `${o.key} names the record before it`);
    prev = header.id!;
  }
  return logs.length;
}

test('a second commit uploads its segments while the first publishes its record', async (t) => {
  const { store, v } = await setup(t);
  store.hold = (k) => isLog(k); // every record put waits
  await v.write(0, fill(2 * MiB, 1), false); // past the soft limit: a background commit starts
  const first = v.flush();
  await until(() => store.heldKeys().length === 1, 'the first record put');
  const firstSegs = store.started.filter(isSeg).length;
  t.true(firstSegs >= 7, `the first commit uploaded its segments (${firstSegs})`);
  // More data while the first record is held: the next commit seals and uploads it now.
  await v.write(8 * MiB, fill(2 * MiB, 2), false);
  const second = v.flush();
  await until(() => store.started.filter(isSeg).length >= firstSegs + 7, 'the second commit\'s segments');
  t.is(store.heldKeys().length, 1, 'the second record waits for the first to land');
  store.hold = () => false;
  store.release();
  await Promise.all([first, second]);
  t.true((await v.read(0, 2 * MiB)).equals(fill(2 * MiB, 1)));
  t.true((await v.read(8 * MiB, 2 * MiB)).equals(fill(2 * MiB, 2)));
});

test('when the first commit fails, the pipelined one fails too, nothing is lost, and the next flush lands both in a valid chain', async (t) => {
  const { memory, store, catalog, v, open } = await setup(t);
  let failing = true;
  store.hold = (k) => isLog(k);
  // The first commit's last segment fails once it was held: the second was packed after it meanwhile.
  await v.write(0, fill(2 * MiB, 3), false);
  const first = v.flush();
  await until(() => store.heldKeys().length === 1, 'the first record put');
  await v.write(8 * MiB, fill(MiB, 4), false);
  const second = v.flush();
  await until(() => store.started.filter((k) => isSeg(k) && k.includes('/seg/0000000000000000000' + '3')).length >= 1, 'the second commit\'s segments (position 3)');
  store.fail = (k) => (failing && isLog(k) ? new StoreUnavailableError(`put ${k}: 503`) : null);
  store.hold = () => false;
  store.release();
  const [r1, r2] = await Promise.allSettled([first, second]);
  t.is(r1.status, 'rejected', 'the first flush fails');
  t.is(r2.status, 'rejected', 'the second flush fails with it');
  // Nothing acknowledged, nothing lost: the data reads from the buffer, and the next flush lands it.
  t.true((await v.read(0, 2 * MiB)).equals(fill(2 * MiB, 3)));
  t.true((await v.read(8 * MiB, MiB)).equals(fill(MiB, 4)));
  failing = false;
  await v.flush();
  await v.close();
  const id = (await catalog.record('v')).id;
  t.true(await checkChain(t, memory, id) >= 2);
  const again = await open();
  t.true((await again.read(0, 2 * MiB)).equals(fill(2 * MiB, 3)), 'recovered: first write');
  t.true((await again.read(8 * MiB, MiB)).equals(fill(MiB, 4)), 'recovered: second write');
});

test('many pipelined commits under random failures: the data survives a reopen, the chain holds', async (t) => {
  const { memory, store, catalog, v, open } = await setup(t);
  let n = 0;
  store.fail = (k) => ((isLog(k) || isSeg(k)) && (++n % 7 === 0) ? new StoreUnavailableError(`put ${k}: 503`) : null);
  const flushes: Promise<unknown>[] = [];
  for (let i = 0; i < 40; i++) {
    await v.write((i % 24) * MiB, fill(MiB, 10 + i), false);
    flushes.push(v.flush().catch(() => {}));
  }
  await Promise.all(flushes);
  store.fail = () => null;
  await v.flush();
  // The last write to each slot: i = s + 24 for s < 16, else i = s.
  const acked = new Map<number, number>();
  for (let s = 0; s < 24; s++) acked.set(s, 10 + s + (s < 16 ? 24 : 0));
  await v.close();
  await checkChain(t, memory, (await catalog.record('v')).id);
  const again = await open();
  for (const [s, b] of acked) t.true((await again.read(s * MiB, MiB)).equals(fill(MiB, b)), `slot ${s} holds byte ${b}`);
});

test('a commit that lands after the lease ran out fails its flush, and the pipelined one after it fails too instead of waiting forever', async (t) => {
  const { store, v } = await setup(t);
  store.hold = (k) => isLog(k);
  await v.write(0, fill(2 * MiB, 5), false);
  const first = v.flush();
  await until(() => store.heldKeys().length === 1, 'the first record put');
  await v.write(8 * MiB, fill(2 * MiB, 6), false);
  const second = v.flush();
  await until(() => store.started.filter((k) => isSeg(k) && k.includes('/seg/00000000000000000003')).length >= 1, 'the second commit\'s segments');
  v.setWriteDeadline(() => 0); // the lease is gone: a record landing now is not vouched for
  store.hold = () => false;
  store.release();
  const timeout = new Promise<string>((r) => { setTimeout(() => r('still waiting after 5 s'), 5000).unref(); });
  const outcome = (p: Promise<void>) => Promise.race([p.then(() => 'acknowledged', (e: unknown) => `failed: ${(e as Error).message}`), timeout]);
  t.regex(await outcome(first), /^failed: .*lease/);
  t.regex(await outcome(second), /^failed: /);
});

test('a run that re-publishes an ambiguous commit and then loses the lease drops its own next commit, so a third one does not wait forever', async (t) => {
  const { store, v } = await setup(t);
  // 1. A commit whose record put fails without an answer: ambiguous, kept for its next try.
  let failLog = true;
  store.fail = (k) => (failLog && isLog(k) ? new StoreUnavailableError(`put ${k}: 503`) : null);
  await v.write(0, fill(MiB, 7), false);
  await t.throwsAsync(v.flush());
  failLog = false;
  store.fail = () => null;
  // 2. The next run re-publishes it (held) and packs the new data after it.
  store.hold = (k) => isLog(k);
  await v.write(4 * MiB, fill(2 * MiB, 8), false);
  const second = v.flush();
  await until(() => store.heldKeys().length === 1, 'the re-published record');
  // 3. A third run packs after the second run's new commit.
  await v.write(16 * MiB, fill(2 * MiB, 9), false);
  const third = v.flush();
  await until(() => store.started.some((k) => isSeg(k) && k.includes('/seg/00000000000000000004')), 'the third commit\'s segments');
  v.setWriteDeadline(() => 0);
  store.hold = () => false;
  store.release();
  const timeout = new Promise<string>((r) => { setTimeout(() => r('still waiting after 5 s'), 5000).unref(); });
  const outcome = (p: Promise<void>) => Promise.race([p.then(() => 'acknowledged', (e: unknown) => `failed: ${(e as Error).message}`), timeout]);
  t.regex(await outcome(second), /^failed: /);
  t.regex(await outcome(third), /^failed: /, 'the third flush ends (simulator seed 14 waited forever here)');
});

/**
 * Decorator tests: the retrying store under seeded faults (errors and lost replies), the
 * create-only ambiguity it must resolve, and the fault and instrumentation tools themselves.
 * All on MemoryObjectStore with no real sleeps, so they are fast and deterministic.
 */
import test from 'ava';
import {
  InvalidArgumentError,
  NotFoundError,
  PreconditionFailedError,
  StoreUnavailableError,
  TimeoutError,
} from '../../src/errors.js';
import { listAll, type ByteRange, type ListOptions, type ObjectInfo, type ObjectStore, type PutOptions } from '../../src/store/object-store.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import {
  FaultyObjectStore,
  InstrumentedObjectStore,
  PUT_ID_META,
  RetryingObjectStore,
  seededRandom,
} from '../../src/store/decorators.js';

const noSleep = async (): Promise<void> => {};

/** Records which puts actually reached the store underneath (landed), per key. */
class LandedPuts implements ObjectStore {
  readonly description = 'landed';
  readonly landed = new Map<string, number>();
  constructor(readonly next: ObjectStore) {}
  get(key: string, range?: ByteRange) { return this.next.get(key, range); }
  async put(key: string, body: Buffer, options?: PutOptions) {
    await this.next.put(key, body, options);
    this.landed.set(key, (this.landed.get(key) ?? 0) + 1);
  }
  head(key: string) { return this.next.head(key); }
  list(prefix: string, options?: ListOptions) { return this.next.list(prefix, options); }
  delete(key: string) { return this.next.delete(key); }
  close() { return this.next.close(); }
}

function stack(faults: ConstructorParameters<typeof FaultyObjectStore>[1], attempts = 30) {
  const memory = new MemoryObjectStore();
  const landed = new LandedPuts(memory);
  const faulty = new FaultyObjectStore(landed, faults);
  const retrying = new RetryingObjectStore(faulty, { attempts, baseDelayMs: 1, maxDelayMs: 4, random: seededRandom(7), sleep: noSleep });
  return { memory, landed, faulty, retrying };
}

test('retrying: 30% errors + lost replies (seeded): every create-only put succeeds and lands exactly once', async (t) => {
  const { memory, landed, faulty, retrying } = stack({ seed: 1234, errorRate: 0.15, lostReplyRate: 0.15 });
  const keys = Array.from({ length: 300 }, (_, i) => `vol/v/log/${String(i).padStart(6, '0')}`);
  await Promise.all(keys.map((k) => retrying.put(k, Buffer.from(`body ${k}`), { ifNoneMatch: true })));
  for (const k of keys) {
    t.is((await memory.get(k)).toString(), `body ${k}`);
    t.is(landed.landed.get(k), 1, `${k} landed once`);
  }
  const c = faulty.counters();
  t.true(c.put.injectedErrors > 20, `errors injected: ${c.put.injectedErrors}`);
  t.true(c.put.lostReplies > 20, `lost replies injected: ${c.put.lostReplies}`);
  t.log(`seed ${faulty.seed}: ${c.put.requests} put requests, ${c.put.injectedErrors} errors, ${c.put.lostReplies} lost replies`);
});

test('retrying: plain puts under the same faults all succeed with the right bytes', async (t) => {
  const { memory, faulty, retrying } = stack({ seed: 99, errorRate: 0.15, lostReplyRate: 0.15 });
  const keys = Array.from({ length: 200 }, (_, i) => `blk/${i}`);
  await Promise.all(keys.map((k) => retrying.put(k, Buffer.from(k))));
  for (const k of keys) t.is((await memory.get(k)).toString(), k);
  // Reads, heads and lists under faults too.
  for (const k of keys.slice(0, 50)) t.is((await retrying.get(k)).toString(), k);
  for (const k of keys.slice(0, 50)) t.is((await retrying.head(k))!.size, k.length);
  t.is((await listAll(retrying, 'blk/')).length, 200);
  t.true(faulty.counters().total.injectedErrors > 0);
});

test('retrying: a real conflict is still PreconditionFailedError under faults', async (t) => {
  const { memory, faulty, retrying } = stack({ seed: 5, errorRate: 0.15, lostReplyRate: 0.15 });
  const keys = Array.from({ length: 100 }, (_, i) => `lease/${i}`);
  for (const k of keys) await memory.put(k, Buffer.from('other host'), { metadata: { [PUT_ID_META]: 'someone-else' } });
  const results = await Promise.allSettled(keys.map((k) => retrying.put(k, Buffer.from('me'), { ifNoneMatch: true })));
  for (const r of results) {
    t.is(r.status, 'rejected');
    if (r.status === 'rejected') t.true(r.reason instanceof PreconditionFailedError, String(r.reason));
  }
  for (const k of keys) t.is((await memory.get(k)).toString(), 'other host');
  t.true(faulty.counters().put.injectedErrors > 0, 'some conflicts were found on a retry, after an error');
});

test('retrying: the ambiguous case, deterministically: reply lost, retry sees 412, put id says it was ours', async (t) => {
  const memory = new MemoryObjectStore();
  const faulty = new FaultyObjectStore(memory, { lostReplyRate: 1, ops: ['put'] });
  const retries: number[] = [];
  const retrying = new RetryingObjectStore(faulty, { attempts: 3, sleep: noSleep, onRetry: (i) => retries.push(i.attempt) });
  await retrying.put('fence', Buffer.from('mine'), { ifNoneMatch: true, metadata: { epoch: '3' } });
  t.deepEqual(retries, [1], 'one retry');
  const h = await memory.head('fence');
  t.is(h!.metadata.epoch, '3');
  t.truthy(h!.metadata[PUT_ID_META]);
  // Without the retry layer the same store reports the lost reply as a failure.
  await t.throwsAsync(faulty.put('fence2', Buffer.from('x'), { ifNoneMatch: true }), { instanceOf: StoreUnavailableError });
  t.truthy(await memory.head('fence2'), 'yet the put landed');
});

test('retrying: a 412 on the first attempt is never second-guessed', async (t) => {
  const memory = new MemoryObjectStore();
  const inst = new InstrumentedObjectStore(memory);
  const retrying = new RetryingObjectStore(inst, { sleep: noSleep });
  await memory.put('k', Buffer.from('theirs'));
  await t.throwsAsync(retrying.put('k', Buffer.from('mine'), { ifNoneMatch: true }), { instanceOf: PreconditionFailedError });
  t.is(inst.stats().put.requests, 1);
  t.is(inst.stats().head.requests, 0, 'no read-back without an earlier failed attempt');
});

test('retrying: gives up after `attempts` and does not retry non-transient errors', async (t) => {
  const memory = new MemoryObjectStore();
  const faulty = new FaultyObjectStore(memory, { errorRate: 1 });
  const retrying = new RetryingObjectStore(faulty, { attempts: 4, sleep: noSleep });
  await t.throwsAsync(retrying.put('k', Buffer.from('x')), { instanceOf: StoreUnavailableError });
  t.is(faulty.counters().put.requests, 4);

  const inst = new InstrumentedObjectStore(memory);
  const r2 = new RetryingObjectStore(inst, { attempts: 4, sleep: noSleep });
  await t.throwsAsync(r2.get('missing'), { instanceOf: NotFoundError });
  await t.throwsAsync(r2.put('a//b', Buffer.from('x')), { instanceOf: InvalidArgumentError });
  t.is(inst.stats().get.requests, 1);
  t.is(inst.stats().put.requests, 1);
});

test('retrying: timeouts are retried too', async (t) => {
  const memory = new MemoryObjectStore();
  await memory.put('k', Buffer.from('v'));
  const faulty = new FaultyObjectStore(memory, { timeoutRate: 1, timeoutMs: 1 });
  // The first backoff turns the fault off: one timeout, then success.
  const r = new RetryingObjectStore(faulty, { attempts: 3, sleep: async () => faulty.setFaults({ timeoutRate: 0 }) });
  t.is((await r.get('k')).toString(), 'v');
  t.is(faulty.counters().get.timeouts, 1);
  faulty.setFaults({ timeoutRate: 1 });
  const r2 = new RetryingObjectStore(faulty, { attempts: 3, sleep: noSleep });
  await t.throwsAsync(r2.get('k'), { instanceOf: TimeoutError });
  t.is(faulty.counters().get.timeouts, 4);
});

test('retrying: backoff doubles from baseDelayMs up to maxDelayMs, with half of it jittered', async (t) => {
  const delays: number[] = [];
  const faulty = new FaultyObjectStore(new MemoryObjectStore(), { errorRate: 1 });
  const r = new RetryingObjectStore(faulty, {
    attempts: 8, baseDelayMs: 10, maxDelayMs: 200, random: () => 0.5, sleep: noSleep,
    onRetry: (i) => delays.push(i.delayMs),
  });
  await t.throwsAsync(r.head('k'));
  t.deepEqual(delays, [7.5, 15, 30, 60, 120, 150, 150]);
});

test('retrying: a listing that fails half-way resumes after the last key, no repeats or gaps', async (t) => {
  const memory = new MemoryObjectStore();
  const keys = Array.from({ length: 50 }, (_, i) => `l/${String(i).padStart(2, '0')}`);
  for (const k of keys) await memory.put(k, Buffer.from('x'));
  let failuresLeft = 3;
  const flaky: ObjectStore = {
    description: 'flaky-list',
    get: (k, r) => memory.get(k, r),
    put: (k, b, o) => memory.put(k, b, o),
    head: (k) => memory.head(k),
    delete: (k) => memory.delete(k),
    close: () => memory.close(),
    async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
      let n = 0;
      for await (const o of memory.list(prefix, options)) {
        if (++n === 7 && failuresLeft > 0) {
          failuresLeft--;
          throw new StoreUnavailableError('connection reset mid-listing');
        }
        yield o;
      }
    },
  };
  const r = new RetryingObjectStore(flaky, { attempts: 2, sleep: noSleep });
  t.deepEqual((await listAll(r, 'l/')).map((o) => o.key), keys);
  t.is(failuresLeft, 0);
});

test('instrumented: counts requests, errors and bytes per op; stats() is a snapshot; reset()', async (t) => {
  const s = new InstrumentedObjectStore(new MemoryObjectStore());
  await s.put('a', Buffer.alloc(100));
  await s.put('b', Buffer.alloc(50), { ifNoneMatch: true });
  await t.throwsAsync(s.put('b', Buffer.alloc(50), { ifNoneMatch: true }));
  await s.get('a');
  await s.get('a', { offset: 10, length: 20 });
  await t.throwsAsync(s.get('zz'));
  await s.head('a');
  t.is((await listAll(s, '')).length, 2);
  await s.delete('a');
  const snap = s.stats();
  t.deepEqual(snap.put, { requests: 3, errors: 1, bytes: 150, items: 0 });
  t.deepEqual(snap.get, { requests: 3, errors: 1, bytes: 120, items: 0 });
  t.deepEqual(snap.head, { requests: 1, errors: 0, bytes: 0, items: 0 });
  t.deepEqual(snap.list, { requests: 1, errors: 0, bytes: 0, items: 2 });
  t.deepEqual(snap.delete, { requests: 1, errors: 0, bytes: 0, items: 0 });
  t.is(snap.total.requests, 9);
  await s.put('c', Buffer.alloc(1));
  t.is(snap.put.requests, 3, 'snapshot unchanged by later requests');
  s.reset();
  t.is(s.stats().total.requests, 0);
  await Promise.all(Array.from({ length: 8 }, (_, i) => s.put(`p${i}`, Buffer.alloc(1))));
  t.is(s.stats().put.requests, 8);
  t.true(s.stats().maxInFlight >= 1);
  t.is(s.stats().inFlight, 0);
});

test('instrumented: counts PUTs of a "flush" through a retrying stack', async (t) => {
  const memory = new MemoryObjectStore();
  const wire = new InstrumentedObjectStore(memory); // what the store would see
  const faulty = new FaultyObjectStore(wire, { seed: 3 });
  const retrying = new RetryingObjectStore(faulty, { sleep: noSleep });
  faulty.failNext(2, 'put');
  await retrying.put('seg/1', Buffer.alloc(4096));
  await retrying.put('seg/2', Buffer.alloc(4096));
  t.is(wire.stats().put.requests, 2, 'failed-before-sending attempts never reach the store');
  t.is(faulty.counters().put.requests, 4);
});

test('faulty: hang() parks requests without doing them; unhang() lets them through', async (t) => {
  const memory = new MemoryObjectStore();
  const f = new FaultyObjectStore(memory, { seed: 1 });
  await memory.put('k', Buffer.from('v'));
  f.hang();
  t.true(f.isHung);
  let putDone = false;
  let getDone = false;
  const p = f.put('new', Buffer.from('x')).then(() => { putDone = true; });
  const g = f.get('k').then((b) => { getDone = true; return b; });
  await new Promise((r) => setTimeout(r, 50));
  t.false(putDone);
  t.false(getDone);
  t.is(f.pendingHung, 2);
  t.is(await memory.head('new'), null, 'a hung put has not happened');
  f.unhang();
  await p;
  t.is((await g).toString(), 'v');
  t.true(putDone && getDone);
  t.is(f.pendingHung, 0);
  t.truthy(await memory.head('new'));
  t.is(f.counters().total.hung, 2);
});

test('faulty: latency applies to every request, as one figure or per op', async (t) => {
  const f = new FaultyObjectStore(new MemoryObjectStore(), { latencyMs: 30, ops: [] });
  let t0 = performance.now();
  await f.put('k', Buffer.from('x'));
  await f.get('k');
  t.true(performance.now() - t0 >= 55, `took ${performance.now() - t0} ms`);
  f.setFaults({ latencyMs: { put: 40 } });
  t0 = performance.now();
  await f.put('k', Buffer.from('y'));
  t.true(performance.now() - t0 >= 35, 'put has 40 ms');
});

test('faulty: timeouts send the request, wait, then throw TimeoutError or StoreUnavailableError', async (t) => {
  const memory = new MemoryObjectStore();
  const f = new FaultyObjectStore(memory, { timeoutRate: 1, timeoutMs: 20 });
  const t0 = performance.now();
  await t.throwsAsync(f.put('k', Buffer.from('x')), { instanceOf: TimeoutError });
  t.true(performance.now() - t0 >= 15);
  t.truthy(await memory.head('k'), 'the timed-out put still landed');
  f.setFaults({ timeoutError: 'unavailable' });
  await t.throwsAsync(f.get('k'), { instanceOf: StoreUnavailableError });
  t.is(f.counters().total.timeouts, 2);
});

test('faulty: failNext(n, op) fails exactly the next n requests of that op', async (t) => {
  const f = new FaultyObjectStore(new MemoryObjectStore());
  f.failNext(2, 'put');
  await t.throwsAsync(f.put('a', Buffer.from('x')), { instanceOf: StoreUnavailableError });
  t.is(await f.head('a'), null, 'other ops unaffected, and the failed put did nothing');
  await t.throwsAsync(f.put('a', Buffer.from('x')), { instanceOf: StoreUnavailableError });
  await f.put('a', Buffer.from('x'));
  f.failNext(1);
  await t.throwsAsync(f.get('a'), { instanceOf: StoreUnavailableError });
  t.is((await f.get('a')).toString(), 'x');
  t.is(f.counters().total.injectedErrors, 3);
});

test('faulty: the same seed gives the same fault schedule', async (t) => {
  async function run(seed: number): Promise<string[]> {
    const f = new FaultyObjectStore(new MemoryObjectStore(), { seed, errorRate: 0.3, lostReplyRate: 0.2 });
    const out: string[] = [];
    for (let i = 0; i < 100; i++) {
      try {
        await f.put(`k${i}`, Buffer.from('x'));
        out.push('ok');
      } catch (err) {
        out.push(err instanceof Error && err.message.includes('lost reply') ? 'lost' : 'err');
      }
    }
    return out;
  }
  const a = await run(42);
  t.deepEqual(await run(42), a);
  t.notDeepEqual(await run(43), a);
  t.true(a.includes('lost') && a.includes('err') && a.includes('ok'));
});

test('faulty: a listing fails before its first key', async (t) => {
  const memory = new MemoryObjectStore();
  await memory.put('x/1', Buffer.from('1'));
  const f = new FaultyObjectStore(memory, { errorRate: 1, ops: ['list'] });
  const seen: string[] = [];
  await t.throwsAsync(async () => { for await (const o of f.list('x/')) seen.push(o.key); }, { instanceOf: StoreUnavailableError });
  t.deepEqual(seen, []);
  f.setFaults({ errorRate: 0 });
  t.deepEqual((await listAll(f, 'x/')).map((o) => o.key), ['x/1']);
});

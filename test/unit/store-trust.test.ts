/**
 * Can baton trust its store, and does it say so when it cannot (issues 9.10 and 17, store
 * items): bounded requests and retries against an endpoint that never answers, listings that
 * claim more without a token, stale local temp files, stores that drop metadata, a skewed
 * clock, and BATON_MAX_OPERATION_MS recorded with the store.
 *
 * The S3 cases run against small local servers (127.0.0.1, no radosgw needed) that play one
 * misbehaviour each. Time limits are set small through options; what decides pass or fail is
 * the error, plus a generous bound on elapsed time where the bound is the point.
 */
import test, { type ExecutionContext } from 'ava';
import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { link, mkdir, mkdtemp, readdir, rm, stat, utimes, writeFile } from 'node:fs/promises';
import { createServer as createHttpServer, type IncomingMessage, type ServerResponse } from 'node:http';
import { createServer as createTcpServer, type AddressInfo, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import {
  CorruptError,
  MisconfiguredError,
  PreconditionFailedError,
  StoreUnavailableError,
  StoreUnsafeError,
} from '../../src/errors.js';
import { FaultyObjectStore, PUT_ID_META, RetryingObjectStore } from '../../src/store/decorators.js';
import { LocalDirObjectStore, PROCESS_NONCE, STALE_TMP_MS, TMP_DIR } from '../../src/store/local-dir.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { listAll, type ByteRange, type ListOptions, type ObjectStore, type PutOptions } from '../../src/store/object-store.js';
import { openStore } from '../../src/store/open.js';
import { PROBE_PREFIX, STORE_SETTINGS_KEY, SettingsCheckedObjectStore, checkStoreSettings, probeStore, waitForStore } from '../../src/store/probe.js';
import { S3ObjectStore, payloadProtectedInTransit, type S3StoreOptions } from '../../src/store/s3.js';

const CREDENTIALS = { accessKeyId: 'test', secretAccessKey: 'test-secret' };

async function tempDir(t: ExecutionContext): Promise<string> {
  const dir = await mkdtemp(join(tmpdir(), 'baton-store-trust-'));
  t.teardown(() => rm(dir, { recursive: true, force: true }));
  return dir;
}

/** A TCP server that accepts connections and never sends a byte (the 9.10 endpoint). */
async function silentServer(t: ExecutionContext): Promise<{ endpoint: string; connections: () => number }> {
  const sockets = new Set<Socket>();
  let connections = 0;
  const server = createTcpServer((s) => {
    connections++;
    sockets.add(s);
    s.on('error', () => {});
    s.on('close', () => sockets.delete(s));
    s.resume(); // read the request, answer nothing
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  t.teardown(() => {
    for (const s of sockets) s.destroy();
    server.close();
  });
  return { endpoint: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, connections: () => connections };
}

/** An HTTP server that answers every request with `handler` (a fake S3 for one misbehaviour). */
async function fakeS3(t: ExecutionContext, handler: (req: IncomingMessage, res: ServerResponse) => void): Promise<string> {
  const server = createHttpServer((req, res) => {
    req.resume();
    req.on('end', () => handler(req, res));
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  t.teardown(() => { server.closeAllConnections(); server.close(); });
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
}

function s3At(t: ExecutionContext, endpoint: string, extra: Partial<S3StoreOptions> = {}): S3ObjectStore {
  const s = new S3ObjectStore({ bucket: 'bucket', endpoint, region: 'us-east-1', credentials: CREDENTIALS, ...extra });
  t.teardown(() => s.close());
  return s;
}

async function elapsed<T>(p: Promise<T>): Promise<{ ms: number; err: unknown }> {
  const t0 = performance.now();
  try {
    await p;
    return { ms: performance.now() - t0, err: undefined };
  } catch (err) {
    return { ms: performance.now() - t0, err };
  }
}

// --- 9.10: an endpoint that accepts connections and never answers ----------------------------

test('9.10: openStore s3:// against an endpoint that never answers fails within the retry budget, naming the endpoint', async (t) => {
  t.timeout(60_000); // before the fix: 596 s
  const { endpoint, connections } = await silentServer(t);
  const BUDGET = 1_000;
  // Per-call limits far above the budget: the budget alone has to end each operation.
  const store = openStore('s3://bucket/prefix', {
    endpoint, region: 'us-east-1', credentials: CREDENTIALS,
    retry: { budgetMs: BUDGET },
    s3: { firstByteTimeoutMs: 60_000, socketTimeoutMs: 60_000, requestTimeoutMs: 120_000 },
  });
  t.teardown(() => store.close());
  const ops: [string, () => Promise<unknown>][] = [
    ['get', () => store.get('volumes/work')],
    ['head', () => store.head('volumes/work')],
    ['put', () => store.put('vol/x/log/1', Buffer.from('x'), { ifNoneMatch: true })],
    ['list', () => listAll(store, 'volumes/')],
    ['delete', () => store.delete('vol/x/log/1')],
  ];
  for (const [op, run] of ops) {
    const { ms, err } = await elapsed(run());
    t.true(err instanceof StoreUnavailableError, `${op}: ${String(err)}`);
    t.true(ms < BUDGET + 1_500, `${op} failed after ${Math.round(ms)} ms, budget ${BUDGET} ms`);
    const msg = (err as Error).message;
    t.true(msg.includes(endpoint), `${op}: the message names the endpoint: ${msg}`);
    t.regex(msg, /gave up after 1\.0 s/, op);
    t.regex(msg, /reachable from this host/, `${op}: says what to check`);
  }
  t.true(connections() > 0, 'the requests did reach the silent server');
});

test('9.10: an S3 call has its own limits: no response headers within the first-byte limit fails, naming the endpoint', async (t) => {
  t.timeout(30_000);
  const { endpoint } = await silentServer(t);
  const store = s3At(t, endpoint, { maxAttempts: 1, firstByteTimeoutMs: 300, socketTimeoutMs: 60_000, requestTimeoutMs: 60_000 });
  const { ms, err } = await elapsed(store.head('k'));
  t.true(err instanceof StoreUnavailableError, String(err));
  t.true(ms < 3_000, `took ${Math.round(ms)} ms with a 300 ms first-byte limit`);
  t.true((err as Error).message.includes(endpoint));
  t.regex((err as Error).message, /no answer from/);
});

test('9.10: a server that trickles a body forever is cut off by the whole-request limit', async (t) => {
  t.timeout(30_000);
  const timers = new Set<NodeJS.Timeout>();
  t.teardown(() => { for (const x of timers) clearInterval(x); });
  const endpoint = await fakeS3(t, (_req, res) => {
    // Headers at once, then one byte every 50 ms: never idle, never done.
    res.writeHead(200, { 'content-type': 'application/octet-stream', 'content-length': String(1 << 20) });
    const timer = setInterval(() => res.write('x'), 50);
    timers.add(timer);
    res.on('close', () => { clearInterval(timer); timers.delete(timer); });
  });
  const store = s3At(t, endpoint, { maxAttempts: 1, firstByteTimeoutMs: 5_000, socketTimeoutMs: 5_000, requestTimeoutMs: 500, minBytesPerSecond: 1024 ** 3 });
  const { ms, err } = await elapsed(store.get('k'));
  t.true(err instanceof StoreUnavailableError, String(err));
  t.true(ms < 4_000, `took ${Math.round(ms)} ms with a 500 ms whole-request limit`);
  t.regex((err as Error).message, /whole-request limit|aborted/i);
});

test('9.10: retrying store: an attempt still hanging at the budget is abandoned, with the target and hint in the message', async (t) => {
  const faulty = new FaultyObjectStore(new MemoryObjectStore());
  faulty.hang();
  t.teardown(() => faulty.unhang());
  const store = new RetryingObjectStore(faulty, { budgetMs: 200, target: 's3://b/ at http://10.9.8.7:7480', hint: 'check the endpoint' });
  const runs: (() => Promise<unknown>)[] = [() => store.get('k'), () => store.put('k', Buffer.from('x'), { ifNoneMatch: true }), () => listAll(store, '')];
  for (const run of runs) {
    const { ms, err } = await elapsed(run());
    t.true(err instanceof StoreUnavailableError, String(err));
    t.true(ms < 1_500, `${Math.round(ms)} ms`);
    t.regex((err as Error).message, /on s3:\/\/b\/ at http:\/\/10\.9\.8\.7:7480: gave up after 0\.2 s and 1 attempt \(no answer\); check the endpoint/);
  }
});

test('9.10: retrying store: fast failures stop once the next backoff would pass the budget (fake clock)', async (t) => {
  let now = 0;
  const faulty = new FaultyObjectStore(new MemoryObjectStore());
  faulty.failNext(1_000);
  const store = new RetryingObjectStore(faulty, {
    attempts: 1_000, budgetMs: 10_000, baseDelayMs: 1_000, maxDelayMs: 1_000, random: () => 1,
    now: () => now, sleep: async (ms) => { now += ms; },
  });
  const err = await t.throwsAsync(store.get('k'), { instanceOf: StoreUnavailableError });
  // Backoffs of 1 s each: attempts at 0, 1, ..., 9 s; a tenth backoff would end at the deadline.
  t.is(faulty.counters().get.requests, 10);
  t.regex(err!.message, /gave up after 10\.0 s and 10 attempts \(last error: .*injected failure/);
  t.true(now < 10_000);
});

test('9.10: retrying store with a budget still never retries a 412, and still resolves an ambiguous create-only put by its put id', async (t) => {
  const memory = new MemoryObjectStore();
  const faulty = new FaultyObjectStore(memory, { seed: 1 });
  const store = new RetryingObjectStore(faulty, { budgetMs: 5_000, baseDelayMs: 1, maxDelayMs: 2 });
  await store.put('taken', Buffer.from('theirs'), { ifNoneMatch: true });
  faulty.resetCounters();
  await t.throwsAsync(store.put('taken', Buffer.from('mine'), { ifNoneMatch: true }), { instanceOf: PreconditionFailedError });
  t.is(faulty.counters().put.requests, 1, 'a first-attempt 412 is a conflict: not retried');

  // The first attempt lands but its reply is lost; the retry gets 412; the put id says it was ours.
  const lossy = new LosesFirstPutReply(memory);
  const store2 = new RetryingObjectStore(lossy, { budgetMs: 5_000, baseDelayMs: 1, maxDelayMs: 2 });
  await store2.put('mine', Buffer.from('body'), { ifNoneMatch: true });
  t.is(lossy.puts, 2, 'retried once, and that retry got 412');
  t.is((await memory.get('mine')).toString(), 'body');
  t.truthy((await memory.head('mine'))!.metadata[PUT_ID_META]);
});

/** The first put lands and then "loses its reply". */
class LosesFirstPutReply implements ObjectStore {
  readonly description = 'loses-first-reply';
  puts = 0;
  constructor(readonly next: ObjectStore) {}
  get(key: string, range?: ByteRange) { return this.next.get(key, range); }
  async put(key: string, body: Buffer, options?: PutOptions) {
    this.puts++;
    await this.next.put(key, body, options);
    if (this.puts === 1) throw new StoreUnavailableError(`put ${key}: reply lost (test)`);
  }
  head(key: string) { return this.next.head(key); }
  list(prefix: string, options?: ListOptions) { return this.next.list(prefix, options); }
  delete(key: string) { return this.next.delete(key); }
  close() { return this.next.close(); }
}

// --- 17: a truncated listing without a continuation token ------------------------------------

function listXml(keys: string[], truncated: boolean, token?: string): string {
  return '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">' +
    `<Name>bucket</Name><Prefix></Prefix><KeyCount>${keys.length}</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>${truncated}</IsTruncated>` +
    (token !== undefined ? `<NextContinuationToken>${token}</NextContinuationToken>` : '') +
    keys.map((k) => `<Contents><Key>${k}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified><ETag>"e"</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass></Contents>`).join('') +
    '</ListBucketResult>';
}

test('17: a listing page that says "truncated" without a continuation token throws instead of ending early', async (t) => {
  let pages = 0;
  const endpoint = await fakeS3(t, (req, res) => {
    if (!req.url!.includes('list-type=2')) { // a GET of an object (the settings record): none
      res.writeHead(404, { 'content-type': 'application/xml' });
      res.end('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchKey</Code><Message>no</Message></Error>');
      return;
    }
    pages++;
    res.writeHead(200, { 'content-type': 'application/xml' });
    res.end(listXml(['vol/a/1', 'vol/a/2'], true));
  });
  const s3 = s3At(t, endpoint, { maxAttempts: 1 });
  const err = await t.throwsAsync(listAll(s3, 'vol/'), { instanceOf: StoreUnsafeError });
  t.regex(err!.message, /truncated but gave no continuation token/);
  t.true(err!.message.includes(endpoint));
  // Through the whole stack: not retried into a loop, not swallowed.
  const store = openStore('s3://bucket', { endpoint, region: 'us-east-1', credentials: CREDENTIALS });
  t.teardown(() => store.close());
  pages = 0;
  await t.throwsAsync(listAll(store, 'vol/'), { instanceOf: StoreUnsafeError });
  t.is(pages, 1);
});

test('17: a listing that hands back the same continuation token again throws instead of looping', async (t) => {
  const endpoint = await fakeS3(t, (req, res) => {
    const again = new URL(req.url!, 'http://x').searchParams.has('continuation-token');
    res.writeHead(200, { 'content-type': 'application/xml' });
    res.end(listXml([again ? 'vol/b' : 'vol/a'], true, 'tok-1'));
  });
  const s3 = s3At(t, endpoint, { maxAttempts: 1 });
  const err = await t.throwsAsync(listAll(s3, 'vol/'), { instanceOf: StoreUnsafeError });
  t.regex(err!.message, /the same continuation token again/);
});

test('17: a complete paged listing still works against the fake server (the check is not over-eager)', async (t) => {
  const endpoint = await fakeS3(t, (req, res) => {
    const token = new URL(req.url!, 'http://x').searchParams.get('continuation-token');
    res.writeHead(200, { 'content-type': 'application/xml' });
    res.end(token === null ? listXml(['vol/a'], true, 'tok-1') : listXml(['vol/b'], false));
  });
  const s3 = s3At(t, endpoint, { maxAttempts: 1 });
  t.deepEqual((await listAll(s3, 'vol/')).map((o) => o.key), ['vol/a', 'vol/b']);
});

// --- 17: RequestTimeTooSkewed -----------------------------------------------------------------

test('17: RequestTimeTooSkewed says the clock is off, and by how much; not "access denied"', async (t) => {
  const serverAhead = 20 * 60_000;
  const endpoint = await fakeS3(t, (req, res) => {
    const serverTime = new Date(Date.now() + serverAhead).toISOString().replace(/\.\d{3}Z$/, 'Z');
    res.writeHead(403, { 'content-type': 'application/xml' });
    res.end('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>RequestTimeTooSkewed</Code>' +
      '<Message>The difference between the request time and the current time is too large.</Message>' +
      `<RequestTime>${String(req.headers['x-amz-date'])}</RequestTime><ServerTime>${serverTime}</ServerTime>` +
      '<MaxAllowedSkewMilliseconds>900000</MaxAllowedSkewMilliseconds><RequestId>r</RequestId><HostId>h</HostId></Error>');
  });
  const s3 = s3At(t, endpoint);
  const err = await t.throwsAsync(s3.get('volumes/work'), { instanceOf: MisconfiguredError });
  t.notRegex(err!.message, /access denied/i);
  t.regex(err!.message, /clock is about 20 min behind the store's/);
  t.regex(err!.message, /at most 15 min allowed/);
  t.regex(err!.message, /set the clock right/);
  // And it is not retried as if the store were down.
  const store = new RetryingObjectStore(s3, { baseDelayMs: 1 });
  await t.throwsAsync(store.get('volumes/work'), { instanceOf: MisconfiguredError });
});

test('17: the clock skew mapping without a ServerTime still says clock, and a plain 403 is still access denied', (t) => {
  const s3 = new S3ObjectStore({ bucket: 'bucket', endpoint: 'http://127.0.0.1:1', credentials: CREDENTIALS });
  t.teardown(() => s3.close());
  const skew = s3.mapError('get', 'k', { name: 'RequestTimeTooSkewed', message: 'too skewed', $metadata: { httpStatusCode: 403 } });
  t.true(skew instanceof MisconfiguredError);
  t.regex(skew.message, /clock differs too much from the store's/);
  const denied = s3.mapError('get', 'k', { name: 'AccessDenied', message: 'no', $metadata: { httpStatusCode: 403 } });
  t.regex(denied.message, /access denied/);
});

// --- 17: stale temp files of the local store --------------------------------------------------

function deadPid(): number {
  const r = spawnSync(process.execPath, ['-e', ''], { stdio: 'ignore' });
  return r.pid!;
}

test('17: a temp file left by a crash (garbage, or a second name after the link) is removed at the next process\'s first put; a live writer\'s is not', async (t) => {
  const dir = await tempDir(t);
  const first = new LocalDirObjectStore(dir);
  await first.put('vol/v/seg/1', Buffer.alloc(64 * 1024, 7), { ifNoneMatch: true });
  const tmp = join(dir, TMP_DIR);
  await first.close(); // removes the temp it made ahead for its next put
  t.deepEqual(await readdir(tmp), [], 'the normal path leaves no temp behind');

  // What crashes leave: a second name of an object (crash between link and unlink), and a
  // half-written temp (crash before the link); plus one of our own pid (a predecessor's, its
  // pid recycled), one of a live process (still writing), and an old one of a live process.
  const dead = deadPid();
  const objectFile = join(dir, 'vol', 'v', 'seg', '1@');
  await link(objectFile, join(tmp, `${dead}-afterlink`));
  await writeFile(join(tmp, `${dead}-halfwritten`), 'partial');
  await writeFile(join(tmp, `${process.pid}-predecessor`), 'partial');
  await writeFile(join(tmp, `${process.ppid}-live`), 'being written');
  await writeFile(join(tmp, `${process.pid}-${PROCESS_NONCE}-inflight`), 'this process, another store instance');
  await writeFile(join(tmp, `${process.ppid}-ancient`), 'stuck');
  const old = new Date(Date.now() - STALE_TMP_MS - 60_000);
  await utimes(join(tmp, `${process.ppid}-ancient`), old, old);
  t.is((await stat(objectFile)).nlink, 2, 'the object has a second name');

  const next = new LocalDirObjectStore(dir); // the next process
  await next.put('vol/v/seg/2', Buffer.from('x'));
  await next.close();
  t.deepEqual((await readdir(tmp)).sort(), [`${process.pid}-${PROCESS_NONCE}-inflight`, `${process.ppid}-live`].sort());
  t.is((await stat(objectFile)).nlink, 1, 'deleting the object now frees it');
  await next.delete('vol/v/seg/1');
  await next.delete('vol/v/seg/2');
  t.deepEqual((await readdir(dir)).sort(), [TMP_DIR], 'the volume\'s directories are gone');
});

test('17: no path of a put leaves a temp file: plain, create-only, a refused create-only, a failed one', async (t) => {
  const dir = await tempDir(t);
  const s = new LocalDirObjectStore(dir);
  await s.put('a/b', Buffer.from('1'));
  await s.put('a/b', Buffer.from('2'));
  await s.put('a/c', Buffer.from('3'), { ifNoneMatch: true });
  await t.throwsAsync(s.put('a/c', Buffer.from('4'), { ifNoneMatch: true }), { instanceOf: PreconditionFailedError });
  // A key whose directory cannot be made (a file named like it is in the way).
  await mkdir(join(dir, 'x'), { recursive: true });
  await writeFile(join(dir, 'x', 'y'), 'not a directory');
  await t.throwsAsync(s.put('x/y/z', Buffer.from('5')));
  const live = await readdir(join(dir, TMP_DIR));
  t.is(live.length, 1, 'only the temp made ahead for the next put');
  t.true(live[0]!.startsWith(`${process.pid}-${PROCESS_NONCE}-`));
  await s.close();
  t.deepEqual(await readdir(join(dir, TMP_DIR)), [], 'and close() removes it');
  t.is((await s.get('a/b')).toString(), '2');
  t.is((await s.get('a/c')).toString(), '3');
});

// --- 17: the probe checks that put metadata survives ------------------------------------------

/** A store (or gateway) that loses the metadata of every put. */
class DropsMetadata implements ObjectStore {
  readonly description: string;
  constructor(readonly next: ObjectStore) { this.description = `drops-metadata(${next.description})`; }
  get(key: string, range?: ByteRange) { return this.next.get(key, range); }
  put(key: string, body: Buffer, options?: PutOptions) {
    return this.next.put(key, body, options?.ifNoneMatch === true ? { ifNoneMatch: true } : {});
  }
  head(key: string) { return this.next.head(key); }
  list(prefix: string, options?: ListOptions) { return this.next.list(prefix, options); }
  delete(key: string) { return this.next.delete(key); }
  close() { return this.next.close(); }
}

test('17: probeStore refuses a store that drops put metadata, and cleans up', async (t) => {
  for (const base of [new MemoryObjectStore(), new LocalDirObjectStore(await tempDir(t))]) {
    const broken = new DropsMetadata(base);
    const err = await t.throwsAsync(probeStore(broken), { instanceOf: StoreUnsafeError });
    t.regex(err!.message, /does not keep a put's metadata/);
    t.regex(err!.message, /baton-put-id=\S+ and came back without it/);
    t.true(err!.message.includes(broken.description));
    t.deepEqual(await listAll(base, PROBE_PREFIX), [], 'probe key deleted');
    await t.notThrowsAsync(probeStore(base), 'the same store with metadata passes');
  }
});

// --- 9: BATON_MAX_OPERATION_MS recorded with the store ----------------------------------------

test('9: the first write records the settings; a process with another BATON_MAX_OPERATION_MS is refused on every operation', async (t) => {
  const memory = new MemoryObjectStore();
  const a = new SettingsCheckedObjectStore(memory, { maxOperationMs: 60_000 });
  t.is(await a.head('volumes/x'), null);
  t.is(await memory.head(STORE_SETTINGS_KEY), null, 'a read records nothing (read-only processes need no write access)');
  await a.put('volumes/x', Buffer.from('rec'));
  const rec = JSON.parse((await memory.get(STORE_SETTINGS_KEY)).toString()) as Record<string, unknown>;
  t.is(rec.maxOperationMs, 60_000);
  t.is(rec.format, 'baton-settings-1');

  const b = new SettingsCheckedObjectStore(memory, { maxOperationMs: 1_000 });
  for (const run of [() => b.get('volumes/x'), () => b.head('volumes/x'), () => listAll(b, 'volumes/'), () => b.put('vol/y/meta', Buffer.from('y')), () => b.delete('volumes/x')]) {
    const err = await t.throwsAsync(run(), { instanceOf: MisconfiguredError });
    t.regex(err!.message, /BATON_MAX_OPERATION_MS=60000 .*but this process has 1000/);
    t.regex(err!.message, /Run this process with BATON_MAX_OPERATION_MS=60000 \(or unset it: that is the default\)/);
  }
  t.is(await memory.head('vol/y/meta'), null, 'nothing of the refused process landed');
  t.truthy(await memory.head('volumes/x'), 'nor did its delete');
  const same = new SettingsCheckedObjectStore(memory, { maxOperationMs: 60_000 });
  t.is((await same.get('volumes/x')).toString(), 'rec');
});

test('9: two processes with different values racing to record: one wins, the other is refused', async (t) => {
  for (let round = 0; round < 20; round++) {
    const memory = new MemoryObjectStore();
    const a = new SettingsCheckedObjectStore(memory, { maxOperationMs: 60_000 });
    const b = new SettingsCheckedObjectStore(memory, { maxOperationMs: 2_000 });
    const [ra, rb] = await Promise.allSettled([a.put('k/a', Buffer.from('a')), b.put('k/b', Buffer.from('b'))]);
    t.is([ra, rb].filter((r) => r.status === 'fulfilled').length, 1);
    const loser = ra.status === 'rejected' ? ra : rb;
    t.true(loser.status === 'rejected' && loser.reason instanceof MisconfiguredError);
  }
});

test('9: a store error while checking is not a verdict (the next operation checks again); a corrupt record is', async (t) => {
  const memory = new MemoryObjectStore();
  const faulty = new FaultyObjectStore(memory);
  const s = new SettingsCheckedObjectStore(faulty, { maxOperationMs: 60_000 });
  faulty.failNext(1);
  await t.throwsAsync(s.put('k', Buffer.from('x')), { instanceOf: StoreUnavailableError });
  await s.put('k', Buffer.from('x'));
  t.truthy(await memory.head(STORE_SETTINGS_KEY));
  // Through the retrying layer, the failed check is simply retried.
  const retried = new RetryingObjectStore(new SettingsCheckedObjectStore(faulty, { maxOperationMs: 60_000 }), { baseDelayMs: 1 });
  faulty.failNext(2);
  t.is((await retried.get('k')).toString(), 'x');

  const bad = new MemoryObjectStore();
  await bad.put(STORE_SETTINGS_KEY, Buffer.from('{"nonsense": true}'));
  const c = new SettingsCheckedObjectStore(bad, { maxOperationMs: 60_000 });
  const err = await t.throwsAsync(c.get('k'), { instanceOf: CorruptError });
  t.regex(err!.message, /not a baton settings object/);
  await t.throwsAsync(checkStoreSettings(bad, { maxOperationMs: 60_000 }, true), { instanceOf: CorruptError });
});

test('9: openStore checks the settings of a file: store; memory: is not checked (no other process can share it)', async (t) => {
  const dir = await tempDir(t);
  const a = openStore(`file:${dir}`, { settings: { maxOperationMs: 1_000 } });
  await a.put('volumes/v', Buffer.from('x'));
  const b = openStore(`file:${dir}`, { settings: { maxOperationMs: 60_000 } });
  const err = await t.throwsAsync(b.get('volumes/v'), { instanceOf: MisconfiguredError });
  t.regex(err!.message, new RegExp(`store file:${dir} is used with BATON_MAX_OPERATION_MS=1000`));
  t.regex(err!.message, /baton\/settings\.json@/);
  const m = openStore('memory:', { settings: { maxOperationMs: 1 } });
  await m.put('k', Buffer.from('x'));
  t.is(await m.head(STORE_SETTINGS_KEY), null);
});

// --- 9.10: serve waits for the store, and says so ---------------------------------------------

test('9.10: waitForStore logs that it waits, keeps trying while the store does not answer, and returns once it does', async (t) => {
  const faulty = new FaultyObjectStore(new MemoryObjectStore());
  const store = new RetryingObjectStore(faulty, { attempts: 1, target: 's3://b/ at http://10.1.2.3:7480' });
  const lines: string[] = [];
  const log = { info: (_o: object, m: string) => { lines.push(`info ${m}`); }, warn: (_o: object, m: string) => { lines.push(`warn ${m}`); } };
  faulty.failNext(3, 'put');
  let sleeps = 0;
  const r = await waitForStore(store, { log, sleep: async () => { sleeps++; } });
  t.true(r.key.startsWith(PROBE_PREFIX));
  t.is(sleeps, 3);
  t.is(lines.filter((l) => /^warn the store s3:\/\/b\/ at http:\/\/10\.1\.2\.3:7480 does not answer; retrying/.test(l)).length, 3, lines.join('\n'));

  // A hanging store: the "waiting" line comes while the attempt is still out.
  faulty.hang();
  const waiting = waitForStore(store, { log, slowMs: 10, sleep: async () => {} });
  while (!lines.some((l) => /waiting for the store s3:\/\/b\/ at http:\/\/10\.1\.2\.3:7480 to answer/.test(l))) await new Promise((res) => setTimeout(res, 5));
  faulty.unhang();
  await waiting;

  // What waiting cannot fix ends it at once.
  const refusing = new SettingsCheckedObjectStore(new MemoryObjectStore(), { maxOperationMs: 5 });
  await refusing.put('x', Buffer.from('x'));
  await t.throwsAsync(waitForStore(new SettingsCheckedObjectStore((refusing as SettingsCheckedObjectStore).next, { maxOperationMs: 6 }), { log, sleep: async () => {} }), { instanceOf: MisconfiguredError });
});

// --- 11: payload signing where nothing else protects a body in transit ----------------------

test('11: bodies are sent UNSIGNED-PAYLOAD over https and to loopback, signed (their SHA-256) elsewhere or when asked', async (t) => {
  t.true(payloadProtectedInTransit(undefined), 'AWS S3 (https)');
  t.true(payloadProtectedInTransit('https://s3.example.com'));
  t.true(payloadProtectedInTransit('http://127.0.0.1:9000'));
  t.true(payloadProtectedInTransit('http://127.3.2.1'));
  t.true(payloadProtectedInTransit('http://localhost:7480'));
  t.true(payloadProtectedInTransit('http://[::1]:9000'));
  t.false(payloadProtectedInTransit('http://10.0.0.5:9000'));
  t.false(payloadProtectedInTransit('http://minio.internal'));
  t.false(payloadProtectedInTransit('http://127.0.0.1.example.com'));

  const seen: (string | undefined)[] = [];
  const endpoint = await fakeS3(t, (req, res) => {
    seen.push(req.headers['x-amz-content-sha256'] as string | undefined);
    res.writeHead(200, { ETag: '"x"' }).end();
  });
  const body = Buffer.from('a segment body');
  await s3At(t, endpoint).put('k1', body);
  await s3At(t, endpoint, { signPayload: true }).put('k2', body);
  t.deepEqual(seen, ['UNSIGNED-PAYLOAD', createHash('sha256').update(body).digest('hex')]);
});

// --- a delete retried: the caller is told (catalog.remove then waits out the earlier try) ----

test('a delete the SDK had to send again tells onRetry (an earlier attempt may still land); one that went through at once does not', async (t) => {
  let deletes = 0;
  const endpoint = await fakeS3(t, (req, res) => {
    if (req.method !== 'DELETE') { res.writeHead(404); res.end(); return; }
    deletes++;
    if (req.url!.includes('flaky') && deletes === 1) { res.writeHead(503, { 'content-type': 'application/xml' }); res.end('<Error><Code>SlowDown</Code><Message>again</Message></Error>'); return; }
    res.writeHead(204);
    res.end();
  });
  const s3 = s3At(t, endpoint, { maxAttempts: 3 });
  let told = 0;
  await s3.delete('vol/a/flaky', { onRetry: () => { told++; } });
  t.is(deletes, 2, 'the SDK sent the delete twice');
  t.is(told, 1);
  await s3.delete('vol/a/fine', { onRetry: () => { told++; } });
  t.is(told, 1, 'a delete answered at the first attempt is not a retry');
});

test('the retrying store tells a delete\'s onRetry when it sends it again', async (t) => {
  const inner = new MemoryObjectStore('memory:');
  await inner.put('k', Buffer.from('x'));
  const faulty = new FaultyObjectStore(inner);
  faulty.failNext(1, 'delete');
  const store = new RetryingObjectStore(faulty, { attempts: 3, sleep: () => Promise.resolve() });
  let told = 0;
  await store.delete('k', { onRetry: () => { told++; } });
  t.is(told, 1);
  t.is(await inner.head('k'), null);
});

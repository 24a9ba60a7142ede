/**
 * One table of ObjectStore conformance checks, run against every implementation: memory,
 * local-dir (temp dir) and S3 on a throwaway radosgw (skipped when radosgw is absent and no
 * BATON_TEST_S3_ENDPOINT is set). The volume engine is tested on memory; these checks are
 * what makes that evidence carry over to the other two.
 */
import test, { type ExecutionContext } from 'ava';
import { createServer, request as httpRequest, type IncomingMessage, type ServerResponse } from 'node:http';
import { randomBytes } from 'node:crypto';
import { mkdtemp, readdir, rm, writeFile, mkdir } from 'node:fs/promises';
import { tmpdir, homedir } from 'node:os';
import { join } from 'node:path';
import type { AddressInfo } from 'node:net';
import {
  BatonError,
  CorruptError,
  InvalidArgumentError,
  NotFoundError,
  OutOfRangeError,
  PreconditionFailedError,
  StoreUnavailableError,
  StoreUnsafeError,
  isBatonError,
} from '../../src/errors.js';
import { keysOf, listAll, type ListOptions, type ObjectStore, type PutOptions } from '../../src/store/object-store.js';
import { MemoryObjectStore, compareKeys } from '../../src/store/memory.js';
import { LocalDirObjectStore, LOCAL_HEADER_SIZE } from '../../src/store/local-dir.js';
import { S3ObjectStore } from '../../src/store/s3.js';
import { RetryingObjectStore } from '../../src/store/decorators.js';
import { probeStore, PROBE_PREFIX, SettingsCheckedObjectStore } from '../../src/store/probe.js';
import { defaultStoreUrl, openStore } from '../../src/store/open.js';
import { hasS3, makeTestBucket, s3TestEnv, type S3TestEnv } from '../helpers/s3.js';

const S3_PAGE = 7;

interface Backend {
  name: string;
  available: boolean;
  make(t: ExecutionContext): Promise<ObjectStore>;
}

async function tempDir(t: ExecutionContext): Promise<string> {
  const dir = await mkdtemp(join(tmpdir(), 'baton-store-'));
  t.teardown(() => rm(dir, { recursive: true, force: true }));
  return dir;
}

function s3Store(t: ExecutionContext, env: S3TestEnv, bucket: string, extra: Partial<ConstructorParameters<typeof S3ObjectStore>[0]> = {}): S3ObjectStore {
  const store = new S3ObjectStore({
    bucket,
    prefix: 'conf/',
    endpoint: env.endpoint,
    region: env.region,
    credentials: { accessKeyId: env.accessKeyId, secretAccessKey: env.secretAccessKey },
    listPageSize: S3_PAGE,
    ...extra,
  });
  t.teardown(() => store.close());
  return store;
}

const backends: Backend[] = [
  { name: 'memory', available: true, make: async () => new MemoryObjectStore() },
  {
    name: 'local-dir',
    available: true,
    make: async (t) => new LocalDirObjectStore(await tempDir(t)),
  },
  {
    name: 's3-rgw',
    available: hasS3(),
    make: async (t) => {
      const env = await s3TestEnv(t);
      return s3Store(t, env, await makeTestBucket(env));
    },
  },
];

const utf8Order = (a: string, b: string): number => Buffer.compare(Buffer.from(a), Buffer.from(b));

/** Buffer.equals: ava's deepEqual formats buffers byte by byte and takes seconds on megabytes. */
function sameBytes(t: ExecutionContext, actual: Buffer, expected: Buffer, message?: string): void {
  t.true(actual.equals(expected), `${message ?? 'bytes differ'} (got ${actual.length} bytes, expected ${expected.length})`);
}

/** A store that ignores ifNoneMatch: what s3rver does, and what probeStore must refuse. */
class IgnoresIfNoneMatch implements ObjectStore {
  readonly description: string;
  constructor(readonly next: ObjectStore) {
    this.description = `broken(${next.description})`;
  }
  get(key: string, range?: { offset: number; length: number }) { return this.next.get(key, range); }
  put(key: string, body: Buffer, options?: PutOptions) {
    return this.next.put(key, body, options?.metadata !== undefined ? { metadata: options.metadata } : {});
  }
  head(key: string) { return this.next.head(key); }
  list(prefix: string, options?: { startAfter?: string }) { return this.next.list(prefix, options); }
  delete(key: string) { return this.next.delete(key); }
  close() { return this.next.close(); }
}

type Check = (t: ExecutionContext, store: ObjectStore) => Promise<void>;

const checks: Record<string, Check> = {
  'put, get, head, delete round trip': async (t, store) => {
    const body = randomBytes(3000);
    const before = Date.now();
    await store.put('vol/abc/blk/0001', body);
    sameBytes(t, await store.get('vol/abc/blk/0001'), body);
    const h = await store.head('vol/abc/blk/0001');
    t.truthy(h);
    t.is(h!.key, 'vol/abc/blk/0001');
    t.is(h!.size, 3000);
    t.true(h!.lastModified instanceof Date);
    t.true(Math.abs(h!.lastModified.getTime() - before) < 60_000, 'lastModified is about now');
    await store.delete('vol/abc/blk/0001');
    await t.throwsAsync(store.get('vol/abc/blk/0001'), { instanceOf: NotFoundError });
    t.is(await store.head('vol/abc/blk/0001'), null);
  },

  'plain put overwrites body and metadata': async (t, store) => {
    await store.put('k', Buffer.from('one'), { metadata: { gen: '1' } });
    await store.put('k', Buffer.from('second'), { metadata: { other: 'x' } });
    t.is((await store.get('k')).toString(), 'second');
    const h = await store.head('k');
    t.is(h!.size, 6);
    t.deepEqual(h!.metadata, { other: 'x' });
  },

  'empty object': async (t, store) => {
    await store.put('empty', Buffer.alloc(0));
    t.is((await store.get('empty')).length, 0);
    t.is((await store.head('empty'))!.size, 0);
    t.is((await store.get('empty', { offset: 0, length: 0 })).length, 0);
    await t.throwsAsync(store.get('empty', { offset: 0, length: 1 }), { instanceOf: OutOfRangeError });
  },

  'ranged gets': async (t, store) => {
    const body = randomBytes(1000);
    await store.put('r', body);
    const cases: [number, number][] = [[0, 1], [0, 10], [1, 1], [500, 17], [999, 1], [990, 10], [0, 1000], [500, 0], [1000, 0]];
    for (const [offset, length] of cases) {
      const got = await store.get('r', { offset, length });
      t.is(got.length, length, `length of ${offset}+${length}`);
      sameBytes(t, got, body.subarray(offset, offset + length), `bytes of ${offset}+${length}`);
    }
    for (const [offset, length] of [[995, 10], [1000, 1], [5000, 1], [0, 1001]] as const) {
      await t.throwsAsync(store.get('r', { offset, length }), { instanceOf: OutOfRangeError }, `${offset}+${length} past the end`);
    }
    await t.throwsAsync(store.get('r', { offset: -1, length: 1 }), { instanceOf: InvalidArgumentError });
    await t.throwsAsync(store.get('r', { offset: 0.5, length: 1 }), { instanceOf: InvalidArgumentError });
  },

  'large object, ranged read in the middle': async (t, store) => {
    const body = randomBytes(5 * 1024 * 1024 + 123);
    await store.put('big', body);
    const off = 3 * 1024 * 1024 - 7;
    sameBytes(t, await store.get('big', { offset: off, length: 65_536 }), body.subarray(off, off + 65_536));
    sameBytes(t, await store.get('big'), body);
    t.is((await store.head('big'))!.size, body.length);
  },

  'missing key': async (t, store) => {
    await t.throwsAsync(store.get('nope/x'), { instanceOf: NotFoundError });
    await t.throwsAsync(store.get('nope/x', { offset: 0, length: 4 }), { instanceOf: NotFoundError });
    await t.throwsAsync(store.get('nope/x', { offset: 0, length: 0 }), { instanceOf: NotFoundError });
    t.is(await store.head('nope/x'), null);
    await t.notThrowsAsync(store.delete('nope/x'));
  },

  'create-only put twice: second is PreconditionFailedError, first body stays': async (t, store) => {
    await store.put('fence/epoch-1', Buffer.from('first'), { ifNoneMatch: true });
    const err = await t.throwsAsync(store.put('fence/epoch-1', Buffer.from('second'), { ifNoneMatch: true }), { instanceOf: PreconditionFailedError });
    t.is(err?.code, 'BATON_ERR_PRECONDITION_FAILED');
    t.is((await store.get('fence/epoch-1')).toString(), 'first');
    // create-only after a delete creates again
    await store.delete('fence/epoch-1');
    await store.put('fence/epoch-1', Buffer.from('third'), { ifNoneMatch: true });
    t.is((await store.get('fence/epoch-1')).toString(), 'third');
  },

  'big create-only puts (S3: Expect 100-continue): the second is PreconditionFailedError, the first body stays; racing ones have one winner': async (t, store) => {
    const first = randomBytes(3 * 1024 * 1024 + 5);
    await store.put('fence/big', first, { ifNoneMatch: true });
    await t.throwsAsync(store.put('fence/big', randomBytes(3 * 1024 * 1024), { ifNoneMatch: true }), { instanceOf: PreconditionFailedError });
    sameBytes(t, await store.get('fence/big'), first);
    const bodies = Array.from({ length: 4 }, () => randomBytes(2 * 1024 * 1024 + 1));
    const results = await Promise.allSettled(bodies.map((b) => store.put('fence/big-race', b, { ifNoneMatch: true })));
    const winners = results.flatMap((r, i) => (r.status === 'fulfilled' ? [i] : []));
    t.is(winners.length, 1, JSON.stringify(results.map((r) => r.status === 'rejected' ? String(r.reason) : 'ok')));
    for (const r of results) if (r.status === 'rejected') t.true(r.reason instanceof PreconditionFailedError, String(r.reason));
    sameBytes(t, await store.get('fence/big-race'), bodies[winners[0]!]!);
  },

  '20 racing create-only puts: exactly one winner': async (t, store) => {
    const bodies = Array.from({ length: 20 }, (_, i) => Buffer.from(`writer-${i}-${randomBytes(8).toString('hex')}`));
    const results = await Promise.allSettled(bodies.map((b) => store.put('race/lease', b, { ifNoneMatch: true })));
    const winners = results.flatMap((r, i) => (r.status === 'fulfilled' ? [i] : []));
    t.is(winners.length, 1, 'exactly one put succeeded');
    for (const r of results) {
      if (r.status === 'rejected') t.true(r.reason instanceof PreconditionFailedError, `loser got ${String(r.reason)}`);
    }
    sameBytes(t, await store.get('race/lease'), bodies[winners[0]!]!);
  },

  'metadata round trip': async (t, store) => {
    const metadata = { 'baton-epoch': '42', owner: 'host-a.example:1234', note: 'a b=c "q"' };
    await store.put('meta/plain', Buffer.from('x'), { metadata });
    t.deepEqual((await store.head('meta/plain'))!.metadata, metadata);
    await store.put('meta/create', Buffer.from('x'), { ifNoneMatch: true, metadata });
    const got = (await store.head('meta/create'))!.metadata;
    for (const [k, v] of Object.entries(metadata)) t.is(got[k], v, k);
    await store.put('meta/none', Buffer.from('x'));
    t.deepEqual((await store.head('meta/none'))!.metadata, {});
    await t.throwsAsync(store.put('meta/bad', Buffer.from('x'), { metadata: { Upper: 'x' } }), { instanceOf: InvalidArgumentError });
    await t.throwsAsync(store.put('meta/bad', Buffer.from('x'), { metadata: { k: 'caf\u00e9' } }), { instanceOf: InvalidArgumentError });
    await t.throwsAsync(store.put('meta/bad', Buffer.from('x'), { metadata: { k: ' padded ' } }), { instanceOf: InvalidArgumentError });
    t.is(await store.head('meta/bad'), null);
  },

  'invalid keys are refused': async (t, store) => {
    for (const key of ['', '/a', 'a/', 'a//b', 'a/../b', './a', 'a/.', '..', 'a\nb', 'x'.repeat(1025)]) {
      await t.throwsAsync(store.put(key, Buffer.from('x')), { instanceOf: InvalidArgumentError }, JSON.stringify(key.slice(0, 20)));
      await t.throwsAsync(store.get(key), { instanceOf: InvalidArgumentError });
    }
  },

  'key "a" and key "a/b" coexist; odd characters survive': async (t, store) => {
    const keys = ['a', 'a/b', 'a/b/c', 'x@y', 'p%41', '.hidden', 'dir/.dot', 'sp ace/+plus', 'caf\u00e9/\u{1f600}', '-dash', 'a@'];
    for (const k of keys) await store.put(k, Buffer.from(`body of ${k}`));
    for (const k of keys) t.is((await store.get(k)).toString(), `body of ${k}`, k);
    t.deepEqual((await listAll(store, '')).map((o) => o.key), [...keys].sort(utf8Order));
    await store.delete('a/b');
    t.is((await store.get('a')).toString(), 'body of a');
    t.is((await store.get('a/b/c')).toString(), 'body of a/b/c');
  },

  'list: UTF-8 byte order, prefix, startAfter, sizes': async (t, store) => {
    const keys = [
      'l/a', 'l/a/b', 'l/a-b', 'l/a0', 'l/a/b/c', 'l/b', 'l/Z', 'l/\u00e9', 'l/\u{1f600}', 'l/\ufffd', 'l/\ue000',
      'l/aa', 'm/x', 'k', 'l', 'l0/q',
    ];
    for (const [i, k] of keys.entries()) await store.put(k, Buffer.alloc(i + 1, 1));
    const sorted = [...keys].sort(utf8Order);
    t.deepEqual([...keys].sort(compareKeys), sorted, 'compareKeys agrees with UTF-8 byte order');
    const all = await listAll(store, '');
    t.deepEqual(all.map((o) => o.key), sorted);
    for (const o of all) {
      t.is(o.size, keys.indexOf(o.key) + 1, `size of ${o.key}`);
      t.true(o.lastModified instanceof Date);
    }
    const under = (p: string) => sorted.filter((k) => k.startsWith(p));
    for (const p of ['l/', 'l/a', 'l/a/', 'l', 'l/a/b/', 'm', 'nothing', 'l/\u{1f600}']) {
      t.deepEqual((await listAll(store, p)).map((o) => o.key), under(p), `prefix ${JSON.stringify(p)}`);
    }
    for (const after of ['l/a', 'l/a/', 'l/a/b', 'l/a.', 'l/\u00e9', 'l/zzz', '', 'a', 'z']) {
      t.deepEqual(
        (await listAll(store, 'l/', { startAfter: after })).map((o) => o.key),
        under('l/').filter((k) => utf8Order(k, after) > 0),
        `startAfter ${JSON.stringify(after)}`,
      );
    }
    // keysOf (a local store's keys-only listing where there is one) gives the same keys.
    const keysList = async (p: string, o?: ListOptions): Promise<string[]> => { const out: string[] = []; for await (const k of keysOf(store, p, o)) out.push(k); return out; };
    for (const p of ['', 'l/', 'l/a', 'l/a/', 'l', 'nothing', 'l/\u{1f600}']) t.deepEqual(await keysList(p), under(p), `keysOf prefix ${JSON.stringify(p)}`);
    for (const after of ['l/a', 'l/a/', 'l/a/b', 'l/zzz']) {
      t.deepEqual(await keysList('l/', { startAfter: after }), (await listAll(store, 'l/', { startAfter: after })).map((o) => o.key), `keysOf startAfter ${JSON.stringify(after)}`);
    }
    const ends = await keysList('l/', { endAt: 'l/b' });
    t.deepEqual(ends.filter((k) => utf8Order(k, 'l/b') <= 0), under('l/').filter((k) => utf8Order(k, 'l/b') <= 0), 'keysOf endAt (a store may return more)');
  },

  'list: pagination and startAfter across pages': async (t, store) => {
    const keys = Array.from({ length: 3 * S3_PAGE + 4 }, (_, i) => `p/${String(i).padStart(3, '0')}`);
    await Promise.all(keys.map((k) => store.put(k, Buffer.from(k))));
    await store.put('q/outside', Buffer.from('x'));
    t.deepEqual((await listAll(store, 'p/')).map((o) => o.key), keys);
    t.deepEqual((await listAll(store, 'p/', { startAfter: keys[S3_PAGE + 2]! })).map((o) => o.key), keys.slice(S3_PAGE + 3));
    t.deepEqual((await listAll(store, 'p/', { startAfter: keys.at(-1)! })).map((o) => o.key), []);
    // Stopping early is allowed and does not leak (S3: no more pages fetched).
    const firstTwo: string[] = [];
    for await (const o of store.list('p/')) {
      firstTwo.push(o.key);
      if (firstTwo.length === 2) break;
    }
    t.deepEqual(firstTwo, keys.slice(0, 2));
  },

  'list: endAt stops the listing (across pages); etags name versions and match head': async (t, store) => {
    const keys = Array.from({ length: 2 * S3_PAGE + 3 }, (_, i) => `e/${String(i).padStart(3, '0')}`);
    for (const k of keys) await store.put(k, Buffer.from(k));
    await store.put('e0', Buffer.from('outside'));
    // A store may return keys past endAt (callers filter), but these three stop there.
    t.deepEqual((await listAll(store, 'e/', { endAt: keys[S3_PAGE + 1]! })).map((o) => o.key), keys.slice(0, S3_PAGE + 2));
    t.deepEqual((await listAll(store, 'e/', { startAfter: keys[1]!, endAt: keys[4]! })).map((o) => o.key), keys.slice(2, 5));
    t.deepEqual((await listAll(store, 'e/', { endAt: 'e/' })).map((o) => o.key), []);
    t.deepEqual((await listAll(store, 'e/', { endAt: 'e/zzz' })).map((o) => o.key), keys);
    const listed = await listAll(store, 'e/', { etags: true });
    for (const o of listed) {
      t.is(typeof o.etag, 'string', `${o.key} listed with an etag`);
      t.is(o.etag, (await store.head(o.key))!.etag, `${o.key}: the listing's etag is head's`);
    }
    // A new put of the same key, even with the same bytes, is another version (S3: other bytes).
    const before = listed[0]!.etag;
    await store.delete(keys[0]!);
    await store.put(keys[0]!, Buffer.from('other bytes'));
    t.not((await listAll(store, 'e/', { etags: true, endAt: keys[0]! }))[0]!.etag, before);
  },

  'delete is idempotent': async (t, store) => {
    await store.put('d/1', Buffer.from('x'));
    await store.delete('d/1');
    await store.delete('d/1');
    await store.delete('d/never');
    t.deepEqual(await listAll(store, 'd/'), []);
  },

  'buffers are not shared with the caller': async (t, store) => {
    const body = Buffer.from('original');
    await store.put('iso', body);
    body.fill(0);
    const got = await store.get('iso');
    t.is(got.toString(), 'original');
    got.fill(0);
    t.is((await store.get('iso')).toString(), 'original');
  },

  'probeStore passes and cleans up': async (t, store) => {
    const r = await probeStore(store);
    t.is(r.store, store.description);
    t.true(r.key.startsWith(PROBE_PREFIX));
    t.deepEqual(await listAll(store, PROBE_PREFIX), []);
  },

  'probeStore refuses a store that ignores ifNoneMatch': async (t, store) => {
    const broken = new IgnoresIfNoneMatch(store);
    const err = await t.throwsAsync(probeStore(broken), { instanceOf: StoreUnsafeError });
    t.is(err?.code, 'BATON_ERR_STORE_UNSAFE');
    t.regex(err!.message, /If-None-Match: \*/);
    t.true(err!.message.includes(broken.description), 'names the store');
    t.deepEqual(await listAll(store, PROBE_PREFIX), [], 'probe key deleted even on failure');
  },
};

for (const b of backends) {
  for (const [name, check] of Object.entries(checks)) {
    (b.available ? test : test.skip)(`${b.name}: ${name}`, async (t) => {
      const store = await b.make(t);
      await check(t, store);
    });
  }
}

// --- local-dir specifics --------------------------------------------------------------------

test('local-dir: data survives a new instance; layout and header as documented', async (t) => {
  const dir = await tempDir(t);
  const a = new LocalDirObjectStore(dir);
  await a.put('vol/x/1', Buffer.from('hello'), { metadata: { k: 'v' } });
  await a.put('vol/x', Buffer.from('sibling'));
  const b = new LocalDirObjectStore(dir);
  t.is((await b.get('vol/x/1')).toString(), 'hello');
  t.deepEqual((await b.head('vol/x/1'))!.metadata, { k: 'v' });
  t.deepEqual((await readdir(join(dir, 'vol'))).sort(), ['x', 'x@']);
  t.deepEqual(await readdir(join(dir, 'vol', 'x')), ['1@']);
  t.is(b.description, `file:${dir}`);
  t.is(LOCAL_HEADER_SIZE, 4096);
  // A root that does not exist yet is created (with its missing parents) on the first put.
  const nested = new LocalDirObjectStore(join(dir, 'new', 'deeper', 'store'));
  t.deepEqual(await listAll(nested, ''), []);
  await t.throwsAsync(nested.get('k'), { instanceOf: NotFoundError });
  await nested.put('k', Buffer.from('v'));
  t.is((await nested.get('k')).toString(), 'v');
});

test('local-dir: leftover temp files are invisible; emptied directories are removed', async (t) => {
  const dir = await tempDir(t);
  const s = new LocalDirObjectStore(dir);
  await s.put('v/a/b/obj', Buffer.from('x'));
  await writeFile(join(dir, 'v', 'a', '.tmp-deadbeef'), 'garbage from a crash');
  t.deepEqual((await listAll(s, '')).map((o) => o.key), ['v/a/b/obj']);
  await s.delete('v/a/b/obj');
  // v/a still holds the crash leftover, so only v/a/b goes.
  t.deepEqual(await readdir(join(dir, 'v', 'a')), ['.tmp-deadbeef']);
  t.deepEqual((await readdir(dir)).filter((n) => n !== '.tmp'), ['v']); // .tmp/: the temp files' directory
  await s.put('v/a/b/obj', Buffer.from('again'));
  t.is((await s.get('v/a/b/obj')).toString(), 'again');
});

test('local-dir: puts racing deletes of sibling keys (rmdir vs mkdir) all land', async (t) => {
  const dir = await tempDir(t);
  const s = new LocalDirObjectStore(dir);
  for (let round = 0; round < 30; round++) {
    await s.put(`r/d${round % 3}/a`, Buffer.from('a'));
    await Promise.all([s.delete(`r/d${round % 3}/a`), s.put(`r/d${round % 3}/b`, Buffer.from(`b${round}`))]);
    t.is((await s.get(`r/d${round % 3}/b`)).toString(), `b${round}`);
    await s.delete(`r/d${round % 3}/b`);
  }
  t.deepEqual(await listAll(s, ''), []);
});

test('local-dir: a file that is not a baton object is CorruptError', async (t) => {
  const dir = await tempDir(t);
  await mkdir(join(dir, 'v'));
  await writeFile(join(dir, 'v', 'junk@'), 'not a baton object');
  const s = new LocalDirObjectStore(dir);
  await t.throwsAsync(s.get('v/junk'), { instanceOf: CorruptError });
});

// --- S3 specifics ---------------------------------------------------------------------------

const s3test = hasS3() ? test : test.skip;

s3test('s3-rgw: prefixes isolate stores sharing a bucket', async (t) => {
  const env = await s3TestEnv(t);
  const bucket = await makeTestBucket(env);
  const a = s3Store(t, env, bucket, { prefix: 'one' });
  const b = s3Store(t, env, bucket, { prefix: 'one-two/' });
  await a.put('k', Buffer.from('a'));
  await b.put('k', Buffer.from('b'));
  t.is(a.description, `s3://${bucket}/one/`);
  t.deepEqual((await listAll(a, '')).map((o) => o.key), ['k']);
  t.is((await b.get('k')).toString(), 'b');
});

s3test('s3-rgw: configuration mistakes say what to fix and are not retryable', async (t) => {
  const env = await s3TestEnv(t);
  const missing = s3Store(t, env, `baton-missing-${randomBytes(4).toString('hex')}`);
  const e1 = await t.throwsAsync(missing.put('k', Buffer.from('x')));
  t.true(isBatonError(e1, 'BATON_ERR_INVALID_ARGUMENT'), String(e1));
  t.regex(e1!.message, /does not exist: create it or check --store/);

  const bucket = await makeTestBucket(env);
  const badKey = s3Store(t, env, bucket, { credentials: { accessKeyId: env.accessKeyId, secretAccessKey: 'wrong' } });
  const e2 = await t.throwsAsync(badKey.get('k'));
  t.true(isBatonError(e2, 'BATON_ERR_INVALID_ARGUMENT'), String(e2));
  t.regex(e2!.message, /AWS_ACCESS_KEY_ID/);
  t.false(e2 instanceof StoreUnavailableError);
});

s3test('s3-rgw: a closed port is StoreUnavailableError', async (t) => {
  const env = await s3TestEnv(t);
  const port = await closedPort();
  const store = s3Store(t, { ...env, endpoint: `http://127.0.0.1:${port}` }, 'whatever', { maxAttempts: 1 });
  const err = await t.throwsAsync(store.get('k'), { instanceOf: StoreUnavailableError });
  t.regex(err!.message, /retry later/);
});

s3test('s3-rgw: a server that stops answering is StoreUnavailableError after the socket timeout', async (t) => {
  const server = createServer(() => { /* never answers */ });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  t.teardown(() => { server.closeAllConnections(); server.close(); });
  const { port } = server.address() as AddressInfo;
  const env = await s3TestEnv(t);
  const store = s3Store(t, { ...env, endpoint: `http://127.0.0.1:${port}` }, 'whatever', { maxAttempts: 1, socketTimeoutMs: 300 });
  const err = await t.throwsAsync(store.head('k'), { instanceOf: StoreUnavailableError });
  t.regex(err!.message, /TimeoutError|timed out/);
});

s3test('s3-rgw: a create-only put whose reply is lost is resolved by its put id (SDK-level retry)', async (t) => {
  const env = await s3TestEnv(t);
  const bucket = await makeTestBucket(env);
  // A proxy that forwards the first PUT, lets it land, then kills the client connection.
  const target = new URL(env.endpoint);
  let dropped = 0;
  const proxy = createServer((req: IncomingMessage, res: ServerResponse) => {
    const up = httpRequest(
      { host: target.hostname, port: target.port, method: req.method, path: req.url, headers: req.headers },
      (upRes) => {
        if (req.method === 'PUT' && dropped === 0) {
          dropped++;
          upRes.resume();
          upRes.on('end', () => req.socket.destroy());
          return;
        }
        res.writeHead(upRes.statusCode ?? 502, upRes.headers);
        upRes.pipe(res);
      },
    );
    req.pipe(up);
  });
  await new Promise<void>((r) => proxy.listen(0, '127.0.0.1', r));
  t.teardown(() => { proxy.closeAllConnections(); proxy.close(); });
  const { port } = proxy.address() as AddressInfo;
  const store = s3Store(t, { ...env, endpoint: `http://127.0.0.1:${port}` }, bucket);
  await store.put('lease', Buffer.from('mine'), { ifNoneMatch: true });
  t.is(dropped, 1, 'the first reply was dropped and the SDK retried');
  t.is((await store.get('lease')).toString(), 'mine');
  // A real conflict through the same path is still a conflict.
  await t.throwsAsync(store.put('lease', Buffer.from('theirs'), { ifNoneMatch: true }), { instanceOf: PreconditionFailedError });
});

s3test('s3-rgw: openStore s3:// with retries passes the probe', async (t) => {
  const env = await s3TestEnv(t);
  const bucket = await makeTestBucket(env);
  const store = openStore(`s3://${bucket}/some/prefix`, {
    endpoint: env.endpoint,
    region: env.region,
    credentials: { accessKeyId: env.accessKeyId, secretAccessKey: env.secretAccessKey },
  });
  t.teardown(() => store.close());
  t.true(store instanceof RetryingObjectStore);
  t.is(store.description, `s3://${bucket}/some/prefix/`);
  await probeStore(store);
});

async function closedPort(): Promise<number> {
  const s = createServer();
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
  const { port } = s.address() as AddressInfo;
  await new Promise<void>((r) => s.close(() => r()));
  return port;
}

// --- openStore / defaultStoreUrl ------------------------------------------------------------

test('openStore parses file:, file:///, memory: and refuses the rest', (t) => {
  const rel = openStore('file:some/dir');
  t.true(rel instanceof SettingsCheckedObjectStore && rel.next instanceof LocalDirObjectStore); // the settings check wraps every shared store
  t.is(rel.description, `file:${join(process.cwd(), 'some/dir')}`);
  t.is(openStore('file:///var/lib/baton').description, 'file:/var/lib/baton');
  t.is(openStore('file://localhost/srv/b').description, 'file:/srv/b');
  t.is(openStore('file:~/b').description, `file:${join(homedir(), 'b')}`);
  t.true(openStore('memory:') instanceof MemoryObjectStore);
  for (const bad of ['', 'bucket', 'http://x/y', 'file:', 'file://otherhost/x', 's3://', 's3://AB/x', 's3://b/x', 's3://bucket/a//b', 'gs://b']) {
    const err = t.throws(() => openStore(bad), { instanceOf: InvalidArgumentError }, bad);
    t.true(err instanceof BatonError);
  }
  t.regex(t.throws(() => openStore('ftp://x'))!.message, /--store must be file:DIR or s3:\/\/bucket\[\/prefix\]/);
});

test('defaultStoreUrl follows BATON_STORE, BATON_HOME, XDG_DATA_HOME, then ~/.local/share', (t) => {
  const saved = { ...process.env };
  try {
    // Synchronous from set to restore: no other test can observe the changed environment.
    for (const k of ['BATON_STORE', 'BATON_HOME', 'XDG_DATA_HOME']) delete process.env[k];
    t.is(defaultStoreUrl(), `file:${join(homedir(), '.local', 'share', 'baton', 'store')}`);
    process.env.XDG_DATA_HOME = '/x';
    t.is(defaultStoreUrl(), 'file:/x/baton/store');
    process.env.BATON_HOME = '/opt/b';
    t.is(defaultStoreUrl(), 'file:/opt/b/store');
    process.env.BATON_STORE = 's3://bkt/p';
    t.is(defaultStoreUrl(), 's3://bkt/p');
  } finally {
    for (const k of ['BATON_STORE', 'BATON_HOME', 'XDG_DATA_HOME']) {
      if (saved[k] === undefined) delete process.env[k];
      else process.env[k] = saved[k];
    }
  }
});

/**
 * S3ObjectStore's PUTs signed by baton and sent with node's http (`#putOnce`), against fake S3
 * servers that check the signature themselves (test/helpers/fake-s3.ts). The same PUTs against
 * radosgw are in store-conformance.test.ts (create-only races, metadata, big bodies).
 */
import test from 'ava';
import { createHash, randomBytes } from 'node:crypto';
import type { ServerResponse } from 'node:http';
import { PreconditionFailedError, StoreUnavailableError } from '../../src/errors.js';
import { PUT_ID_META } from '../../src/store/decorators.js';
import { UNSIGNED_PAYLOAD, encodeKeyPath } from '../../src/store/sigv4.js';
import { fakeS3, fakeS3Store as store } from '../helpers/fake-s3.js';

const MiB = 1024 * 1024;

function preconditionFailed(res: ServerResponse): void {
  res.writeHead(412, { 'content-type': 'application/xml' });
  res.end('<Error><Code>PreconditionFailed</Code><Message>At least one of the pre-conditions you specified did not hold</Message></Error>');
}

test('a PUT is signed by baton, not the SDK: Content-Length, If-None-Match and metadata signed, the body as sent; the payload hashed only when asked', async (t) => {
  const { endpoint, seen } = await fakeS3(t, (_req, res) => { res.writeHead(200, { etag: '"x"' }); res.end(); });
  const key = 'vol/a b/(x)!+ü/seg/0001';
  const body = randomBytes(10_000);
  await store(t, endpoint).put(key, body, { ifNoneMatch: true, metadata: { 'baton-kind': 'segment' } });
  const r = seen[0]!;
  t.is(r.method, 'PUT');
  t.is(r.url, `/bucket/p/${encodeKeyPath(key)}`);
  t.true(r.signatureOk, 'the store recomputes the same signature');
  t.deepEqual(r.body, body);
  t.is(r.headers['x-amz-content-sha256'], UNSIGNED_PAYLOAD, 'a loopback endpoint: the payload is not hashed');
  t.is(r.headers['if-none-match'], '*');
  t.is(r.headers['x-amz-meta-baton-kind'], 'segment');
  t.regex(String(r.headers[`x-amz-meta-${PUT_ID_META}`]), /^[\w-]+$/, 'a create-only put carries its put id');
  t.is(r.headers.expect, undefined, 'a small body goes with the headers');
  t.is(r.headers['x-amz-user-agent'], undefined, 'the SDK would have sent its user agent');
  t.regex(String(r.headers.authorization), /SignedHeaders=content-length;host;if-none-match;x-amz-content-sha256;x-amz-date;x-amz-meta-baton-kind;x-amz-meta-baton-put-id,/);

  // signPayload: the body's SHA-256 is in the signature; a plain put has no If-None-Match.
  await store(t, endpoint, { signPayload: true }).put('k', body);
  const s = seen[1]!;
  t.is(s.headers['x-amz-content-sha256'], createHash('sha256').update(body).digest('hex'));
  t.true(s.signatureOk);
  t.is(s.headers['if-none-match'], undefined);
  t.deepEqual(s.body, body);
});

test('a big body asks 100-continue first: a refusal before the body (412 of a create-only put) is PreconditionFailedError, and no byte of the body travelled', async (t) => {
  let refuse = true;
  let bodyBytesAfterRefusal = 0;
  const { endpoint, seen } = await fakeS3(t, (_req, res) => { res.writeHead(200); res.end(); }, {
    onExpect: (req, res) => {
      if (refuse) {
        preconditionFailed(res);
        req.on('data', (c: Buffer) => { bodyBytesAfterRefusal += c.length; }); // whatever the client sends anyway
        return;
      }
      res.writeContinue();
      const chunks: Buffer[] = [];
      req.on('data', (c: Buffer) => chunks.push(c));
      req.on('end', () => { seen[seen.length - 1]!.body = Buffer.concat(chunks); res.writeHead(200); res.end(); });
    },
  });
  const s = store(t, endpoint, { maxAttempts: 1 });
  const body = randomBytes(3 * MiB);
  await t.throwsAsync(s.put('seg', body, { ifNoneMatch: true }), { instanceOf: PreconditionFailedError });
  t.is(seen[0]!.headers.expect, '100-continue');
  t.true(seen[0]!.signatureOk, 'Expect is sent unsigned, as SigV4 says');
  await new Promise((r) => setTimeout(r, 1500)); // past the wait after which a body goes anyway
  t.is(bodyBytesAfterRefusal, 0, 'no byte of the refused body was sent');
  refuse = false;
  await s.put('seg2', body, { ifNoneMatch: true });
  t.deepEqual(seen[1]!.body, body, 'after 100 Continue the whole body');
});

test('a store that ignores Expect (never says 100 Continue) gets the body after a wait, and the put lands', async (t) => {
  let at = 0;
  const { endpoint, seen } = await fakeS3(t, (_req, res) => { res.writeHead(200); res.end(); }, {
    onExpect: (req, res) => {
      const t0 = performance.now();
      const chunks: Buffer[] = [];
      req.on('data', (c: Buffer) => { if (at === 0) at = performance.now() - t0; chunks.push(c); });
      req.on('end', () => { seen[seen.length - 1]!.body = Buffer.concat(chunks); res.writeHead(200); res.end(); });
    },
  });
  const body = randomBytes(2 * MiB);
  await store(t, endpoint).put('seg', body);
  t.deepEqual(seen[0]!.body, body);
  t.true(at >= 900, `the body started after ${at.toFixed(0)} ms`);
});

test('transient answers are tried again (503, a connection cut before the answer), and a create-only put whose first try landed resolves its own 412 by its put id', async (t) => {
  let mode: 'flaky' | 'lost-reply' = 'flaky';
  let n = 0;
  const stored = new Map<string, { body: Buffer; putId: string }>();
  const { endpoint, seen } = await fakeS3(t, (req, res) => {
    n++;
    if (req.method === 'HEAD') {
      const o = stored.get(req.url!);
      if (!o) { res.writeHead(404); res.end(); return; }
      res.writeHead(200, { 'content-length': String(o.body.length), [`x-amz-meta-${PUT_ID_META}`]: o.putId, 'last-modified': new Date().toUTCString() });
      res.end();
      return;
    }
    if (mode === 'flaky' && n < 3) {
      res.writeHead(503, { 'content-type': 'application/xml' });
      res.end('<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>');
      return;
    }
    if (stored.has(req.url!) && req.headers['if-none-match'] === '*') { preconditionFailed(res); return; }
    stored.set(req.url!, { body: seen[seen.length - 1]!.body, putId: String(req.headers[`x-amz-meta-${PUT_ID_META}`]) });
    if (mode === 'lost-reply' && n === 1) { res.socket?.destroy(); return; } // landed, reply lost
    res.writeHead(200);
    res.end();
  });
  const s = store(t, endpoint, { maxAttempts: 3 });
  let retried = 0;
  await s.put('a', Buffer.from('first'), { onRetry: () => retried++ });
  t.is(n, 3, 'two 503s, then it landed');
  t.is(retried, 1, 'the caller is told an earlier try may still be on its way');

  mode = 'lost-reply'; n = 0;
  await s.put('b', Buffer.from('mine'), { ifNoneMatch: true });
  t.is(seen.filter((r) => r.method === 'HEAD').length, 1, 'the 412 of the second try was checked against the put id');
  t.is(stored.get('/bucket/p/b')!.body.toString(), 'mine');
  // Someone else's object at that key is a real conflict.
  stored.set('/bucket/p/c', { body: Buffer.from('theirs'), putId: 'other' });
  n = 0;
  mode = 'flaky'; // (n restarts: two 503s first)
  await t.throwsAsync(s.put('c', Buffer.from('mine'), { ifNoneMatch: true }), { instanceOf: PreconditionFailedError });
});

test('a put the store never answers fails at the first-byte limit, naming the endpoint; the connection is closed, not left sending', async (t) => {
  let closed = 0;
  const { endpoint } = await fakeS3(t, (req) => { req.socket.on('close', () => closed++); /* never answers */ });
  const s = store(t, endpoint, { maxAttempts: 1, firstByteTimeoutMs: 300, minBytesPerSecond: 1024 * MiB });
  const err = await t.throwsAsync(s.put('k', randomBytes(1000)), { instanceOf: StoreUnavailableError });
  t.regex(err!.message, /first-byte limit/);
  t.regex(err!.message, /127\.0\.0\.1/);
  await new Promise((r) => setTimeout(r, 100));
  t.is(closed, 1);
});

/**
 * S3ObjectStore's GETs signed by baton and sent with node's http (`#getDirect`), against fake
 * S3 servers that check the signature themselves and misbehave one way each. The same GETs
 * against radosgw are in store-conformance.test.ts (ranges, odd characters in keys).
 */
import test from 'ava';
import type { IncomingMessage, ServerResponse } from 'node:http';
import { TURN_BUDGET_BYTES, systemWorld, turnBudget } from '../../src/clock.js';
import { type BatonError, MisconfiguredError, NotFoundError, StoreUnavailableError } from '../../src/errors.js';
import { EMPTY_SHA256, encodeKeyPath } from '../../src/store/sigv4.js';
import { CREDENTIALS, fakeS3, fakeS3Store as store } from '../helpers/fake-s3.js';

const DATA = Buffer.from(Array.from({ length: 1000 }, (_, i) => i % 251));

/** Answers a GET of DATA as S3 does: 206 with Content-Range for a range, 200 otherwise. */
function serveData(req: IncomingMessage, res: ServerResponse): void {
  const m = /^bytes=(\d+)-(\d+)$/.exec(String(req.headers.range ?? ''));
  if (m === null) {
    res.writeHead(200, { 'content-length': String(DATA.length) });
    res.end(DATA);
    return;
  }
  const a = Number(m[1]), b = Math.min(Number(m[2]), DATA.length - 1);
  res.writeHead(206, { 'content-length': String(b - a + 1), 'content-range': `bytes ${a}-${b}/${DATA.length}` });
  res.end(DATA.subarray(a, b + 1));
}

test.serial('GET bodies are received within the process\'s turn budget: four 4 MiB GETs at once read about 1 MiB per turn of the event loop, not all their sockets hold', async (t) => {
  const MiB = 1024 * 1024;
  const big = Buffer.alloc(4 * MiB, 7);
  for (let i = 0; i < big.length; i += 4096) big.writeUInt32LE(i, i);
  const { endpoint } = await fakeS3(t, (_req, res) => {
    res.writeHead(200, { 'content-length': String(big.length) });
    res.end(big);
  });
  const s = store(t, endpoint);
  const budget = turnBudget(systemWorld);
  // One sample per turn of the event loop: setImmediate runs once per turn, after its poll phase.
  const perTurn: number[] = [];
  let last = budget.asked;
  let ticking = true;
  const tick = (): void => {
    perTurn.push(budget.asked - last);
    last = budget.asked;
    if (ticking) setImmediate(tick);
  };
  setImmediate(tick);
  const askedBefore = budget.asked;
  const bodies = await Promise.all(Array.from({ length: 4 }, (_, i) => s.get(`k${i}`)));
  ticking = false;
  for (const b of bodies) t.true(b.equals(big));
  t.true(budget.asked - askedBefore >= 4 * big.length, 'every body byte went through the budget');
  // A response paused once the turn's budget is spent still delivers the chunk it was reading
  // (one socket read, at most 64 KiB); four of them at most.
  const most = Math.max(...perTurn);
  t.true(most <= TURN_BUDGET_BYTES + 4 * 64 * 1024, `at most ${most} bytes in one turn`);
  t.true(perTurn.filter((n) => n > 0).length >= 16, 'spread over turns');
});

test('a GET is signed by baton, not the SDK, to the path the SDK\'s endpoint rules give, and the store\'s check of the signature passes', async (t) => {
  const { endpoint, seen } = await fakeS3(t, serveData);
  const s = store(t, endpoint);
  const key = "vol/a b/(x)!+ü/log/0001";
  t.deepEqual(await s.get(key, { offset: 10, length: 300 }), DATA.subarray(10, 310));
  t.deepEqual(await s.get(key), DATA);
  t.is(seen.length, 2);
  for (const r of seen) {
    t.is(r.method, 'GET');
    t.is(r.url, `/bucket/p/${encodeKeyPath(key)}`);
    t.true(r.signatureOk, `signature of ${r.url}`);
    t.is(r.headers['x-amz-content-sha256'], EMPTY_SHA256);
    t.is(r.headers['x-amz-user-agent'], undefined, 'the SDK would have sent its user agent');
  }
  t.is(seen[0]!.headers.range, 'bytes=10-309');
  t.is(seen[1]!.headers.range, undefined);
  // Session tokens travel signed.
  const withToken = store(t, endpoint, { credentials: { ...CREDENTIALS, sessionToken: 'tok+en/=' } });
  await withToken.get(key, { offset: 0, length: 1 });
  t.is(seen[2]!.headers['x-amz-security-token'], 'tok+en/=');
  t.true(seen[2]!.signatureOk);
  t.regex(String(seen[2]!.headers.authorization), /SignedHeaders=host;range;x-amz-content-sha256;x-amz-date;x-amz-security-token,/);
});

test('transient answers are tried again up to maxAttempts (503, a cut connection); 404 and 403 are not', async (t) => {
  let mode: 'flaky' | 'cut' | 'missing' | 'denied' = 'flaky';
  let n = 0;
  const { endpoint } = await fakeS3(t, (req, res) => {
    n++;
    if (mode === 'flaky' && n < 3) {
      res.writeHead(503, { 'content-type': 'application/xml' });
      res.end('<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>');
    } else if (mode === 'cut') {
      res.writeHead(200, { 'content-length': String(DATA.length) });
      res.write(DATA.subarray(0, 100));
      setTimeout(() => res.socket?.destroy(), 20);
    } else if (mode === 'missing') {
      res.writeHead(404, { 'content-type': 'application/xml' });
      res.end('<Error><Code>NoSuchKey</Code><Message>The specified key does not exist.</Message></Error>');
    } else if (mode === 'denied') {
      res.writeHead(403, { 'content-type': 'application/xml' });
      res.end('<Error><Code>AccessDenied</Code><Message>Access Denied &amp; more</Message></Error>');
    } else {
      serveData(req, res);
    }
  });
  const s = store(t, endpoint, { maxAttempts: 3 });
  t.deepEqual(await s.get('k', { offset: 0, length: 1000 }), DATA);
  t.is(n, 3, 'two 503s, then the answer');

  mode = 'cut'; n = 0;
  const cut = await t.throwsAsync(s.get('k'), { instanceOf: StoreUnavailableError });
  t.is(n, 3, 'a body cut short is tried again, up to maxAttempts');
  t.regex(cut!.message, /closed before the whole answer|aborted|ECONNRESET/);

  mode = 'missing'; n = 0;
  await t.throwsAsync(s.get('k'), { instanceOf: NotFoundError });
  t.is(n, 1);

  mode = 'denied'; n = 0;
  const denied = await t.throwsAsync<BatonError>(s.get('k'));
  t.is(denied!.code, 'BATON_ERR_INVALID_ARGUMENT');
  t.regex(denied!.message, /access denied to bucket bucket/);
  t.regex(denied!.message, /Access Denied & more/);
  t.is(n, 1);
});

test('a store whose clock is 20 minutes ahead: the offset is corrected from its Date header and the GET tried again; the next GET is right at once', async (t) => {
  const ahead = 20 * 60_000;
  let refused = 0;
  const { endpoint, seen } = await fakeS3(t, (req, res) => {
    const now = Date.now() + ahead;
    const d = String(req.headers['x-amz-date']);
    const sent = Date.parse(`${d.slice(0, 4)}-${d.slice(4, 6)}-${d.slice(6, 8)}T${d.slice(9, 11)}:${d.slice(11, 13)}:${d.slice(13, 15)}Z`);
    if (Math.abs(now - sent) > 15 * 60_000) {
      refused++;
      res.writeHead(403, { 'content-type': 'application/xml', date: new Date(now).toUTCString() });
      res.end(`<Error><Code>RequestTimeTooSkewed</Code><Message>The difference between the request time and the current time is too large.</Message><MaxAllowedSkewMilliseconds>900000</MaxAllowedSkewMilliseconds></Error>`);
      return;
    }
    res.setHeader('date', new Date(now).toUTCString());
    serveData(req, res);
  });
  const s = store(t, endpoint);
  t.deepEqual(await s.get('k', { offset: 5, length: 5 }), DATA.subarray(5, 10));
  t.is(refused, 1);
  t.is(seen.length, 2);
  t.deepEqual(await s.get('k', { offset: 0, length: 5 }), DATA.subarray(0, 5));
  t.is(seen.length, 3, 'signed with the corrected clock the first time');
  t.true(Math.abs((s.client.config.systemClockOffset ?? 0) - ahead) < 5_000);
});

test('a store that keeps refusing the time: the message says the clocks differ, and it is not retried as if the store were down', async (t) => {
  const { endpoint, seen } = await fakeS3(t, (_req, res) => {
    res.writeHead(403, { 'content-type': 'application/xml' });
    res.end('<Error><Code>RequestTimeTooSkewed</Code><Message>too skewed</Message></Error>');
  });
  const s = store(t, endpoint);
  const err = await t.throwsAsync(s.get('k'), { instanceOf: MisconfiguredError });
  t.regex(err!.message, /clock/);
  t.is(seen.length, 1, 'the Date header agrees with this host: no correction, no retry');
});

test('a body shorter or longer than its Content-Length, or silent mid-way, is never returned', async (t) => {
  let mode: 'short' | 'long' | 'silent' = 'short';
  const { endpoint } = await fakeS3(t, (_req, res) => {
    // Raw bytes on the socket: node's server would not send a body that disagrees with its header.
    const sock = res.socket!;
    if (mode === 'short') sock.end('HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n' + 'x'.repeat(50));
    else if (mode === 'long') sock.end('HTTP/1.1 206 Partial Content\r\ncontent-length: 10\r\ncontent-range: bytes 0-9/100\r\n\r\n' + 'y'.repeat(20));
    else sock.write('HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n' + 'z'.repeat(10));
  });
  const s = store(t, endpoint, { maxAttempts: 1, socketTimeoutMs: 300 });
  await t.throwsAsync(s.get('k'), { instanceOf: StoreUnavailableError });
  mode = 'long';
  const got = await s.get('k', { offset: 0, length: 10 }).then((b) => b.toString(), (e: unknown) => e);
  // HTTP/1.1 framing ends the body at its Content-Length: the extra bytes are not body. What
  // matters is that exactly the 10 asked-for bytes come back or an error does.
  t.true(got === 'y'.repeat(10) || got instanceof StoreUnavailableError, String(got));
  mode = 'silent';
  const t0 = performance.now();
  const err = await t.throwsAsync(s.get('k'), { instanceOf: StoreUnavailableError });
  t.regex(err!.message, /socket limit/);
  t.true(performance.now() - t0 < 3_000);
});

test('the first-byte limit ends with the headers: a body that takes longer than it (but is never silent) arrives whole', async (t) => {
  const { endpoint } = await fakeS3(t, (_req, res) => {
    res.writeHead(200, { 'content-length': String(DATA.length) });
    let at = 0;
    const timer = setInterval(() => {
      res.write(DATA.subarray(at, at + 100));
      at += 100;
      if (at >= DATA.length) { clearInterval(timer); res.end(); }
    }, 60); // 600 ms in all, twice the first-byte limit
    res.on('close', () => clearInterval(timer));
  });
  const s = store(t, endpoint, { maxAttempts: 1, firstByteTimeoutMs: 300, socketTimeoutMs: 5_000, requestTimeoutMs: 30_000 });
  t.deepEqual(await s.get('k'), DATA);
});

test('an error answer read to its end leaves the connection for the next request (no new connection per 404)', async (t) => {
  const fake = await fakeS3(t, (_req, res) => {
    res.writeHead(404, { 'content-type': 'application/xml' });
    res.end('<Error><Code>NoSuchKey</Code><Message>The specified key does not exist.</Message></Error>');
  });
  const s = store(t, fake.endpoint);
  for (let i = 0; i < 5; i++) await t.throwsAsync(s.get(`missing-${i}`), { instanceOf: NotFoundError });
  t.is(fake.seen.length, 5);
  t.is(fake.connections(), 1, 'one keep-alive connection for five 404s in turn');
});

test('a kept-alive connection the store closes as the next GET arrives: that GET is tried again on a new connection and succeeds', async (t) => {
  const served = new WeakSet<object>();
  const fake = await fakeS3(t, (req, res) => {
    if (served.has(req.socket)) { req.socket.destroy(); return; } // one answer per connection, then hang up on the next request
    served.add(req.socket);
    serveData(req, res);
  });
  const s = store(t, fake.endpoint, { maxAttempts: 2 });
  t.deepEqual(await s.get('k', { offset: 0, length: 10 }), DATA.subarray(0, 10));
  t.deepEqual(await s.get('k', { offset: 10, length: 10 }), DATA.subarray(10, 20));
  t.is(fake.seen.length, 3, 'the second GET went twice: on the kept-alive connection, then on a new one');
  t.is(fake.connections(), 2);
});

test('an error answer with a chunked XML body is the S3 error it says, and its connection is kept', async (t) => {
  const fake = await fakeS3(t, (_req, res) => {
    res.writeHead(403, { 'content-type': 'application/xml' }); // no Content-Length: node's server sends it chunked
    res.write('<Error><Code>AccessDenied</Code>');
    setTimeout(() => res.end('<Message>Denied by policy &lt;p1&gt;</Message></Error>'), 10);
  });
  const s = store(t, fake.endpoint);
  for (let i = 0; i < 2; i++) {
    const err = await t.throwsAsync<BatonError>(s.get('k'));
    t.is(err!.code, 'BATON_ERR_INVALID_ARGUMENT');
    t.regex(err!.message, /access denied to bucket bucket/);
    t.regex(err!.message, /Denied by policy <p1>/);
  }
  t.is(fake.connections(), 1);
});

test('the whole-call limit ends a body that trickles (never silent) and closes its connection', async (t) => {
  let closed = 0;
  const fake = await fakeS3(t, (_req, res) => {
    res.writeHead(200, { 'content-length': '100000' });
    const timer = setInterval(() => res.write('x'), 20);
    res.on('close', () => { clearInterval(timer); closed++; });
  });
  const s = store(t, fake.endpoint, { maxAttempts: 1, requestTimeoutMs: 300, minBytesPerSecond: 1e9, socketTimeoutMs: 5_000 });
  const err = await t.throwsAsync(s.get('k'), { instanceOf: StoreUnavailableError });
  t.regex(err!.message, /whole-request limit/);
  await new Promise((r) => setTimeout(r, 50));
  t.is(closed, 1);
});

test('close() closes the idle connections of the store\'s GETs', async (t) => {
  const fake = await fakeS3(t, serveData);
  const s = store(t, fake.endpoint);
  t.deepEqual(await s.get('k', { offset: 0, length: 3 }), DATA.subarray(0, 3));
  t.is(fake.open(), 1, 'kept alive after the GET');
  await s.close();
  await new Promise((r) => setTimeout(r, 50));
  t.is(fake.open(), 0);
});

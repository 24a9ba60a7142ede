/**
 * HttpGetClient (src/store/http-get.ts), S3ObjectStore's GET client, against small servers on
 * 127.0.0.1 that write raw bytes (plain TCP, and TLS with a CA made here by openssl): framing,
 * keep-alive reuse and its refusals, protocol errors, abort, certificate checks. The store's
 * behaviour over it (retries, error shapes, limits, turn budget) is in s3-direct-get.test.ts.
 */
import test, { type ExecutionContext } from 'ava';
import * as fs from 'node:fs';
import { createServer, type AddressInfo, type Server, type Socket } from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { setTimeout as delay } from 'node:timers/promises';
import { createServer as createTlsServer } from 'node:tls';
import { HttpGetClient, MAX_HEADER_BYTES, type GetEndpoint, type GetOptions } from '../../src/store/http-get.js';
import { makeCa, makeServerDir } from '../helpers/tls-pki.js';

/** What one connection's handler gets: each request's head (as text), in order, and the socket to answer on. */
type Handler = (req: string, sock: Socket, conn: number, reqOnConn: number) => void;

interface Raw { endpoint: GetEndpoint; connections: () => number; closed: () => number; requests: string[] }

function serve(t: ExecutionContext, server: Server, handler: Handler, protocol: 'http:' | 'https:'): Promise<Raw> {
  let connections = 0;
  let closed = 0;
  const requests: string[] = [];
  const sockets = new Set<Socket>();
  server.on(protocol === 'https:' ? 'secureConnection' : 'connection', (sock: Socket) => {
    const conn = ++connections;
    let onConn = 0;
    sockets.add(sock);
    sock.setNoDelay(true);
    sock.on('error', () => {});
    sock.on('close', () => { closed++; sockets.delete(sock); });
    let buf = '';
    sock.on('data', (d: Buffer) => {
      buf += d.toString('latin1');
      for (let end = buf.indexOf('\r\n\r\n'); end >= 0; end = buf.indexOf('\r\n\r\n')) {
        const req = buf.slice(0, end);
        buf = buf.slice(end + 4);
        requests.push(req);
        handler(req, sock, conn, ++onConn);
      }
    });
  });
  t.teardown(() => { for (const s of sockets) s.destroy(); server.close(); });
  return new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve({
    endpoint: { protocol, hostname: '127.0.0.1', port: (server.address() as AddressInfo).port },
    connections: () => connections,
    closed: () => closed,
    requests,
  })));
}

const raw = (t: ExecutionContext, handler: Handler): Promise<Raw> => serve(t, createServer(), handler, 'http:');

function client(t: ExecutionContext, opts: ConstructorParameters<typeof HttpGetClient>[0] = {}): HttpGetClient {
  const c = new HttpGetClient(opts);
  t.teardown(() => c.close());
  return c;
}

function opts(extra: Partial<GetOptions> = {}): GetOptions {
  return { signal: new AbortController().signal, connectMs: 2_000, firstByteMs: 5_000, socketMs: 5_000, ...extra };
}

const BODY = Buffer.from(Array.from({ length: 3000 }, (_, i) => (i * 7) % 256));
const ok = (body: Buffer, extra = ''): Buffer => Buffer.concat([Buffer.from(`HTTP/1.1 200 OK\r\nContent-Length: ${body.length}\r\n${extra}\r\n`, 'latin1'), body]);

test('headers split across many tiny TCP writes, then the body in pieces: the whole answer, header names in lower case', async (t) => {
  const srv = await raw(t, (_req, sock) => {
    const head = Buffer.from(`HTTP/1.1 206 Partial Content\r\nX-Amz-Request-Id: abc\r\nContent-Range: bytes 0-2999/9000\r\nContent-Length: ${BODY.length}\r\n\r\n`, 'latin1');
    void (async () => {
      for (const b of head) { sock.write(Buffer.of(b)); await delay(1); }
      for (let at = 0; at < BODY.length; at += 700) { sock.write(BODY.subarray(at, at + 700)); await delay(2); }
    })();
  });
  const c = client(t);
  const r = await c.get(srv.endpoint, '/b/k', { host: 'x' }, opts());
  t.is(r.status, 206);
  t.is(r.headers['content-range'], 'bytes 0-2999/9000');
  t.is(r.headers['x-amz-request-id'], 'abc');
  t.true(r.body.equals(BODY));
  t.regex(srv.requests[0]!, /^GET \/b\/k HTTP\/1\.1\r\nhost: x$/);
});

test('a body that arrives with the headers, in the same write, is copied in; the connection is reused for the next GETs', async (t) => {
  const srv = await raw(t, (_req, sock) => sock.write(ok(BODY)));
  const c = client(t);
  for (let i = 0; i < 3; i++) t.true((await c.get(srv.endpoint, `/k${i}`, {}, opts())).body.equals(BODY));
  t.is(srv.connections(), 1, 'one keep-alive connection for three GETs in turn');
  t.is(c.idleCount(srv.endpoint), 1);
  t.regex(srv.requests[0]!, /\r\nhost: 127\.0\.0\.1:\d+$/, 'Host added when the caller gave none');
});

test('a big body read in place over a reused connection, with 1xx interim answers skipped', async (t) => {
  const big = Buffer.alloc(3 * 1024 * 1024 + 17);
  for (let i = 0; i < big.length; i += 4096) big.writeUInt32LE(i, i);
  const srv = await raw(t, (_req, sock) => { sock.write('HTTP/1.1 100 Continue\r\n\r\n'); sock.write(ok(big)); });
  const c = client(t);
  for (let i = 0; i < 2; i++) t.true((await c.get(srv.endpoint, '/big', {}, opts())).body.equals(big));
  t.is(srv.connections(), 1);
});

test('Connection: close is honoured: the connection is not reused', async (t) => {
  const srv = await raw(t, (_req, sock) => sock.write(ok(BODY, 'Connection: close\r\n')));
  const c = client(t);
  for (let i = 0; i < 2; i++) t.true((await c.get(srv.endpoint, '/k', {}, opts())).body.equals(BODY));
  t.is(srv.connections(), 2);
  t.is(c.idleCount(srv.endpoint), 0);
});

test('a server that closes an idle pooled connection: the pool drops it and the next GET goes on a new one', async (t) => {
  const srv = await raw(t, (_req, sock) => { sock.write(ok(BODY)); setTimeout(() => sock.end(), 20); });
  const c = client(t);
  t.true((await c.get(srv.endpoint, '/k', {}, opts())).body.equals(BODY));
  await delay(100);
  t.is(c.idleCount(srv.endpoint), 0, 'dropped once the server closed it');
  t.true((await c.get(srv.endpoint, '/k', {}, opts())).body.equals(BODY));
  t.is(srv.connections(), 2);
});

test('a kept-alive connection the server closes as the next GET goes out fails that GET as ECONNRESET (retryable), before any answer', async (t) => {
  const srv = await raw(t, (_req, sock, _conn, n) => { if (n === 1) sock.write(ok(BODY)); else sock.destroy(); });
  const c = client(t);
  t.true((await c.get(srv.endpoint, '/k', {}, opts())).body.equals(BODY));
  const err = await t.throwsAsync<Error & { code?: string }>(c.get(srv.endpoint, '/k', {}, opts()));
  t.is(err!.code, 'ECONNRESET');
  t.is(srv.connections(), 1, 'the second GET went on the kept-alive connection');
  t.true((await c.get(srv.endpoint, '/k', {}, opts())).body.equals(BODY), 'the next GET, on a new connection');
});

test('extra bytes after the body (with it, or later): the answer is returned, but that connection is never reused', async (t) => {
  let mode: 'with' | 'later' = 'with';
  const srv = await raw(t, (_req, sock) => {
    if (mode === 'with') sock.write(Buffer.concat([ok(BODY), Buffer.from('HTTP/1.1 200 OK\r\n')]));
    else { sock.write(ok(BODY)); setTimeout(() => sock.write('garbage'), 20); }
  });
  const c = client(t);
  t.true((await c.get(srv.endpoint, '/k', {}, opts())).body.equals(BODY));
  t.is(c.idleCount(srv.endpoint), 0);
  mode = 'later';
  t.true((await c.get(srv.endpoint, '/k', {}, opts())).body.equals(BODY));
  t.is(srv.connections(), 2, 'a new connection after the one with bytes past its body');
  await delay(100);
  t.is(c.idleCount(srv.endpoint), 0, 'stray bytes on an idle connection destroyed it');
  t.true((await c.get(srv.endpoint, '/k', {}, opts())).body.equals(BODY));
  t.is(srv.connections(), 3);
});

test('an oversized header block is a clear error, and its connection is closed', async (t) => {
  const srv = await raw(t, (_req, sock) => {
    sock.write('HTTP/1.1 200 OK\r\n');
    const line = `x-filler: ${'a'.repeat(1000)}\r\n`;
    for (let i = 0; i < (MAX_HEADER_BYTES / line.length) + 2; i++) sock.write(line);
  });
  const c = client(t);
  const err = await t.throwsAsync<Error & { code?: string }>(c.get(srv.endpoint, '/k', {}, opts()));
  t.is(err!.code, 'HPE_HEADER_OVERFLOW');
  t.regex(err!.message, /header block is larger than 65536 bytes/);
  await delay(50);
  t.is(srv.closed(), 1);
});

test('not HTTP, or a malformed Content-Length: errors with node http\'s codes', async (t) => {
  let mode = 0;
  const srv = await raw(t, (_req, sock) => sock.write(mode === 0 ? 'SSH-2.0-OpenSSH\r\n\r\n' : 'HTTP/1.1 200 OK\r\nContent-Length: 12, 13\r\n\r\n'));
  const c = client(t);
  t.is((await t.throwsAsync<Error & { code?: string }>(c.get(srv.endpoint, '/k', {}, opts())))!.code, 'HPE_INVALID_CONSTANT');
  mode = 1;
  t.is((await t.throwsAsync<Error & { code?: string }>(c.get(srv.endpoint, '/k', {}, opts())))!.code, 'HPE_INVALID_CONTENT_LENGTH');
});

test('a non-2xx answer with a chunked XML body: status, headers and the whole XML, and the connection is kept', async (t) => {
  const xml = '<?xml version="1.0"?><Error><Code>NoSuchKey</Code><Message>The specified key does not exist.</Message></Error>';
  const srv = await raw(t, (_req, sock) => {
    const a = xml.slice(0, 30), b = xml.slice(30);
    sock.write(`HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\nContent-Type: application/xml\r\n\r\n${a.length.toString(16)};ext=1\r\n${a}\r\n`);
    setTimeout(() => sock.write(`${b.length.toString(16)}\r\n${b}\r\n0\r\nx-trailer: y\r\n\r\n`), 10);
  });
  const c = client(t);
  for (let i = 0; i < 2; i++) {
    const r = await c.get(srv.endpoint, '/k', {}, opts());
    t.is(r.status, 404);
    t.is(r.headers['content-type'], 'application/xml');
    t.is(r.body.toString(), xml);
  }
  t.is(srv.connections(), 1);
});

test('a 2xx chunked body and a body until the connection closes are read whole; the latter\'s connection is not reused', async (t) => {
  let mode: 'chunked' | 'eof' = 'chunked';
  const srv = await raw(t, (_req, sock) => {
    if (mode === 'chunked') sock.write(`HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n${'a'.repeat(1000)}\r\n5\r\nbbbbb\r\n0\r\n\r\n`);
    else sock.end(`HTTP/1.1 200 OK\r\n\r\n${'c'.repeat(500)}`);
  });
  const c = client(t);
  t.is((await c.get(srv.endpoint, '/k', {}, opts())).body.toString(), 'a'.repeat(1000) + 'bbbbb');
  t.is(c.idleCount(srv.endpoint), 1);
  mode = 'eof';
  t.is((await c.get(srv.endpoint, '/k', {}, opts())).body.toString(), 'c'.repeat(500));
  t.is(c.idleCount(srv.endpoint), 0);
});

test('the abort signal mid-body rejects with its reason and destroys the socket', async (t) => {
  const big = Buffer.alloc(1024 * 1024, 1);
  const srv = await raw(t, (_req, sock) => {
    sock.write(`HTTP/1.1 200 OK\r\nContent-Length: ${big.length * 2}\r\n\r\n`);
    sock.write(big);
    // the second half never comes
  });
  const c = client(t);
  const ac = new AbortController();
  const got = c.get(srv.endpoint, '/k', {}, opts({ signal: ac.signal, onBody: (length) => { t.is(length, big.length * 2); } }));
  await delay(100);
  const reason = new Error('caller gave up');
  ac.abort(reason);
  t.is(await t.throwsAsync(got), reason);
  await delay(50);
  t.is(srv.closed(), 1, 'the server saw its connection closed');
  t.is(c.idleCount(srv.endpoint), 0);
});

test('the onBody handle destroys the GET (the store\'s whole-call limit); after the GET settled it does nothing', async (t) => {
  const srv = await raw(t, (req, sock) => {
    if (req.includes('/slow')) sock.write(`HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n${'x'.repeat(10)}`);
    else sock.write(ok(BODY));
  });
  const c = client(t);
  const expired = new Error('whole-call limit');
  const slow = c.get(srv.endpoint, '/slow', {}, opts({ onBody: (_l, b) => setTimeout(() => b.destroy(expired), 50) }));
  t.is(await t.throwsAsync(slow), expired);
  let handle: { destroy(err?: Error): void } | undefined;
  t.true((await c.get(srv.endpoint, '/fast', {}, opts({ onBody: (_l, b) => { handle = b; } }))).body.equals(BODY));
  handle!.destroy(new Error('late'));
  t.true((await c.get(srv.endpoint, '/fast', {}, opts())).body.equals(BODY), 'the pooled connection was not destroyed by the late call');
  t.is(srv.connections(), 2);
});

test('the socket limit (silence mid-body) and the first-byte limit fail as TimeoutError with the store\'s messages', async (t) => {
  const srv = await raw(t, (req, sock) => {
    if (req.includes('/silent')) sock.write(`HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc`);
    // '/mute': nothing at all
  });
  const c = client(t);
  const silent = await t.throwsAsync(c.get(srv.endpoint, '/silent', {}, opts({ socketMs: 150 })));
  t.is(silent!.name, 'TimeoutError');
  t.regex(silent!.message, /no byte in either direction for 150 ms \(the socket limit\)/);
  const mute = await t.throwsAsync(c.get(srv.endpoint, '/mute', {}, opts({ firstByteMs: 150 })));
  t.regex(mute!.message, /no response headers within 150 ms \(the first-byte limit\)/);
});

test('at most maxSockets connections per endpoint: more GETs wait for one', async (t) => {
  let inFlight = 0, most = 0;
  const srv = await raw(t, (_req, sock) => {
    inFlight++;
    most = Math.max(most, inFlight);
    setTimeout(() => { inFlight--; sock.write(ok(BODY)); }, 20);
  });
  const c = client(t, { maxSockets: 2 });
  const all = await Promise.all(Array.from({ length: 6 }, () => c.get(srv.endpoint, '/k', {}, opts())));
  for (const r of all) t.true(r.body.equals(BODY));
  t.is(most, 2);
  t.is(srv.connections(), 2);
});

test('https: a server whose CA the client trusts answers (body in place, connection reused); a client that does not trust it fails on the certificate', async (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-http-get-tls-'));
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }));
  const ca = makeCa(path.join(dir, 'ca'));
  const sdir = makeServerDir(ca, path.join(dir, 'server'));
  const big = Buffer.alloc(1024 * 1024 + 5);
  for (let i = 0; i < big.length; i += 1024) big.writeUInt32LE(i, i);
  const server = createTlsServer({ key: fs.readFileSync(path.join(sdir, 'server-key.pem')), cert: fs.readFileSync(path.join(sdir, 'server-cert.pem')) });
  server.on('tlsClientError', () => {});
  const srv = await serve(t, server, (_req, sock) => sock.write(ok(big)), 'https:');
  const trusting = client(t, { tls: { ca: fs.readFileSync(ca.cert) } });
  for (let i = 0; i < 2; i++) t.true((await trusting.get(srv.endpoint, '/k', {}, opts())).body.equals(big));
  t.is(srv.connections(), 1);
  const wary = client(t);
  const err = await t.throwsAsync<Error & { code?: string }>(wary.get(srv.endpoint, '/k', {}, opts()));
  t.regex(`${err!.code} ${err!.message}`, /SELF_SIGNED_CERT_IN_CHAIN|UNABLE_TO_VERIFY_LEAF_SIGNATURE|self[- ]signed certificate/i);
  t.is(srv.connections(), 1, 'no TLS connection was accepted for the untrusting client');
});

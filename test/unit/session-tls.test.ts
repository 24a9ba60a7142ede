/**
 * The STARTTLS part of NbdSession (proto.md "TLS support"; notes nbd-protocol.md §1.3) over
 * real Unix socket pairs: a scripted client written here speaks the option frames by hand
 * (test/fixtures/nbd-vectors.ts), then upgrades its side with Node's TLS client. Certificates
 * and keys are made at run time (test/helpers/tls-pki.ts).
 *
 * What is proved here, and not by the real clients in test/integration/tls.test.ts: the
 * exact replies of each state (ERR_TLS_REQD for every option but STARTTLS and ABORT, with its
 * payload consumed; ERR_INVALID for a second STARTTLS), that negotiation state does not
 * survive STARTTLS, that the provider is never asked before TLS under `require`, the
 * handshake timeout over a stalled TLS handshake, what is logged for each refusal, and
 * credential rotation with a connection open.
 */

import test, { type ExecutionContext } from 'ava';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { Writable, type Duplex } from 'node:stream';
import * as tls from 'node:tls';
import { pino } from 'pino';
import type { ExportHandle, ExportProvider, ExportSummary, Lent } from '../../nbd/backend.js';
import { DEFAULT_SESSION_OPTIONS, NbdSession, type SessionOptions } from '../../nbd/session.js';
import { NbdTls, type ClientIdentity, type TlsCredentials } from '../../nbd/tls.js';
import { AuthzPolicy, authorizedExports } from '../../src/authz.js';
import { MemoryBackend } from '../../src/backends/memory.js';
import { NotFoundError } from '../../src/errors.js';
import { loadTlsCredentials } from '../../src/tls-config.js';
import * as V from '../fixtures/nbd-vectors.js';
import { makeCa, makeClientDir, makeServerDir } from '../helpers/tls-pki.js';

// ------------------------------------------------------------------ spec values (§1.1), spelled out

const OPT = { EXPORT_NAME: 1, ABORT: 2, LIST: 3, STARTTLS: 5, INFO: 6, GO: 7, STRUCTURED_REPLY: 8, SET_META: 10 } as const;
const REP = { ACK: 1, SERVER: 2, INFO: 3, META_CONTEXT: 4, ERR_UNSUP: 0x80000001, ERR_INVALID: 0x80000003, ERR_TLS_REQD: 0x80000005, ERR_UNKNOWN: 0x80000006 } as const;
const CMD = { READ: 0, WRITE: 1, BLOCK_STATUS: 7 } as const;
const SIMPLE_MAGIC = 0x67446698;
const STRUCTURED_MAGIC = 0x668e33ef;
const EINVAL = 22;
const SIZE = 4 * 1024 * 1024;

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

// ------------------------------------------------------------------ certificates, made once

const PKI = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-session-tls-'));
process.on('exit', () => fs.rmSync(PKI, { recursive: true, force: true }));
const ca = makeCa(path.join(PKI, 'ca'));
const serverDir = makeServerDir(ca, path.join(PKI, 'server'));
const alice = makeClientDir(ca, ca, path.join(PKI, 'alice'), 'alice', ['DNS:alice.example', 'email:alice@example.com']);
const otherCa = makeCa(path.join(PKI, 'other-ca'), 'another CA');
const foreign = makeClientDir(otherCa, ca, path.join(PKI, 'foreign'), 'alice');
const selfSigned = makeClientDir(null, ca, path.join(PKI, 'self'), 'alice');
const x509 = (verifyPeer: boolean): TlsCredentials => loadTlsCredentials({ certificatesDir: serverDir, verifyPeer });
const KEY_A = Buffer.alloc(32, 0xa1);
const KEY_B = Buffer.alloc(32, 0xb2);
const psk = (entries: Record<string, Buffer>): TlsCredentials => ({ psk: new Map(Object.entries(entries)) });

// ------------------------------------------------------------------ a provider that counts what it is asked

/** Reads that take a while, so requests are still in flight when the client half-closes. */
class SlowReads extends MemoryBackend {
  override async read(offset: number, length: number, into?: Buffer): Promise<Buffer> {
    await sleep(50);
    return super.read(offset, length, into);
  }
  override async readLent(offset: number, length: number): Promise<Lent> {
    await sleep(50);
    return super.readLent(offset, length);
  }
}

class CountingExports implements ExportProvider {
  lists = 0;
  opens = 0;
  readonly backends = new Map<string, MemoryBackend>();
  constructor(names = ['disk'], slowReads = false) {
    for (const n of names) this.backends.set(n, slowReads ? new SlowReads(SIZE) : new MemoryBackend(SIZE));
  }
  async list(): Promise<ExportSummary[]> {
    this.lists++;
    return [...this.backends.keys()].map((name) => ({ name, description: `export ${name}` }));
  }
  async open(requested: string): Promise<ExportHandle> {
    const name = requested === '' && this.backends.size === 1 ? [...this.backends.keys()][0]! : requested;
    const backend = this.backends.get(name);
    if (!backend) throw new NotFoundError(`no volume "${requested}" in test:`);
    this.opens++;
    return { name, description: `export ${name}`, backend, release: () => {} };
  }
}

// ------------------------------------------------------------------ logs

interface LogLine { level: number; msg: string; [k: string]: unknown }
function captureLog(): { log: SessionOptions['log']; lines: LogLine[] } {
  const lines: LogLine[] = [];
  const stream = new Writable({
    write(chunk: Buffer, _enc, cb) {
      for (const l of chunk.toString().split('\n')) if (l.trim()) lines.push(JSON.parse(l) as LogLine);
      cb();
    },
  });
  return { log: pino({ level: 'debug' }, stream), lines };
}

// ------------------------------------------------------------------ the client

class Conn {
  private buf = Buffer.alloc(0);
  private ended = false;
  private waiter: (() => void) | null = null;
  private sock: Duplex;
  private readonly listeners = {
    data: (d: Buffer): void => { this.buf = Buffer.concat([this.buf, d]); this.wake(); },
    end: (): void => { this.ended = true; this.wake(); },
  };

  constructor(readonly raw: net.Socket) {
    this.sock = raw;
    this.attach(raw);
  }

  private attach(s: Duplex): void {
    s.on('data', this.listeners.data);
    for (const e of ['end', 'close', 'error']) s.on(e, this.listeners.end);
  }

  private detach(s: Duplex): void {
    s.off('data', this.listeners.data);
    for (const e of ['end', 'close', 'error']) s.off(e, this.listeners.end);
  }

  private wake(): void { const w = this.waiter; this.waiter = null; w?.(); }

  get eof(): boolean { return this.ended; }

  write(b: Buffer): void { this.sock.write(b); }

  async read(n: number, timeoutMs = 5000): Promise<Buffer> {
    const deadline = Date.now() + timeoutMs;
    while (this.buf.length < n) {
      if (this.ended) throw new Error(`EOF after ${this.buf.length} of ${n} bytes`);
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`timed out waiting for ${n} bytes (have ${this.buf.length})`);
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, left);
        this.waiter = () => { clearTimeout(timer); resolve(); };
      });
    }
    const out = Buffer.from(this.buf.subarray(0, n));
    this.buf = this.buf.subarray(n);
    return out;
  }

  async waitEof(timeoutMs = 3000): Promise<boolean> {
    const deadline = Date.now() + timeoutMs;
    while (!this.ended && Date.now() < deadline) {
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, Math.max(1, deadline - Date.now()));
        this.waiter = () => { clearTimeout(timer); resolve(); };
      });
    }
    return this.ended;
  }

  async hello(): Promise<void> {
    const g = await this.read(18);
    if (!g.equals(V.GREETING)) throw new Error('bad greeting');
    this.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  }

  /** One option and its replies up to the final one. */
  async option(option: number, data: Buffer = Buffer.alloc(0)): Promise<V.ParsedOptionReply[]> {
    this.write(V.optionFrame(option, data));
    const out: V.ParsedOptionReply[] = [];
    for (;;) {
      const h = await this.read(20);
      const r = V.parseOptionReply(Buffer.concat([h, await this.read(h.readUInt32BE(16))]));
      out.push(r);
      if (r.type === REP.ACK || (r.type & 0x80000000) !== 0) return out;
    }
  }

  /** STARTTLS, its ACK, then the client side of the TLS handshake on the same socket. */
  async starttls(opts: tls.ConnectionOptions): Promise<tls.TLSSocket> {
    const r = await this.option(OPT.STARTTLS);
    if (r.length !== 1 || r[0]!.type !== REP.ACK || r[0]!.data.length !== 0) throw new Error(`STARTTLS not ACKed: ${JSON.stringify(r.map((x) => x.type))}`);
    if (this.buf.length !== 0) throw new Error('bytes after the STARTTLS ACK');
    return this.handshake(opts);
  }

  handshake(opts: tls.ConnectionOptions): Promise<tls.TLSSocket> {
    this.detach(this.raw);
    const t = tls.connect({ socket: this.raw, ...opts });
    this.sock = t;
    this.attach(t);
    return new Promise((resolve, reject) => {
      t.once('secureConnect', () => resolve(t));
      t.once('error', reject);
      t.once('close', () => reject(new Error('closed during the TLS handshake')));
    });
  }

  async go(name: string): Promise<V.ParsedOptionReply[]> { return this.option(OPT.GO, V.infoData(name, [])); }

  async simpleReply(): Promise<{ magic: number; error: number }> {
    const h = await this.read(16);
    return { magic: h.readUInt32BE(0), error: h.readUInt32BE(4) };
  }

  destroy(): void { this.sock.destroy(); this.raw.destroy(); }
}

const trustCa = (): tls.ConnectionOptions => ({ ca: fs.readFileSync(ca.cert), servername: 'localhost' });
const withCert = (dir: string): tls.ConnectionOptions => ({ ...trustCa(), cert: fs.readFileSync(path.join(dir, 'client-cert.pem')), key: fs.readFileSync(path.join(dir, 'client-key.pem')) });
const withPsk = (identity: string, key: Buffer): tls.ConnectionOptions => ({ pskCallback: () => ({ psk: key, identity }), checkServerIdentity: () => undefined });

// ------------------------------------------------------------------ harness

interface Server {
  connect(): Promise<Conn>;
  lines: LogLine[];
  runs: Promise<void>[];
}

async function start(t: ExecutionContext, opts: Partial<SessionOptions>, provider: ExportProvider = new CountingExports()): Promise<Server> {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-stls-'));
  const sockPath = path.join(dir, 'nbd.sock');
  const { log, lines } = captureLog();
  const runs: Promise<void>[] = [];
  let n = 0;
  // As NbdServer: half-open capable sockets (the TLS socket inherits this from the one it wraps).
  const server = net.createServer({ allowHalfOpen: true }, (sock) => {
    const session = new NbdSession(sock, provider, { ...DEFAULT_SESSION_OPTIONS, log: log.child({ conn: ++n }), ...opts });
    runs.push(session.run());
  });
  await new Promise<void>((resolve, reject) => { server.once('error', reject); server.listen(sockPath, resolve); });
  const conns: Conn[] = [];
  t.teardown(async () => {
    for (const c of conns) c.destroy();
    await Promise.race([Promise.all(runs), sleep(5000)]);
    await new Promise<void>((resolve) => server.close(() => resolve()));
    fs.rmSync(dir, { recursive: true, force: true });
  });
  return {
    lines,
    runs,
    connect: async () => {
      const s = net.connect(sockPath);
      await new Promise<void>((resolve, reject) => { s.once('connect', resolve); s.once('error', reject); });
      const c = new Conn(s);
      conns.push(c);
      await c.hello();
      return c;
    },
  };
}

const types = (r: V.ParsedOptionReply[]): number[] => r.map((x) => x.type);

/** WRITE then READ `n` bytes at offset 0 with simple replies (no STRUCTURED_REPLY on this connection). */
async function roundTrip(t: ExecutionContext, c: Conn, n: number, seed: number): Promise<void> {
  const data = Buffer.alloc(n);
  for (let i = 0; i < n; i++) data[i] = (i * 7 + seed) & 0xff;
  c.write(Buffer.concat([V.requestFrame({ type: CMD.WRITE, flags: 0, cookie: V.cookieOf(1), offset: 0n, length: n }), data]));
  t.deepEqual(await c.simpleReply(), { magic: SIMPLE_MAGIC, error: 0 });
  c.write(V.requestFrame({ type: CMD.READ, flags: 0, cookie: V.cookieOf(2), offset: 0n, length: n }));
  t.deepEqual(await c.simpleReply(), { magic: SIMPLE_MAGIC, error: 0 });
  t.true((await c.read(n)).equals(data));
}

function refusals(lines: LogLine[]): LogLine[] {
  return lines.filter((l) => l.msg === 'TLS handshake refused; closing connection');
}

// ================================================================== state machine

test('STARTTLS (tls on): ACK with no data, TLS on the same socket, negotiation state forgotten, second STARTTLS ERR_INVALID', async (t) => {
  const tlsOn = new NbdTls('on', x509(false));
  const s = await start(t, { tls: tlsOn });
  const c = await s.connect();
  // Plaintext haggling is allowed with `on`.
  t.deepEqual(types(await c.option(OPT.LIST)), [REP.SERVER, REP.ACK]);
  t.deepEqual(types(await c.option(OPT.STRUCTURED_REPLY)), [REP.ACK]);
  t.deepEqual(types(await c.option(OPT.SET_META, V.metaData('disk', ['base:allocation']))), [REP.META_CONTEXT, REP.ACK]);
  // STARTTLS with data is malformed: ERR_INVALID, still plaintext.
  t.deepEqual(types(await c.option(OPT.STARTTLS, Buffer.from('x'))), [REP.ERR_INVALID]);
  const sock = await c.starttls(trustCa());
  t.is(sock.getProtocol(), 'TLSv1.3');
  // Over TLS: a second STARTTLS is ERR_INVALID.
  t.deepEqual(types(await c.option(OPT.STARTTLS)), [REP.ERR_INVALID]);
  // STRUCTURED_REPLY is accepted again (it was forgotten, else ERR_INVALID "already negotiated")...
  // ...but first prove the meta context was forgotten: GO without SET_META, structured off.
  t.deepEqual(types(await c.go('disk')), [REP.INFO, REP.ACK]);
  // Simple replies (structured was forgotten), and BLOCK_STATUS refused (no meta context).
  c.write(V.requestFrame({ type: CMD.BLOCK_STATUS, flags: 0, cookie: V.cookieOf(9), offset: 0n, length: 4096 }));
  t.deepEqual(await c.simpleReply(), { magic: SIMPLE_MAGIC, error: EINVAL });
  await roundTrip(t, c, 1024 * 1024, 3);
  const est = s.lines.filter((l) => l.msg === 'TLS session established');
  t.is(est.length, 1);
  t.is(est[0]!['identity'], 'anonymous');
  t.is(est[0]!['protocol'], 'TLSv1.3');
  t.is(est[0]!['peer'], 'unix');
});

test('STARTTLS (tls on): STRUCTURED_REPLY before TLS does not count after it (ACK again, then structured READs)', async (t) => {
  const s = await start(t, { tls: new NbdTls('on', x509(false)) });
  const c = await s.connect();
  t.deepEqual(types(await c.option(OPT.STRUCTURED_REPLY)), [REP.ACK]);
  t.deepEqual(types(await c.option(OPT.STRUCTURED_REPLY)), [REP.ERR_INVALID], 'twice in one session: ERR_INVALID');
  await c.starttls(trustCa());
  t.deepEqual(types(await c.option(OPT.STRUCTURED_REPLY)), [REP.ACK], 'a fresh negotiation after STARTTLS');
  t.deepEqual(types(await c.go('disk')), [REP.INFO, REP.ACK]);
  c.write(V.requestFrame({ type: CMD.READ, flags: 0, cookie: V.cookieOf(5), offset: 0n, length: 512 }));
  t.is((await c.read(4)).readUInt32BE(0), STRUCTURED_MAGIC);
});

test('tls require: every option but STARTTLS and ABORT gets ERR_TLS_REQD (payload consumed, haggling goes on); the provider is never asked', async (t) => {
  const provider = new CountingExports();
  const s = await start(t, { tls: new NbdTls('require', x509(false)) }, provider);
  const c = await s.connect();
  const asked: [number, Buffer][] = [
    [OPT.LIST, Buffer.alloc(0)],
    [OPT.INFO, V.infoData('disk', [3])],
    [OPT.GO, V.infoData('disk', [])],
    [OPT.STRUCTURED_REPLY, Buffer.alloc(0)],
    [OPT.SET_META, V.metaData('disk', ['base:allocation'])],
    [0x7654321, V.OPTIONS.list.bytes], // unknown, with a payload that looks like an option
  ];
  for (const [opt, data] of asked) {
    const r = await c.option(opt, data);
    t.is(r.length, 1, `option ${opt}`);
    t.is(r[0]!.option, opt);
    t.is(r[0]!.type, REP.ERR_TLS_REQD, `option ${opt}`);
    t.regex(r[0]!.data.toString('utf8'), /requires TLS/);
  }
  t.is(provider.lists, 0);
  t.is(provider.opens, 0);
  await c.starttls(trustCa());
  t.deepEqual(types(await c.option(OPT.LIST)), [REP.SERVER, REP.ACK]);
  t.deepEqual(types(await c.go('disk')), [REP.INFO, REP.ACK]);
  await roundTrip(t, c, 64 * 1024, 9);
});

test('tls require: EXPORT_NAME before TLS closes the connection without a reply; ABORT gets its ACK', async (t) => {
  const provider = new CountingExports();
  const s = await start(t, { tls: new NbdTls('require', x509(false)) }, provider);
  const a = await s.connect();
  a.write(V.optionFrame(OPT.EXPORT_NAME, Buffer.from('disk')));
  t.true(await a.waitEof());
  await t.throwsAsync(a.read(1), { message: /EOF after 0/ });
  t.is(provider.opens, 0);
  t.truthy(s.lines.find((l) => l.msg === 'EXPORT_NAME without TLS on a server that requires TLS: closing' && l['peer'] === 'unix'));
  const b = await s.connect();
  t.deepEqual(types(await b.option(OPT.ABORT)), [REP.ACK]);
  t.true(await b.waitEof());
});

test('tls off: STARTTLS is ERR_UNSUP, never ERR_TLS_REQD', async (t) => {
  const s = await start(t, {});
  const c = await s.connect();
  t.deepEqual(types(await c.option(OPT.STARTTLS)), [REP.ERR_UNSUP]);
  t.deepEqual(types(await c.go('disk')), [REP.INFO, REP.ACK]);
});

test('bytes sent after STARTTLS before its ACK: the connection is closed (nothing is fed to TLS out of turn)', async (t) => {
  const s = await start(t, { tls: new NbdTls('require', x509(false)) });
  const c = await s.connect();
  c.write(Buffer.concat([V.optionFrame(OPT.STARTTLS), Buffer.from('16030100', 'hex')]));
  const h = await c.read(20);
  t.is(h.readUInt32BE(12), REP.ACK);
  t.true(await c.waitEof());
  await Promise.all(s.runs);
  t.truthy(s.lines.find((l) => l.msg === 'closing connection after protocol error' && /bytes after STARTTLS/.test(String(l['err']))));
});

test('handshake timeout covers TLS: a client silent after the ACK, and one that stops mid-ClientHello, are closed; one log line each', async (t) => {
  const s = await start(t, { tls: new NbdTls('require', x509(false)), handshakeTimeoutMs: 400 });
  const silent = await s.connect();
  const r = await silent.option(OPT.STARTTLS);
  t.is(r[0]!.type, REP.ACK);
  const half = await s.connect();
  t.is((await half.option(OPT.STARTTLS))[0]!.type, REP.ACK);
  half.write(Buffer.from('160301020001', 'hex')); // a TLS record header and the start of a ClientHello
  const t0 = Date.now();
  t.true(await silent.waitEof(3000));
  t.true(await half.waitEof(3000));
  t.true(Date.now() - t0 < 2500);
  await Promise.all(s.runs);
  const timeouts = s.lines.filter((l) => l.msg === 'handshake timed out; closing connection');
  t.is(timeouts.length, 2);
  t.is(refusals(s.lines).length, 0, 'the timeout is the one line logged for each');
});

test('over TLS a client may half-close right after its last requests (close_notify + FIN, as libnbd after DISC): every reply still arrives', async (t) => {
  const s = await start(t, { tls: new NbdTls('require', x509(false)) }, new CountingExports(['disk'], true));
  const c = await s.connect();
  const sock = await c.starttls(trustCa());
  t.deepEqual(types(await c.go('disk')), [REP.INFO, REP.ACK]);
  const n = 16;
  const frames: Buffer[] = [];
  for (let i = 0; i < n; i++) frames.push(V.requestFrame({ type: CMD.READ, flags: 0, cookie: V.cookieOf(100 + i), offset: BigInt(i * 65536), length: 65536 }));
  frames.push(V.requestFrame({ type: 2 /* DISC */, flags: 0, cookie: V.cookieOf(999), offset: 0n, length: 0 }));
  sock.end(Buffer.concat(frames));
  for (let i = 0; i < n; i++) {
    const r = await c.simpleReply();
    t.deepEqual(r, { magic: SIMPLE_MAGIC, error: 0 });
    t.is((await c.read(65536)).length, 65536);
  }
  t.true(await c.waitEof());
});

test('upgrading a socket that is already closed rejects at once (a client that hung up right after STARTTLS never leaves a session waiting)', async (t) => {
  const nbdTls = new NbdTls('require', x509(false));
  const server = net.createServer((sock) => sock.destroy());
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  t.teardown(() => new Promise<void>((resolve) => server.close(() => resolve())));
  const sock = net.connect((server.address() as net.AddressInfo).port, '127.0.0.1');
  await new Promise<void>((resolve) => sock.once('connect', resolve));
  sock.destroy();
  await new Promise<void>((resolve) => sock.once('close', () => resolve()));
  const r = await Promise.race([nbdTls.upgrade(sock).then(() => 'resolved', (e: Error) => e.message), sleep(2000).then(() => 'still waiting')]);
  t.is(r, 'the client closed the connection before the TLS handshake');
});

// ================================================================== X.509

test('--tls-verify-peer: a certificate signed by the CA gets in, its CN and subjectAltNames become the identity', async (t) => {
  let seen: ClientIdentity | undefined;
  const provider = new CountingExports();
  const s = await start(t, { tls: new NbdTls('require', x509(true)), exportsFor: (id) => { seen = id; return provider; } });
  const c = await s.connect();
  await c.starttls(withCert(alice));
  t.deepEqual(types(await c.go('disk')), [REP.INFO, REP.ACK]);
  t.is(seen?.kind, 'x509');
  t.deepEqual(seen?.names, ['alice', 'alice.example', 'alice@example.com']);
  t.is(s.lines.find((l) => l.msg === 'TLS session established')?.['identity'], 'x509:alice');
});

for (const [title, opts, reason] of [
  ['a certificate signed by another CA', () => withCert(foreign), /UNABLE_TO_GET_ISSUER_CERT|UNABLE_TO_VERIFY_LEAF_SIGNATURE/],
  ['a self-signed certificate', () => withCert(selfSigned), /SELF_SIGNED/],
  ['no certificate', () => trustCa(), /.+/],
] as const) {
  test(`--tls-verify-peer: ${title} is refused, logged once with the peer and the identity it claimed; the export is never opened`, async (t) => {
    const provider = new CountingExports();
    const s = await start(t, { tls: new NbdTls('require', x509(true)) }, provider);
    const c = await s.connect();
    // TLS 1.3: the client finishes its side before the server has judged its certificate,
    // so the refusal shows as the connection closing (or the handshake failing).
    try {
      await c.starttls(opts());
      c.write(V.optionFrame(OPT.LIST));
    } catch { /* refused during the handshake */ }
    t.true(await c.waitEof());
    await Promise.all(s.runs);
    const r = refusals(s.lines);
    t.is(r.length, 1, JSON.stringify(s.lines));
    t.regex(String(r[0]!['err']), reason);
    t.is(r[0]!['peer'], 'unix');
    if (title !== 'no certificate') t.is(r[0]!['identity'], 'x509:alice');
    t.is(r[0]!.level, 40);
    t.is(provider.lists + provider.opens, 0);
  });
}

// ================================================================== PSK

test('PSK: the right key gets in as psk:IDENTITY (TLS 1.3); a wrong key and an unknown identity are refused and logged with the identity', async (t) => {
  let seen: ClientIdentity | undefined;
  const provider = new CountingExports();
  const s = await start(t, { tls: new NbdTls('require', psk({ alice: KEY_A })), exportsFor: (id) => { seen = id; return provider; } });
  const ok = await s.connect();
  const sock = await ok.starttls(withPsk('alice', KEY_A));
  t.is(sock.getProtocol(), 'TLSv1.3');
  t.is(sock.getCipher().standardName, 'TLS_AES_128_GCM_SHA256', 'with PSK, AES-128-GCM before ChaCha20');
  t.deepEqual(types(await ok.go('disk')), [REP.INFO, REP.ACK]);
  t.deepEqual(seen, { kind: 'psk', names: ['alice'], display: 'psk:alice' });

  for (const [id, key, why] of [['alice', KEY_B, /wrong PSK/], ['mallory', KEY_A, /unknown PSK identity/]] as const) {
    const bad = await s.connect();
    await t.throwsAsync(bad.starttls(withPsk(id, key)));
    t.true(await bad.waitEof());
    await sleep(50);
    const r = refusals(s.lines).filter((l) => l['identity'] === `psk:${id}`);
    t.is(r.length, 1, JSON.stringify(s.lines));
    t.regex(String(r[0]!['err']), why);
  }
  t.is(provider.opens, 1, 'only the client with the right key attached');
});

test('TLS 1.2 (the spec\'s minimum) still works, with certificates and with PSK; TLS 1.1 does not', async (t) => {
  const x = await start(t, { tls: new NbdTls('require', x509(false)) });
  const c1 = await x.connect();
  const s1 = await c1.starttls({ ...trustCa(), maxVersion: 'TLSv1.2' });
  t.is(s1.getProtocol(), 'TLSv1.2');
  t.deepEqual(types(await c1.go('disk')), [REP.INFO, REP.ACK]);
  const p = await start(t, { tls: new NbdTls('require', psk({ alice: KEY_A })) });
  const c2 = await p.connect();
  const s2 = await c2.starttls({ ...withPsk('alice', KEY_A), maxVersion: 'TLSv1.2', ciphers: 'PSK-AES128-GCM-SHA256:ECDHE-PSK-AES128-CBC-SHA256' });
  t.is(s2.getProtocol(), 'TLSv1.2');
  t.regex(s2.getCipher().name, /PSK/);
  t.deepEqual(types(await c2.go('disk')), [REP.INFO, REP.ACK]);
  const c3 = await x.connect();
  await t.throwsAsync(c3.starttls({ ...trustCa(), minVersion: 'TLSv1', maxVersion: 'TLSv1.1' }));
});

test('a certificate client on a PSK server is refused with a message that says so', async (t) => {
  const s = await start(t, { tls: new NbdTls('require', psk({ alice: KEY_A })) });
  const c = await s.connect();
  await t.throwsAsync(c.starttls(trustCa()));
  t.true(await c.waitEof());
  await Promise.all(s.runs);
  t.regex(String(refusals(s.lines)[0]?.['err']), /offered no PSK identity/);
});

// ================================================================== rotation, isolation

test('rotation: new credentials apply to new handshakes; an established TLS connection keeps its session and keeps working', async (t) => {
  const nbdTls = new NbdTls('require', psk({ alice: KEY_A }));
  const s = await start(t, { tls: nbdTls });
  const old = await s.connect();
  await old.starttls(withPsk('alice', KEY_A));
  t.deepEqual(types(await old.go('disk')), [REP.INFO, REP.ACK]);
  await roundTrip(t, old, 256 * 1024, 1);

  nbdTls.setCredentials(psk({ alice: KEY_B }));
  await roundTrip(t, old, 256 * 1024, 2); // same session, after the rotation
  const stale = await s.connect();
  await t.throwsAsync(stale.starttls(withPsk('alice', KEY_A)), undefined, 'the old key no longer gets in');
  const fresh = await s.connect();
  await fresh.starttls(withPsk('alice', KEY_B));
  t.deepEqual(types(await fresh.go('disk')), [REP.INFO, REP.ACK]);
  await roundTrip(t, fresh, 4096, 3);
  t.throws(() => nbdTls.setCredentials(x509(false)), { message: /same kind/ });
});

test('rotation of certificates: new handshakes get the new server certificate (a client that trusts only the old CA is refused by its own check), the established session goes on', async (t) => {
  const nbdTls = new NbdTls('require', x509(false));
  const s = await start(t, { tls: nbdTls });
  const old = await s.connect();
  await old.starttls(trustCa());
  t.deepEqual(types(await old.go('disk')), [REP.INFO, REP.ACK]);
  const ca2 = makeCa(path.join(PKI, 'ca2'), 'rotated CA');
  const server2 = makeServerDir(ca2, path.join(PKI, 'server2'));
  nbdTls.setCredentials(loadTlsCredentials({ certificatesDir: server2 }));
  await roundTrip(t, old, 128 * 1024, 5);
  const stale = await s.connect();
  await t.throwsAsync(stale.starttls(trustCa()), { message: /unable to get local issuer|self[- ]signed|unable to verify/i });
  const fresh = await s.connect();
  const sock = await fresh.starttls({ ca: fs.readFileSync(ca2.cert), servername: 'localhost' });
  t.is(sock.getPeerCertificate().issuer?.CN, 'rotated CA');
  t.deepEqual(types(await fresh.go('disk')), [REP.INFO, REP.ACK]);
});

test('failures are per connection: while one client stalls in its TLS handshake and others fail theirs, another attaches and works', async (t) => {
  // Long enough that the other clients are done first even on a loaded machine.
  const s = await start(t, { tls: new NbdTls('require', x509(true)), handshakeTimeoutMs: 4000 });
  const stalled = await s.connect();
  t.is((await stalled.option(OPT.STARTTLS))[0]!.type, REP.ACK);
  const failures = await Promise.all([foreign, selfSigned].map(async (dir) => {
    const c = await s.connect();
    try { await c.starttls(withCert(dir)); c.write(V.optionFrame(OPT.LIST)); } catch { /* refused */ }
    return c.waitEof();
  }));
  t.deepEqual(failures, [true, true]);
  const good = await s.connect();
  await good.starttls(withCert(alice));
  t.deepEqual(types(await good.go('disk')), [REP.INFO, REP.ACK]);
  await roundTrip(t, good, 2 * 1024 * 1024, 4);
  t.false(stalled.eof, 'the stalled client is still waiting on its own timeout');
  t.true(await stalled.waitEof(8000));
});

// ================================================================== authorization through the session

test('--authz through the session: LIST shows an identity its own exports; another tenant\'s is refused at INFO/GO like a missing one, EXPORT_NAME closes; "" is its only export', async (t) => {
  const provider = new CountingExports(['tenant-a-db', 'tenant-a-web@monday', 'tenant-b-db', 'shared']);
  const policy = AuthzPolicy.parse('# who may attach what\nalice tenant-a-* shared\nbob tenant-b-*\n', 'authz');
  const nbdTls = new NbdTls('require', psk({ alice: KEY_A, bob: KEY_B }));
  const s = await start(t, { tls: nbdTls, exportsFor: authorizedExports(provider, () => policy) }, provider);

  const a = await s.connect();
  await a.starttls(withPsk('alice', KEY_A));
  const list = await a.option(OPT.LIST);
  const names = list.filter((r) => r.type === REP.SERVER).map((r) => r.data.subarray(4, 4 + r.data.readUInt32BE(0)).toString());
  t.deepEqual(names.sort(), ['shared', 'tenant-a-db', 'tenant-a-web@monday']);
  const forbidden = await a.option(OPT.INFO, V.infoData('tenant-b-db', []));
  const missing = await a.option(OPT.INFO, V.infoData('tenant-a-nope', []));
  t.deepEqual(types(forbidden), [REP.ERR_UNKNOWN]);
  t.deepEqual(types(missing), [REP.ERR_UNKNOWN]);
  t.is(forbidden[0]!.data.toString(), 'no export "tenant-b-db"');
  t.is(missing[0]!.data.toString(), 'no export "tenant-a-nope"', 'a missing export reads the same');
  t.deepEqual(types(await a.go('tenant-b-db')), [REP.ERR_UNKNOWN]);
  const opensBefore = provider.opens;
  t.deepEqual(types(await a.go('tenant-a-web@monday')), [REP.INFO, REP.ACK]);
  t.is(provider.opens, opensBefore + 1, 'the forbidden GO opened nothing');

  const b = await s.connect();
  await b.starttls(withPsk('bob', KEY_B));
  t.deepEqual(types(await b.go('')), [REP.INFO, REP.ACK], '"" is bob\'s only export');
  t.truthy(s.lines.find((l) => l.msg === 'GO refused' && l['identity'] === 'psk:alice' && l['export'] === 'tenant-b-db'));

  const c = await s.connect();
  await c.starttls(withPsk('bob', KEY_B));
  c.write(V.optionFrame(OPT.EXPORT_NAME, Buffer.from('tenant-a-db')));
  t.true(await c.waitEof());
  t.truthy(s.lines.find((l) => l.msg === 'EXPORT_NAME refused' && l['identity'] === 'psk:bob'));
});

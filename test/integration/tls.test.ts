/**
 * TLS and authorization with the real Debian clients against a real `baton serve`:
 * nbdinfo/nbdcopy (libnbd: nbds+unix:// URIs with tls-certificates= / tls-psk-file=, the PSK
 * username in the URI's user part), qemu-img/qemu-io (--object tls-creds-x509 / tls-creds-psk),
 * libnbd's Python binding (a client that stays attached across a SIGHUP), nbd-client over TCP
 * (-cacertfile -certfile -keyfile -tlshostname; negotiation only: no kernel nbd module here),
 * and nbdkit --tls as the reference server for the certificate layout. Every refusal has its
 * own test: a certificate from another CA, a self-signed one, a revoked one, a wrong PSK, an
 * unknown PSK identity, a client that skips STARTTLS, another tenant's export.
 *
 * Certificates are made at run time (test/helpers/tls-pki.ts; the README's certtool recipe
 * in its own test). Servers listen on Unix sockets, or on 127.0.0.1 for nbd-client.
 */

import test, { type ExecutionContext } from 'ava';
import { spawn, spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as os from 'node:os';
import * as path from 'node:path';
import { run, sha256, type RunResult } from '../helpers/ext4.js';
import { BATON_BIN, REPO_ROOT, baton, has, startBatonServer, tempDir, waitForSocket, type BatonServer, type StartOptions, type Teardown } from '../helpers/server.js';
import { makeCa, makeClientDir, makePskFile, makeServerDir, revoke } from '../helpers/tls-pki.js';

const MiB = 1024 * 1024;

// ------------------------------------------------------------------ certificates and keys, made once for the file

const PKI = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-tls-it-'));
process.on('exit', () => fs.rmSync(PKI, { recursive: true, force: true }));
const haveOpenssl = has('openssl');
const pki = haveOpenssl ? (() => {
  const ca = makeCa(path.join(PKI, 'ca'));
  const server = makeServerDir(ca, path.join(PKI, 'server'));
  const alice = makeClientDir(ca, ca, path.join(PKI, 'alice'), 'alice');
  const bob = makeClientDir(ca, ca, path.join(PKI, 'bob'), 'bob');
  const carol = makeClientDir(ca, ca, path.join(PKI, 'carol'), 'carol');
  const otherCa = makeCa(path.join(PKI, 'other-ca'), 'another CA');
  const foreign = makeClientDir(otherCa, ca, path.join(PKI, 'foreign'), 'alice');
  const selfSigned = makeClientDir(null, ca, path.join(PKI, 'self-signed'), 'alice');
  // The same server certificates plus a CRL revoking carol's certificate.
  const serverCrl = path.join(PKI, 'server-crl');
  fs.cpSync(server, serverCrl, { recursive: true });
  revoke(ca, path.join(carol, 'client-cert.pem'), path.join(serverCrl, 'ca-crl.pem'));
  // qemu's tls-creds-psk reads DIR/keys.psk; libnbd reads the file named in the URI.
  const pskDir = path.join(PKI, 'psk');
  fs.mkdirSync(pskDir);
  const keys = makePskFile(path.join(pskDir, 'keys.psk'), ['alice', 'bob']);
  const wrongDir = path.join(PKI, 'psk-wrong');
  fs.mkdirSync(wrongDir);
  makePskFile(path.join(wrongDir, 'keys.psk'), ['alice', 'mallory']);
  return { ca, server, serverCrl, alice, bob, carol, foreign, selfSigned, pskDir, pskFile: path.join(pskDir, 'keys.psk'), keys, wrongDir, wrongPskFile: path.join(wrongDir, 'keys.psk') };
})() : null;
const PKI_OK = pki!;

// ------------------------------------------------------------------ test plumbing

/** At most two of this file's tests at once: each drives a server and CPU-heavy TLS clients on a 2-core machine. */
let slots = 2;
const queue: (() => void)[] = [];
async function limited<T>(fn: () => Promise<T>): Promise<T> {
  while (slots === 0) await new Promise<void>((r) => queue.push(r));
  slots--;
  try { return await fn(); } finally { slots++; queue.shift()?.(); }
}

type Body = (t: ExecutionContext) => Promise<void>;
function needs(...tools: string[]): (title: string, body: Body) => void {
  const ok = haveOpenssl && tools.every((tool) => has(tool));
  return (title, body) => {
    if (ok) test(title, (t) => limited(() => body(t)));
    else test.skip(title, () => {});
  };
}

function check(t: ExecutionContext, r: RunResult, what: string): void {
  t.is(r.code, 0, `${what}\n${r.output}`);
}

interface LogLine { level: number; msg: string; conn?: number; [k: string]: unknown }
function logLines(s: string): LogLine[] {
  return s.split('\n').filter((l) => l.startsWith('{')).map((l) => JSON.parse(l) as LogLine);
}
const established = (s: string): LogLine[] => logLines(s).filter((l) => l.msg === 'TLS session established');
const refused = (s: string): LogLine[] => logLines(s).filter((l) => l.msg === 'TLS handshake refused; closing connection');

/** The server's "listening" line (its socket may accept a moment before the line reaches us). */
async function listeningLine(s: BatonServer): Promise<LogLine | undefined> {
  for (let i = 0; i < 100; i++) {
    const l = logLines(s.stderr()).find((x) => x.msg === 'listening');
    if (l) return l;
    await new Promise((r) => setTimeout(r, 50));
  }
  return undefined;
}

/** No error-level line, and no connection logged as refused twice. */
function assertCleanLog(t: ExecutionContext, log: string): void {
  const lines = logLines(log);
  t.falsy(lines.find((l) => l.level >= 50), `error-level log line:\n${log}`);
  const perConn = new Map<unknown, number>();
  for (const l of refused(log)) perConn.set(l.conn, (perConn.get(l.conn) ?? 0) + 1);
  t.true([...perConn.values()].every((n) => n === 1), 'each refused connection is logged once');
}

const x509Args = (dir = PKI_OK.server, verify = false): string[] => ['--tls', 'require', '--tls-certificates', dir, ...(verify ? ['--tls-verify-peer'] : [])];
const pskArgs = (file = PKI_OK.pskFile): string[] => ['--tls', 'require', '--tls-psk', file];

function startTls(t: ExecutionContext, args: string[], opts: StartOptions = {}): Promise<BatonServer> {
  return startBatonServer(t, { volumes: [{ name: 'vol', size: 64 * MiB }], logLevel: 'info', ...opts, extraArgs: [...args, ...(opts.extraArgs ?? [])] });
}

/** libnbd URIs: certificates, or a PSK file with the username in the URI's user part (libnbd 1.14 has no tls-username=). */
const certUri = (s: BatonServer, name: string, dir: string): string => `nbds+unix:///${name}?socket=${s.socket}&tls-certificates=${dir}`;
const pskUri = (s: BatonServer, name: string, user: string, file = PKI_OK.pskFile): string => `nbds+unix://${user}@/${name}?socket=${s.socket}&tls-psk-file=${file}`;

/** qemu's --object and --image-opts for an NBD export over TLS on a Unix socket. */
function qemuTls(s: BatonServer, name: string, creds: { x509: string } | { pskDir: string; user: string }): string[] {
  const obj = 'x509' in creds
    ? `tls-creds-x509,id=tls0,endpoint=client,dir=${creds.x509}`
    : `tls-creds-psk,id=tls0,endpoint=client,dir=${creds.pskDir},username=${creds.user}`;
  // Over a Unix socket qemu has no host name to check the server's certificate against: give it one.
  return ['--object', obj, '--image-opts', `driver=nbd,path=${s.socket},export=${name},tls-creds=tls0${'x509' in creds ? ',tls-hostname=localhost' : ''}`];
}

function qemuIo(args: string[], cmds: string[]): Promise<RunResult> {
  return run('qemu-io', [...args, ...cmds.flatMap((c) => ['-c', c])], { timeoutMs: 60_000 });
}

async function randomFile(dir: string, size: number): Promise<{ file: string; hash: string }> {
  const data = randomBytes(size);
  const file = path.join(dir, `in-${randomBytes(4).toString('hex')}.bin`);
  await fsp.writeFile(file, data);
  return { file, hash: sha256(data) };
}

// ================================================================== x509

for (const store of [undefined, 'ram:'] as const) needs('nbdinfo', 'nbdcopy')(`x509: nbdinfo --json says TLS; nbdcopy 32 MiB in and back out over 4 TLS connections, same bytes${store ? ` (${store})` : ''}`, async (t) => {
  const s = await startTls(t, x509Args(), { ...(store ? { store } : {}) });
  const listening = await listeningLine(s);
  t.is(listening?.['tls'], 'require');
  t.is(listening?.['authz'], 'none: every client may attach every export', 'the start-up line says who may attach what');
  t.regex(String(listening?.['uri']), /^nbds\+unix:/);
  const info = await run('nbdinfo', ['--json', certUri(s, 'vol', PKI_OK.alice)]);
  check(t, info, 'nbdinfo');
  const j = JSON.parse(info.stdout) as { TLS: boolean; exports: { 'export-size': number }[] };
  t.true(j.TLS);
  t.is(j.exports[0]!['export-size'], 64 * MiB);

  const dir = tempDir(t);
  const src = await randomFile(dir, 32 * MiB);
  const before = established(s.stderr()).length;
  check(t, await run('nbdcopy', ['--flush', '-C', '4', '-T', '4', src.file, certUri(s, 'vol', PKI_OK.alice)], { timeoutMs: 120_000 }), 'nbdcopy in');
  t.is(established(s.stderr()).length - before, 4, 'one TLS session per connection');
  const out = path.join(dir, 'out.bin');
  check(t, await run('nbdcopy', [certUri(s, 'vol', PKI_OK.alice), out], { timeoutMs: 120_000 }), 'nbdcopy out');
  const back = await fsp.readFile(out);
  t.is(sha256(back.subarray(0, 32 * MiB)), src.hash);
  for (const l of established(s.stderr())) {
    t.is(l['protocol'], 'TLSv1.3');
    t.is(l['identity'], 'anonymous', 'no client certificate asked for without --tls-verify-peer');
  }
  assertCleanLog(t, s.stderr());
});

needs('qemu-io', 'qemu-img')('--tls-verify-peer: qemu-io and qemu-img with tls-creds-x509 write, read back and compare; the identity is the certificate CN', async (t) => {
  const s = await startTls(t, x509Args(PKI_OK.server, true));
  const q = qemuTls(s, 'vol', { x509: PKI_OK.alice });
  const w = await qemuIo(q, ['write -P 0x5a 0 4M', 'write -P 0x33 5M 1M', 'flush', 'read -P 0x5a 0 4M', 'read -P 0x33 5M 1M', 'read -P 0 4M 1M']);
  t.is(w.code, 0, w.output);
  t.notRegex(w.stdout + w.stderr, /failed|error/i, w.output);
  const info = await run('qemu-img', ['info', '--output=json', ...q]);
  check(t, info, 'qemu-img info');
  t.is((JSON.parse(info.stdout) as { 'virtual-size': number })['virtual-size'], 64 * MiB);
  const dir = tempDir(t);
  const img = path.join(dir, 'copy.raw');
  check(t, await run('qemu-img', ['convert', '-O', 'raw', ...q, img], { timeoutMs: 120_000 }), 'qemu-img convert out');
  const buf = await fsp.readFile(img);
  t.true(buf.subarray(0, 4 * MiB).equals(Buffer.alloc(4 * MiB, 0x5a)));
  t.true(buf.subarray(5 * MiB, 6 * MiB).equals(Buffer.alloc(MiB, 0x33)));
  const ids = new Set(established(s.stderr()).map((l) => l['identity']));
  t.deepEqual([...ids], ['x509:alice']);
  assertCleanLog(t, s.stderr());
});

// ================================================================== PSK

needs('nbdinfo', 'nbdcopy', 'qemu-io')('PSK: nbdinfo and nbdcopy with tls-psk-file, qemu-io with tls-creds-psk; TLS 1.3 with AES-128-GCM; identities logged', async (t) => {
  const s = await startTls(t, pskArgs());
  const info = await run('nbdinfo', ['--json', pskUri(s, 'vol', 'alice')]);
  check(t, info, 'nbdinfo');
  t.true((JSON.parse(info.stdout) as { TLS: boolean }).TLS);
  const dir = tempDir(t);
  const src = await randomFile(dir, 16 * MiB);
  check(t, await run('nbdcopy', ['--flush', src.file, pskUri(s, 'vol', 'alice')], { timeoutMs: 120_000 }), 'nbdcopy in');
  const out = path.join(dir, 'out.bin');
  check(t, await run('nbdcopy', [pskUri(s, 'vol', 'bob'), out], { timeoutMs: 120_000 }), 'nbdcopy out');
  t.is(sha256((await fsp.readFile(out)).subarray(0, 16 * MiB)), src.hash);
  const q = await qemuIo(qemuTls(s, 'vol', { pskDir: PKI_OK.pskDir, user: 'bob' }), ['read -P 0 16M 1M', 'write -P 0x77 20M 64k', 'read -P 0x77 20M 64k']);
  t.is(q.code, 0, q.output);
  t.notRegex(q.stdout + q.stderr, /failed|error/i, q.output);
  const est = established(s.stderr());
  t.deepEqual([...new Set(est.map((l) => l['identity']))].sort(), ['psk:alice', 'psk:bob']);
  t.true(est.every((l) => l['protocol'] === 'TLSv1.3' && l['cipher'] === 'TLS_AES_128_GCM_SHA256'), JSON.stringify(est));
  assertCleanLog(t, s.stderr());
});

needs('nbdinfo', 'qemu-io')('--tls on: a plaintext client and a TLS client are both served (and only the TLS one logs a session)', async (t) => {
  const s = await startTls(t, ['--tls', 'on', '--tls-certificates', PKI_OK.server]);
  const plain = await run('nbdinfo', ['--json', `nbd+unix:///vol?socket=${s.socket}`]);
  check(t, plain, 'plaintext nbdinfo');
  t.false((JSON.parse(plain.stdout) as { TLS: boolean }).TLS);
  t.is(established(s.stderr()).length, 0, 'the plaintext client made no TLS session');
  const q = await qemuIo(qemuTls(s, 'vol', { x509: PKI_OK.alice }), ['write -P 0x21 0 64k', 'read -P 0x21 0 64k']);
  t.is(q.code, 0, q.output);
  t.is(established(s.stderr()).length, 1);
  const enc = await run('nbdinfo', ['--json', certUri(s, 'vol', PKI_OK.alice)]);
  check(t, enc, 'nbdinfo over TLS');
  t.true((JSON.parse(enc.stdout) as { TLS: boolean }).TLS);
  t.true(established(s.stderr()).length >= 2);
  assertCleanLog(t, s.stderr());
});

// ================================================================== nbd-client (negotiation only here)

interface TcpServer { port: number; log(): string; stop(): Promise<number | null> }

async function startTcpServer(t: Teardown, store: string, args: string[]): Promise<TcpServer> {
  const proc = spawn(process.execPath, [BATON_BIN, 'serve', '--listen', '127.0.0.1:0', '--store', store, '--log-level', 'info', ...args], { stdio: ['ignore', 'ignore', 'pipe'] });
  let err = '';
  const exited = new Promise<number | null>((resolve) => proc.once('exit', (code) => resolve(code)));
  t.teardown(async () => {
    if (proc.exitCode === null && proc.signalCode === null) proc.kill('SIGKILL');
    await exited;
  });
  const port = await new Promise<number>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no "listening" line: ${err}`)), 15_000);
    proc.stderr!.on('data', (d: Buffer) => {
      err += d.toString();
      const m = /"address":\{"host":"127\.0\.0\.1","port":(\d+)\}/.exec(err);
      if (m) { clearTimeout(timer); resolve(Number(m[1])); }
    });
    void exited.then(() => { clearTimeout(timer); reject(new Error(`baton serve exited: ${err}`)); });
  });
  return { port, log: () => err, stop: async () => { proc.kill('SIGTERM'); return exited; } };
}

/** Debian's nbd-client 3.24 takes only the long forms (its -F/-K/-A short options are rejected). */
const nbdClientTls = (dir: string): string[] => ['-cacertfile', path.join(dir, 'ca-cert.pem'), '-certfile', path.join(dir, 'client-cert.pem'), '-keyfile', path.join(dir, 'client-key.pem'), '-tlshostname', 'localhost'];
const kernelNbd = fs.existsSync('/sys/module/nbd') || fs.existsSync('/dev/nbd0');

(kernelNbd ? (title: string) => test.skip(title, () => {}) : needs('nbd-client', 'nbdinfo'))('nbd-client with certificates: lists over TLS, completes GO (no kernel module here); without them it is refused with the server\'s message; the server stays healthy', async (t) => {
  const dir = tempDir(t);
  const store = `file:${path.join(dir, 'store')}`;
  for (const [name, size] of [['vol', '64M'], ['other', '1M']] as const) t.is(baton(['create', name, '--size', size, '--store', store]).status, 0);
  const s = await startTcpServer(t, store, x509Args(PKI_OK.server, true));
  const port = String(s.port);

  const list = await run('nbd-client', ['-l', '127.0.0.1', port, ...nbdClientTls(PKI_OK.alice)], { timeoutMs: 20_000 });
  t.is(list.code, 0, list.output);
  t.regex(list.stdout + list.stderr, /^vol: baton volume vol/m, list.output);
  t.regex(list.stdout + list.stderr, /^other: baton volume other/m, list.output);

  const go = await run('nbd-client', ['127.0.0.1', port, '/dev/nbd0', '-N', 'vol', ...nbdClientTls(PKI_OK.alice)], { timeoutMs: 20_000 });
  t.not(go.code, 0, `no nbd module: ${go.output}`);
  t.regex(go.stdout + go.stderr, /size = 64MB/, 'nbd-client completed GO over TLS and learned the size');

  const plain = await run('nbd-client', ['127.0.0.1', port, '/dev/nbd0', '-N', 'vol'], { timeoutMs: 20_000 });
  t.not(plain.code, 0);
  t.regex(plain.stdout + plain.stderr, /requires TLS/, plain.output);
  t.notRegex(plain.stdout + plain.stderr, /size = /);

  const foreign = await run('nbd-client', ['127.0.0.1', port, '/dev/nbd0', '-N', 'vol', ...nbdClientTls(PKI_OK.foreign)], { timeoutMs: 20_000 });
  t.not(foreign.code, 0);
  t.notRegex(foreign.stdout + foreign.stderr, /size = /, foreign.output);

  await new Promise((r) => setTimeout(r, 300));
  const ids = established(s.log()).map((l) => l['identity']);
  t.true(ids.length >= 2 && ids.every((i) => i === 'x509:alice'), JSON.stringify(ids));
  t.is(refused(s.log()).length, 1, s.log());
  t.regex(String(refused(s.log())[0]!['peer']), /^127\.0\.0\.1:\d+$/, 'the refusal names the peer address');
  const info = await run('nbdinfo', ['--size', `nbds://127.0.0.1:${port}/vol?tls-certificates=${PKI_OK.alice}`]);
  check(t, info, 'nbdinfo after the refused clients');
  t.is(info.stdout.trim(), String(64 * MiB));
  assertCleanLog(t, s.log());
  t.is(await s.stop(), 0, 'graceful stop');
});

// ================================================================== refusals

needs('nbdinfo', 'qemu-img')('refused: a certificate from another CA, a self-signed one, a revoked one, no certificate, a client that skips STARTTLS; each logged once with peer and identity; a good client still works', async (t) => {
  const s = await startTls(t, x509Args(PKI_OK.serverCrl, true));
  // GnuTLS (libnbd) sends its certificate only if a CA the server names issued it: one from
  // another CA, or a self-signed one, never reaches the server, which refuses the client for
  // having none. A revoked one is sent and refused for what it is.
  const none = /client certificate refused: the client sent none/;
  const cases: [string, string, RegExp, string | null][] = [
    ['another CA', certUri(s, 'vol', PKI_OK.foreign), none, null],
    ['self-signed', certUri(s, 'vol', PKI_OK.selfSigned), none, null],
    ['revoked', certUri(s, 'vol', PKI_OK.carol), /client certificate refused: CERT_REVOKED/, 'x509:carol'],
    ['no certificate', `nbds+unix:///vol?socket=${s.socket}&tls-certificates=${path.join(PKI, 'ca')}`, none, null],
  ];
  for (const [what, uri, reason, identity] of cases) {
    const before = refused(s.stderr()).length;
    const r = await run('nbdinfo', ['--size', uri]);
    t.not(r.code, 0, `${what}: ${r.output}`);
    t.notRegex(r.stdout, /67108864/, what);
    await new Promise((res) => setTimeout(res, 200));
    const lines = refused(s.stderr()).slice(before);
    t.is(lines.length, 1, `${what}: one log line\n${s.stderr()}`);
    t.is(lines[0]!['peer'], 'unix');
    t.regex(String(lines[0]!['err']), reason, what);
    t.is(lines[0]!['identity'], identity ?? 'unknown', what);
  }
  // No STARTTLS at all: libnbd and qemu both give up on ERR_TLS_REQD.
  const plain = await run('nbdinfo', ['--size', `nbd+unix:///vol?socket=${s.socket}`]);
  t.not(plain.code, 0, plain.output);
  const q = await run('qemu-img', ['info', `nbd+unix:///vol?socket=${s.socket}`]);
  t.not(q.code, 0, q.output);
  t.regex(q.output, /TLS|requires/i, q.output);
  // The server never opened the volume for any of them, and serves a good client.
  t.falsy(logLines(s.stderr()).find((l) => l.msg === 'volume opened'));
  const ok = await run('nbdinfo', ['--size', certUri(s, 'vol', PKI_OK.alice)]);
  check(t, ok, 'nbdinfo with a good certificate');
  t.is(ok.stdout.trim(), String(64 * MiB));
  assertCleanLog(t, s.stderr());
});

needs('nbdinfo', 'qemu-img')('refused: a wrong PSK and an unknown PSK identity (nbdinfo and qemu-img); logged once each with the identity', async (t) => {
  const s = await startTls(t, pskArgs());
  for (const [user, client] of [['alice', 'nbdinfo'], ['mallory', 'nbdinfo'], ['alice', 'qemu-img']] as const) {
    const before = refused(s.stderr()).length;
    const r = client === 'nbdinfo'
      ? await run('nbdinfo', ['--size', pskUri(s, 'vol', user, PKI_OK.wrongPskFile)])
      : await run('qemu-img', ['info', ...qemuTls(s, 'vol', { pskDir: PKI_OK.wrongDir, user })]);
    t.not(r.code, 0, r.output);
    await new Promise((res) => setTimeout(res, 200));
    const lines = refused(s.stderr()).slice(before);
    t.is(lines.length, 1, s.stderr());
    t.is(lines[0]!['identity'], `psk:${user}`);
    t.regex(String(lines[0]!['err']), user === 'mallory' ? /unknown PSK identity/ : /wrong PSK/);
  }
  check(t, await run('nbdinfo', ['--size', pskUri(s, 'vol', 'alice')]), 'the right key still gets in');
  assertCleanLog(t, s.stderr());
});

// ================================================================== authorization

const TENANT_VOLUMES = [{ name: 'tenant-a-db', size: 8 * MiB }, { name: 'tenant-a-web', size: 8 * MiB }, { name: 'tenant-b-db', size: 8 * MiB }, { name: 'shared', size: 8 * MiB }];
const AUTHZ = '# tenants\nalice tenant-a-* shared\nbob   tenant-b-*\n';

async function listNames(uri: string): Promise<string[]> {
  const r = await run('nbdinfo', ['--list', '--json', uri]);
  if (r.code !== 0) throw new Error(`nbdinfo --list: ${r.output}`);
  return (JSON.parse(r.stdout) as { exports: { 'export-name': string }[] }).exports.map((e) => e['export-name']).sort();
}

needs('nbdinfo', 'qemu-io', 'qemu-img')('--authz (PSK): nbdinfo --list shows each identity its own exports; another tenant\'s export is refused like a missing one; snapshots follow their own names', async (t) => {
  const dir = tempDir(t);
  const authz = path.join(dir, 'authz');
  fs.writeFileSync(authz, AUTHZ);
  const s = await startTls(t, [...pskArgs(), '--authz', authz], { volumes: TENANT_VOLUMES });
  t.is(baton(['snapshot', 'tenant-a-db', 'monday', '--store', s.store]).status, 0);
  t.is(baton(['snapshot', 'shared', 'monday', '--store', s.store]).status, 0);
  t.regex(String((await listeningLine(s))?.['authz']), /authz \(2 identities\)$/);

  t.deepEqual(await listNames(pskUri(s, '', 'alice')), ['shared', 'tenant-a-db', 'tenant-a-db@monday', 'tenant-a-web']);
  t.deepEqual(await listNames(pskUri(s, '', 'bob')), ['tenant-b-db']);

  // alice and another tenant's export: the same refusal as an export that does not exist.
  const forbidden = await run('nbdinfo', ['--size', pskUri(s, 'tenant-b-db', 'alice')]);
  const missing = await run('nbdinfo', ['--size', pskUri(s, 'tenant-b-xx', 'alice')]);
  t.not(forbidden.code, 0);
  t.is(forbidden.code, missing.code);
  const norm = (r: RunResult, name: string): string => r.stderr.split(name).join('NAME').split(s.socket).join('SOCK');
  t.is(norm(forbidden, 'tenant-b-db'), norm(missing, 'tenant-b-xx'), `${forbidden.stderr}\n${missing.stderr}`);
  // libnbd prints its own words; the server's reply text is in its log line.
  t.truthy(logLines(s.stderr()).find((l) => l.msg === 'GO refused' && l['identity'] === 'psk:alice' && l['err'] === 'no export "tenant-b-db"'), s.stderr());
  // shared@monday is not covered by "shared" (snapshots go by their own names).
  t.not((await run('nbdinfo', ['--size', pskUri(s, 'shared@monday', 'alice')])).code, 0);
  const q = await run('qemu-img', ['info', ...qemuTls(s, 'tenant-a-db', { pskDir: PKI_OK.pskDir, user: 'bob' })]);
  t.not(q.code, 0, q.output);
  const opened = (): unknown[] => logLines(s.stderr()).filter((l) => l.msg === 'volume opened').map((l) => l['volume']);
  t.deepEqual(opened(), [], 'no refused attach opened its volume (LIST and INFO open nothing either)');

  // Each can write its own.
  const w = await qemuIo(qemuTls(s, 'tenant-b-db', { pskDir: PKI_OK.pskDir, user: 'bob' }), ['write -P 0x42 0 64k', 'read -P 0x42 0 64k']);
  t.is(w.code, 0, w.output);
  check(t, await run('nbdinfo', ['--size', pskUri(s, 'tenant-a-db@monday', 'alice')]), 'alice and her snapshot');
  const lines = logLines(s.stderr()).filter((l) => l.msg === 'GO refused' || l.msg === 'INFO refused');
  t.truthy(lines.find((l) => l['identity'] === 'psk:alice' && l['export'] === 'tenant-b-db'), s.stderr());
  t.truthy(lines.find((l) => l['identity'] === 'psk:bob' && l['export'] === 'tenant-a-db'), s.stderr());
  t.deepEqual(opened().sort(), ['tenant-a-db@monday', 'tenant-b-db']);
  assertCleanLog(t, s.stderr());
});

needs('nbdinfo')('--authz (certificates): the verified certificate\'s CN picks the line', async (t) => {
  const dir = tempDir(t);
  const authz = path.join(dir, 'authz');
  fs.writeFileSync(authz, AUTHZ);
  const s = await startTls(t, [...x509Args(PKI_OK.server, true), '--authz', authz], { volumes: TENANT_VOLUMES });
  const v = await startTls(t, x509Args(PKI_OK.server, true));
  t.is((await listeningLine(v))?.['authz'], 'none: every client that completes the TLS handshake may attach every export');
  t.deepEqual(await listNames(certUri(s, '', PKI_OK.alice)), ['shared', 'tenant-a-db', 'tenant-a-web']);
  t.deepEqual(await listNames(certUri(s, '', PKI_OK.bob)), ['tenant-b-db']);
  t.deepEqual(await listNames(certUri(s, '', PKI_OK.carol)), [], 'carol is in no line: she sees nothing');
  t.not((await run('nbdinfo', ['--size', certUri(s, 'tenant-a-db', PKI_OK.bob)])).code, 0);
  check(t, await run('nbdinfo', ['--size', certUri(s, '', PKI_OK.bob)]), 'bob\'s only export is his default');
});

// ================================================================== SIGHUP

/** libnbd's Python binding: the system python3 (a pyenv one on PATH may lack it). */
const PY = fs.existsSync('/usr/bin/python3') && spawnSync('/usr/bin/python3', ['-c', 'import nbd'], { cwd: '/' }).status === 0 ? '/usr/bin/python3' : null;

(PY ? needs('nbdinfo') : (title: string) => test.skip(title, () => {}))('SIGHUP re-reads the PSK file and the authz file: an attached client keeps its session; the old key stops working, the new one works; a bad file changes nothing', async (t) => {
  const dir = tempDir(t);
  const keys = path.join(dir, 'keys.psk');
  const authz = path.join(dir, 'authz');
  const k1 = makePskFile(keys, ['alice', 'bob']);
  fs.writeFileSync(authz, AUTHZ);
  const s = await startTls(t, [...pskArgs(keys), '--authz', authz], { volumes: TENANT_VOLUMES });
  const oldKeys = path.join(dir, 'old.psk');
  fs.copyFileSync(keys, oldKeys);

  // A client that attaches, writes, then waits on stdin with its TLS session open.
  const script = [
    'import nbd, sys',
    'h = nbd.NBD()',
    'h.set_uri_allow_local_file(True)',
    `h.connect_uri(${JSON.stringify(pskUri(s, 'tenant-a-db', 'alice', oldKeys))})`,
    "h.pwrite(b'\\x11' * 65536, 0)",
    "print('attached', flush=True)",
    'sys.stdin.readline()',
    "h.pwrite(b'\\x22' * 65536, 65536)",
    "assert h.pread(65536, 0) == b'\\x11' * 65536",
    "assert h.pread(65536, 65536) == b'\\x22' * 65536",
    'h.flush()',
    "print('still works', flush=True)",
    'h.shutdown()',
  ].join('\n');
  const py = spawn(PY!, ['-c', script], { cwd: '/', stdio: ['pipe', 'pipe', 'pipe'] });
  let pyOut = '';
  py.stdout.on('data', (d: Buffer) => { pyOut += d.toString(); });
  py.stderr.on('data', (d: Buffer) => { pyOut += d.toString(); });
  const pyExit = new Promise<number | null>((r) => py.once('exit', (c) => r(c)));
  t.teardown(() => { if (py.exitCode === null) py.kill('SIGKILL'); });
  for (let i = 0; i < 200 && !pyOut.includes('attached'); i++) await new Promise((r) => setTimeout(r, 50));
  t.regex(pyOut, /attached/);

  // Rotate alice's key and give her tenant-b-* too; then SIGHUP.
  const k2 = makePskFile(keys, ['alice', 'bob'], { bob: k1['bob']! });
  t.not(k1['alice'], k2['alice']);
  fs.writeFileSync(authz, 'alice tenant-a-* tenant-b-*\nbob tenant-b-*\n');
  s.proc.kill('SIGHUP');
  for (let i = 0; i < 100 && !/SIGHUP: reloaded/.test(s.stderr()); i++) await new Promise((r) => setTimeout(r, 50));
  t.regex(s.stderr(), /SIGHUP: reloaded TLS credentials and authorization/);

  py.stdin.write('\n');
  t.is(await pyExit, 0, pyOut);
  t.regex(pyOut, /still works/, 'the attached client kept its TLS session through the rotation');

  t.not((await run('nbdinfo', ['--size', pskUri(s, 'tenant-a-db', 'alice', oldKeys)])).code, 0, 'the old key no longer gets in');
  t.deepEqual(await listNames(pskUri(s, '', 'alice', keys)), ['tenant-a-db', 'tenant-a-web', 'tenant-b-db'], 'the new key and the new authz (tenant-b-* added, shared gone)');

  // A broken file on SIGHUP: logged, nothing changes.
  fs.writeFileSync(keys, 'alice:nothex\n');
  s.proc.kill('SIGHUP');
  for (let i = 0; i < 100 && !/SIGHUP: reload failed/.test(s.stderr()); i++) await new Promise((r) => setTimeout(r, 50));
  const failed = logLines(s.stderr()).find((l) => l.msg === 'SIGHUP: reload failed; still using the previous TLS credentials and authorization');
  t.is(failed?.['err'], `${keys}:1: the key of "alice" is not hexadecimal bytes (psktool writes 64 hex digits)`);
  makePskFile(oldKeys, ['alice', 'bob'], k2);
  check(t, await run('nbdinfo', ['--size', pskUri(s, 'tenant-a-db', 'alice', oldKeys)]), 'the key loaded before the broken file still works');
});

// ================================================================== start-up checks

needs()('serve refuses, before touching the store: a network address without --tls require, bad PSK and authz files (naming file and line), TLS flags without --tls', async (t) => {
  const dir = tempDir(t);
  const store = `file:${path.join(dir, 'nope', 'store')}`;
  const bad = (args: string[], re: RegExp): void => {
    const r = baton(['serve', '--store', store, ...args]);
    t.is(r.status, 2, `${args.join(' ')}\n${r.stderr}`);
    t.regex(r.stderr, re, args.join(' '));
  };
  bad(['--listen', '0.0.0.0:10809'], /refusing to listen on 0\.0\.0\.0 without --tls require.*--insecure/);
  bad(['--listen', '0.0.0.0:10809', '--tls', 'on', '--tls-psk', PKI_OK.pskFile], /without --tls require/);
  const psk = path.join(dir, 'keys.psk');
  fs.writeFileSync(psk, 'alice:00ff\nbob:xyz\n');
  bad(['--tls', 'require', '--tls-psk', psk], new RegExp(`${psk.replace(/[.]/g, '\\.')}:2: the key of "bob" is not hexadecimal`));
  const authz = path.join(dir, 'authz');
  fs.writeFileSync(authz, 'alice tenant-a-*\n\nbob ten*ant\n');
  bad(['--tls', 'require', '--tls-psk', PKI_OK.pskFile, '--authz', authz], new RegExp(`${authz}:3: "ten\\*ant" is not an export pattern`));
  bad(['--tls-psk', PKI_OK.pskFile], /--tls-psk needs TLS: add --tls require/);
  bad(['--tls', 'require'], /--tls require needs credentials/);
  bad(['--tls', 'on', '--tls-psk', PKI_OK.pskFile, '--authz', authz], /use --tls require/);
  bad(['--tls', 'require', '--tls-certificates', path.join(dir, 'missing')], /cannot read server-cert\.pem/);
  t.false(fs.existsSync(path.join(dir, 'nope')), 'the store was never touched');
});

// ================================================================== the README recipe, and nbdkit on the same files

/** The README's "Making certificates" bash block, run as written (SERVER_NAME=localhost). */
function readmeRecipe(): string {
  const md = fs.readFileSync(path.join(REPO_ROOT, 'README.md'), 'utf8');
  const blocks = [...md.matchAll(/```bash\n([\s\S]*?)```/g)].map((m) => m[1]!);
  const b = blocks.find((x) => x.includes('certtool --generate-self-signed'));
  if (!b) throw new Error('README.md has no bash block with the certtool recipe');
  return b;
}

needs('certtool', 'psktool', 'nbdinfo', 'nbdkit')('the README recipe (certtool, psktool) makes files baton and nbdkit --tls both serve, for nbdinfo with a client certificate and with a PSK', async (t) => {
  const dir = tempDir(t);
  const r = await run('bash', ['-euo', 'pipefail', '-c', readmeRecipe()], { cwd: dir, env: { SERVER_NAME: 'localhost' }, timeoutMs: 60_000 });
  t.is(r.code, 0, r.output);
  for (const f of ['pki/ca-cert.pem', 'pki/server-cert.pem', 'pki/server-key.pem', 'client-pki/ca-cert.pem', 'client-pki/client-cert.pem', 'client-pki/client-key.pem', 'keys.psk']) {
    t.true(fs.existsSync(path.join(dir, f)), f);
  }
  const pkiDir = path.join(dir, 'pki');
  const clientDir = path.join(dir, 'client-pki');
  const keys = path.join(dir, 'keys.psk');
  const user = fs.readFileSync(keys, 'utf8').split(':')[0]!;
  const s = await startTls(t, ['--tls', 'require', '--tls-certificates', pkiDir, '--tls-verify-peer']);
  const info = await run('nbdinfo', ['--size', `nbds+unix:///vol?socket=${s.socket}&tls-certificates=${clientDir}`]);
  check(t, info, 'nbdinfo against baton');
  t.regex(s.stderr(), /"identity":"x509:alice"/);
  const p = await startTls(t, ['--tls', 'require', '--tls-psk', keys]);
  check(t, await run('nbdinfo', ['--size', `nbds+unix://${user}@/vol?socket=${p.socket}&tls-psk-file=${keys}`]), 'nbdinfo PSK against baton');

  // nbdkit reads the same directory and key file, and the same client commands work.
  for (const tlsArgs of [[`--tls-certificates=${pkiDir}`, '--tls-verify-peer'], [`--tls-psk=${keys}`]]) {
    const sock = path.join(dir, `kit-${tlsArgs.length}.sock`);
    const kit = spawn('nbdkit', ['-f', '--exit-with-parent', '-U', sock, '--tls=require', ...tlsArgs, 'memory', '1M'], { stdio: ['ignore', 'ignore', 'pipe'] });
    const gone = new Promise<void>((res) => kit.once('exit', () => res()));
    t.teardown(async () => { if (kit.exitCode === null) kit.kill('SIGKILL'); await gone; });
    await waitForSocket(sock);
    const uri = tlsArgs.length === 2 ? `nbds+unix:///?socket=${sock}&tls-certificates=${clientDir}` : `nbds+unix://${user}@/?socket=${sock}&tls-psk-file=${keys}`;
    const k = await run('nbdinfo', ['--size', uri]);
    check(t, k, `nbdinfo against nbdkit ${tlsArgs.join(' ')}`);
    t.is(k.stdout.trim(), String(MiB));
  }
});

/**
 * src/tls-config.ts and the serve-side checks: nbdkit's certificate layout, psktool's PSK
 * format (errors name file and line), which flag combinations `baton serve` refuses, and
 * which --listen hosts count as loopback. Also the certificate names an identity is made of.
 */

import test from 'ava';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { certificateNames, opensslReason } from '../../nbd/tls.js';
import { isLoopbackHost } from '../../src/config.js';
import { InvalidArgumentError } from '../../src/errors.js';
import { checkServeSecurity, loadTlsCredentials, parsePskFile, type ServeSecurityFlags } from '../../src/tls-config.js';
import { makeCa, makeServerDir } from '../helpers/tls-pki.js';

test('PSK file: psktool lines; blank lines skipped; each malformed line is an error naming file:line', (t) => {
  const keys = parsePskFile('alice:00ff10\n\nbob:ABCDEF0123456789\r\n', 'keys.psk');
  t.deepEqual([...keys.keys()], ['alice', 'bob']);
  t.deepEqual(keys.get('alice'), Buffer.from([0x00, 0xff, 0x10]));
  const bad: [string, RegExp][] = [
    ['alice:00ff\nbob\n', /^keys\.psk:2: expected identity:hexkey/],
    [':00ff\n', /^keys\.psk:1: empty identity/],
    ['alice:0g\n', /^keys\.psk:1: the key of "alice" is not hexadecimal/],
    ['alice:abc\n', /^keys\.psk:1: the key of "alice" is not hexadecimal/],
    ['alice:\n', /^keys\.psk:1: the key of "alice" is not hexadecimal/],
    ['alice:00\nalice:11\n', /^keys\.psk:2: "alice" is given a second time/],
    ['\n\n', /no identity:hexkey lines \(make one with: psktool/],
  ];
  for (const [text, re] of bad) t.throws(() => parsePskFile(text, 'keys.psk'), { instanceOf: InvalidArgumentError, message: re }, JSON.stringify(text));
});

test('certificate dir: nbdkit layout; missing files and a key that does not match are errors naming the directory', (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-tlscfg-'));
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }));
  const ca = makeCa(path.join(dir, 'ca'));
  const server = makeServerDir(ca, path.join(dir, 'server'));
  const c = loadTlsCredentials({ certificatesDir: server, verifyPeer: true });
  t.truthy(c.x509?.ca);
  t.is(c.verifyPeer, true);
  t.is(c.x509?.crl, undefined);
  // ca-cert.pem is needed only to verify clients.
  fs.rmSync(path.join(server, 'ca-cert.pem'));
  t.notThrows(() => loadTlsCredentials({ certificatesDir: server }));
  t.throws(() => loadTlsCredentials({ certificatesDir: server, verifyPeer: true }), { message: /cannot read ca-cert\.pem/ });
  // A key that is not the certificate's.
  const other = makeServerDir(makeCa(path.join(dir, 'ca2')), path.join(dir, 'server2'));
  fs.copyFileSync(path.join(other, 'server-key.pem'), path.join(server, 'server-key.pem'));
  t.throws(() => loadTlsCredentials({ certificatesDir: server }), { instanceOf: InvalidArgumentError, message: new RegExp(`--tls-certificates ${server}: .*key values mismatch`) });
  t.throws(() => loadTlsCredentials({ certificatesDir: path.join(dir, 'nope') }), { message: /cannot read server-cert\.pem .*nbdkit --tls-certificates/ });
  t.throws(() => loadTlsCredentials({ pskFile: path.join(dir, 'keys.psk') }), { message: /--tls-psk .*keys\.psk: cannot read it/ });
});

const base: ServeSecurityFlags = { tls: 'off' };
const check = (f: Partial<ServeSecurityFlags>, host: string | null = '127.0.0.1'): void => checkServeSecurity({ ...base, ...f }, host, isLoopbackHost);

test('serve flags: combinations that would do nothing, or not what they say, are refused', (t) => {
  t.notThrows(() => check({}));
  t.notThrows(() => check({}, null));
  t.throws(() => check({ tlsPsk: 'k' }), { message: /--tls-psk needs TLS: add --tls require/ });
  t.throws(() => check({ tlsCertificates: 'd', authz: 'a' }), { message: /--tls-certificates, --authz need TLS/ });
  t.throws(() => check({ tls: 'require' }), { message: /--tls require needs credentials/ });
  t.throws(() => check({ tls: 'on', tlsPsk: 'k', tlsCertificates: 'd' }), { message: /alternatives/ });
  t.throws(() => check({ tls: 'require', tlsPsk: 'k', tlsVerifyPeer: true }), { message: /--tls-verify-peer checks client certificates/ });
  t.throws(() => check({ tls: 'on', tlsPsk: 'k', authz: 'a' }), { message: /--authz .* use --tls require/ });
  t.throws(() => check({ tls: 'require', tlsCertificates: 'd', authz: 'a' }), { message: /--authz needs clients that prove who they are/ });
  t.notThrows(() => check({ tls: 'require', tlsCertificates: 'd', tlsVerifyPeer: true, authz: 'a' }));
  t.notThrows(() => check({ tls: 'require', tlsPsk: 'k', authz: 'a' }));
});

test('serve flags: a non-loopback listener needs --tls require, or --insecure', (t) => {
  for (const host of ['0.0.0.0', '::', '10.0.0.5', 'myhost.example', '192.168.1.1']) {
    const err = t.throws(() => check({}, host), { instanceOf: InvalidArgumentError });
    t.regex(err!.message, new RegExp(`refusing to listen on ${host.replace(/[.]/g, '\\.')} without --tls require`));
    t.regex(err!.message, /--insecure/);
    t.throws(() => check({ tls: 'on', tlsPsk: 'k' }, host), { message: /without --tls require/ });
    t.notThrows(() => check({ tls: 'require', tlsPsk: 'k' }, host));
    t.notThrows(() => check({ insecure: true }, host));
  }
  for (const host of ['127.0.0.1', '127.1.2.3', '::1', 'localhost', '::ffff:127.0.0.1']) t.notThrows(() => check({}, host), host);
});

test('loopback hosts', (t) => {
  t.true(isLoopbackHost('127.0.0.1'));
  t.true(isLoopbackHost('LOCALHOST'));
  t.false(isLoopbackHost('127.0.0.1.example.com'));
  t.false(isLoopbackHost('0.0.0.0'));
  t.false(isLoopbackHost('::'));
  t.false(isLoopbackHost('::ffff:10.0.0.1'));
});

test('certificate names: subject CN, then subjectAltName values, without duplicates', (t) => {
  const cert = { subject: { CN: 'alice', O: 'x' }, subjectaltname: 'DNS:alice.example, email:alice@example.com, IP Address:10.0.0.1, DNS:alice' } as never;
  t.deepEqual(certificateNames(cert), ['alice', 'alice.example', 'alice@example.com', '10.0.0.1']);
  t.deepEqual(certificateNames({ subject: { O: 'no cn' } } as never), []);
  t.deepEqual(certificateNames({} as never), []);
  t.deepEqual(certificateNames(null), []);
});

test('OpenSSL reasons are shortened for the log', (t) => {
  t.is(opensslReason(new Error('80DC830FE47F0000:error:0A000076:SSL routines:tls_choose_sigalg:no suitable signature algorithm:../deps/openssl/openssl/ssl/t1_lib.c:3242:')), 'no suitable signature algorithm');
  t.is(opensslReason(new Error('socket hang up')), 'socket hang up');
});

/**
 * Certificates and PSK files for TLS tests, generated at run time with `openssl` (never
 * committed). Layouts are the ones the real tools read:
 *
 * - server dir (nbdkit's --tls-certificates layout, which `baton serve --tls-certificates`
 *   reads): ca-cert.pem, server-cert.pem, server-key.pem [, ca-crl.pem]
 * - client dir (libnbd's tls-certificates=DIR and qemu's tls-creds-x509 dir=DIR,endpoint=client):
 *   ca-cert.pem, client-cert.pem, client-key.pem
 * - PSK file (psktool's format): `identity:hexkey` lines
 *
 * Keys are ECDSA P-256 (fast to make). The server certificate names localhost, this host's
 * name (libnbd checks the server's name against the URI host, or the local hostname for a
 * Unix socket) and 127.0.0.1. Client certificates carry the key purposes qemu's sanity check
 * insists on (clientAuth, digitalSignature, CA:FALSE).
 */

import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';

function openssl(args: string[], cwd: string): void {
  execFileSync('openssl', args, { cwd, stdio: ['ignore', 'ignore', 'pipe'] });
}

const EC = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes'];

export interface Ca {
  dir: string;
  cert: string;
  key: string;
}

/** A self-signed CA in `dir` (ca-cert.pem, ca-key.pem). */
export function makeCa(dir: string, cn = 'baton test CA'): Ca {
  fs.mkdirSync(dir, { recursive: true });
  openssl(['req', '-x509', '-new', ...EC, '-keyout', 'ca-key.pem', '-out', 'ca-cert.pem', '-days', '2', '-subj', `/CN=${cn}`,
    '-addext', 'basicConstraints=critical,CA:TRUE', '-addext', 'keyUsage=critical,keyCertSign,cRLSign'], dir);
  return { dir, cert: path.join(dir, 'ca-cert.pem'), key: path.join(dir, 'ca-key.pem') };
}

/** A key and a certificate signed by `ca` (or self-signed when ca is null), as `<out>-key.pem`/`<out>-cert.pem`-style paths. */
function issue(ca: Ca | null, keyPath: string, certPath: string, cn: string, ext: string[]): void {
  const dir = path.dirname(certPath);
  fs.mkdirSync(dir, { recursive: true });
  const extFile = path.join(dir, `.ext-${randomBytes(4).toString('hex')}`);
  fs.writeFileSync(extFile, ext.join('\n') + '\n');
  try {
    if (!ca) {
      openssl(['req', '-x509', '-new', ...EC, '-keyout', keyPath, '-out', certPath, '-days', '2', '-subj', `/CN=${cn}`, '-extensions', 'v3', '-config', configWith(extFile)], dir);
      return;
    }
    const csr = path.join(dir, `.csr-${randomBytes(4).toString('hex')}`);
    openssl(['req', '-new', ...EC, '-keyout', keyPath, '-out', csr, '-subj', `/CN=${cn}`], dir);
    openssl(['x509', '-req', '-in', csr, '-CA', ca.cert, '-CAkey', ca.key, '-set_serial', `0x${randomBytes(8).toString('hex')}`, '-out', certPath, '-days', '2', '-extfile', extFile], dir);
    fs.rmSync(csr, { force: true });
  } finally {
    fs.rmSync(extFile, { force: true });
  }
}

/** An openssl config whose [v3] section is the extension lines (for self-signed `req -x509`). */
function configWith(extFile: string): string {
  const cfg = `${extFile}.cnf`;
  fs.writeFileSync(cfg, `[req]\ndistinguished_name = dn\n[dn]\n[v3]\n${fs.readFileSync(extFile, 'utf8')}`);
  return cfg;
}

/** nbdkit's server layout in `dir`: the CA's certificate, a server key and certificate signed by it. */
export function makeServerDir(ca: Ca, dir: string): string {
  fs.mkdirSync(dir, { recursive: true });
  fs.copyFileSync(ca.cert, path.join(dir, 'ca-cert.pem'));
  const names = [...new Set(['localhost', os.hostname()])].map((n) => `DNS:${n}`).concat('IP:127.0.0.1');
  issue(ca, path.join(dir, 'server-key.pem'), path.join(dir, 'server-cert.pem'), 'localhost', [
    'basicConstraints=critical,CA:FALSE', 'keyUsage=critical,digitalSignature,keyEncipherment', 'extendedKeyUsage=serverAuth',
    `subjectAltName=${names.join(',')}`,
  ]);
  return dir;
}

/**
 * A client dir (libnbd / qemu layout) for `cn`, whose certificate is signed by `ca` (null:
 * self-signed). `trust` is the CA the client checks the server with (ca-cert.pem).
 */
export function makeClientDir(ca: Ca | null, trust: Ca, dir: string, cn: string, san: string[] = []): string {
  fs.mkdirSync(dir, { recursive: true });
  fs.copyFileSync(trust.cert, path.join(dir, 'ca-cert.pem'));
  issue(ca, path.join(dir, 'client-key.pem'), path.join(dir, 'client-cert.pem'), cn, [
    'basicConstraints=critical,CA:FALSE', 'keyUsage=critical,digitalSignature,keyEncipherment', 'extendedKeyUsage=clientAuth',
    ...(san.length ? [`subjectAltName=${san.join(',')}`] : []),
  ]);
  return dir;
}

/** A psktool-format file with these identities (random 32-byte keys unless given); returns the keys. */
export function makePskFile(file: string, identities: string[], keys: Record<string, string> = {}): Record<string, string> {
  const out: Record<string, string> = {};
  for (const id of identities) out[id] = keys[id] ?? randomBytes(32).toString('hex');
  fs.writeFileSync(file, identities.map((id) => `${id}:${out[id]}\n`).join(''), { mode: 0o600 });
  return out;
}

/** Revoke `certPath` (issued by `ca`): writes `<dir>/ca-crl.pem`. */
export function revoke(ca: Ca, certPath: string, crlOut: string): void {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-crl-'));
  try {
    fs.writeFileSync(path.join(dir, 'index.txt'), '');
    fs.writeFileSync(path.join(dir, 'crlnumber'), '01\n');
    const cnf = path.join(dir, 'ca.cnf');
    fs.writeFileSync(cnf, [
      '[ca]', 'default_ca = CA', '[CA]', `database = ${path.join(dir, 'index.txt')}`, `crlnumber = ${path.join(dir, 'crlnumber')}`,
      'default_md = sha256', 'default_crl_days = 2', `certificate = ${ca.cert}`, `private_key = ${ca.key}`,
    ].join('\n') + '\n');
    openssl(['ca', '-config', cnf, '-revoke', certPath], dir);
    openssl(['ca', '-config', cnf, '-gencrl', '-out', crlOut], dir);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

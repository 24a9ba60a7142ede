/**
 * TLS credentials from files, in the layouts nbdkit reads, so a certificate directory or a
 * PSK file made for `nbdkit --tls` serves baton unchanged:
 *
 * - `--tls-certificates DIR`: `server-cert.pem`, `server-key.pem`, `ca-cert.pem` (the CA
 *   client certificates must chain to; needed for --tls-verify-peer), optional `ca-crl.pem`.
 * - `--tls-psk FILE`: psktool's format, one `identity:hexkey` per line.
 *
 * Everything is read and checked before the server listens (and again on SIGHUP, when a
 * failure keeps the credentials in use): a problem is an InvalidArgumentError naming the
 * file, and the line for a PSK file.
 */

import * as fs from 'node:fs';
import * as path from 'node:path';
import * as tls from 'node:tls';
import type { ExportProvider } from '../nbd/backend.js';
import { NbdTls, type ClientIdentity, type TlsCredentials } from '../nbd/tls.js';
import { AuthzPolicy, authorizedExports } from './authz.js';
import { InvalidArgumentError, errorMessage } from './errors.js';
import type { Logger } from './log.js';

export interface TlsFiles {
  certificatesDir?: string;
  pskFile?: string;
  verifyPeer?: boolean;
}

export function loadTlsCredentials(f: TlsFiles): TlsCredentials {
  if (!!f.certificatesDir === !!f.pskFile) {
    throw new InvalidArgumentError('TLS needs exactly one of --tls-certificates DIR and --tls-psk FILE');
  }
  if (f.pskFile) {
    if (f.verifyPeer) throw new InvalidArgumentError('--tls-verify-peer checks client certificates; with --tls-psk the key already authenticates each client (leave --tls-verify-peer out)');
    return { psk: loadPskFile(f.pskFile) };
  }
  const dir = f.certificatesDir!;
  const read = (name: string, required: boolean): Buffer | undefined => {
    const p = path.join(dir, name);
    try {
      return fs.readFileSync(p);
    } catch (err) {
      if (!required && (err as NodeJS.ErrnoException).code === 'ENOENT') return undefined;
      throw new InvalidArgumentError(`--tls-certificates ${dir}: cannot read ${name} (${errorMessage(err)}); the directory holds server-cert.pem, server-key.pem, ca-cert.pem and optionally ca-crl.pem, as for nbdkit --tls-certificates`);
    }
  };
  const cert = read('server-cert.pem', true)!;
  const key = read('server-key.pem', true)!;
  const ca = read('ca-cert.pem', !!f.verifyPeer);
  const crl = read('ca-crl.pem', false);
  const x509 = { key, cert, ...(ca ? { ca } : {}), ...(crl ? { crl } : {}) };
  // Let OpenSSL parse them now (a key that does not match the certificate, a PEM that is
  // not one), so the error names the directory instead of surfacing at the first handshake.
  try {
    tls.createSecureContext(x509);
  } catch (err) {
    throw new InvalidArgumentError(`--tls-certificates ${dir}: ${errorMessage(err)} (server-cert.pem, server-key.pem${ca ? ', ca-cert.pem' : ''}${crl ? ', ca-crl.pem' : ''})`);
  }
  return { x509, verifyPeer: !!f.verifyPeer };
}

export function loadPskFile(file: string): Map<string, Buffer> {
  let text: string;
  try {
    text = fs.readFileSync(file, 'utf8');
  } catch (err) {
    throw new InvalidArgumentError(`--tls-psk ${file}: cannot read it (${errorMessage(err)})`);
  }
  return parsePskFile(text, file);
}

/**
 * psktool's `identity:hexkey` lines (what GnuTLS, and so nbdkit, reads). Blank lines are
 * skipped; anything else that is not `identity:hexkey` (an empty identity, a key that is not
 * an even number of hex digits, an identity given twice) is an error naming the line.
 */
export function parsePskFile(text: string, file = '<psk>'): Map<string, Buffer> {
  const out = new Map<string, Buffer>();
  const lines = text.split('\n');
  for (let i = 0; i < lines.length; i++) {
    const raw = lines[i]!.replace(/\r$/, '');
    if (raw.trim() === '') continue;
    const where = `${file}:${i + 1}`;
    const colon = raw.indexOf(':');
    if (colon < 0) throw new InvalidArgumentError(`${where}: expected identity:hexkey (as psktool writes), found no ':'`);
    const identity = raw.slice(0, colon);
    const hex = raw.slice(colon + 1).trim();
    if (identity === '') throw new InvalidArgumentError(`${where}: empty identity before ':'`);
    if (hex === '' || hex.length % 2 !== 0 || !/^[0-9a-fA-F]+$/.test(hex)) {
      throw new InvalidArgumentError(`${where}: the key of "${identity}" is not hexadecimal bytes (psktool writes 64 hex digits)`);
    }
    if (out.has(identity)) throw new InvalidArgumentError(`${where}: "${identity}" is given a second time`);
    out.set(identity, Buffer.from(hex, 'hex'));
  }
  if (out.size === 0) throw new InvalidArgumentError(`--tls-psk ${file}: no identity:hexkey lines (make one with: psktool -u NAME -p ${file})`);
  return out;
}

export interface ServeSecurityFlags {
  tls: 'off' | 'on' | 'require';
  tlsCertificates?: string;
  tlsPsk?: string;
  tlsVerifyPeer?: boolean;
  authz?: string;
  insecure?: boolean;
}

/**
 * The flags of `baton serve` that decide who may connect, checked together before anything
 * is opened: TLS flags that would do nothing are errors (a user who wrote --tls-psk meant
 * TLS), --authz needs clients that prove an identity and cannot skip TLS, and a listener
 * reachable from the network needs --tls require unless --insecure says otherwise.
 * `listenHost` is the TCP host, or null for a Unix socket.
 */
export function checkServeSecurity(f: ServeSecurityFlags, listenHost: string | null, isLoopback: (host: string) => boolean): void {
  if (f.tls === 'off') {
    const given = [f.tlsCertificates && '--tls-certificates', f.tlsPsk && '--tls-psk', f.tlsVerifyPeer && '--tls-verify-peer', f.authz && '--authz'].filter(Boolean);
    if (given.length > 0) throw new InvalidArgumentError(`${given.join(', ')} ${given.length > 1 ? 'need' : 'needs'} TLS: add --tls require (or --tls on)`);
  } else {
    if (!f.tlsCertificates && !f.tlsPsk) throw new InvalidArgumentError(`--tls ${f.tls} needs credentials: --tls-certificates DIR (server-cert.pem, server-key.pem, ca-cert.pem) or --tls-psk FILE (psktool -u NAME -p FILE)`);
    if (f.tlsCertificates && f.tlsPsk) throw new InvalidArgumentError('--tls-certificates and --tls-psk are alternatives (as in nbdkit): give one');
    if (f.tlsVerifyPeer && !f.tlsCertificates) throw new InvalidArgumentError('--tls-verify-peer checks client certificates against --tls-certificates DIR/ca-cert.pem; with --tls-psk the key already authenticates each client (leave --tls-verify-peer out)');
  }
  if (f.authz) {
    if (f.tls !== 'require') throw new InvalidArgumentError('--authz grants exports to client identities, which only TLS proves: use --tls require (with --tls on a client could skip TLS)');
    if (!f.tlsPsk && !f.tlsVerifyPeer) throw new InvalidArgumentError('--authz needs clients that prove who they are: --tls-psk FILE, or --tls-certificates DIR with --tls-verify-peer');
  }
  if (listenHost !== null && !isLoopback(listenHost) && f.tls !== 'require' && !f.insecure) {
    throw new InvalidArgumentError(`refusing to listen on ${listenHost} without --tls require: anyone who can reach it could read and write every volume. `
      + 'Serve with --tls require and --tls-certificates DIR or --tls-psk FILE (see baton serve --help), '
      + 'or add --insecure if every host on that network may use every volume');
  }
}

/** What `baton serve` runs with for TLS and authorization, and how SIGHUP renews it. */
export interface ServeTls {
  /** For NbdServer's options (absent without TLS). */
  tls?: NbdTls;
  /** For NbdServer's options (absent without --authz: every client sees every export). */
  exportsFor?: (identity: ClientIdentity) => ExportProvider;
  /** One line for the start-up log: what is required of clients. */
  describe(): Record<string, unknown>;
  /**
   * Re-read the certificate directory or PSK file and the authz file (SIGHUP). New handshakes
   * and new options use them; established TLS sessions and attached exports are kept. On
   * any error nothing changes and the error is logged.
   */
  reload(log: Logger): void;
}

/**
 * Reads every TLS and authz file named by the flags (checkServeSecurity first), so a bad
 * file stops `serve` before it listens. `provider()` is the server's export provider (made
 * later than the files are read).
 */
export function setupServeTls(f: ServeSecurityFlags, provider: () => ExportProvider, handshakeTimeoutMs: number): ServeTls {
  if (f.tls === 'off') return { describe: () => ({ tls: 'off' }), reload: () => {} };
  const files: TlsFiles = { ...(f.tlsCertificates ? { certificatesDir: f.tlsCertificates } : {}), ...(f.tlsPsk ? { pskFile: f.tlsPsk } : {}), verifyPeer: !!f.tlsVerifyPeer };
  const tls = new NbdTls(f.tls, loadTlsCredentials(files), handshakeTimeoutMs);
  let policy = f.authz ? AuthzPolicy.load(f.authz) : null;
  const authzFile = f.authz;
  return {
    tls,
    ...(policy ? { exportsFor: (identity: ClientIdentity) => authorizedExports(provider(), () => policy!)(identity) } : {}),
    describe: () => ({
      tls: f.tls,
      credentials: f.tlsPsk ? `psk:${f.tlsPsk}` : `x509:${f.tlsCertificates}`,
      clientCertificates: f.tlsPsk ? 'n/a (PSK)' : f.tlsVerifyPeer ? 'required and verified' : 'not requested',
      authz: policy ? `${authzFile} (${policy.rules.length} identities)` : (f.tls === 'require' && (f.tlsPsk || f.tlsVerifyPeer)
        ? 'none: every client that completes the TLS handshake may attach every export'
        : 'none: every client may attach every export'),
    }),
    reload: (log) => {
      try {
        const creds = loadTlsCredentials(files);
        const next = authzFile ? AuthzPolicy.load(authzFile) : null;
        tls.setCredentials(creds);
        if (next) policy = next;
        log.info({ credentials: f.tlsPsk ?? f.tlsCertificates, ...(next ? { authz: authzFile, identities: next.rules.length } : {}) }, 'SIGHUP: reloaded TLS credentials' + (next ? ' and authorization' : '') + '; established connections keep their sessions');
      } catch (err) {
        log.error({ err: errorMessage(err) }, 'SIGHUP: reload failed; still using the previous TLS credentials and authorization');
      }
    },
  };
}

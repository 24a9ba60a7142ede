/**
 * TLS for NBD_OPT_STARTTLS: the server side of the TLS handshake on a connection that has
 * already spoken plaintext NBD, and who the client turned out to be.
 *
 * How a socket is upgraded: one `tls.Server` that never listens is the factory for every
 * connection's TLS session. After the session ACKs STARTTLS, the plaintext socket is handed
 * to it (`emit('connection', raw)`, the way a net.Server hands it an accepted socket), which
 * wraps it in a TLSSocket on the same file descriptor. Going through a tls.Server rather than
 * `new tls.TLSSocket(raw, { isServer: true })` is what makes Node verify a client
 * certificate at all: a standalone server-side TLSSocket accepts any certificate (observed on
 * Node 20: a self-signed one came out `authorized: false`, `authorizationError: null`); the
 * server's 'secureConnection' path sets `authorized` / `authorizationError` from OpenSSL's
 * verification. It also gives rotation for free: `setSecureContext` affects only handshakes
 * that start afterwards, so connections keep the session they have.
 *
 * The TLSSocket is matched back to its connection by `tlsSocket._parent`, the plaintext
 * socket it wraps: Node sets it for every net.Socket it wraps (lib/_tls_wrap.js, `_init`) but
 * does not document it. If a Node release dropped it, no handshake would ever be matched:
 * every upgrade would fail with TlsError "internal error: ..." (and the unit tests in
 * test/unit/session-tls.test.ts fail), never a session given to the wrong connection.
 *
 * The TLS socket inherits allowHalfOpen from the socket it wraps (NbdServer's are half-open
 * capable), so a client that sends close_notify and FIN after its last requests still gets
 * every reply, as over plaintext (test/unit/session-tls.test.ts, "half-close").
 *
 * Who the client is (ClientIdentity): with PSK the identity it proved it has the key of;
 * with --tls-verify-peer its certificate's subject CN and subjectAltName entries, after
 * OpenSSL verified it against the CA (and CRL); otherwise nobody in particular.
 *
 * Session resumption is off (SSL_OP_NO_TICKET, and no session cache: Node's server contexts
 * keep none unless a 'resumeSession' listener exists). A resumed session skips the PSK
 * callback, so it would come without an identity, and it would let a client whose key or
 * certificate was rotated out keep attaching; every NBD connection is long-lived, so a full
 * handshake per connection costs nothing that matters.
 */

import { constants as cryptoConstants } from 'node:crypto';
import * as net from 'node:net';
import type { Duplex } from 'node:stream';
import * as tls from 'node:tls';
import { TlsError, errorMessage } from '../src/errors.js';

/** `off`: STARTTLS is refused. `on`: offered, plaintext allowed. `require`: nothing but STARTTLS/ABORT until TLS. */
export type TlsMode = 'off' | 'on' | 'require';

export interface X509Credentials {
  /** PEM: the server's private key and certificate (chain). */
  key: Buffer;
  cert: Buffer;
  /** PEM: CA certificate(s) client certificates must chain to (needed for verifyPeer). */
  ca?: Buffer;
  /** PEM: revoked client certificates. */
  crl?: Buffer;
}

/** What the server authenticates with, and how it authenticates clients. Exactly one of x509 and psk. */
export interface TlsCredentials {
  x509?: X509Credentials;
  /** Ask every client for a certificate and refuse one that does not verify against `x509.ca`. */
  verifyPeer?: boolean;
  /** PSK identity -> key (psktool's `identity:hexkey` lines). */
  psk?: ReadonlyMap<string, Buffer>;
}

/** What a client proved in the TLS handshake. */
export interface ClientIdentity {
  kind: 'psk' | 'x509' | 'anonymous';
  /**
   * Names an authorization rule may use for this client: the PSK identity; or the verified
   * certificate's subject CN followed by its subjectAltName values (DNS, email, URI, IP).
   * Empty for `anonymous` (TLS without a client certificate).
   */
  names: readonly string[];
  /** For log lines: `psk:alice`, `x509:alice` (the CN, or the first name), `anonymous`. */
  display: string;
}

export const ANONYMOUS: ClientIdentity = Object.freeze({ kind: 'anonymous', names: Object.freeze([]) as readonly string[], display: 'anonymous' });

export interface TlsUpgrade {
  sock: tls.TLSSocket;
  identity: ClientIdentity;
  /** e.g. TLSv1.3 */
  protocol: string;
  /** e.g. TLS_AES_256_GCM_SHA384 */
  cipher: string;
}

/**
 * TLS 1.3 suites in our order of preference, then Node's TLS 1.2 defaults, then TLS 1.2 PSK
 * suites for PSK. The legacy PSK callback (which Node uses) works in TLS 1.3 only with
 * SHA-256 suites, so with PSK AES-128-GCM is picked: it is listed before ChaCha20, which
 * would otherwise win (slower than AES-GCM on CPUs with AES-NI). Node's defaults put ChaCha20
 * second and exclude PSK suites.
 */
const TLS13_SUITES = 'TLS_AES_256_GCM_SHA384:TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256';
const TLS12_PSK_SUITES = 'ECDHE-PSK-AES128-CBC-SHA256:ECDHE-PSK-CHACHA20-POLY1305:DHE-PSK-AES128-GCM-SHA256:DHE-PSK-AES256-GCM-SHA384:PSK-AES128-GCM-SHA256:PSK-AES256-GCM-SHA384';
const tls12Default = tls.DEFAULT_CIPHERS.split(':').filter((c) => !c.startsWith('TLS_')).join(':');

interface Pending {
  resolve(u: TlsUpgrade): void;
  reject(e: TlsError): void;
}

/** The TLS socket wraps this plaintext socket (see the module comment). */
function parentOf(s: tls.TLSSocket): unknown {
  return (s as unknown as { _parent?: unknown })._parent;
}

export class NbdTls {
  private readonly server: tls.Server;
  private readonly pending = new Map<unknown, Pending>();
  /** The identity each handshake's client named in the PSK callback (known or not: for the log). */
  private readonly pskIdentities = new WeakMap<tls.TLSSocket, string>();
  private creds: TlsCredentials;

  constructor(readonly mode: Exclude<TlsMode, 'off'>, creds: TlsCredentials, handshakeTimeoutMs = 30_000) {
    checkCredentials(creds);
    this.creds = creds;
    this.server = new tls.Server({
      ...contextOptions(creds),
      // We verify clients only with --tls-verify-peer; then an unverified client is refused
      // by us (see onSecure) rather than destroyed by Node, so the log can say why.
      requestCert: !!creds.verifyPeer,
      rejectUnauthorized: false,
      handshakeTimeout: handshakeTimeoutMs,
      // Always installed: whether a PSK table exists is decided per handshake, so SIGHUP can rotate it.
      pskCallback: (sock: tls.TLSSocket, identity: string) => {
        this.pskIdentities.set(sock, identity);
        return this.creds.psk?.get(identity) ?? null;
      },
    });
    this.server.on('secureConnection', (s) => this.onSecure(s));
    this.server.on('tlsClientError', (err, s) => this.onFailed(s, err));
  }

  /** Whether clients prove an identity (PSK, or a verified certificate): what --authz needs. */
  get identifiesClients(): boolean {
    return this.creds.psk !== undefined || !!this.creds.verifyPeer;
  }

  get kind(): 'psk' | 'x509' { return this.creds.psk ? 'psk' : 'x509'; }

  /**
   * New credentials (SIGHUP): handshakes that start from now on use them; connections that
   * finished theirs keep their session. The kind (x509 or PSK) and verifyPeer cannot change.
   */
  setCredentials(creds: TlsCredentials): void {
    checkCredentials(creds);
    if (!!creds.psk !== !!this.creds.psk || !!creds.verifyPeer !== !!this.creds.verifyPeer) {
      throw new TlsError('internal error: reloaded TLS credentials must be of the same kind (x509 or PSK, verify-peer or not)');
    }
    this.server.setSecureContext(contextOptions(creds));
    this.creds = creds;
  }

  /**
   * Runs the server side of the TLS handshake on `raw`, which must be a net.Socket whose
   * plaintext reader has let go of it, with no bytes of the client's ClientHello consumed.
   * Resolves once the client is trusted; rejects with TlsError (handshake failed or timed
   * out, certificate not verified, unknown PSK identity or wrong key), after destroying the
   * socket. Never leaves the socket half-upgraded.
   */
  upgrade(raw: Duplex): Promise<TlsUpgrade> {
    if (!(raw instanceof net.Socket)) return Promise.reject(new TlsError('internal error: STARTTLS needs a net.Socket'));
    if (this.pending.has(raw)) return Promise.reject(new TlsError('internal error: a second TLS upgrade of one socket'));
    // Its 'close' may be past already (a client that hung up right after STARTTLS): nothing
    // would ever settle the promise below.
    if (raw.destroyed) return Promise.reject(new TlsError('the client closed the connection before the TLS handshake'));
    return new Promise<TlsUpgrade>((resolve, reject) => {
      this.pending.set(raw, { resolve, reject });
      // Neither event comes if the plaintext socket goes away first (Node emits tlsClientError
      // only for sockets still open): settle then, or the session would wait for its timeout.
      raw.once('close', () => {
        if (!this.pending.delete(raw)) return;
        reject(new TlsError('the client closed the connection during the TLS handshake'));
      });
      this.server.emit('connection', raw);
    });
  }

  private take(s: tls.TLSSocket): Pending | undefined {
    const raw = parentOf(s);
    const p = this.pending.get(raw);
    if (p) this.pending.delete(raw);
    return p;
  }

  private onSecure(s: tls.TLSSocket): void {
    const p = this.take(s);
    if (!p) {
      // Cannot happen while Node sets _parent (module comment); never serve an unmatched session.
      s.destroy();
      return;
    }
    const protocol = s.getProtocol() ?? 'unknown';
    const cipher = s.getCipher()?.standardName ?? 'unknown';
    let identity: ClientIdentity = ANONYMOUS;
    const psk = this.pskIdentities.get(s);
    if (this.creds.psk) {
      // A PSK server has no certificate: a finished handshake is a PSK one, with a known identity.
      if (psk === undefined || !this.creds.psk.has(psk)) {
        s.destroy();
        p.reject(new TlsError('internal error: a PSK handshake finished without a known identity', psk));
        return;
      }
      identity = { kind: 'psk', names: [psk], display: `psk:${psk}` };
    } else if (this.creds.verifyPeer) {
      const cert = s.getPeerCertificate();
      const names = certificateNames(cert);
      const who = names[0] ?? 'no certificate';
      if (!s.authorized) {
        // Node reports a missing certificate as UNABLE_TO_GET_ISSUER_CERT; say what happened.
        const none = !cert || Object.keys(cert).length === 0;
        const why = none
          ? 'the client sent none (GnuTLS clients, as libnbd, qemu and nbd-client, send one only if it is issued by a CA in ca-cert.pem)'
          : String(s.authorizationError ?? 'not verified');
        s.destroy();
        p.reject(new TlsError(`client certificate refused: ${why}`, names.length ? `x509:${who}` : undefined));
        return;
      }
      identity = { kind: 'x509', names, display: `x509:${who}` };
    }
    p.resolve({ sock: s, identity, protocol, cipher });
  }

  private onFailed(s: tls.TLSSocket, err: Error & { code?: string }): void {
    const p = this.take(s);
    // tlsClientError does not close the socket (a handshake timeout leaves it open): we do.
    s.destroy();
    if (!p) return;
    const psk = this.pskIdentities.get(s);
    const reason = opensslReason(err);
    let message: string;
    if (err.code === 'ERR_TLS_HANDSHAKE_TIMEOUT') message = 'TLS handshake timed out';
    else if (this.creds.psk && psk === undefined) message = `TLS handshake failed: the client offered no PSK identity (a client using certificates, on a server using --tls-psk?): ${reason}`;
    else if (this.creds.psk && !this.creds.psk.has(psk!)) message = `TLS handshake failed: unknown PSK identity: ${reason}`;
    else if (this.creds.psk) message = `TLS handshake failed: wrong PSK for this identity?: ${reason}`;
    else message = `TLS handshake failed: ${reason}`;
    p.reject(new TlsError(message, psk !== undefined ? `psk:${psk}` : undefined, { cause: err }));
  }
}

/**
 * The reason in an OpenSSL error ("...:error:0A000076:SSL routines:tls_choose_sigalg:no
 * suitable signature algorithm:../deps/openssl/...:3242:" -> "no suitable signature
 * algorithm"), or the message as it is.
 */
export function opensslReason(err: Error): string {
  const msg = errorMessage(err).split('\n')[0]!;
  const m = /error:[0-9A-Fa-f]+:[^:]*:[^:]*:([^:]+)/.exec(msg);
  return m ? m[1]!.trim() : msg;
}

function checkCredentials(c: TlsCredentials): void {
  // Asserted here as well as by the CLI: a server with neither, or both, would not do what it says.
  if (!c.x509 === !c.psk) throw new TlsError('internal error: TLS needs exactly one of X.509 certificates and a PSK table');
  if (c.verifyPeer && !c.x509?.ca) throw new TlsError('internal error: verifying client certificates needs a CA certificate');
}

function contextOptions(c: TlsCredentials): tls.SecureContextOptions {
  return {
    minVersion: 'TLSv1.2', // the NBD spec requires TLS 1.2 at least; 1.3 is preferred by both sides
    ciphers: c.psk ? `${TLS13_SUITES}:${TLS12_PSK_SUITES}` : `${TLS13_SUITES}:${tls12Default}`,
    honorCipherOrder: true,
    secureOptions: cryptoConstants.SSL_OP_NO_TICKET,
    ...(c.x509 ? { key: c.x509.key, cert: c.x509.cert } : {}),
    ...(c.x509?.ca ? { ca: c.x509.ca } : {}),
    ...(c.x509?.crl ? { crl: c.x509.crl } : {}),
  };
}

/** A certificate's subject CN(s), then its subjectAltName values (`DNS:a, email:b` -> a, b). */
export function certificateNames(cert: tls.PeerCertificate | Record<string, never> | null | undefined): string[] {
  if (!cert || !('subject' in cert) || !cert.subject) return [];
  const out: string[] = [];
  const cn = (cert.subject as unknown as Record<string, string | string[] | undefined>).CN;
  for (const v of Array.isArray(cn) ? cn : cn !== undefined ? [cn] : []) if (v && !out.includes(v)) out.push(v);
  const san = cert.subjectaltname;
  if (san) {
    for (const part of san.split(', ')) {
      const i = part.indexOf(':');
      const v = i >= 0 ? part.slice(i + 1) : part;
      if (v && !out.includes(v)) out.push(v);
    }
  }
  return out;
}

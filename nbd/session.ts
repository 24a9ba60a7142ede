/**
 * One NBD connection: handshake (fixed newstyle option haggling), then transmission, over
 * any Duplex (TCP, Unix socket, an in-memory pair in tests).
 *
 * Invariants:
 * - Every request is validated once (validate.ts) before the backend sees it.
 * - Requests are dispatched in arrival order and may complete out of order; each reply is
 *   one atomic sequence of writes (cork/uncork), so frames never interleave.
 * - A READ's data is fully in hand before its reply header goes out (an error after a
 *   success header would force a hard disconnect).
 * - After STRUCTURED_REPLY, READ and BLOCK_STATUS always get structured replies (even for
 *   EINVAL); other commands get simple replies, which the spec allows.
 * - Memory per connection is bounded: at most `maxInflight` requests and `maxInflightBytes`
 *   bytes of request memory (WRITE payloads, READ data, CACHE pieces; see slotBytes) are
 *   held; beyond that we stop reading the socket.
 * - A request's slot is released only when its reply was handed to the socket, so a client
 *   that never reads replies stalls itself, not the server.
 * - Lent memory goes back when nothing uses it any more: a WRITE payload lent to
 *   BlockBackend.writeLent right after the call, a READ's pieces from BlockBackend.readLent
 *   (and a pooled READ buffer) once the socket has sent the reply.
 * - TLS (opts.tls, proto.md "TLS support"): STARTTLS is ACKed, then the same socket carries
 *   a TLS session and haggling starts over with everything negotiated before it forgotten
 *   (structured replies, meta contexts). Under `require`, nothing but STARTTLS and ABORT is
 *   answered before TLS (ERR_TLS_REQD; EXPORT_NAME, which has no error reply, closes), so no
 *   export is listed, described or opened in plaintext. Exports are always looked up
 *   through `exportsFor(identity)` when given: before TLS that is the anonymous identity.
 */

import type { Duplex } from 'node:stream';
import { InvalidArgumentError, ProtocolError, TlsError, TlsRequiredError, errorMessage } from '../src/errors.js';
import type { Logger } from '../src/log.js';
import { CACHE_PIECE_BYTES, type BlockBackend, type ExportHandle, type ExportInfo, type ExportProvider, type Lent } from './backend.js';
import * as codec from './codec.js';
import * as C from './constants.js';
import { toNbdErrno, toOptionError } from './errno.js';
import { ConnectionClosedError, FrameReader } from './reader.js';
import { CARVE_MAX, acquireBuffer, carveBuffer, releaseBuffer } from './buffer-pool.js';
import type { RequestStats } from './stats.js';
import { COMMAND_NAMES, alignExtents, transmissionFlags, validateRequest, type ValidationContext } from './validate.js';
import { ANONYMOUS, type ClientIdentity, type NbdTls } from './tls.js';

export interface SessionOptions {
  log: Logger;
  /** A client must finish option haggling within this time (a VM's client opens its socket ~3 s before speaking). */
  handshakeTimeoutMs: number;
  maxInflight: number;
  maxInflightBytes: number;
  /**
   * Largest READ/WRITE payload: enforced, and advertised as the maximum block size
   * (NBD_INFO_BLOCK_SIZE), one number so the two can never disagree. See MAX_PAYLOAD.
   */
  maxPayload: number;
  /** Minimum and preferred block sizes advertised in NBD_INFO_BLOCK_SIZE (the maximum is maxPayload). */
  blockSize: { min: number; preferred: number };
  maxOptions: number;
  maxOptionLength: number;
  /**
   * How long a closing connection waits for the client to take its remaining replies (then
   * it is cut off): a peer that reads nothing must not keep a session, its export's handle
   * and its replies' memory past a shutdown, a handoff or its own DISC. Default LINGER_MS.
   */
  lingerMs?: number;
  /**
   * Refuse this connection during the handshake: every option is answered with
   * NBD_REP_ERR_SHUTDOWN and this message (ABORT with its ACK), the provider is never asked.
   */
  refuseWith?: string;
  /** STARTTLS is offered (`on`) or required (`require`); without it STARTTLS gets ERR_UNSUP. */
  tls?: NbdTls;
  /**
   * The exports a client may see and attach, by what it proved in the TLS handshake
   * (authorization: src/authz.ts). Asked again after STARTTLS; before it the identity is
   * ANONYMOUS. Without it every client sees the session's provider.
   */
  exportsFor?: (identity: ClientIdentity) => ExportProvider;
}

/**
 * The largest READ/WRITE we take, and the maximum block size we advertise: 32 MiB. The spec
 * says payloads up to 32 MiB "SHOULD NOT be considered a denial of service" and that a
 * client which asked for NBD_INFO_BLOCK_SIZE MUST obey the advertised maximum; the kernel
 * (hard cap) and qemu never send more than 32 MiB, and libnbd's tools stay within what the
 * server advertises. Taking 64 MiB would only double the memory one request may pin, for
 * no client that needs it. Before, we advertised 32 MiB and enforced 64 MiB: a client that
 * trusted the advertisement lost nothing, but the bound we reasoned about was not the one
 * in force.
 */
export const MAX_PAYLOAD = 32 * 1024 * 1024;

/**
 * At most this many extents per BLOCK_STATUS reply (8 bytes each on the wire, so 8 KiB),
 * and the backend is asked for no more: the work of one request is bounded by what its
 * reply can carry. The spec lets a reply cover less than the requested length; clients
 * (nbdinfo --map, nbdcopy, qemu) ask again from where the reply ended.
 */
export const MAX_BLOCK_STATUS_EXTENTS = 1024;

export const DEFAULT_SESSION_OPTIONS: Omit<SessionOptions, 'log'> = {
  handshakeTimeoutMs: 30_000,
  maxInflight: 128,
  maxInflightBytes: 256 * 1024 * 1024,
  maxPayload: MAX_PAYLOAD,
  blockSize: { min: 512, preferred: 4096 },
  maxOptions: 128,
  maxOptionLength: 64 * 1024,
};

const HANDSHAKE_FLAGS = C.NBD_FLAG_FIXED_NEWSTYLE | C.NBD_FLAG_NO_ZEROES;
/** How long a closing connection may take to flush its last replies to a peer that does not read. */
const LINGER_MS = 10_000;
/**
 * Requests one connection takes in one turn of the event loop before it lets the others (and
 * lease renewals, and timers) run: well above a turn's work at QD32-128, far below one that
 * stalls a host (each request costs microseconds).
 */
const TURN_REQUESTS = 256;
const BASE_ALLOCATION_ID = 1;

/** Frames of one reply; `release` runs once the socket no longer needs them. */
interface Reply { frames: Buffer[]; release?: () => void }

/** Thrown inside the session to end it quietly (client aborted, or we must hang up). */
class EndSession extends Error {}

export class NbdSession {
  /** The connection's stream: the accepted socket, then its TLS socket after STARTTLS. */
  private sock: Duplex;
  private reader: FrameReader;
  /** Whom the exports are looked up for (ANONYMOUS until a TLS handshake says otherwise). */
  private provider: ExportProvider;
  private identity: ClientIdentity = ANONYMOUS;
  private tlsActive = false;
  private handshakeTimedOut = false;
  /** For log lines about this connection: address:port, or `unix`. */
  private readonly peer: string;
  private structured = false;
  private metaContextExport: string | null = null; // export name base:allocation was selected for
  private handle: ExportHandle | null = null;
  /** The attached export's request counters (ExportHandle.stats), if it keeps any. */
  private stats: RequestStats | undefined;
  private inflight = 0;
  private inflightBytes = 0;
  private slotWaiter: (() => void) | null = null;
  private drainWaiter: (() => void) | null = null;
  private shuttingDown = false;
  private corked = false;
  private closed = false;
  /** READs dispatched whose reply is not yet written. */
  private readsExecuting = 0;
  /** READs waiting for one of those to end (backend.maxConcurrentReads), in arrival order. */
  private readonly heldReads: codec.Request[] = [];

  constructor(sock: Duplex, provider: ExportProvider, private readonly opts: SessionOptions) {
    this.sock = sock;
    this.reader = this.readerFor(sock);
    this.provider = opts.exportsFor ? opts.exportsFor(ANONYMOUS) : provider;
    const s = sock as Duplex & { remoteAddress?: string; remotePort?: number };
    this.peer = s.remoteAddress ? `${s.remoteAddress.includes(':') ? `[${s.remoteAddress}]` : s.remoteAddress}:${s.remotePort ?? 0}` : 'unix';
  }

  /** A reader over `sock`, and the listeners every stream of the session needs. */
  private readerFor(sock: Duplex): FrameReader {
    sock.on('error', (err) => this.opts.log.debug({ err: errorMessage(err) }, 'socket error'));
    sock.on('close', () => { this.closed = true; });
    // Handshake first: an option is at most maxOptionLength, so more buffered than a few of
    // them is a client running ahead of a slow provider call (a store's LIST, a lease wait)
    // or junk; before authentication it must not make the server hold 128 MiB (reviewed
    // finding). transmission() raises the bound.
    return new FrameReader(sock, this.opts.maxOptionLength + 64 * 1024);
  }

  /** The export this connection is attached to, once transmission started. */
  get exportName(): string | null { return this.handle?.name ?? null; }

  /** Runs the connection to its end; never rejects. */
  async run(): Promise<void> {
    try {
      const timer = setTimeout(() => {
        this.handshakeTimedOut = true;
        this.opts.log.info({ peer: this.peer, identity: this.identity.display, tls: this.tlsActive }, 'handshake timed out; closing connection');
        this.sock.destroy();
      }, this.opts.handshakeTimeoutMs);
      let handle: { handle: ExportHandle; noZeroes: boolean } | null;
      try {
        handle = await this.handshake();
      } finally {
        clearTimeout(timer);
      }
      if (!handle) return;
      this.handle = handle.handle;
      this.stats = handle.handle.stats;
      await this.transmission(handle.handle.backend);
    } catch (err) {
      if (!(err instanceof ConnectionClosedError) && !(err instanceof EndSession)) {
        this.opts.log.warn({ err: errorMessage(err) }, 'closing connection after protocol error');
      }
    } finally {
      // Whatever ended the session (DISC, the client's FIN, a protocol error), requests
      // already dispatched are completed and their replies handed to the socket first (for
      // at most lingerMs; then the socket is cut, which completes the replies it held, and
      // what still runs in the backend is waited for: the handle is released only after).
      await this.drainOrCut();
      this.handle?.release();
      this.handle = null;
      this.closeSocket();
    }
  }

  /**
   * End our side gracefully: end() sends what was written, then FIN; destroy() would drop
   * replies still queued in the stream. The server's sockets are half-open capable
   * (allowHalfOpen), so a client that shut down its write side after its last request
   * (libnbd does, after DISC) still receives every reply; Node does not end our side for
   * us when its FIN arrives. Once our side is flushed nothing more is owed, so the socket is
   * destroyed; a peer that never reads cannot keep it past LINGER_MS.
   */
  private closeSocket(): void {
    const sock = this.sock;
    if (sock.destroyed) return;
    if (sock.writableFinished) { sock.destroy(); return; }
    const timer = setTimeout(() => sock.destroy(), this.lingerMs);
    timer.unref?.();
    sock.once('close', () => clearTimeout(timer));
    sock.once('finish', () => sock.destroy());
    sock.end();
  }

  /**
   * Graceful shutdown (server stopping, or the volume handed to another host): requests
   * already dispatched finish, new ones get ESHUTDOWN, then the connection closes.
   */
  shutdown(): void {
    if (this.shuttingDown) return;
    this.shuttingDown = true;
    if (!this.handle) { this.sock.destroy(); return; }
    // run()'s loop ends once the socket does; its `finally` releases the handle.
    void this.idleOrLingered().then((idle) => { if (idle) this.closeSocket(); else this.sock.destroy(); });
  }

  private get lingerMs(): number { return this.opts.lingerMs ?? LINGER_MS; }

  /**
   * Every request dispatched has had its reply taken by the socket (waitIdle), or lingerMs
   * passed (false). Slots come back only in write callbacks, so waiting for idle alone let a
   * client that reads no reply keep a handed-off or shut-down session forever (reviewed
   * finding).
   */
  /**
   * Wait until every dispatched request's reply was taken by the socket; past lingerMs cut the
   * socket (which completes the replies it held) and wait for what still runs in the backend.
   */
  private async drainOrCut(): Promise<void> {
    if (await this.idleOrLingered()) return;
    this.sock.destroy();
    await this.waitIdle();
  }

  private idleOrLingered(): Promise<boolean> {
    if (this.inflight === 0) return Promise.resolve(true);
    return new Promise((resolve) => {
      const timer = setTimeout(() => resolve(false), this.lingerMs);
      void this.waitIdle().then(() => { clearTimeout(timer); resolve(true); });
    });
  }

  // ------------------------------------------------------------ handshake

  private send(...bufs: Buffer[]): void {
    if (this.closed || this.sock.destroyed || this.sock.writableEnded) return;
    this.sock.cork();
    for (const b of bufs) this.sock.write(b);
    this.sock.uncork();
  }

  private async readFrame(n: number): Promise<Buffer> {
    return this.reader.tryRead(n) ?? this.reader.read(n);
  }

  private async handshake(): Promise<{ handle: ExportHandle; noZeroes: boolean } | null> {
    this.send(codec.encodeGreeting(HANDSHAKE_FLAGS));
    const clientFlags = codec.decodeClientFlags(await this.readFrame(4), HANDSHAKE_FLAGS);
    const fixed = (clientFlags & C.NBD_FLAG_C_FIXED_NEWSTYLE) !== 0;
    const noZeroes = (clientFlags & C.NBD_FLAG_C_NO_ZEROES) !== 0;

    for (let count = 0; ; count++) {
      if (count >= this.opts.maxOptions) throw new ProtocolError(`more than ${this.opts.maxOptions} options`);
      const { option, length } = codec.decodeOptionHeader(await this.readFrame(C.OPTION_HEADER_SIZE));
      if (length > this.opts.maxOptionLength) throw new ProtocolError(`option ${option} length ${length} too large`);
      const data = length > 0 ? await this.readFrame(length) : Buffer.alloc(0);
      if (this.opts.refuseWith !== undefined) {
        if (option === C.NBD_OPT_EXPORT_NAME) throw new EndSession(); // no error reply exists: close
        if (option === C.NBD_OPT_ABORT) { this.send(codec.encodeOptionReply(option, C.NBD_REP_ACK)); throw new EndSession(); }
        this.send(codec.encodeOptionError(option, C.NBD_REP_ERR_SHUTDOWN, this.opts.refuseWith));
        continue;
      }
      if (this.shuttingDown) {
        if (option === C.NBD_OPT_EXPORT_NAME) throw new EndSession();
        this.send(codec.encodeOptionError(option, C.NBD_REP_ERR_SHUTDOWN, 'server is shutting down'));
        continue;
      }
      if (this.opts.tls?.mode === 'require' && !this.tlsActive) {
        // FORCEDTLS: EXPORT_NAME has no error reply, so that client is closed; every other
        // option but STARTTLS and ABORT is refused (its payload was read) and haggling goes on.
        if (option === C.NBD_OPT_EXPORT_NAME) {
          this.opts.log.info({ peer: this.peer }, 'EXPORT_NAME without TLS on a server that requires TLS: closing');
          throw new EndSession();
        }
        if (option !== C.NBD_OPT_STARTTLS && option !== C.NBD_OPT_ABORT) {
          const err = new TlsRequiredError('this server requires TLS: send NBD_OPT_STARTTLS first');
          this.send(codec.encodeOptionError(option, toOptionError(err), err.message));
          continue;
        }
      }
      if (!fixed && option !== C.NBD_OPT_EXPORT_NAME) {
        // Without FIXED_NEWSTYLE the client cannot parse option replies.
        throw new ProtocolError(`option ${option} from a non-fixed-newstyle client`);
      }
      const result = await this.handleOption(option, data, noZeroes);
      if (result === 'abort') throw new EndSession();
      if (result) return { handle: result, noZeroes };
    }
  }

  /** Returns an export handle when transmission should start, 'abort' to hang up, or null to go on haggling. */
  private async handleOption(option: number, data: Buffer, noZeroes: boolean): Promise<ExportHandle | 'abort' | null> {
    const log = this.opts.log;
    switch (option) {
      case C.NBD_OPT_EXPORT_NAME: {
        let name: string;
        try {
          name = codec.decodeString(data, 'export name');
        } catch {
          return 'abort';
        }
        let h: ExportHandle;
        try {
          h = await this.provider.open(name);
        } catch (err) {
          // EXPORT_NAME has no error reply: the spec says close the connection.
          log.info({ export: name, peer: this.peer, identity: this.identity.display, err: errorMessage(err) }, 'EXPORT_NAME refused');
          return 'abort';
        }
        this.send(codec.encodeExportNameReply(h.backend.size, this.flagsFor(h.backend), noZeroes));
        // As for GO: a meta context selected for another export does not apply to this one.
        this.dropMetaContextUnlessFor(name, h.name);
        log.debug({ export: name }, 'attached (EXPORT_NAME)');
        return h;
      }
      case C.NBD_OPT_ABORT:
        this.send(codec.encodeOptionReply(option, C.NBD_REP_ACK));
        return 'abort';
      case C.NBD_OPT_LIST: {
        if (data.length !== 0) {
          this.send(codec.encodeOptionError(option, C.NBD_REP_ERR_INVALID, 'LIST takes no data'));
          return null;
        }
        let exports;
        try {
          exports = await this.provider.list();
        } catch (err) {
          this.send(codec.encodeOptionError(option, toOptionError(err), errorMessage(err)));
          return null;
        }
        const replies = exports.map((e) => codec.encodeOptionReply(option, C.NBD_REP_SERVER, codec.encodeServerEntry(e.name, e.description)));
        this.send(...replies, codec.encodeOptionReply(option, C.NBD_REP_ACK));
        return null;
      }
      case C.NBD_OPT_INFO:
      case C.NBD_OPT_GO:
        return this.handleInfoOrGo(option, data);
      case C.NBD_OPT_STRUCTURED_REPLY:
        if (data.length !== 0) this.send(codec.encodeOptionError(option, C.NBD_REP_ERR_INVALID, 'STRUCTURED_REPLY takes no data'));
        else if (this.structured) this.send(codec.encodeOptionError(option, C.NBD_REP_ERR_INVALID, 'structured replies already negotiated'));
        else {
          this.structured = true;
          this.send(codec.encodeOptionReply(option, C.NBD_REP_ACK));
        }
        return null;
      case C.NBD_OPT_LIST_META_CONTEXT:
      case C.NBD_OPT_SET_META_CONTEXT:
        this.handleMetaContext(option, data);
        return null;
      case C.NBD_OPT_STARTTLS:
        await this.startTls(option, data);
        return null;
      default:
        // Unknown options (EXTENDED_HEADERS included, for now): payload consumed, ERR_UNSUP, go on.
        this.send(codec.encodeOptionError(option, C.NBD_REP_ERR_UNSUP, `option ${option} is not supported`));
        return null;
    }
  }

  /**
   * STARTTLS (proto.md "TLS support"): ACK, then the TLS handshake on the same socket, then
   * haggling starts over. Returns normally once TLS is up; throws EndSession when the client
   * cannot be trusted (the TLS layer closed the socket; logged once here).
   */
  private async startTls(option: number, data: Buffer): Promise<void> {
    const tls = this.opts.tls;
    if (!tls) {
      // NOTLS mode: ERR_UNSUP (ERR_POLICY would do too), never ERR_TLS_REQD.
      this.send(codec.encodeOptionError(option, C.NBD_REP_ERR_UNSUP, 'TLS is not supported by this server'));
      return;
    }
    if (data.length !== 0) {
      this.send(codec.encodeOptionError(option, C.NBD_REP_ERR_INVALID, 'STARTTLS takes no data'));
      return;
    }
    if (this.tlsActive) {
      this.send(codec.encodeOptionError(option, C.NBD_REP_ERR_INVALID, 'TLS is already active'));
      return;
    }
    this.send(codec.encodeOptionReply(option, C.NBD_REP_ACK));
    // The client sends its ClientHello only after reading the ACK, so the plaintext reader
    // holds nothing more; bytes it does hold were sent out of turn.
    const early = this.reader.detach();
    if (early > 0) throw new ProtocolError(`${early} bytes after STARTTLS before the server's ACK`);
    let up;
    try {
      up = await tls.upgrade(this.sock);
    } catch (err) {
      // The handshake timeout already said why it closed the connection.
      if (!this.handshakeTimedOut) {
        const who = err instanceof TlsError && err.identity ? err.identity : 'unknown';
        this.opts.log.warn({ peer: this.peer, identity: who, err: errorMessage(err) }, 'TLS handshake refused; closing connection');
      }
      throw new EndSession();
    }
    this.sock = up.sock;
    this.reader = this.readerFor(up.sock);
    this.tlsActive = true;
    this.identity = up.identity;
    if (this.opts.exportsFor) this.provider = this.opts.exportsFor(up.identity);
    // Everything negotiated before TLS is forgotten (an attacker may have injected it).
    this.structured = false;
    this.metaContextExport = null;
    this.opts.log.info({ peer: this.peer, identity: up.identity.display, protocol: up.protocol, cipher: up.cipher }, 'TLS session established');
  }

  private async handleInfoOrGo(option: number, data: Buffer): Promise<ExportHandle | null> {
    let req: codec.InfoRequest;
    try {
      req = codec.decodeInfoRequest(data);
    } catch (err) {
      this.send(codec.encodeOptionError(option, C.NBD_REP_ERR_INVALID, errorMessage(err)));
      return null;
    }
    // INFO only describes: with a provider that can answer from its catalog it opens
    // nothing (an open takes the lease, replays the log, writes a takeover record, and may
    // evict another host's client). GO, and INFO on a provider without info(), open.
    const describeOnly = option === C.NBD_OPT_INFO && this.provider.info !== undefined;
    let h: ExportHandle | null = null;
    let desc: ExportInfo;
    try {
      if (describeOnly) {
        desc = await this.provider.info!(req.name);
      } else {
        h = await this.provider.open(req.name);
        desc = { name: h.name, size: h.backend.size, readOnly: h.backend.readOnly, description: h.description };
      }
    } catch (err) {
      this.opts.log.info({ export: req.name, peer: this.peer, identity: this.identity.display, err: errorMessage(err) }, option === C.NBD_OPT_GO ? 'GO refused' : 'INFO refused');
      this.send(codec.encodeOptionError(option, toOptionError(err), errorMessage(err)));
      return null;
    }
    const replies: Buffer[] = [];
    const info = (b: Buffer): void => { replies.push(codec.encodeOptionReply(option, C.NBD_REP_INFO, b)); };
    // NBD_INFO_EXPORT goes out even unrequested: qemu fails without it.
    info(codec.encodeInfoExport(desc.size, transmissionFlags({ readOnly: desc.readOnly, structuredReplies: this.structured })));
    const asked = new Set(req.infoTypes);
    if (asked.has(C.NBD_INFO_NAME)) info(codec.encodeInfoString(C.NBD_INFO_NAME, desc.name));
    if (asked.has(C.NBD_INFO_DESCRIPTION)) info(codec.encodeInfoString(C.NBD_INFO_DESCRIPTION, desc.description));
    if (asked.has(C.NBD_INFO_BLOCK_SIZE)) {
      const bs = this.opts.blockSize;
      info(codec.encodeInfoBlockSize(bs.min, bs.preferred, this.opts.maxPayload));
    }
    replies.push(codec.encodeOptionReply(option, C.NBD_REP_ACK));
    this.send(...replies);
    if (option === C.NBD_OPT_INFO || !h) {
      h?.release();
      return null;
    }
    this.dropMetaContextUnlessFor(req.name, h.name);
    this.opts.log.debug({ export: h.name, structured: this.structured }, 'attached (GO)');
    return h;
  }

  /** Meta context selection applies only to the export that GO (or EXPORT_NAME) then names. */
  private dropMetaContextUnlessFor(requested: string, canonical: string): void {
    if (this.metaContextExport !== null && this.metaContextExport !== requested && this.metaContextExport !== canonical) {
      this.metaContextExport = null;
    }
  }

  private handleMetaContext(option: number, data: Buffer): void {
    const isSet = option === C.NBD_OPT_SET_META_CONTEXT;
    // SET replaces the previous selection, even when it fails.
    if (isSet) this.metaContextExport = null;
    let req: codec.MetaContextRequest;
    try {
      req = codec.decodeMetaContextRequest(data);
    } catch (err) {
      this.send(codec.encodeOptionError(option, C.NBD_REP_ERR_INVALID, errorMessage(err)));
      return;
    }
    if (isSet) {
      if (!this.structured) {
        this.send(codec.encodeOptionError(option, C.NBD_REP_ERR_INVALID, 'SET_META_CONTEXT needs structured replies first'));
        return;
      }
    }
    // LIST with no queries means "all"; "base:" is a wildcard for LIST only; unknown names are ignored.
    const match = req.queries.length === 0
      ? !isSet
      : req.queries.some((q) => q === C.BASE_ALLOCATION || (!isSet && q === 'base:'));
    const replies: Buffer[] = [];
    if (match) {
      replies.push(codec.encodeOptionReply(option, C.NBD_REP_META_CONTEXT, codec.encodeMetaContext(isSet ? BASE_ALLOCATION_ID : 0, C.BASE_ALLOCATION)));
      if (isSet) this.metaContextExport = req.exportName;
    }
    replies.push(codec.encodeOptionReply(option, C.NBD_REP_ACK));
    this.send(...replies);
  }

  private flagsFor(b: BlockBackend): number {
    return transmissionFlags({ readOnly: b.readOnly, structuredReplies: this.structured });
  }

  // ------------------------------------------------------------ transmission

  private async transmission(backend: BlockBackend): Promise<void> {
    // Requests may run ahead of their replies up to half the in-flight bytes, and a WRITE's
    // payload must fit whole.
    this.reader.setHighWater(Math.max(this.opts.maxInflightBytes / 2, this.opts.maxPayload + 1024));
    const ctx: ValidationContext = {
      size: backend.size,
      readOnly: backend.readOnly,
      structuredReplies: this.structured,
      blockStatusEnabled: this.structured && this.metaContextExport !== null,
      maxPayload: this.opts.maxPayload,
    };
    // A backend that copies a write before it returns is lent the payloads, so the socket
    // can be read into buffers the reader reuses (no allocation per socket read).
    if (backend.writeLent) this.reader.useSlabs();
    let inTurn = 0; // requests taken in this turn of the event loop (reset by `turnEnded`)
    const turnEnded = (): void => { inTurn = 0; };
    for (;;) {
      // A connection whose socket is gone is served no more: no reply can reach anyone, the
      // spec lets requests without a reply go undone, and the work would be for nothing. Not
      // only waste: once the socket is gone a reply completes at once (reply()), so without
      // this the loop served everything the reader held (up to its high-water mark: millions
      // of READs) in one turn, and other volumes' lease renewals waited for it (reviewed
      // finding: 1M READs held the loop 4.2 s). A FIN alone (half-close) is not "gone".
      if (this.closed || this.sock.destroyed) throw new ConnectionClosedError();
      // And no turn takes more than TURN_REQUESTS requests: while the socket is open the
      // in-flight bounds keep a turn short only while replies wait for the socket, which a
      // fast reader or small replies need not do.
      if (inTurn === 0) setImmediate(turnEnded);
      else if (inTurn >= TURN_REQUESTS) { await new Promise<void>((r) => setImmediate(r)); continue; }
      inTurn++;
      // The synchronous paths first (a buffered header, a free slot): a request that needs no
      // wait costs no promise (the promises were a fifth of the garbage of a READ answered on the
      // spot, which at 100k READs a second meant a young-generation collection every few ms).
      const req = codec.decodeRequest(this.reader.tryRead(C.REQUEST_SIZE) ?? await this.reader.read(C.REQUEST_SIZE));
      if (req.type === C.NBD_CMD_DISC) {
        await this.drainOrCut();
        if (!backend.readOnly && !this.shuttingDown) {
          // nbdcopy and raw device users often end with DISC and no FLUSH: flush on their
          // behalf, best effort (nobody is left to hear a failure; the data stays dirty).
          try { await backend.flush(); } catch (err) { this.opts.log.warn({ err: errorMessage(err) }, 'flush on disconnect failed; data stays dirty for the next flush'); }
        }
        throw new EndSession();
      }
      let payload: Buffer | undefined;
      let lent: Lent | undefined;
      if (req.type === C.NBD_CMD_WRITE) {
        // A WRITE payload must be consumed even when the request is refused; one we will not
        // buffer leaves no way to stay in sync, so that is the one case we hang up.
        if (req.length > this.opts.maxPayload) throw new ProtocolError(`write payload of ${req.length} bytes exceeds ${this.opts.maxPayload}`);
        if (!this.tryAcquireSlot(req.length)) await this.acquireSlot(req.length);
        try {
          if (req.length === 0) payload = Buffer.alloc(0);
          else if (backend.writeLent) lent = this.reader.tryLend(req.length) ?? await this.reader.lend(req.length);
          else payload = await this.readFrame(req.length);
        } catch (err) {
          this.releaseSlot(req.length); // the client vanished mid-payload: nothing will be dispatched
          throw err;
        }
      } else {
        const bytes = this.slotBytes(req);
        if (!this.tryAcquireSlot(bytes)) await this.acquireSlot(bytes);
      }
      if (!lent) {
        const limit = backend.maxConcurrentReads;
        if (req.type === C.NBD_CMD_READ && limit !== undefined && (this.heldReads.length > 0 || this.readsExecuting >= limit)) {
          this.heldReads.push(req); // its slot is held: a READ done dispatches it (dispatch)
        } else {
          this.dispatch(backend, ctx, req, payload);
        }
        continue;
      }
      // writeLent has copied the pieces by the time dispatch returns (it calls the backend synchronously).
      try {
        this.dispatch(backend, ctx, req, undefined, lent.chunks);
      } finally {
        lent.release();
      }
    }
  }

  /**
   * The request memory a command may hold until its reply is sent, counted against
   * maxInflightBytes: a WRITE its payload, a READ its data (a longer one is refused), a
   * CACHE what the backend may hold at once (BlockBackend.cache). Every other command
   * holds no buffer of its length (BLOCK_STATUS replies are capped in extents).
   */
  private slotBytes(req: codec.Request): number {
    switch (req.type) {
      case C.NBD_CMD_WRITE: return req.length;
      case C.NBD_CMD_READ: return Math.min(req.length, this.opts.maxPayload);
      case C.NBD_CMD_CACHE: return Math.min(req.length, CACHE_PIECE_BYTES);
      default: return 0;
    }
  }

  private async acquireSlot(bytes: number): Promise<void> {
    while (!this.tryAcquireSlot(bytes)) {
      await new Promise<void>((resolve) => { this.slotWaiter = resolve; });
    }
  }

  /** acquireSlot without a wait: the slot if one is free now. */
  private tryAcquireSlot(bytes: number): boolean {
    if (this.inflight >= this.opts.maxInflight || (this.inflight > 0 && this.inflightBytes + bytes > this.opts.maxInflightBytes)) return false;
    this.inflight++;
    this.inflightBytes += bytes;
    return true;
  }

  private releaseSlot(bytes: number): void {
    this.inflight--;
    this.inflightBytes -= bytes;
    const w = this.slotWaiter;
    if (w) { this.slotWaiter = null; w(); }
    if (this.inflight === 0 && this.drainWaiter) { const d = this.drainWaiter; this.drainWaiter = null; d(); }
  }

  private waitIdle(): Promise<void> {
    if (this.inflight === 0) return Promise.resolve();
    return new Promise((resolve) => {
      const prev = this.drainWaiter;
      this.drainWaiter = () => { prev?.(); resolve(); };
    });
  }

  /** Called synchronously in arrival order; the backend call starts before this returns. */
  private dispatch(backend: BlockBackend, ctx: ValidationContext, req: codec.Request, payload: Buffer | undefined, chunks?: Buffer[]): void {
    const slotBytes = this.slotBytes(req);
    let done = (): void => this.releaseSlot(slotBytes);
    if (req.type === C.NBD_CMD_READ) {
      // A READ held for maxConcurrentReads waits only for one executing: each done lets the
      // next go (so held READs cannot be left behind: one is held only while one executes).
      this.readsExecuting++;
      done = (): void => {
        this.readsExecuting--;
        this.releaseSlot(slotBytes);
        const limit = backend.maxConcurrentReads ?? Infinity;
        // One session, one export: the held READs are for this backend and context.
        while (this.heldReads.length > 0 && this.readsExecuting < limit) this.dispatch(backend, ctx, this.heldReads.shift()!, undefined);
      };
    }
    const stats = this.stats;
    const v = validateRequest(req, ctx);
    if (!v.ok) {
      this.opts.log.debug({ cmd: COMMAND_NAMES[req.type] ?? req.type, errno: v.errno, msg: v.message }, 'request refused');
      stats?.done(req.type, v.errno, 0, -1);
      this.replyError(req, v.errno, v.message, done);
      return;
    }
    if (this.shuttingDown) {
      stats?.done(req.type, C.NBD_ESHUTDOWN, 0, -1);
      this.replyError(req, C.NBD_ESHUTDOWN, 'server is shutting down', done);
      return;
    }
    // Only a FLUSH is timed (RequestStats.done): one clock read, none for other commands.
    const startedAt = stats !== undefined && req.type === C.NBD_CMD_FLUSH ? performance.now() : -1;
    const fua = (req.flags & C.NBD_CMD_FLAG_FUA) !== 0;
    const succeeded = (r: Reply | null): void => {
      stats?.done(req.type, 0, v.length, startedAt);
      if (!r) this.reply([this.okReply(req)], done);
      else if (r.release) { const release = r.release; this.reply(r.frames, () => { release(); done(); }); }
      else this.reply(r.frames, done);
    };
    const failed = (err: unknown): void => {
      const errno = toNbdErrno(err);
      stats?.done(req.type, errno, 0, startedAt);
      this.opts.log.warn({ cmd: COMMAND_NAMES[req.type], offset: v.offset, length: v.length, errno, err: errorMessage(err) }, 'request failed');
      this.replyError(req, errno, errorMessage(err), done);
    };
    // A READ the backend can answer on the spot (BlockBackend.readNow) is answered here, in
    // this turn, without a promise; else (and for every other command) through execute. A
    // small one is read into a buffer that also holds its reply header: one socket write.
    if (req.type === C.NBD_CMD_READ && v.length > 0 && backend.readNow && !backend.readLent) {
      const head = this.structured ? codec.OFFSET_DATA_HEADER_SIZE : C.SIMPLE_REPLY_SIZE;
      const whole = head + v.length <= CARVE_MAX ? carveBuffer(head + v.length) : null;
      const buf = whole ? whole.subarray(head) : acquireBuffer(v.length);
      let filled: boolean;
      try {
        filled = backend.readNow(v.offset, v.length, buf);
      } catch (err) {
        if (!whole) releaseBuffer(buf);
        failed(err);
        return;
      }
      if (filled) {
        if (!whole) { succeeded({ frames: this.readReply(req, [buf], v.length), release: () => releaseBuffer(buf) }); return; }
        if (this.structured) codec.writeOffsetDataHeader(whole, req.cookie, req.offset, v.length, true);
        else codec.writeSimpleReply(whole, 0, req.cookie);
        succeeded({ frames: [whole] });
        return;
      }
      if (!whole) releaseBuffer(buf); // a carved piece is simply left to the GC
    }
    // Likewise a WRITE without FUA the backend can take on the spot (BlockBackend.writeNow).
    if (req.type === C.NBD_CMD_WRITE && !fua && v.length > 0 && chunks && backend.writeNow) {
      let taken: boolean;
      try {
        taken = backend.writeNow(v.offset, chunks);
      } catch (err) {
        failed(err);
        return;
      }
      if (taken) { succeeded(null); return; }
    }
    let p: Promise<Reply | null>;
    try {
      p = this.execute(backend, req, v.offset, v.length, fua, payload, chunks);
    } catch (err) {
      p = Promise.reject(err);
    }
    p.then(succeeded, failed);
  }

  /** Resolves to the reply frames, or null for a plain success reply. */
  private execute(backend: BlockBackend, req: codec.Request, offset: number, length: number, fua: boolean, payload: Buffer | undefined, chunks?: Buffer[]): Promise<Reply | null> {
    switch (req.type) {
      case C.NBD_CMD_READ:
        if (length === 0) return Promise.resolve({ frames: this.readReply(req, [], 0) });
        if (backend.readLent) return backend.readLent(offset, length).then((l) => ({ frames: this.readReply(req, l.chunks, length), release: () => l.release() }));
        return this.pooledRead(backend, offset, length, req);
      case C.NBD_CMD_WRITE:
        if (length === 0) return fua ? backend.flush().then(() => null) : Promise.resolve(null);
        // Pieces are lent exactly when the backend takes lent pieces (transmission).
        if (chunks && backend.writeLent) return backend.writeLent(offset, chunks, fua).then(() => null);
        return backend.write(offset, payload!, fua).then(() => null);
      case C.NBD_CMD_FLUSH:
        return backend.flush().then(() => null);
      case C.NBD_CMD_TRIM:
        if (length === 0) return Promise.resolve(null);
        return backend.trim(offset, length, fua).then(() => null);
      case C.NBD_CMD_WRITE_ZEROES:
        if (length === 0) return Promise.resolve(null);
        return backend.zero(offset, length, {
          fua,
          mayTrim: (req.flags & C.NBD_CMD_FLAG_NO_HOLE) === 0,
          fastZero: (req.flags & C.NBD_CMD_FLAG_FAST_ZERO) !== 0,
        }).then(() => null);
      case C.NBD_CMD_CACHE:
        if (length === 0) return Promise.resolve(null);
        return backend.cache(offset, length).then(() => null);
      case C.NBD_CMD_BLOCK_STATUS: {
        const max = (req.flags & C.NBD_CMD_FLAG_REQ_ONE) ? 1 : MAX_BLOCK_STATUS_EXTENTS;
        return backend.blockStatus(offset, length, max).then((extents) => ({ frames: this.blockStatusReply(req, backend.size, offset, length, extents, max) }));
      }
      default:
        return Promise.reject(new InvalidArgumentError(`unknown command ${req.type}`));
    }
  }

  /** Reads into a pooled buffer, which goes back to the pool once the socket has sent it. */
  private async pooledRead(backend: BlockBackend, offset: number, length: number, req: codec.Request): Promise<Reply> {
    const buf = acquireBuffer(length);
    let data: Buffer;
    try {
      data = await backend.read(offset, length, buf);
    } catch (err) {
      releaseBuffer(buf);
      throw err;
    }
    if (data !== buf) { releaseBuffer(buf); return { frames: this.readReply(req, [data], data.length) }; }
    return { frames: this.readReply(req, [data], data.length), release: () => releaseBuffer(buf) };
  }

  private okReply(req: codec.Request): Buffer {
    return codec.encodeSimpleReply(0, req.cookie);
  }

  /** The reply to a READ whose data are `data` (pieces of `length` bytes in all). */
  private readReply(req: codec.Request, data: Buffer[], length: number): Buffer[] {
    if (!this.structured) return [codec.encodeSimpleReply(0, req.cookie), ...data];
    if (length === 0) return [codec.encodeNoneChunk(req.cookie)];
    return [codec.encodeOffsetDataHeader(req.cookie, req.offset, length, true), ...data];
  }

  private blockStatusReply(req: codec.Request, size: number, offset: number, length: number, raw: { length: number; flags: number }[], max: number): Buffer[] {
    const align = this.opts.blockSize.min;
    let extents = alignExtents(raw.filter((e) => e.length > 0), offset, align, size);
    // A backend that stopped early (REQ_ONE asks it for one extent) may leave a lone piece
    // shorter than a block: report the whole block as status 0, which is always safe,
    // rather than an extent the spec says must be a multiple of the minimum block size.
    const first = extents[0];
    if (extents.length === 1 && first && offset % align === 0 && first.length < align && offset + first.length < size) {
      extents = [{ length: Math.min(align, size - offset), flags: 0 }];
    }
    // Clip at the end of the request (lengths are u32 on the wire) and cap the count.
    const clipped: { length: number; flags: number }[] = [];
    let covered = 0;
    for (const e of extents) {
      if (covered >= length || clipped.length >= max) break;
      const len = Math.min(e.length, length - covered);
      clipped.push({ length: len, flags: e.flags });
      covered += len;
    }
    extents = clipped.length > 0 ? clipped : [{ length, flags: 0 }]; // status 0 is always safe
    return [codec.encodeBlockStatusChunk(req.cookie, BASE_ALLOCATION_ID, extents, true)];
  }

  private replyError(req: codec.Request, errno: number, message: string, done: () => void): void {
    if (this.structured && (req.type === C.NBD_CMD_READ || req.type === C.NBD_CMD_BLOCK_STATUS)) {
      this.reply([codec.encodeErrorChunk(req.cookie, errno, message, true)], done);
    } else {
      this.reply([codec.encodeSimpleReply(errno, req.cookie)], done);
    }
  }

  /**
   * Replies completing in the same turn of the event loop go out in one writev: the socket
   * stays corked until the microtasks of this turn have run.
   */
  private reply(bufs: Buffer[], done: () => void): void {
    if (this.closed || this.sock.destroyed || this.sock.writableEnded) { done(); return; }
    if (!this.corked) {
      this.corked = true;
      this.sock.cork();
      process.nextTick(() => { this.corked = false; this.sock.uncork(); });
    }
    for (let i = 0; i < bufs.length - 1; i++) this.sock.write(bufs[i]!);
    this.sock.write(bufs[bufs.length - 1]!, () => done());
  }
}


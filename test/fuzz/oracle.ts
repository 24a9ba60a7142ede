/**
 * The oracle, part 1: what the server must do with a byte stream. It reads the client's bytes
 * the way the spec frames them (doc/proto.md "Fixed newstyle negotiation", "Transmission";
 * notes §1.2-§1.9) and produces the sequence of exchanges the server owes: option replies in
 * order, then one reply per request (any order), then a close. Part 2 (checker.ts) holds the
 * server's bytes against it.
 *
 * Where the spec leaves a choice, the oracle accepts every answer the spec allows, except
 * where the choice feeds later state or is baton's documented behaviour; those are marked
 * "baton:" below and come from nbd/README.md and nbd/session.ts:
 * - baton: past maxOptions options, an option longer than maxOptionLength, a WRITE payload
 *   over 32 MiB, a bad option or request magic, a non-fixed-newstyle client's option other
 *   than EXPORT_NAME: hang up (the spec allows a hard disconnect for each). Replies to
 *   everything before the offending frame still arrive (session.ts: requests already
 *   dispatched are completed and answered first).
 * - baton: STRUCTURED_REPLY is accepted the first time (ACK), a repeat gets ERR_INVALID or ACK.
 * - baton: unaligned requests are served (min block 512 is advertised with read-modify-write
 *   in the engine, for nbdfuse); the spec would also allow EINVAL.
 * - baton: "" names no export when more than one volume exists (ERR_UNKNOWN).
 * - baton: the transmission flags are exactly the set validate.ts documents.
 */

import { CF, CMD, E, IHAVEOPT, INFO, MAX_PAYLOAD, MAX_STRING, OPT, REP, REQUEST_MAGIC, TF, BASE_ALLOCATION, allExportNames, type World } from './proto.js';

export interface ExportDesc { name: string; size: number; readOnly: boolean }

export type OptExpect =
  /** An error reply (the only reply), of one of these types. */
  | { t: 'error'; allowed: number[]; why: string }
  /** STRUCTURED_REPLY accepted: ACK only (or, for a repeat, ERR_INVALID). */
  | { t: 'sr'; repeat: boolean }
  /** LIST: one SERVER per export, then ACK. */
  | { t: 'list' }
  /** INFO/GO: INFO replies (EXPORT always, plus what was asked), then ACK. */
  | { t: 'info'; exp: ExportDesc; asked: number[]; go: boolean; structured: boolean }
  /** LIST/SET_META_CONTEXT: exactly these contexts, then ACK; or one of `alt` as the only reply. */
  | { t: 'meta'; set: boolean; contexts: string[]; alt: number[] }
  /** ABORT: ACK, then the server closes. */
  | { t: 'abort' };

export type Ev =
  | { k: 'opt'; end: number; option: number; data: Buffer; exp: OptExpect }
  | { k: 'export-name'; end: number; exp: ExportDesc; noZeroes: boolean; structured: boolean }
  | { k: 'req'; end: number; burst: number; seq: number; req: Req; payload: Buffer | null; allowed: Set<number> }
  /** The server must close here, after answering everything before. */
  | { k: 'close'; at: number; why: string }
  /** The client's bytes end here (mid-frame or not). */
  | { k: 'eof'; at: number; midFrame: boolean };

export interface Req {
  flags: number;
  type: number;
  cookie: Buffer;
  cookieHex: string;
  offset: bigint;
  length: number;
}

export interface Transmission {
  exp: ExportDesc;
  structured: boolean;
  /** base:allocation was selected for this export (BLOCK_STATUS allowed). */
  blockStatus: boolean;
  /** The flags the server must advertise. */
  eflags: number;
  /** Stream offset where transmission starts. */
  start: number;
}

export interface Parsed {
  events: Ev[];
  tx: Transmission | null;
  /** Where the server stops reading (a close event), or the end of the stream. */
  stopAt: number;
  closes: boolean;
  /** The last event is 'eof' in the handshake phase: with no FIN, only the handshake timer ends it. */
  stallsInHandshake: boolean;
}

/** baton: the transmission flags validate.ts advertises (transmissionFlags()). */
export function expectedEflags(readOnly: boolean, structured: boolean): number {
  let f = TF.HAS_FLAGS | TF.SEND_FLUSH | TF.SEND_FUA | TF.CAN_MULTI_CONN | TF.SEND_CACHE;
  if (readOnly) f |= TF.READ_ONLY;
  else f |= TF.SEND_TRIM | TF.SEND_WRITE_ZEROES | TF.SEND_FAST_ZERO;
  if (structured) f |= TF.SEND_DF;
  return f;
}

export function exportTable(w: World): Map<string, ExportDesc> {
  const m = new Map<string, ExportDesc>();
  for (const name of allExportNames(w)) {
    if (name === w.roName) m.set(name, { name, size: w.roSize, readOnly: true });
    else if (name === w.victimName) m.set(name, { name, size: w.victimSize, readOnly: false });
    else if (name === w.roName.split('@')[0]) m.set(name, { name, size: w.roSize, readOnly: false });
    else m.set(name, { name, size: w.laneSize, readOnly: false });
  }
  return m;
}

const strictUtf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

/** A spec string: valid UTF-8 without NUL (the MUST ≤ 4096 bytes is checked by callers). */
export function specString(b: Buffer): string | null {
  try {
    const s = strictUtf8.decode(b);
    return s.includes('\0') ? null : s;
  } catch {
    return null;
  }
}

type Decoded<T> = { ok: true; v: T } | { ok: false; tooBig: boolean; why: string };

/** INFO/GO data (§1.3): u32 namelen, name, u16 n, n × u16; the lengths must add up exactly. */
export function decodeInfo(d: Buffer): Decoded<{ name: string; infos: number[] }> {
  if (d.length < 6) return { ok: false, tooBig: false, why: `INFO/GO data of ${d.length} bytes (< 6)` };
  const nl = d.readUInt32BE(0);
  if (nl > MAX_STRING) return { ok: false, tooBig: true, why: `name length ${nl} > 4096` };
  if (4 + nl + 2 > d.length) return { ok: false, tooBig: false, why: 'name runs past the option' };
  const name = specString(d.subarray(4, 4 + nl));
  if (name === null) return { ok: false, tooBig: false, why: 'name is not a valid string' };
  const n = d.readUInt16BE(4 + nl);
  if (6 + nl + 2 * n !== d.length) return { ok: false, tooBig: false, why: `${n} info requests do not fill ${d.length} bytes` };
  const infos: number[] = [];
  for (let i = 0; i < n; i++) infos.push(d.readUInt16BE(6 + nl + 2 * i));
  return { ok: true, v: { name, infos } };
}

/** LIST/SET_META_CONTEXT data (§1.3): u32 namelen, name, u32 n, n × (u32 len, query); exact length. */
export function decodeMeta(d: Buffer): Decoded<{ name: string; queries: string[] }> {
  let off = 0;
  const need = (n: number): boolean => off + n <= d.length;
  if (!need(4)) return { ok: false, tooBig: false, why: 'no name length' };
  const nl = d.readUInt32BE(off); off += 4;
  if (nl > MAX_STRING) return { ok: false, tooBig: true, why: `name length ${nl} > 4096` };
  if (!need(nl)) return { ok: false, tooBig: false, why: 'name runs past the option' };
  const name = specString(d.subarray(off, off + nl)); off += nl;
  if (name === null) return { ok: false, tooBig: false, why: 'name is not a valid string' };
  if (!need(4)) return { ok: false, tooBig: false, why: 'no query count' };
  const n = d.readUInt32BE(off); off += 4;
  const queries: string[] = [];
  for (let i = 0; i < n; i++) {
    if (!need(4)) return { ok: false, tooBig: false, why: `query ${i} length runs past the option` };
    const ql = d.readUInt32BE(off); off += 4;
    if (ql > MAX_STRING) return { ok: false, tooBig: true, why: `query length ${ql} > 4096` };
    if (!need(ql)) return { ok: false, tooBig: false, why: `query ${i} runs past the option` };
    const q = specString(d.subarray(off, off + ql)); off += ql;
    if (q === null) return { ok: false, tooBig: false, why: `query ${i} is not a valid string` };
    queries.push(q);
  }
  if (off !== d.length) return { ok: false, tooBig: false, why: 'trailing bytes' };
  return { ok: true, v: { name, queries } };
}

const invalid = (d: Decoded<unknown>): number[] => (d.ok ? [] : d.tooBig ? [REP.ERR_INVALID, REP.ERR_TOO_BIG] : [REP.ERR_INVALID]);

export interface ParseContext {
  world: World;
  /** Cumulative end offset of each send, and whether the client waits after it. */
  sendEnds: number[];
  waitAfter: boolean[];
}

/**
 * Read the client's stream as the server must. `burst` of a request = how many waits the
 * client made before its last byte went out: requests of different bursts never overlap in
 * time, so their effects are ordered.
 */
export function parse(stream: Buffer, ctx: ParseContext): Parsed {
  const w = ctx.world;
  const lim = w.limits;
  const table = exportTable(w);
  const events: Ev[] = [];
  let pos = 0;
  const burstOf = (end: number): number => {
    let b = 0;
    for (let i = 0; i < ctx.sendEnds.length; i++) if (ctx.waitAfter[i] && ctx.sendEnds[i]! < end) b++;
    return b;
  };
  const done = (p: Omit<Parsed, 'events' | 'stallsInHandshake' | 'closes' | 'stopAt'>): Parsed => {
    const last = events[events.length - 1];
    const closes = last?.k === 'close';
    return {
      events, ...p,
      closes,
      stopAt: last?.k === 'close' ? last.at : stream.length,
      stallsInHandshake: last?.k === 'eof' && p.tx === null,
    };
  };
  // `at`: how far the server has read when it decides to close (it reads a whole header first).
  const close = (why: string, at = pos): void => { events.push({ k: 'close', at, why }); };
  const eof = (midFrame: boolean): void => { events.push({ k: 'eof', at: stream.length, midFrame }); };

  // Client flags (§1.2): unknown bits (or NO_ZEROES not offered; we offer it) => the server MUST drop the connection.
  if (stream.length < 4) { eof(stream.length > 0); return done({ tx: null }); }
  const cflags = stream.readUInt32BE(0);
  pos = 4;
  if ((cflags & ~0x3) !== 0) { close('unknown client flags'); return done({ tx: null }); }
  const fixed = (cflags & 1) !== 0;
  const noZeroes = (cflags & 2) !== 0;

  let structured = false;
  let meta: { exportName: string } | null = null;
  let count = 0;
  let tx: Transmission | null = null;
  for (;;) {
    if (count >= lim.maxOptions) { close(`baton: more than ${lim.maxOptions} options`); return done({ tx: null }); }
    if (pos + 16 > stream.length) { eof(pos < stream.length); return done({ tx: null }); }
    const magic = stream.readBigUInt64BE(pos);
    const option = stream.readUInt32BE(pos + 8);
    const length = stream.readUInt32BE(pos + 12);
    if (magic !== IHAVEOPT) { close('baton: bad option magic', pos + 16); return done({ tx: null }); }
    if (length > lim.maxOptionLength) { close(`baton: option length ${length} > ${lim.maxOptionLength}`, pos + 16); return done({ tx: null }); }
    if (pos + 16 + length > stream.length) { eof(true); return done({ tx: null }); }
    const data = stream.subarray(pos + 16, pos + 16 + length);
    if (!fixed && option !== OPT.EXPORT_NAME) { pos += 16 + length; close('baton: option from a non-fixed-newstyle client'); return done({ tx: null }); }
    pos += 16 + length;
    count++;
    const end = pos;
    const opt = (exp: OptExpect): void => { events.push({ k: 'opt', end, option, data, exp }); };
    switch (option) {
      case OPT.EXPORT_NAME: {
        const name = specString(data);
        const exp = name === null ? undefined : table.get(name);
        if (!exp) { close('EXPORT_NAME of an unknown export: the server MUST terminate the session'); return done({ tx: null }); }
        events.push({ k: 'export-name', end, exp, noZeroes, structured });
        tx = { exp, structured, blockStatus: structured && meta?.exportName === exp.name, eflags: expectedEflags(exp.readOnly, structured), start: pos };
        break;
      }
      case OPT.ABORT:
        opt({ t: 'abort' });
        close('ABORT');
        return done({ tx: null });
      case OPT.LIST:
        opt(data.length ? { t: 'error', allowed: [REP.ERR_INVALID], why: 'LIST with data' } : { t: 'list' });
        break;
      case OPT.INFO:
      case OPT.GO: {
        const d = decodeInfo(data);
        if (!d.ok) { opt({ t: 'error', allowed: invalid(d), why: d.why }); break; }
        const exp = table.get(d.v.name);
        if (!exp) { opt({ t: 'error', allowed: [REP.ERR_UNKNOWN], why: `no export ${JSON.stringify(d.v.name)}` }); break; }
        opt({ t: 'info', exp, asked: d.v.infos, go: option === OPT.GO, structured });
        if (option === OPT.GO) {
          // Meta context selection applies to the export GO names.
          tx = { exp, structured, blockStatus: structured && meta?.exportName === exp.name, eflags: expectedEflags(exp.readOnly, structured), start: pos };
        }
        break;
      }
      case OPT.STRUCTURED_REPLY:
        if (data.length) opt({ t: 'error', allowed: [REP.ERR_INVALID], why: 'STRUCTURED_REPLY with data' });
        else { opt({ t: 'sr', repeat: structured }); structured = true; }
        break;
      case OPT.LIST_META:
      case OPT.SET_META: {
        const set = option === OPT.SET_META;
        if (set) meta = null; // SET replaces the selection, even when it fails
        const d = decodeMeta(data);
        if (!d.ok) { opt({ t: 'error', allowed: invalid(d), why: d.why }); break; }
        if (set && !structured) { opt({ t: 'error', allowed: [REP.ERR_INVALID], why: 'SET_META_CONTEXT before STRUCTURED_REPLY' }); break; }
        const q = d.v.queries;
        // LIST: no query = all contexts; "base:" is a wildcard for LIST only; unknown names ignored.
        const hit = q.length === 0 ? !set : q.some((x) => x === BASE_ALLOCATION || (!set && x === 'base:'));
        const alt: number[] = [];
        if (!table.has(d.v.name)) alt.push(REP.ERR_UNKNOWN); // the spec lets a server refuse an unknown export here
        if (!set && !structured) alt.push(REP.ERR_INVALID); // spec versions differ on LIST before STRUCTURED_REPLY
        opt({ t: 'meta', set, contexts: hit ? [BASE_ALLOCATION] : [], alt });
        if (set && hit) meta = { exportName: d.v.name };
        break;
      }
      case OPT.STARTTLS:
        opt({ t: 'error', allowed: [REP.ERR_UNSUP, REP.ERR_POLICY], why: 'no TLS' });
        break;
      default:
        // Unknown options (EXTENDED_HEADERS, PEEK_EXPORT included): payload consumed, ERR_UNSUP, go on.
        opt({ t: 'error', allowed: [REP.ERR_UNSUP], why: `option ${option >>> 0} unsupported` });
    }
    if (tx) break;
  }

  // Transmission (§1.4): 28-byte headers; only WRITE carries a payload.
  let seq = 0;
  for (;;) {
    if (pos + 28 > stream.length) { eof(pos < stream.length); break; }
    if (stream.readUInt32BE(pos) !== REQUEST_MAGIC) { close('baton: bad request magic', pos + 28); break; }
    const req: Req = {
      flags: stream.readUInt16BE(pos + 4),
      type: stream.readUInt16BE(pos + 6),
      cookie: stream.subarray(pos + 8, pos + 16),
      cookieHex: stream.subarray(pos + 8, pos + 16).toString('hex'),
      offset: stream.readBigUInt64BE(pos + 16),
      length: stream.readUInt32BE(pos + 24),
    };
    if (req.type === CMD.DISC) { pos += 28; close('DISC'); break; }
    let payload: Buffer | null = null;
    if (req.type === CMD.WRITE) {
      if (req.length > MAX_PAYLOAD) { close(`baton: WRITE payload of ${req.length} bytes > 32 MiB`, pos + 28); break; }
      if (pos + 28 + req.length > stream.length) { eof(true); break; }
      payload = stream.subarray(pos + 28, pos + 28 + req.length);
    }
    pos += 28 + (payload ? payload.length : 0);
    events.push({ k: 'req', end: pos, burst: burstOf(pos), seq: seq++, req, payload, allowed: allowedErrnos(req, tx) });
  }
  return done({ tx });
}

/** The errnos a reply may carry (0 = success), per §1.6 and §1.8. Several violations: any of their errnos. */
export function allowedErrnos(req: Req, tx: Transmission): Set<number> {
  const hard = new Set<number>();
  const soft = new Set<number>();
  const ef = tx.eflags;
  const { type, flags, length } = req;
  const known = [CMD.READ, CMD.WRITE, CMD.FLUSH, CMD.TRIM, CMD.CACHE, CMD.WRITE_ZEROES, CMD.BLOCK_STATUS] as number[];
  if (!known.includes(type)) return new Set([E.EINVAL]);
  let ok = ef & TF.SEND_FUA ? CF.FUA : 0;
  if (type === CMD.READ && ef & TF.SEND_DF) ok |= CF.DF;
  if (type === CMD.WRITE_ZEROES) ok |= CF.NO_HOLE | (ef & TF.SEND_FAST_ZERO ? CF.FAST_ZERO : 0);
  if (type === CMD.BLOCK_STATUS) ok |= CF.REQ_ONE;
  if (flags & ~ok) hard.add(E.EINVAL);
  const needs: Record<number, number> = { [CMD.FLUSH]: TF.SEND_FLUSH, [CMD.TRIM]: TF.SEND_TRIM, [CMD.WRITE_ZEROES]: TF.SEND_WRITE_ZEROES, [CMD.CACHE]: TF.SEND_CACHE };
  if (needs[type] !== undefined && !(ef & needs[type]!)) hard.add(E.EINVAL);
  const writeType = type === CMD.WRITE || type === CMD.TRIM || type === CMD.WRITE_ZEROES;
  if (writeType && tx.exp.readOnly) hard.add(E.EPERM);
  if (type === CMD.FLUSH) {
    if (req.offset !== 0n || length !== 0) soft.add(E.EINVAL); // reserved fields: EINVAL, or ignored
  } else {
    if (type === CMD.BLOCK_STATUS && !tx.blockStatus) hard.add(E.EINVAL);
    if (type === CMD.READ && length > MAX_PAYLOAD) { hard.add(E.EINVAL); hard.add(E.EOVERFLOW); }
    if (req.offset + BigInt(length) > BigInt(tx.exp.size)) hard.add(type === CMD.WRITE || type === CMD.WRITE_ZEROES ? E.ENOSPC : E.EINVAL);
    else if (length === 0) soft.add(E.EINVAL); // zero length: unspecified, no disconnect
  }
  if (hard.size) { for (const e of soft) hard.add(e); return hard; }
  const out = new Set<number>([0, ...soft]);
  if (type === CMD.WRITE_ZEROES && flags & CF.FAST_ZERO) out.add(E.ENOTSUP);
  return out;
}

/** The same data in an INFO reply and in the GO right after it (the spec's MUST), compared by the checker. */
export function infoKey(data: Buffer): string { return data.toString('hex'); }

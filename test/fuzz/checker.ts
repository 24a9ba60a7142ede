/**
 * The oracle, part 2: reads the server's bytes for one input and holds them against the
 * expectations from oracle.ts: the greeting, each option's replies in order, then one reply
 * per request in any order (matched by cookie; simple or structured as negotiated; errno in
 * the allowed set; READ data and BLOCK_STATUS ZERO extents against the content model), then
 * a close with nothing after it. Any deviation throws a Violation with what was expected.
 */

import { CF, CHUNK, CMD, CMD_NAMES, ERRNO_NAMES, INFO, IHAVEOPT, MAX_PAYLOAD, MAX_STRING, NBDMAGIC, REP, REPLY_FLAG_DONE, REP_MAGIC, SIMPLE_MAGIC, SPEC_ERRNOS, STATE_HOLE, STATE_ZERO, STRUCTURED_MAGIC, TF, allExportNames, isRepError, optName, repName, type World } from './proto.js';
import { Conn, Eof, Hang } from './conn.js';
import type { ContentModel, Range } from './model.js';
import { expectedEflags, infoKey, specString, type Ev, type ExportDesc, type OptExpect, type Parsed, type Req, type Transmission } from './oracle.js';

export class Violation extends Error {
  constructor(readonly kind: string, message: string) { super(message); }
}

class HandshakeTimedOut extends Error {}

const v = (kind: string, msg: string): Violation => new Violation(kind, msg);
const errnoName = (e: number): string => ERRNO_NAMES[e] ?? `errno ${e}`;
const setStr = (s: Set<number>): string => `{${[...s].map(errnoName).join(', ')}}`;

/** What became of one request: its errno (null = no reply) and the burst it was in. */
export interface Outcome { ev: Extract<Ev, { k: 'req' }>; errno: number | null }

export interface Stats {
  optReplies: Map<string, number>;
  results: Map<string, number>;
  transmissions: number;
  structured: number;
  blockStatusOk: number;
  readsVerifiedBytes: number;
  /** Handshakes the server's timer ended (slow negotiations on a loaded machine). */
  handshakeTimeouts: number;
}

export function newStats(): Stats {
  return { optReplies: new Map(), results: new Map(), transmissions: 0, structured: 0, blockStatusOk: 0, readsVerifiedBytes: 0, handshakeTimeouts: 0 };
}
const bump = (m: Map<string, number>, k: string): void => { m.set(k, (m.get(k) ?? 0) + 1); };

interface OptReply { option: number; type: number; data: Buffer }

interface Pending {
  ev: Extract<Ev, { k: 'req' }>;
  chunks: number;
  content: Range[];
  errored: number | null;
  blockStatusChunks: number;
  gotNone: boolean;
}

export interface CheckerOptions {
  world: World;
  /** Content of the attached export (null: none known, nothing compared). */
  model: (name: string) => ContentModel | null;
  deadline: () => number;
  /** The client is going to destroy the socket after the last reply: do not expect a close. */
  noCloseCheck: boolean;
  stats: Stats;
}

export class Checker {
  private readonly outstanding = new Map<string, Pending[]>();
  /** Request events not answered yet, by seq (the sender waits on them). */
  private readonly unanswered = new Set<number>();
  private handshakeDone = -1; // index of the last completed handshake event
  private finished = false;
  private waiters: (() => void)[] = [];
  readonly outcomes: Outcome[] = [];
  tx: Transmission | null = null;
  /** The context id the server gave base:allocation in SET_META_CONTEXT. */
  private contextId: number | null = null;
  private lastInfo: { data: string; replies: string } | null = null;
  private greetingFlags = 0;

  private readonly startedAt = Date.now();
  constructor(private readonly conn: Conn, private readonly parsed: Parsed, private readonly o: CheckerOptions) {}

  /** Resolves once every exchange whose bytes end at or before `pos` is complete, or the check ended. */
  waitThrough(pos: number): Promise<void> {
    return new Promise((resolve) => {
      const test = (): boolean => {
        if (this.finished) return true;
        for (let i = 0; i < this.parsed.events.length; i++) {
          const e = this.parsed.events[i]!;
          if (e.k === 'close' || e.k === 'eof') continue;
          if (e.end > pos) continue;
          if (e.k === 'req') { if (this.unanswered.has(e.seq) || !this.txStarted) return false; }
          else if (i > this.handshakeDone) return false;
        }
        return true;
      };
      if (test()) { resolve(); return; }
      const w = (): void => { if (test()) { this.waiters = this.waiters.filter((x) => x !== w); resolve(); } };
      this.waiters.push(w);
    });
  }

  private txStarted = false;
  /** The server's close was seen (after everything it owed). */
  sawClose = false;

  private progress(): void { for (const w of [...this.waiters]) w(); }

  get isFinished(): boolean { return this.finished; }

  /** Every request event, with or without a reply. */
  async run(): Promise<void> {
    try {
      await this.check();
    } catch (err) {
      // Our own destroy ends the check without a verdict on what was still owed.
      if (err instanceof HandshakeTimedOut) return;
      const cut = err instanceof Eof || err instanceof Hang || (err instanceof Violation && (err.kind === 'eof' || err.kind === 'hang'));
      if (this.conn.destroyed && cut) return;
      throw err;
    } finally {
      this.finished = true;
      this.progress();
    }
  }

  private read(n: number): Promise<Buffer> { return this.conn.read(n, this.o.deadline()); }

  private async check(): Promise<void> {
    const g = await this.read(18).catch((err) => { throw this.eofAs(err, 'greeting'); });
    if (g.readBigUInt64BE(0) !== NBDMAGIC || g.readBigUInt64BE(8) !== IHAVEOPT) throw v('greeting', `bad greeting ${g.toString('hex')}`);
    this.greetingFlags = g.readUInt16BE(16);
    if ((this.greetingFlags & ~0x3) !== 0 || !(this.greetingFlags & 1)) throw v('greeting', `handshake flags 0x${this.greetingFlags.toString(16)}: FIXED_NEWSTYLE must be set and no unknown bit`);
    if (!(this.greetingFlags & 2)) throw v('greeting', 'NO_ZEROES not offered (the oracle assumes it)');

    const evs = this.parsed.events;
    let i = 0;
    for (; i < evs.length; i++) {
      const e = evs[i]!;
      if (e.k === 'opt') { await this.option(e); this.handshakeDone = i; this.progress(); if (this.tx) { i++; break; } continue; }
      if (e.k === 'export-name') { await this.exportName(e); this.handshakeDone = i; this.progress(); i++; break; }
      if (e.k === 'close') { await this.expectClose(e.why); return; }
      if (e.k === 'eof') { await this.expectClose(e.midFrame ? 'the client stopped mid-frame in the handshake' : 'the client stopped in the handshake'); return; }
    }
    if (!this.tx) throw v('oracle', 'internal: handshake ended without transmission or close');
    this.txStarted = true;
    this.o.stats.transmissions++;
    if (this.tx.structured) this.o.stats.structured++;
    // Transmission: every request owed a reply, any order.
    const reqs: Extract<Ev, { k: 'req' }>[] = [];
    let terminal: Ev | null = null;
    for (; i < evs.length; i++) {
      const e = evs[i]!;
      if (e.k === 'req') reqs.push(e);
      else terminal = e;
    }
    for (const e of reqs) {
      const p: Pending = { ev: e, chunks: 0, content: [], errored: null, blockStatusChunks: 0, gotNone: false };
      const list = this.outstanding.get(e.req.cookieHex);
      if (list) list.push(p); else this.outstanding.set(e.req.cookieHex, [p]);
      this.unanswered.add(e.seq);
    }
    this.progress();
    while (this.unanswered.size > 0) {
      await this.reply();
      this.progress();
    }
    if (this.o.noCloseCheck) return;
    const why = terminal?.k === 'close' ? terminal.why : 'the client half-closed';
    await this.expectClose(why);
  }

  private eofAs(err: unknown, what: string): unknown {
    // The server's handshake timer may end a negotiation that took longer than it allows (a
    // hard disconnect, which the spec lets a server make; it may cut a reply short).
    if (err instanceof Eof && !this.txStarted && Date.now() - this.startedAt >= this.o.world.limits.handshakeTimeoutMs - 50) {
      this.o.stats.handshakeTimeouts++;
      return new HandshakeTimedOut();
    }
    if (err instanceof Eof) return v('eof', `the server closed the connection while ${what} was owed (${err.message})`);
    if (err instanceof Hang) return v('hang', `${what}: ${err.message}`);
    return err;
  }

  private async expectClose(why: string): Promise<void> {
    try {
      await this.conn.waitEof(this.o.deadline(), why);
    } catch (err) {
      if (err instanceof Hang) throw v('hang', `expected the server to close (${why}), it did not: ${err.message}`);
      throw err;
    }
    this.sawClose = !this.conn.destroyed;
    if (this.conn.unread > 0 && !this.conn.destroyed) {
      const extra = await this.read(Math.min(this.conn.unread, 64));
      throw v('extra-bytes', `after ${why} the server sent ${extra.length}+ more bytes: ${extra.toString('hex')}`);
    }
  }

  // ---------------------------------------------------------------- options

  private async optionReply(expectOption: number): Promise<OptReply> {
    const h = await this.read(20).catch((err) => { throw this.eofAs(err, `a reply to ${optName(expectOption)}`); });
    if (h.readBigUInt64BE(0) !== REP_MAGIC) throw v('option-reply', `reply to ${optName(expectOption)}: bad magic ${h.subarray(0, 8).toString('hex')}`);
    const option = h.readUInt32BE(8);
    const type = h.readUInt32BE(12);
    const len = h.readUInt32BE(16);
    if (option !== (expectOption >>> 0)) throw v('option-reply', `reply echoes option ${option}, expected ${expectOption >>> 0}`);
    if (len > 1024 * 1024) throw v('option-reply', `reply to ${optName(option)} of ${len} bytes`);
    const data = await this.read(len).catch((err) => { throw this.eofAs(err, `the data of a reply to ${optName(option)}`); });
    bump(this.o.stats.optReplies, `${optName(option)}:${repName(type)}`);
    if (isRepError(type)) {
      // Error replies MAY carry a human-readable message: a valid string of at most 4096 bytes.
      if (data.length > MAX_STRING || specString(data) === null) throw v('option-reply', `error ${repName(type)} to ${optName(option)} carries an invalid message (${data.length} bytes)`);
    }
    return { option, type, data: Buffer.from(data) };
  }

  /** Replies up to the final one (ACK or an error). */
  private async optionReplies(option: number): Promise<OptReply[]> {
    const out: OptReply[] = [];
    for (;;) {
      const r = await this.optionReply(option);
      out.push(r);
      if (r.type === REP.ACK || isRepError(r.type)) return out;
      if (out.length > 10_000) throw v('option-reply', `more than 10000 replies to ${optName(option)}`);
    }
  }

  private async option(e: Extract<Ev, { k: 'opt' }>): Promise<void> {
    const x = e.exp;
    const name = optName(e.option);
    if (x.t === 'abort') {
      const r = await this.optionReply(e.option);
      if (r.type !== REP.ACK || r.data.length !== 0) throw v('option-reply', `ABORT answered with ${repName(r.type)} (${r.data.length} bytes), expected an empty ACK`);
      return;
    }
    const replies = await this.optionReplies(e.option);
    const last = replies[replies.length - 1]!;
    const types = replies.map((r) => repName(r.type)).join(',');
    const prevInfo = this.lastInfo;
    this.lastInfo = null;
    if (x.t === 'error') {
      if (replies.length !== 1 || !x.allowed.includes(last.type)) throw v('option-reply', `${name}: got [${types}], expected one of ${x.allowed.map(repName).join('/')} (${x.why})`);
      return;
    }
    if (x.t === 'sr') {
      const ok = replies.length === 1 && (last.type === REP.ACK ? last.data.length === 0 : x.repeat && last.type === REP.ERR_INVALID);
      if (!ok) throw v('option-reply', `STRUCTURED_REPLY${x.repeat ? ' (repeat)' : ''}: got [${types}]`);
      return;
    }
    if (x.t === 'list') {
      if (last.type !== REP.ACK || last.data.length) throw v('option-reply', `LIST: got [${types}], expected SERVER* then ACK`);
      const names: string[] = [];
      for (const r of replies.slice(0, -1)) {
        if (r.type !== REP.SERVER || r.data.length < 4) throw v('option-reply', `LIST: reply ${repName(r.type)} of ${r.data.length} bytes`);
        const nl = r.data.readUInt32BE(0);
        if (nl > r.data.length - 4) throw v('option-reply', `LIST: name length ${nl} runs past a SERVER reply of ${r.data.length} bytes`);
        const n = specString(r.data.subarray(4, 4 + nl));
        if (n === null || specString(r.data.subarray(4 + nl)) === null) throw v('option-reply', 'LIST: SERVER reply with an invalid string');
        names.push(n);
      }
      const want = allExportNames(this.o.world);
      if (names.slice().sort().join('\n') !== want.join('\n')) throw v('option-reply', `LIST returned ${JSON.stringify(names)}, expected ${JSON.stringify(want)}`);
      return;
    }
    if (x.t === 'meta') {
      if (replies.length === 1 && x.alt.includes(last.type)) return;
      if (last.type !== REP.ACK || last.data.length) throw v('option-reply', `${name}: got [${types}], expected META_CONTEXT* then ACK${x.alt.length ? ` or ${x.alt.map(repName).join('/')}` : ''}`);
      const got: string[] = [];
      for (const r of replies.slice(0, -1)) {
        if (r.type !== REP.META_CONTEXT || r.data.length < 4) throw v('option-reply', `${name}: reply ${repName(r.type)} of ${r.data.length} bytes`);
        const n = specString(r.data.subarray(4));
        if (n === null) throw v('option-reply', `${name}: META_CONTEXT name is not a valid string`);
        got.push(n);
        if (x.set) this.contextId = r.data.readUInt32BE(0);
      }
      if (got.join('\n') !== x.contexts.join('\n')) throw v('option-reply', `${name}: contexts ${JSON.stringify(got)}, expected ${JSON.stringify(x.contexts)}`);
      if (x.set && got.length === 0) this.contextId = null;
      return;
    }
    // INFO / GO
    if (last.type !== REP.ACK || last.data.length) throw v('option-reply', `${name} ${x.exp.name}: got [${types}], expected INFO* then ACK`);
    this.checkInfos(name, x, replies.slice(0, -1));
    const key = infoKey(e.data);
    const rendered = replies.slice(0, -1).map((r) => r.data.toString('hex')).join('|');
    // "INFO then GO with the same parameters and nothing between MUST return the same data."
    if (x.go && prevInfo && prevInfo.data === key && prevInfo.replies !== rendered) throw v('option-reply', `GO ${x.exp.name} answered differently from the INFO right before it`);
    if (!x.go) this.lastInfo = { data: key, replies: rendered };
    if (x.go) this.tx = this.txFor(x.exp);
  }

  private txFor(exp: ExportDesc): Transmission {
    const t = this.parsed.tx;
    if (!t || t.exp.name !== exp.name) throw v('oracle', `internal: transmission on ${exp.name} not predicted`);
    if (t.blockStatus && this.contextId === null) throw v('option-reply', 'base:allocation selected but no context id seen');
    return t;
  }

  private checkInfos(name: string, x: Extract<OptExpect, { t: 'info' }>, infos: OptReply[]): void {
    const seen = new Map<number, Buffer>();
    for (const r of infos) {
      if (r.type !== REP.INFO || r.data.length < 2) throw v('option-reply', `${name}: reply ${repName(r.type)} of ${r.data.length} bytes before the ACK`);
      const t = r.data.readUInt16BE(0);
      if (seen.has(t)) throw v('option-reply', `${name}: info type ${t} sent twice`);
      seen.set(t, r.data);
    }
    const exp = seen.get(INFO.EXPORT);
    if (!exp) throw v('option-reply', `${name}: no NBD_INFO_EXPORT (qemu fails without it)`);
    if (exp.length !== 12) throw v('option-reply', `${name}: NBD_INFO_EXPORT of ${exp.length} bytes, must be 12`);
    const size = exp.readBigUInt64BE(2);
    const flags = exp.readUInt16BE(10);
    if (size !== BigInt(x.exp.size)) throw v('option-reply', `${name} ${x.exp.name}: size ${size}, expected ${x.exp.size}`);
    this.checkEflags(`${name} ${x.exp.name}`, flags, x.exp.readOnly, x.structured);
    for (const [t, d] of seen) {
      if (t === INFO.EXPORT) continue;
      if (t === INFO.NAME || t === INFO.DESCRIPTION) {
        const s = specString(d.subarray(2));
        if (s === null || d.length - 2 > MAX_STRING) throw v('option-reply', `${name}: info ${t} is not a valid string`);
        if (t === INFO.NAME && s !== x.exp.name) throw v('option-reply', `${name}: NBD_INFO_NAME ${JSON.stringify(s)}, expected ${JSON.stringify(x.exp.name)}`);
      } else if (t === INFO.BLOCK_SIZE) {
        if (d.length !== 14) throw v('option-reply', `${name}: NBD_INFO_BLOCK_SIZE of ${d.length} bytes, must be 14`);
        const min = d.readUInt32BE(2); const pref = d.readUInt32BE(6); const max = d.readUInt32BE(10);
        const pow2 = (n: number): boolean => n > 0 && (n & (n - 1)) === 0;
        if (!pow2(min) || min > 65536 || !pow2(pref) || pref < Math.max(min, 512) || max < pref || (max !== 0xffffffff && max % min !== 0)) {
          throw v('option-reply', `${name}: block sizes ${min}/${pref}/${max} break the spec's constraints`);
        }
        if (max !== MAX_PAYLOAD) throw v('option-reply', `${name}: maximum block size ${max}, but the payload limit enforced is ${MAX_PAYLOAD} (they must agree)`);
      } else {
        throw v('option-reply', `${name}: unknown info type ${t}`);
      }
    }
    for (const t of [INFO.NAME, INFO.DESCRIPTION, INFO.BLOCK_SIZE]) {
      if (x.asked.includes(t) && !seen.has(t)) throw v('option-reply', `${name}: asked for info ${t}, not sent`);
    }
  }

  private checkEflags(what: string, flags: number, readOnly: boolean, structured: boolean): void {
    if (!(flags & TF.HAS_FLAGS)) throw v('eflags', `${what}: HAS_FLAGS clear (0x${flags.toString(16)})`);
    if (!!(flags & TF.READ_ONLY) !== readOnly) throw v('eflags', `${what}: READ_ONLY ${flags & TF.READ_ONLY ? 'set' : 'clear'} on a ${readOnly ? 'read-only' : 'writable'} export`);
    if (flags & TF.SEND_DF && !structured) throw v('eflags', `${what}: SEND_DF without structured replies`);
    if (flags & TF.SEND_FAST_ZERO && !(flags & TF.SEND_WRITE_ZEROES)) throw v('eflags', `${what}: SEND_FAST_ZERO without SEND_WRITE_ZEROES`);
    const want = expectedEflags(readOnly, structured);
    if (flags !== want) throw v('eflags', `${what}: flags 0x${flags.toString(16)}, baton documents 0x${want.toString(16)}`);
  }

  private async exportName(e: Extract<Ev, { k: 'export-name' }>): Promise<void> {
    const n = e.noZeroes ? 10 : 134;
    const b = await this.read(n).catch((err) => { throw this.eofAs(err, `the EXPORT_NAME answer for ${e.exp.name}`); });
    bump(this.o.stats.optReplies, 'EXPORT_NAME:answer');
    const size = b.readBigUInt64BE(0);
    if (size !== BigInt(e.exp.size)) throw v('option-reply', `EXPORT_NAME ${e.exp.name}: size ${size}, expected ${e.exp.size}`);
    this.checkEflags(`EXPORT_NAME ${e.exp.name}`, b.readUInt16BE(8), e.exp.readOnly, e.structured);
    if (!e.noZeroes && b.subarray(10).some((x) => x !== 0)) throw v('option-reply', 'EXPORT_NAME: the 124 padding bytes are not zero');
    this.tx = this.parsed.tx;
    if (this.tx?.blockStatus && this.contextId === null) throw v('option-reply', 'base:allocation selected but no context id seen');
  }

  // ---------------------------------------------------------------- transmission

  /** Write-type requests of the same burst that overlap [offset, offset+length): their bytes are not compared. */
  private excludes(p: Pending): Range[] {
    const out: Range[] = [];
    for (const list of this.outstandingAll) {
      const e = list;
      if (e.burst !== p.ev.burst || e.seq === p.ev.seq) continue;
      const t = e.req.type;
      if (t !== CMD.WRITE && t !== CMD.TRIM && t !== CMD.WRITE_ZEROES) continue;
      if (e.req.offset > BigInt(Number.MAX_SAFE_INTEGER)) continue;
      out.push({ offset: Number(e.req.offset), length: e.req.length });
    }
    return out;
  }

  private get outstandingAll(): Extract<Ev, { k: 'req' }>[] {
    return this.parsed.events.filter((e): e is Extract<Ev, { k: 'req' }> => e.k === 'req');
  }

  private find(cookieHex: string, what: string): Pending {
    const list = this.outstanding.get(cookieHex);
    const p = list?.[0];
    if (!p) throw v('cookie', `${what} for cookie ${cookieHex}, which has no request outstanding (unknown, or answered already)`);
    return p;
  }

  private finish(p: Pending, errno: number): void {
    const list = this.outstanding.get(p.ev.req.cookieHex)!;
    list.shift();
    if (list.length === 0) this.outstanding.delete(p.ev.req.cookieHex);
    this.unanswered.delete(p.ev.seq);
    this.outcomes.push({ ev: p.ev, errno });
    const r = p.ev.req;
    bump(this.o.stats.results, `${CMD_NAMES[r.type] ?? 'unknown'}:${errnoName(errno)}`);
    if (!p.ev.allowed.has(errno)) {
      throw v('errno', `${describe(r)}: ${errno === 0 ? 'succeeded' : `failed with ${errnoName(errno)}`}, expected ${setStr(p.ev.allowed)}`);
    }
  }

  private modelFor(): ContentModel | null { return this.tx ? this.o.model(this.tx.exp.name) : null; }

  private async reply(): Promise<void> {
    const tx = this.tx!;
    const m = await this.read(4).catch((err) => { throw this.eofAs(err, `${this.unanswered.size} replies`); });
    const magic = m.readUInt32BE(0);
    if (magic === SIMPLE_MAGIC) {
      const h = await this.read(12).catch((err) => { throw this.eofAs(err, 'a simple reply header'); });
      const errno = h.readUInt32BE(0);
      const cookie = h.subarray(4, 12).toString('hex');
      const p = this.find(cookie, 'simple reply');
      const r = p.ev.req;
      if (p.chunks > 0) throw v('reply', `${describe(r)}: a simple reply after structured chunks`);
      if (tx.structured && (r.type === CMD.READ || r.type === CMD.BLOCK_STATUS)) throw v('reply', `${describe(r)}: simple reply although structured replies were negotiated (READ and BLOCK_STATUS must be structured)`);
      if (errno !== 0 && !SPEC_ERRNOS.has(errno)) throw v('errno', `${describe(r)}: errno ${errno} is not one the spec defines`);
      if (r.type === CMD.READ && errno === 0) {
        const data = await this.read(r.length).catch((err) => { throw this.eofAs(err, `${r.length} bytes of READ data`); });
        this.verifyData(p, Number(r.offset), data);
      }
      this.finish(p, errno);
      return;
    }
    if (magic !== STRUCTURED_MAGIC) throw v('reply', `reply magic 0x${magic.toString(16)} (neither simple nor structured)`);
    if (!tx.structured) throw v('reply', 'a structured reply chunk although structured replies were not negotiated');
    const h = await this.read(16).catch((err) => { throw this.eofAs(err, 'a chunk header'); });
    const flags = h.readUInt16BE(0);
    const type = h.readUInt16BE(2);
    const cookie = h.subarray(4, 12).toString('hex');
    const len = h.readUInt32BE(12);
    const p = this.find(cookie, `chunk type ${type}`);
    const r = p.ev.req;
    p.chunks++;
    if (flags & ~REPLY_FLAG_DONE) throw v('reply', `${describe(r)}: chunk flags 0x${flags.toString(16)}`);
    const done = (flags & REPLY_FLAG_DONE) !== 0;
    const inRange = (off: bigint, n: number): boolean => off >= r.offset && off + BigInt(n) <= r.offset + BigInt(r.length);
    const overlaps = (off: number, n: number): boolean => p.content.some((c) => off < c.offset + c.length && c.offset < off + n);
    if (type === CHUNK.NONE) {
      if (len !== 0 || !done) throw v('reply', `${describe(r)}: NONE chunk with length ${len}, DONE ${done}`);
      p.gotNone = true;
    } else if (type === CHUNK.OFFSET_DATA) {
      if (r.type !== CMD.READ) throw v('reply', `${describe(r)}: OFFSET_DATA chunk`);
      if (len < 9) throw v('reply', `${describe(r)}: OFFSET_DATA of length ${len}`);
      const b = await this.read(len).catch((err) => { throw this.eofAs(err, 'OFFSET_DATA payload'); });
      const off = b.readBigUInt64BE(0);
      const n = len - 8;
      if (!inRange(off, n)) throw v('reply', `${describe(r)}: OFFSET_DATA at ${off}+${n} outside the request`);
      if (overlaps(Number(off), n)) throw v('reply', `${describe(r)}: overlapping content chunks`);
      if (r.flags & CF.DF && p.content.length > 0) throw v('reply', `${describe(r)}: DF read answered in more than one content chunk`);
      p.content.push({ offset: Number(off), length: n });
      if (p.errored === null) this.verifyData(p, Number(off), b.subarray(8));
    } else if (type === CHUNK.OFFSET_HOLE) {
      if (r.type !== CMD.READ) throw v('reply', `${describe(r)}: OFFSET_HOLE chunk`);
      if (len !== 12) throw v('reply', `${describe(r)}: OFFSET_HOLE of length ${len}`);
      const b = await this.read(12).catch((err) => { throw this.eofAs(err, 'OFFSET_HOLE payload'); });
      const off = b.readBigUInt64BE(0);
      const n = b.readUInt32BE(8);
      if (n === 0 || !inRange(off, n)) throw v('reply', `${describe(r)}: OFFSET_HOLE ${off}+${n}`);
      if (overlaps(Number(off), n)) throw v('reply', `${describe(r)}: overlapping content chunks`);
      if (r.flags & CF.DF && p.content.length > 0) throw v('reply', `${describe(r)}: DF read answered in more than one content chunk`);
      p.content.push({ offset: Number(off), length: n });
      const model = this.modelFor();
      const bad = model?.nonZeroKnown(Number(off), n, this.excludes(p));
      if (bad) throw v('data', `${describe(r)}: OFFSET_HOLE over ${off}+${n}, but byte ${bad.offset} must be 0x${bad.expected.toString(16)}`);
    } else if (type === CHUNK.BLOCK_STATUS) {
      if (r.type !== CMD.BLOCK_STATUS) throw v('reply', `${describe(r)}: BLOCK_STATUS chunk`);
      if (len < 12 || (len - 4) % 8 !== 0) throw v('reply', `${describe(r)}: BLOCK_STATUS chunk of length ${len}`);
      const b = await this.read(len).catch((err) => { throw this.eofAs(err, 'BLOCK_STATUS payload'); });
      p.blockStatusChunks++;
      if (p.blockStatusChunks > 1) throw v('reply', `${describe(r)}: more than one BLOCK_STATUS chunk for one context`);
      if (b.readUInt32BE(0) !== this.contextId) throw v('reply', `${describe(r)}: context id ${b.readUInt32BE(0)}, SET_META_CONTEXT gave ${this.contextId}`);
      this.checkExtents(p, b);
    } else if (type === CHUNK.ERROR || type === CHUNK.ERROR_OFFSET) {
      const min = type === CHUNK.ERROR ? 6 : 14;
      if (len < min) throw v('reply', `${describe(r)}: error chunk of length ${len}`);
      const b = await this.read(len).catch((err) => { throw this.eofAs(err, 'error chunk payload'); });
      const errno = b.readUInt32BE(0);
      const ml = b.readUInt16BE(4);
      if (errno === 0) throw v('reply', `${describe(r)}: error chunk with error 0`);
      if (!SPEC_ERRNOS.has(errno)) throw v('errno', `${describe(r)}: errno ${errno} is not one the spec defines`);
      if (6 + ml > len - (min - 6)) throw v('reply', `${describe(r)}: error message length ${ml} runs past the chunk`);
      if (specString(b.subarray(6, 6 + ml)) === null) throw v('reply', `${describe(r)}: error message is not a valid string`);
      if (len > 1000) throw v('reply', `${describe(r)}: error chunk of ${len} bytes (qemu refuses non-data chunks over 1000)`);
      if (type === CHUNK.ERROR_OFFSET) {
        if (![CMD.READ, CMD.WRITE, CMD.TRIM, CMD.BLOCK_STATUS].includes(r.type as 0)) throw v('reply', `${describe(r)}: ERROR_OFFSET chunk`);
        const off = b.readBigUInt64BE(6 + ml);
        if (!inRange(off, 1)) throw v('reply', `${describe(r)}: ERROR_OFFSET at ${off} outside the request`);
      }
      if (p.errored === null) p.errored = errno;
    } else {
      throw v('reply', `${describe(r)}: unknown chunk type 0x${type.toString(16)}`);
    }
    if (!done) return;
    if (p.errored !== null) { this.finish(p, p.errored); return; }
    if (r.type === CMD.READ) {
      const covered = p.content.reduce((s, c) => s + c.length, 0);
      if (covered !== r.length) throw v('reply', `${describe(r)}: success with ${covered} of ${r.length} bytes covered`);
    } else if (r.type === CMD.BLOCK_STATUS) {
      if (p.blockStatusChunks !== 1) throw v('reply', `${describe(r)}: success without a BLOCK_STATUS chunk`);
    } else if (!p.gotNone) {
      throw v('reply', `${describe(r)}: structured success without a NONE chunk`);
    }
    this.finish(p, 0);
  }

  private verifyData(p: Pending, offset: number, data: Buffer): void {
    const model = this.modelFor();
    if (!model) return;
    const bad = model.verify(offset, data, this.excludes(p));
    if (bad) throw v('data', `${describe(p.ev.req)}: byte ${bad.offset} read 0x${bad.got.toString(16)}, the model says 0x${bad.expected.toString(16)}`);
    this.o.stats.readsVerifiedBytes += data.length;
  }

  private checkExtents(p: Pending, b: Buffer): void {
    const r = p.ev.req;
    const n = (b.length - 4) / 8;
    if (r.flags & CF.REQ_ONE && n !== 1) throw v('reply', `${describe(r)}: REQ_ONE answered with ${n} extents`);
    let pos = Number(r.offset);
    let sum = 0;
    const model = this.modelFor();
    for (let i = 0; i < n; i++) {
      const len = b.readUInt32BE(4 + 8 * i);
      const flags = b.readUInt32BE(8 + 8 * i);
      if (len === 0) throw v('reply', `${describe(r)}: extent ${i} of length 0`);
      if (flags & ~(STATE_HOLE | STATE_ZERO)) throw v('reply', `${describe(r)}: extent flags 0x${flags.toString(16)} (base:allocation defines HOLE and ZERO only)`);
      // The first n-1 extents sum to less than the request; none goes past the export's end.
      if (i < n - 1 && sum + len >= r.length) throw v('reply', `${describe(r)}: extents reach past the request before the last one`);
      if (r.flags & CF.REQ_ONE && len > r.length) throw v('reply', `${describe(r)}: REQ_ONE extent of ${len} > the request`);
      if (pos + len > this.tx!.exp.size) throw v('reply', `${describe(r)}: extent ${i} runs past the end of the export`);
      if (flags & STATE_ZERO && model) {
        const bad = model.nonZeroKnown(pos, len, this.excludes(p));
        if (bad) throw v('data', `${describe(r)}: extent ${pos}+${len} reported ZERO, but byte ${bad.offset} is 0x${bad.expected.toString(16)}`);
      }
      pos += len;
      sum += len;
    }
    this.o.stats.blockStatusOk++;
  }
}

export function describe(r: Req): string {
  return `${CMD_NAMES[r.type] ?? `command ${r.type}`}(flags=0x${r.flags.toString(16)}, offset=${r.offset}, length=${r.length}, cookie=${r.cookieHex})`;
}

/**
 * NbdSession driven over a real Unix socket pair by a tiny scripted raw client written here.
 * What the client sends is built by hand from the spec (test/fixtures/nbd-vectors.ts), never
 * by nbd/codec.ts; what it reads is parsed by spec-side parsers. The provider is a
 * VolumeExports-like ExportProvider over MemoryBackend.
 *
 * Spec: NetworkBlockDevice/nbd doc/proto.md; notes /work/shared/notes/nbd-protocol.md §1, §6.
 */

import test, { type ExecutionContext } from 'ava';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import type { BlockBackend, ExportHandle, ExportProvider, ExportSummary, Extent, ZeroOptions } from '../../nbd/backend.js';
import { DEFAULT_SESSION_OPTIONS, NbdSession, type SessionOptions } from '../../nbd/session.js';
import { MemoryBackend } from '../../src/backends/memory.js';
import { BlockCache } from '../../src/cache.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import { NotFoundError } from '../../src/errors.js';
import { silentLogger } from '../../src/log.js';
import * as V from '../fixtures/nbd-vectors.js';

// ------------------------------------------------------------------ spec values (§1.1), spelled out

const OPT = { EXPORT_NAME: 1, ABORT: 2, LIST: 3, STARTTLS: 5, INFO: 6, GO: 7, STRUCTURED_REPLY: 8, LIST_META: 9, SET_META: 10, EXTENDED_HEADERS: 11 } as const;
const REP = {
  ACK: 1, SERVER: 2, INFO: 3, META_CONTEXT: 4,
  ERR_UNSUP: 0x80000001, ERR_POLICY: 0x80000002, ERR_INVALID: 0x80000003, ERR_UNKNOWN: 0x80000006,
} as const;
const INFO = { EXPORT: 0, NAME: 1, DESCRIPTION: 2, BLOCK_SIZE: 3 } as const;
const CMD = { READ: 0, WRITE: 1, DISC: 2, FLUSH: 3, TRIM: 4, CACHE: 5, WRITE_ZEROES: 6, BLOCK_STATUS: 7 } as const;
const F = { FUA: 0x1, NO_HOLE: 0x2, DF: 0x4, REQ_ONE: 0x8 } as const;
const TF = { HAS_FLAGS: 0x1, READ_ONLY: 0x2, SEND_DF: 0x80 } as const;
const E = { EPERM: 1, EINVAL: 22, ENOSPC: 28 } as const;
const CHUNK = { NONE: 0, OFFSET_DATA: 1, OFFSET_HOLE: 2, BLOCK_STATUS: 5 } as const;
const DONE = 1;
const STATE_HOLE = 1;
const SIMPLE_MAGIC = 0x67446698;
const STRUCTURED_MAGIC = 0x668e33ef;

const SIZE = 1024 * 1024;
const MiB = 1024 * 1024;

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));
const isError = (type: number): boolean => (type & 0x80000000) !== 0;

// ------------------------------------------------------------------ a VolumeExports-like provider

/** Wraps a backend and delays writes, so requests are really in flight when the test wants them to be. */
class SlowBackend implements BlockBackend {
  constructor(private readonly inner: MemoryBackend, private readonly delayMs: number) {}
  get size(): number { return this.inner.size; }
  get readOnly(): boolean { return this.inner.readOnly; }
  read(offset: number, length: number): Promise<Buffer> { return this.inner.read(offset, length); }
  async write(offset: number, data: Buffer): Promise<void> { await sleep(this.delayMs); await this.inner.write(offset, data); }
  flush(): Promise<void> { return this.inner.flush(); }
  trim(offset: number, length: number): Promise<void> { return this.inner.trim(offset, length); }
  zero(offset: number, length: number, o: ZeroOptions): Promise<void> { return this.inner.zero(offset, length, o); }
  blockStatus(offset: number, length: number, max: number): Promise<Extent[]> { return this.inner.blockStatus(offset, length, max); }
  cache(): Promise<void> { return Promise.resolve(); }
}

/**
 * A backend that answers some READs and takes some WRITEs on the spot (readNow, writeNow):
 * false for [NOW_WAITS, +64 KiB), throws for the 4 KiB at NOW_THROWS, else the memory disk's
 * bytes; counts both paths.
 */
const NOW_WAITS = 768 * 1024;
const NOW_THROWS = 960 * 1024;
class NowBackend extends SlowBackend {
  nowCalls = 0;
  readCalls = 0;
  constructor(private readonly mem: MemoryBackend) { super(mem, 0); }
  override read(offset: number, length: number, into?: Buffer): Promise<Buffer> { this.readCalls++; return Promise.resolve(this.mem.readSync(offset, length, into)); }
  lentWrites = 0;
  nowWrites = 0;
  async writeLent(offset: number, chunks: readonly Buffer[]): Promise<void> { this.lentWrites++; this.mem.writeSync(offset, Buffer.concat(chunks)); }
  writeNow(offset: number, chunks: readonly Buffer[]): boolean {
    this.nowWrites++;
    let length = 0;
    for (const c of chunks) length += c.length;
    if (offset < NOW_WAITS + 64 * 1024 && offset + length > NOW_WAITS) return false;
    if (offset < NOW_THROWS + 4096 && offset + length > NOW_THROWS) throw new Error('a failed write');
    this.mem.writeSync(offset, Buffer.concat(chunks));
    return true;
  }
  readNow(offset: number, length: number, into: Buffer): boolean {
    this.nowCalls++;
    if (offset < NOW_WAITS + 64 * 1024 && offset + length > NOW_WAITS) return false;
    if (offset < NOW_THROWS + 4096 && offset + length > NOW_THROWS) throw new Error('a failed read');
    this.mem.readSync(offset, length, into);
    return true;
  }
}

const RO_PATTERN = Buffer.alloc(4096, 0xab);

class TestExports implements ExportProvider {
  readonly exports = new Map<string, { backend: BlockBackend; description: string }>();
  opens = 0;
  releases = 0;
  readonly disk = new MemoryBackend(SIZE);
  readonly ro = new MemoryBackend(SIZE, true);
  constructor(opts: { slowWritesMs?: number; readNow?: boolean } = {}) {
    const disk = opts.readNow ? new NowBackend(this.disk) : opts.slowWritesMs ? new SlowBackend(this.disk, opts.slowWritesMs) : this.disk;
    this.exports.set('disk', { backend: disk, description: 'scratch' });
    this.ro.writeSync(0, RO_PATTERN);
    this.exports.set('ro', { backend: this.ro, description: 'read-only image' });
  }
  async list(): Promise<ExportSummary[]> {
    return [...this.exports].map(([name, e]) => ({ name, description: e.description }));
  }
  /** "" means the only writable volume, like VolumeExports with one volume. */
  async open(requested: string): Promise<ExportHandle> {
    const name = requested === '' ? 'disk' : requested;
    const e = this.exports.get(name);
    if (!e) throw new NotFoundError(`no export named ${JSON.stringify(requested)}`);
    this.opens++;
    let released = false;
    return {
      name, description: e.description, backend: e.backend,
      release: () => { if (!released) { released = true; this.releases++; } },
    };
  }
}

// ------------------------------------------------------------------ the raw client

interface Sent { type: number; offset: bigint; length: number }
interface Reply {
  cookie: string;
  kind: 'simple' | 'structured';
  error: number;
  data?: Buffer;
  chunks: V.ParsedChunk[];
}

class RawClient {
  private buf = Buffer.alloc(0);
  private ended = false;
  private waiter: (() => void) | null = null;
  /** Requests sent and not yet answered, by cookie (hex). A reply to anything else is a failure. */
  readonly outstanding = new Map<string, Sent>();
  private readonly partial = new Map<string, V.ParsedChunk[]>();
  readonly closed: Promise<void>;

  constructor(readonly sock: net.Socket) {
    sock.on('data', (c: Buffer) => { this.buf = Buffer.concat([this.buf, c]); this.wake(); });
    sock.on('end', () => { this.ended = true; this.wake(); });
    sock.on('error', () => { this.ended = true; this.wake(); });
    this.closed = new Promise((resolve) => sock.on('close', () => { this.ended = true; this.wake(); resolve(); }));
  }

  private wake(): void { const w = this.waiter; this.waiter = null; w?.(); }

  get unread(): number { return this.buf.length; }
  get eof(): boolean { return this.ended; }

  write(b: Buffer): void { this.sock.write(b); }

  async read(n: number, timeoutMs = 3000): Promise<Buffer> {
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

  /** True if the server closed the connection within the time (bytes still unread do not matter). */
  async waitEof(timeoutMs = 2000): Promise<boolean> {
    const deadline = Date.now() + timeoutMs;
    while (!this.ended && Date.now() < deadline) {
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, Math.max(1, deadline - Date.now()));
        this.waiter = () => { clearTimeout(timer); resolve(); };
      });
    }
    return this.ended;
  }

  // -- handshake

  async greeting(): Promise<Buffer> { return this.read(18); }

  async optionReply(): Promise<V.ParsedOptionReply> {
    const h = await this.read(20);
    const data = await this.read(h.readUInt32BE(16));
    return V.parseOptionReply(Buffer.concat([h, data]));
  }

  /** Send an option and read its replies up to the final one (ACK or an error). */
  async option(option: number, data: Buffer = Buffer.alloc(0)): Promise<V.ParsedOptionReply[]> {
    this.write(V.optionFrame(option, data));
    const out: V.ParsedOptionReply[] = [];
    for (;;) {
      const r = await this.optionReply();
      out.push(r);
      if (r.type === REP.ACK || isError(r.type)) return out;
    }
  }

  // -- transmission

  send(r: V.RequestFields, payload?: Buffer): void {
    this.track(r);
    this.write(payload ? Buffer.concat([V.requestFrame(r), payload]) : V.requestFrame(r));
  }

  track(r: V.RequestFields): void {
    const key = r.cookie.toString('hex');
    if (this.outstanding.has(key)) throw new Error(`test bug: cookie ${key} reused while in flight`);
    this.outstanding.set(key, { type: r.type, offset: r.offset, length: r.length });
  }

  /** The next complete reply (a simple reply, or the structured chunks of one cookie up to DONE). */
  async reply(timeoutMs = 3000): Promise<Reply> {
    for (;;) {
      const m = (await this.read(4, timeoutMs)).readUInt32BE(0);
      if (m === SIMPLE_MAGIC) {
        const rest = await this.read(12, timeoutMs);
        const error = rest.readUInt32BE(0);
        const cookie = rest.subarray(4, 12).toString('hex');
        const s = this.outstanding.get(cookie);
        if (!s) throw new Error(`simple reply for unknown or already answered cookie ${cookie}`);
        if (this.partial.has(cookie)) throw new Error(`simple reply after structured chunks for ${cookie}`);
        this.outstanding.delete(cookie);
        const data = s.type === CMD.READ && error === 0 ? await this.read(s.length, timeoutMs) : undefined;
        return data ? { cookie, kind: 'simple', error, data, chunks: [] } : { cookie, kind: 'simple', error, chunks: [] };
      }
      if (m === STRUCTURED_MAGIC) {
        const rest = await this.read(16, timeoutMs);
        const payload = await this.read(rest.readUInt32BE(12), timeoutMs);
        const chunk = V.parseChunk(Buffer.concat([V.u32(m), rest, payload]));
        const cookie = Buffer.from(chunk.cookie).toString('hex');
        const s = this.outstanding.get(cookie);
        if (!s) throw new Error(`chunk for unknown or already answered cookie ${cookie}`);
        const list = this.partial.get(cookie) ?? [];
        list.push({ ...chunk, cookie: Buffer.from(chunk.cookie), payload: Buffer.from(chunk.payload) });
        this.partial.set(cookie, list);
        if (chunk.type === CHUNK.NONE && !(chunk.flags & DONE)) throw new Error('NONE chunk without DONE');
        if (!(chunk.flags & DONE)) continue;
        this.partial.delete(cookie);
        this.outstanding.delete(cookie);
        return assemble(cookie, s, list);
      }
      throw new Error(`bad reply magic 0x${m.toString(16)}`);
    }
  }

  async replies(n: number): Promise<Map<string, Reply>> {
    const out = new Map<string, Reply>();
    for (let i = 0; i < n; i++) {
      const r = await this.reply();
      if (out.has(r.cookie)) throw new Error(`second reply for cookie ${r.cookie}`);
      out.set(r.cookie, r);
    }
    return out;
  }
}

/** Structured reply → error and READ data, checking the chunk rules of §1.4/§1.6 on the way. */
function assemble(cookie: string, s: Sent, chunks: V.ParsedChunk[]): Reply {
  let error = 0;
  let data: Buffer | undefined;
  if (s.type === CMD.READ) data = Buffer.alloc(s.length);
  const covered = new Array<boolean>(s.type === CMD.READ ? s.length : 0).fill(false);
  for (const c of chunks) {
    if (c.type & 0x8000) {
      const e = V.parseErrorPayload(c.payload);
      if (e.error === 0) throw new Error('error chunk with error 0');
      error ||= e.error;
    } else if (c.type === CHUNK.OFFSET_DATA || c.type === CHUNK.OFFSET_HOLE) {
      if (s.type !== CMD.READ) throw new Error(`content chunk for command ${s.type}`);
      const off = Number(c.payload.readBigUInt64BE(0) - s.offset);
      const len = c.type === CHUNK.OFFSET_DATA ? c.payload.length - 8 : c.payload.readUInt32BE(8);
      if (c.type === CHUNK.OFFSET_HOLE && c.payload.length !== 12) throw new Error('OFFSET_HOLE length != 12');
      if (len <= 0 || off < 0 || off + len > s.length) throw new Error(`content chunk outside the request: off=${off} len=${len}`);
      for (let i = off; i < off + len; i++) { if (covered[i]) throw new Error('overlapping content chunks'); covered[i] = true; }
      if (c.type === CHUNK.OFFSET_DATA) c.payload.copy(data!, off, 8);
    } else if (c.type !== CHUNK.NONE && c.type !== CHUNK.BLOCK_STATUS) {
      throw new Error(`unexpected chunk type ${c.type}`);
    }
  }
  if (s.type === CMD.READ && error === 0 && covered.some((x) => !x)) throw new Error('READ reply does not cover the request');
  const r: Reply = { cookie, kind: 'structured', error, chunks };
  if (data && error === 0) r.data = data;
  return r;
}

// ------------------------------------------------------------------ harness

interface Harness {
  client: RawClient;
  run: Promise<void>;
  provider: TestExports;
  session: NbdSession;
}

async function start(t: ExecutionContext, opts: Partial<SessionOptions> = {}, provider = new TestExports()): Promise<Harness> {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-session-'));
  const sockPath = path.join(dir, 'nbd.sock');
  let accepted!: (v: { session: NbdSession; run: Promise<void> }) => void;
  const acceptedP = new Promise<{ session: NbdSession; run: Promise<void> }>((r) => { accepted = r; });
  const server = net.createServer((sock) => {
    const session = new NbdSession(sock, provider, { ...DEFAULT_SESSION_OPTIONS, log: silentLogger(), ...opts });
    accepted({ session, run: session.run() });
  });
  await new Promise<void>((resolve, reject) => { server.once('error', reject); server.listen(sockPath, resolve); });
  const sock = net.connect(sockPath);
  const client = new RawClient(sock);
  await new Promise<void>((resolve, reject) => { sock.once('connect', resolve); sock.once('error', reject); });
  const { session, run } = await acceptedP;
  t.teardown(async () => {
    sock.destroy();
    await Promise.race([run, sleep(5000)]);
    await new Promise<void>((resolve) => server.close(() => resolve()));
    fs.rmSync(dir, { recursive: true, force: true });
  });
  return { client, run, provider, session };
}

interface Negotiated { size: bigint; eflags: number }

/** Fixed-newstyle handshake by hand: greeting, flags, [STRUCTURED_REPLY], [SET_META_CONTEXT base:allocation], GO. */
async function negotiate(t: ExecutionContext, c: RawClient, o: { structured?: boolean; meta?: boolean; exportName?: string } = {}): Promise<Negotiated> {
  const name = o.exportName ?? 'disk';
  t.deepEqual(await c.greeting(), V.GREETING);
  c.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  if (o.structured) t.deepEqual((await c.option(OPT.STRUCTURED_REPLY)).map((r) => r.type), [REP.ACK]);
  if (o.meta) {
    const r = await c.option(OPT.SET_META, V.metaData(name, ['base:allocation']));
    t.deepEqual(r.map((x) => x.type), [REP.META_CONTEXT, REP.ACK]);
  }
  const replies = await c.option(OPT.GO, V.infoData(name, []));
  t.deepEqual(replies.map((r) => r.type), [REP.INFO, REP.ACK]);
  const info = replies[0]!.data;
  t.is(info.length, 12);
  t.is(info.readUInt16BE(0), INFO.EXPORT);
  return { size: info.readBigUInt64BE(2), eflags: info.readUInt16BE(10) };
}

let nextCookie = 1;
function cookie(): Buffer { return V.cookieOf(nextCookie++); }
function rq(type: number, offset: number | bigint, length: number, flags = 0, ck = cookie()): V.RequestFields {
  return { type, flags, cookie: ck, offset: BigInt(offset), length };
}
function pattern(seed: number, n: number): Buffer {
  const b = Buffer.alloc(n);
  for (let i = 0; i < n; i++) b[i] = (seed * 31 + i * 7) & 0xff;
  return b;
}

// ================================================================== handshake

test('greeting: NBDMAGIC, IHAVEOPT, flags 0x0003, and nothing else until the client speaks', async (t) => {
  const { client } = await start(t);
  t.deepEqual(await client.greeting(), V.GREETING);
  await sleep(50);
  t.is(client.unread, 0);
});

test('EXPORT_NAME with NO_ZEROES negotiated: a 10-byte answer, then transmission', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  client.write(V.OPTIONS.exportName.bytes);
  const ans = await client.read(10);
  t.is(ans.readBigUInt64BE(0), BigInt(SIZE));
  t.is(ans.readUInt16BE(8) & TF.HAS_FLAGS, TF.HAS_FLAGS);
  t.is(ans.readUInt16BE(8) & TF.READ_ONLY, 0);
  // The very next bytes must be the reply to this READ, not padding.
  const r = rq(CMD.READ, 0, 512);
  client.send(r);
  const reply = await client.reply();
  t.is(reply.kind, 'simple');
  t.is(reply.error, 0);
  t.is(reply.data?.length, 512);
});

test('EXPORT_NAME without C_NO_ZEROES: 10 bytes + 124 zero bytes = 134', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixed.bytes);
  client.write(V.OPTIONS.exportName.bytes);
  const ans = await client.read(134);
  t.is(ans.readBigUInt64BE(0), BigInt(SIZE));
  t.deepEqual(ans.subarray(10), Buffer.alloc(124));
  client.send(rq(CMD.FLUSH, 0, 0));
  const reply = await client.reply();
  t.is(reply.error, 0);
});

test('EXPORT_NAME for an unknown export: the server closes without a reply (no error reply exists)', async (t) => {
  const { client, run } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  client.write(V.optionFrame(OPT.EXPORT_NAME, Buffer.from('nope')));
  t.true(await client.waitEof());
  t.is(client.unread, 0);
  await t.notThrowsAsync(run);
});

test('unknown client flags: the server drops the connection', async (t) => {
  const { client, run } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.unknownBit2);
  client.write(V.OPTIONS.list.bytes);
  t.true(await client.waitEof());
  t.is(client.unread, 0);
  await t.notThrowsAsync(run);
});

test('bad option magic: the server drops the connection', async (t) => {
  const { client, run } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  client.write(V.hex('49484156454f5055 | 00000003 | 00000000'));
  t.true(await client.waitEof());
  await t.notThrowsAsync(run);
});

test('unknown option: payload consumed, ERR_UNSUP echoing the option, haggling continues', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  // nbd-tester-client's handshake test uses option 0x7654321; give it a payload that looks like an option.
  const r = await client.option(0x7654321, V.OPTIONS.list.bytes);
  t.is(r.length, 1);
  t.is(r[0]!.option, 0x7654321);
  t.is(r[0]!.type, REP.ERR_UNSUP);
  t.notThrows(() => r[0]!.data.toString('utf8'));
  // PEEK_EXPORT (4, withdrawn) is unknown too.
  t.is((await client.option(4))[0]!.type, REP.ERR_UNSUP);
  const list = await client.option(OPT.LIST);
  t.is(list[list.length - 1]!.type, REP.ACK);
  t.true(list.every((x) => x.option === OPT.LIST));
});

test('LIST: one SERVER reply per export (u32 namelen, name, description), then ACK', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  const r = await client.option(OPT.LIST);
  t.is(r[r.length - 1]!.type, REP.ACK);
  t.is(r[r.length - 1]!.data.length, 0);
  const servers = r.slice(0, -1);
  t.true(servers.every((x) => x.type === REP.SERVER && x.option === OPT.LIST));
  const entries = servers.map((x) => {
    const n = x.data.readUInt32BE(0);
    t.true(n <= x.data.length - 4);
    return { name: x.data.subarray(4, 4 + n).toString('utf8'), description: x.data.subarray(4 + n).toString('utf8') };
  });
  t.deepEqual(entries.sort((a, b) => a.name.localeCompare(b.name)), [{ name: 'disk', description: 'scratch' }, { name: 'ro', description: 'read-only image' }]);
});

test('LIST with data: ERR_INVALID, and haggling continues', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  const r = await client.option(OPT.LIST, Buffer.from('x'));
  t.deepEqual(r.map((x) => [x.option, x.type]), [[OPT.LIST, REP.ERR_INVALID]]);
  t.is((await client.option(OPT.LIST)).pop()!.type, REP.ACK);
});

test('ABORT: ACK, then the server closes; the export is never opened', async (t) => {
  const { client, run, provider } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  client.write(V.OPTIONS.abort.bytes);
  const r = await client.optionReply();
  t.deepEqual([r.option, r.type, r.data.length], [OPT.ABORT, REP.ACK, 0]);
  t.true(await client.waitEof());
  await t.notThrowsAsync(run);
  t.is(provider.opens, 0);
});

test('INFO for an unknown export: ERR_UNKNOWN with no INFO before it; GO still works afterwards', async (t) => {
  const { client, provider } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  const r = await client.option(OPT.INFO, V.infoData('nope', [INFO.BLOCK_SIZE]));
  t.deepEqual(r.map((x) => [x.option, x.type]), [[OPT.INFO, REP.ERR_UNKNOWN]]);
  const go = await client.option(OPT.GO, V.infoData('disk', []));
  t.deepEqual(go.map((x) => x.type), [REP.INFO, REP.ACK]);
  t.is(provider.opens, 1);
});

test('INFO/GO with a malformed payload: ERR_INVALID, haggling continues', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  for (const bad of [V.hex('00000004 | 6469736b | 0002 | 0003'), V.hex('0000000a | 6469736b | 0000'), V.hex('0000')]) {
    t.deepEqual((await client.option(OPT.GO, bad)).map((x) => x.type), [REP.ERR_INVALID]);
  }
  t.deepEqual((await client.option(OPT.GO, V.infoData('disk', []))).map((x) => x.type), [REP.INFO, REP.ACK]);
});

test('GO with zero info requests (nbd-client): INFO_EXPORT anyway, then ACK, then transmission with no padding', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  client.write(V.OPTIONS.goDefaultNoInfos.bytes);
  const info = await client.optionReply();
  t.deepEqual([info.option, info.type, info.data.length], [OPT.GO, REP.INFO, 12]);
  t.is(info.data.readUInt16BE(0), INFO.EXPORT);
  t.is(info.data.readBigUInt64BE(2), BigInt(SIZE));
  const eflags = info.data.readUInt16BE(10);
  t.is(eflags & TF.HAS_FLAGS, TF.HAS_FLAGS);
  t.is(eflags & TF.SEND_DF, 0, 'SEND_DF MUST be clear without structured replies');
  const ack = await client.optionReply();
  t.deepEqual([ack.option, ack.type, ack.data.length], [OPT.GO, REP.ACK, 0]);
  await sleep(30);
  t.is(client.unread, 0, 'no padding after GO');
  client.send(rq(CMD.READ, 0, 512));
  t.is((await client.reply()).error, 0);
});

test('GO/INFO: BLOCK_SIZE (512 / 4096 / 32 MiB, 14 bytes) only when requested; NAME and DESCRIPTION on request; unknown info types ignored', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);

  const plain = await client.option(OPT.INFO, V.infoData('disk', []));
  t.deepEqual(plain.map((x) => x.type), [REP.INFO, REP.ACK]);
  t.is(plain[0]!.data.readUInt16BE(0), INFO.EXPORT);

  const rich = await client.option(OPT.INFO, V.infoData('disk', [INFO.BLOCK_SIZE, INFO.NAME, INFO.DESCRIPTION, 0x4242]));
  t.is(rich[rich.length - 1]!.type, REP.ACK);
  const infos = rich.slice(0, -1);
  t.true(infos.every((x) => x.type === REP.INFO && x.option === OPT.INFO));
  const byType = new Map(infos.map((x) => [x.data.readUInt16BE(0), x.data] as const));
  t.is(infos.length, byType.size, 'each info at most once');
  t.deepEqual([...byType.keys()].sort(), [INFO.EXPORT, INFO.NAME, INFO.DESCRIPTION, INFO.BLOCK_SIZE].sort());
  const bs = byType.get(INFO.BLOCK_SIZE)!;
  t.is(bs.length, 14);
  t.deepEqual([bs.readUInt32BE(2), bs.readUInt32BE(6), bs.readUInt32BE(10)], [512, 4096, 32 * MiB]);
  t.is(byType.get(INFO.NAME)!.subarray(2).toString('utf8'), 'disk');
  t.is(byType.get(INFO.DESCRIPTION)!.subarray(2).toString('utf8'), 'scratch');

  // INFO then GO with the same parameters MUST return the same data.
  client.write(V.optionFrame(OPT.GO, V.infoData('disk', [INFO.BLOCK_SIZE, INFO.NAME, INFO.DESCRIPTION, 0x4242])));
  const go: V.ParsedOptionReply[] = [];
  for (;;) { const r = await client.optionReply(); go.push(r); if (r.type === REP.ACK || isError(r.type)) break; }
  t.deepEqual(go.map((x) => [x.type, x.data.toString('hex')]), rich.map((x) => [x.type, x.data.toString('hex')]));
  t.true(go.every((x) => x.option === OPT.GO));
});

test('INFO releases the export it opened; GO keeps it until the connection ends', async (t) => {
  const { client, run, provider } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  await client.option(OPT.INFO, V.infoData('disk', []));
  t.is(provider.opens, 1);
  t.is(provider.releases, 1);
  await client.option(OPT.GO, V.infoData('disk', []));
  t.is(provider.opens, 2);
  t.is(provider.releases, 1);
  client.sock.destroy();
  await run;
  t.is(provider.releases, 2);
});

test('STARTTLS: ERR_UNSUP (or ERR_POLICY), never ERR_TLS_REQD in NOTLS mode; EXTENDED_HEADERS: ERR_UNSUP; compact headers afterwards', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  const tls = await client.option(OPT.STARTTLS);
  t.is(tls.length, 1);
  t.is(tls[0]!.option, OPT.STARTTLS);
  t.true(tls[0]!.type === REP.ERR_UNSUP || tls[0]!.type === REP.ERR_POLICY, `got 0x${tls[0]!.type.toString(16)}`);
  const ext = await client.option(OPT.EXTENDED_HEADERS);
  t.deepEqual(ext.map((x) => [x.option, x.type]), [[OPT.EXTENDED_HEADERS, REP.ERR_UNSUP]]);
  const go = await client.option(OPT.GO, V.infoData('disk', []));
  t.deepEqual(go.map((x) => x.type), [REP.INFO, REP.ACK]);
  client.send(rq(CMD.READ, 0, 512));
  const r = await client.reply();
  t.deepEqual([r.kind, r.error], ['simple', 0]);
});

test('STRUCTURED_REPLY: ACK the first time, ERR_INVALID the second time; with data ERR_INVALID', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  t.deepEqual((await client.option(OPT.STRUCTURED_REPLY, Buffer.from([0]))).map((x) => x.type), [REP.ERR_INVALID]);
  t.deepEqual((await client.option(OPT.STRUCTURED_REPLY)).map((x) => [x.option, x.type, x.data.length]), [[OPT.STRUCTURED_REPLY, REP.ACK, 0]]);
  t.deepEqual((await client.option(OPT.STRUCTURED_REPLY)).map((x) => x.type), [REP.ERR_INVALID]);
  // SEND_DF appears once structured replies are on.
  const go = await client.option(OPT.GO, V.infoData('disk', []));
  t.is(go[0]!.data.readUInt16BE(10) & TF.SEND_DF, TF.SEND_DF);
});

test('SET_META_CONTEXT before STRUCTURED_REPLY: ERR_INVALID', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  const r = await client.option(OPT.SET_META, V.metaData('disk', ['base:allocation']));
  t.deepEqual(r.map((x) => [x.option, x.type]), [[OPT.SET_META, REP.ERR_INVALID]]);
});

test('SET_META_CONTEXT base:allocation: exactly one META_CONTEXT (id, name), then ACK; BLOCK_STATUS uses that id', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  await client.option(OPT.STRUCTURED_REPLY);
  const r = await client.option(OPT.SET_META, V.metaData('disk', ['base:allocation']));
  t.deepEqual(r.map((x) => [x.option, x.type]), [[OPT.SET_META, REP.META_CONTEXT], [OPT.SET_META, REP.ACK]]);
  const id = r[0]!.data.readUInt32BE(0);
  t.is(r[0]!.data.subarray(4).toString('utf8'), 'base:allocation');
  await client.option(OPT.GO, V.infoData('disk', []));
  client.send(rq(CMD.BLOCK_STATUS, 0, 4096));
  const bs = await client.reply();
  t.is(bs.error, 0);
  const chunks = bs.chunks.filter((c) => c.type === CHUNK.BLOCK_STATUS);
  t.is(chunks.length, 1, 'exactly one BLOCK_STATUS chunk per selected context');
  t.is(V.parseBlockStatusPayload(chunks[0]!.payload).contextId, id);
});

test('SET_META_CONTEXT with "base:" or an unknown namespace selects nothing: plain ACK, then BLOCK_STATUS is EINVAL', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  await client.option(OPT.STRUCTURED_REPLY);
  t.deepEqual((await client.option(OPT.SET_META, V.metaData('disk', ['base:']))).map((x) => x.type), [REP.ACK], '"base:" is a wildcard for LIST only');
  t.deepEqual((await client.option(OPT.SET_META, V.metaData('disk', ['qemu:dirty-bitmap:x']))).map((x) => x.type), [REP.ACK]);
  t.deepEqual((await client.option(OPT.SET_META, V.metaData('disk', []))).map((x) => x.type), [REP.ACK], 'zero queries select nothing');
  await client.option(OPT.GO, V.infoData('disk', []));
  client.send(rq(CMD.BLOCK_STATUS, 0, 4096));
  t.is((await client.reply()).error, E.EINVAL);
  client.send(rq(CMD.READ, 0, 512));
  t.is((await client.reply()).error, 0, 'the connection still works');
});

test('SET_META_CONTEXT for another export than the one GO selects: BLOCK_STATUS is EINVAL', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  await client.option(OPT.STRUCTURED_REPLY);
  t.deepEqual((await client.option(OPT.SET_META, V.metaData('ro', ['base:allocation']))).map((x) => x.type), [REP.META_CONTEXT, REP.ACK]);
  await client.option(OPT.GO, V.infoData('disk', []));
  client.send(rq(CMD.BLOCK_STATUS, 0, 4096));
  t.is((await client.reply()).error, E.EINVAL);
});

// BUG (nbd/session.ts handleMetaContext, lines ~267-282): a SET_META_CONTEXT whose payload
// fails to decode returns ERR_INVALID *before* `this.metaContextExport = null`, so the
// selection from an earlier successful SET survives. proto.md NBD_OPT_SET_META_CONTEXT:
// "Issuing this command replaces all previously-set metadata contexts (including when this
// command fails)"; a client MUST NOT send BLOCK_STATUS unless "the final time it was sent
// ... the server responded by returning at least one metadata context without error", and
// servers SHOULD answer such a BLOCK_STATUS with EINVAL. Here it is answered with extents.
test('a failed SET_META_CONTEXT still clears the earlier selection (BLOCK_STATUS then EINVAL)', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  await client.option(OPT.STRUCTURED_REPLY);
  t.deepEqual((await client.option(OPT.SET_META, V.metaData('disk', ['base:allocation']))).map((x) => x.type), [REP.META_CONTEXT, REP.ACK]);
  t.deepEqual((await client.option(OPT.SET_META, V.hex('00000004 | 6469736b | 00000001 | 000000ff'))).map((x) => x.type), [REP.ERR_INVALID]);
  await client.option(OPT.GO, V.infoData('disk', []));
  client.send(rq(CMD.BLOCK_STATUS, 0, 4096));
  t.is((await client.reply()).error, E.EINVAL);
});

test('LIST_META_CONTEXT: 0 queries → base:allocation; "base:" wildcard → base:allocation; unknown namespace ignored', async (t) => {
  const { client } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  await client.option(OPT.STRUCTURED_REPLY);
  const all = await client.option(OPT.LIST_META, V.metaData('disk', []));
  t.deepEqual(all.map((x) => [x.option, x.type]), [[OPT.LIST_META, REP.META_CONTEXT], [OPT.LIST_META, REP.ACK]]);
  t.is(all[0]!.data.subarray(4).toString('utf8'), 'base:allocation');
  t.is(all[0]!.data.readUInt32BE(0), 0, 'LIST context ids SHOULD be 0');
  // qemu-nbd -L sends "qemu:" and expects a plain ACK (§1.3).
  t.deepEqual((await client.option(OPT.LIST_META, V.metaData('disk', ['qemu:']))).map((x) => x.type), [REP.ACK]);
  const two = await client.option(OPT.LIST_META, V.metaData('disk', ['base:', 'qemu:']));
  t.deepEqual(two.map((x) => x.type), [REP.META_CONTEXT, REP.ACK]);
  t.is(two[0]!.data.subarray(4).toString('utf8'), 'base:allocation');
  // Lengths past the end MUST get ERR_INVALID.
  t.deepEqual((await client.option(OPT.LIST_META, V.hex('00000004 | 6469736b | 00000001 | 00000010 | 626173653a'))).map((x) => x.type), [REP.ERR_INVALID]);
  t.deepEqual((await client.option(OPT.LIST_META, Buffer.concat([V.metaData('disk', []), V.hex('00')]))).map((x) => x.type), [REP.ERR_INVALID]);
});

test('option replies in one connection: a whole qemu-style negotiation from the fixtures', async (t) => {
  const { client } = await start(t);
  t.deepEqual(await client.greeting(), V.GREETING);
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  client.write(V.OPTIONS.structuredReply.bytes);
  t.deepEqual(Buffer.concat([await client.read(20)]), V.hex('0003e889045565a9 | 00000008 | 00000001 | 00000000'));
  client.write(V.OPTIONS.setMetaBaseAllocation.bytes);
  const meta = await client.optionReply();
  t.is(meta.type, REP.META_CONTEXT);
  t.is(meta.data.subarray(4).toString('utf8'), 'base:allocation');
  t.is((await client.optionReply()).type, REP.ACK);
  client.write(V.OPTIONS.goWithInfos.bytes);
  const types: number[] = [];
  for (;;) { const r = await client.optionReply(); types.push(r.type === REP.INFO ? r.data.readUInt16BE(0) : -r.type); if (r.type === REP.ACK) break; }
  t.deepEqual(types.slice(0, -1).sort(), [INFO.EXPORT, INFO.NAME, INFO.BLOCK_SIZE].sort());
});

// ================================================================== transmission

test('simple mode: WRITE then READ round trip; FLUSH, TRIM, WRITE_ZEROES, CACHE; cookies echoed verbatim', async (t) => {
  const { client, provider } = await start(t);
  await negotiate(t, client);
  const data = pattern(1, 8192);
  const w = rq(CMD.WRITE, 4096, data.length, F.FUA, V.KERNEL_COOKIE);
  client.send(w, data);
  const wr = await client.reply();
  t.deepEqual([wr.kind, wr.cookie, wr.error], ['simple', V.KERNEL_COOKIE_HEX, 0]);
  client.send(rq(CMD.READ, 4096, 8192));
  const rr = await client.reply();
  t.deepEqual(rr.data, data);
  t.deepEqual(provider.disk.readSync(4096, 8192), data);

  client.send(rq(CMD.FLUSH, 0, 0));
  t.is((await client.reply()).error, 0);
  client.send(rq(CMD.WRITE_ZEROES, 4096, 4096, F.NO_HOLE));
  t.is((await client.reply()).error, 0);
  client.send(rq(CMD.READ, 4096, 8192));
  t.deepEqual((await client.reply()).data, Buffer.concat([Buffer.alloc(4096), data.subarray(4096)]));
  client.send(rq(CMD.TRIM, 0, 64 * 1024, F.FUA));
  t.is((await client.reply()).error, 0);
  client.send(rq(CMD.CACHE, 0, 64 * 1024));
  t.is((await client.reply()).error, 0);
  client.send(rq(CMD.READ, 0, 0));
  const zero = await client.reply();
  t.is(zero.error, 0);
});

test('64 pipelined WRITEs then 64 READs interleaved with 64 more WRITEs: each cookie answered exactly once, data intact', async (t) => {
  const { client } = await start(t);
  await negotiate(t, client);
  const N = 64;
  const len = 4096;
  const writes: Buffer[] = [];
  for (let i = 0; i < N; i++) {
    const r = rq(CMD.WRITE, i * 8192, len);
    client.track(r);
    writes.push(V.requestFrame(r), pattern(i, len));
  }
  client.write(Buffer.concat(writes)); // one burst: the server sees them coalesced
  const first = await client.replies(N);
  t.is(first.size, N);
  t.true([...first.values()].every((r) => r.kind === 'simple' && r.error === 0));

  const burst: Buffer[] = [];
  const readCookies = new Map<string, number>();
  for (let i = 0; i < N; i++) {
    const r = rq(CMD.READ, i * 8192, len);
    client.track(r);
    readCookies.set(r.cookie.toString('hex'), i);
    const w = rq(CMD.WRITE, 512 * 1024 + i * 4096, len);
    client.track(w);
    burst.push(V.requestFrame(r), V.requestFrame(w), pattern(1000 + i, len));
  }
  client.write(Buffer.concat(burst));
  const second = await client.replies(2 * N);
  t.is(second.size, 2 * N);
  t.is(client.outstanding.size, 0);
  for (const [ck, i] of readCookies) {
    const r = second.get(ck)!;
    t.is(r.error, 0);
    t.deepEqual(r.data, pattern(i, len), `read ${i}`);
  }
  await sleep(30);
  t.is(client.unread, 0, 'no stray replies');
});

test('frames split across many small writes and coalesced with the next one are parsed', async (t) => {
  const { client } = await start(t);
  await negotiate(t, client);
  const data = pattern(9, 3000);
  const w = rq(CMD.WRITE, 1000, data.length);
  const r = rq(CMD.READ, 1000, data.length);
  client.track(w);
  client.track(r);
  const bytes = Buffer.concat([V.requestFrame(w), data, V.requestFrame(r)]);
  for (let off = 0; off < bytes.length;) {
    const n = Math.min(bytes.length - off, [1, 3, 7, 28, 500][off % 5]!);
    client.write(bytes.subarray(off, off + n));
    off += n;
    if (off % 4 === 0) await sleep(1);
  }
  const replies = await client.replies(2);
  t.is(replies.get(w.cookie.toString('hex'))!.error, 0);
  t.deepEqual(replies.get(r.cookie.toString('hex'))!.data, data);
});

test('structured READ: content chunks covering the range, final chunk with DONE, never a simple reply', async (t) => {
  const { client, provider } = await start(t);
  await negotiate(t, client, { structured: true });
  const data = pattern(3, 4096);
  provider.disk.writeSync(8192, data);
  client.send(rq(CMD.READ, 8192, 4096));
  const r = await client.reply();
  t.is(r.kind, 'structured');
  t.is(r.error, 0);
  t.deepEqual(r.data, data);
  t.true(r.chunks.some((c) => c.type === CHUNK.OFFSET_DATA), 'an OFFSET_DATA chunk');
  t.is(r.chunks[r.chunks.length - 1]!.flags & DONE, DONE);
  t.true(r.chunks.slice(0, -1).every((c) => (c.flags & DONE) === 0), 'DONE only on the last chunk');
  const od = r.chunks.find((c) => c.type === CHUNK.OFFSET_DATA)!;
  t.true(od.payload.length >= 9, 'OFFSET_DATA length >= 9');
  // A READ with DF: at most one content chunk.
  client.send(rq(CMD.READ, 8192, 4096, F.DF));
  const df = await client.reply();
  t.deepEqual(df.data, data);
  t.true(df.chunks.filter((c) => c.type === CHUNK.OFFSET_DATA || c.type === CHUNK.OFFSET_HOLE).length <= 1);
});

for (const structured of [false, true]) {
  test(`READs a backend answers on the spot (readNow): the same replies as through read(), in ${structured ? 'structured' : 'simple'} mode; false falls back to read(), a throw is an error reply`, async (t) => {
    const provider = new TestExports({ readNow: true });
    const backend = provider.exports.get('disk')!.backend as NowBackend;
    const { client } = await start(t, {}, provider);
    await negotiate(t, client, { structured });
    const data = pattern(9, SIZE);
    provider.disk.writeSync(0, data);
    // Small (header and data in one carved buffer), odd-sized, and large (a pooled buffer) READs.
    const asks: [number, number][] = [[0, 4096], [12_288, 512], [65_536 + 512, 7_680], [131_072, 65_536], [0, 16_384 - 28], [0, 16_384]];
    for (const [off, len] of asks) {
      client.send(rq(CMD.READ, off, len));
      const r = await client.reply();
      t.is(r.error, 0);
      t.is(r.kind, structured ? 'structured' : 'simple');
      t.deepEqual(r.data, data.subarray(off, off + len), `[${off}, +${len})`);
    }
    t.is(backend.readCalls, 0, 'all answered on the spot');
    // 64 pipelined 4 KiB READs, their replies batched into one turn's writes: each right.
    const sent = new Map<string, number>();
    for (let i = 0; i < 64; i++) { const ck = cookie(); sent.set(ck.toString('hex'), i * 4096 + 1024); client.send(rq(CMD.READ, i * 4096 + 1024, 4096, 0, ck)); }
    for (let i = 0; i < 64; i++) {
      const r = await client.reply();
      const off = sent.get(r.cookie)!;
      t.deepEqual(r.data, data.subarray(off, off + 4096));
      sent.delete(r.cookie);
    }
    t.is(sent.size, 0, 'every cookie answered once');
    // Where readNow says it would wait, read() answers.
    client.send(rq(CMD.READ, NOW_WAITS + 4096, 4096));
    const slow = await client.reply();
    t.deepEqual(slow.data, data.subarray(NOW_WAITS + 4096, NOW_WAITS + 8192));
    t.is(backend.readCalls, 1, 'through read()');
    // A throw is an EIO reply, and the connection carries on.
    client.send(rq(CMD.READ, NOW_THROWS, 4096));
    const bad = await client.reply();
    t.is(bad.error, 5);
    t.is(bad.data === undefined || bad.data.length === 0, true, 'no data with the error');
    client.send(rq(CMD.READ, 0, 4096));
    t.deepEqual((await client.reply()).data, data.subarray(0, 4096));
  });
}

test('WRITEs without FUA a backend takes on the spot (writeNow); FUA, and a false, go through writeLent; a throw is an error reply', async (t) => {
  const provider = new TestExports({ readNow: true });
  const backend = provider.exports.get('disk')!.backend as NowBackend;
  const { client } = await start(t, {}, provider);
  await negotiate(t, client);
  const a = pattern(21, 8192);
  client.send(rq(CMD.WRITE, 4096, a.length), a);
  t.is((await client.reply()).error, 0);
  t.deepEqual([backend.nowWrites, backend.lentWrites], [1, 0], 'on the spot');
  const b = pattern(22, 4096);
  client.send(rq(CMD.WRITE, 65_536, b.length, F.FUA), b);
  t.is((await client.reply()).error, 0);
  t.deepEqual([backend.nowWrites, backend.lentWrites], [1, 1], 'FUA: writeLent (it waits for a flush)');
  const c = pattern(23, 4096);
  client.send(rq(CMD.WRITE, NOW_WAITS + 4096, c.length), c);
  t.is((await client.reply()).error, 0);
  t.deepEqual([backend.nowWrites, backend.lentWrites], [2, 2], 'refused on the spot: writeLent');
  client.send(rq(CMD.WRITE, NOW_THROWS, 4096), pattern(24, 4096));
  t.is((await client.reply()).error, 5, 'EIO');
  t.deepEqual(provider.disk.readSync(4096, 8192), a);
  t.deepEqual(provider.disk.readSync(65_536, 4096), b);
  t.deepEqual(provider.disk.readSync(NOW_WAITS + 4096, 4096), c);
  t.deepEqual(provider.disk.readSync(NOW_THROWS, 4096), Buffer.alloc(4096), 'the failed write left nothing');
});

test('a burst of overlapping WRITEs (FUA, plain, WRITE_ZEROES, TRIM) into a volume ends as the last one sent: requests take effect in arrival order', async (t) => {
  const catalog = new StoreCatalog({ store: new MemoryObjectStore(), log: silentLogger(), cache: () => BlockCache.open({ capacityBytes: 16 * SIZE }) });
  await catalog.create('v', 16 * SIZE);
  const handle = await catalog.open('v', { readOnly: false });
  t.teardown(() => handle.close());
  const provider = new TestExports();
  provider.exports.set('disk', { backend: handle.backend, description: 'a volume' });
  const { client } = await start(t, {}, provider);
  await negotiate(t, client);
  const K = 4096;
  const a = pattern(31, K);
  const b = pattern(32, K);
  const c = pattern(33, K);
  // One socket write: the session reads these requests together and calls the volume for
  // each before any reply; the volume answers some on the spot and others after a wait.
  const frames: Buffer[] = [];
  const add = (r: V.RequestFields, payload?: Buffer): void => { client.track(r); frames.push(V.requestFrame(r)); if (payload) frames.push(payload); };
  add(rq(CMD.WRITE, 0, K, F.FUA), a);
  add(rq(CMD.WRITE, 0, K), b); // ends as b
  add(rq(CMD.WRITE, K, K), a);
  add(rq(CMD.WRITE_ZEROES, K, K, F.FUA)); // ends as zeroes
  add(rq(CMD.TRIM, 2 * K, K));
  add(rq(CMD.WRITE, 2 * K, K), c); // ends as c
  add(rq(CMD.WRITE, 3 * K, K, F.FUA), a);
  add(rq(CMD.WRITE, 3 * K, K, F.FUA), c); // ends as c
  add(rq(CMD.WRITE, 3 * K, K), b); // no: ends as b
  client.write(Buffer.concat(frames));
  for (let i = 0; i < 9; i++) t.is((await client.reply()).error, 0);
  client.send(rq(CMD.READ, 0, 4 * K));
  const r = await client.reply();
  t.is(r.error, 0);
  t.deepEqual(r.data, Buffer.concat([b, Buffer.alloc(K), c, b]));
});

test('structured READ out of range: an ERROR chunk (0x8001-style, DONE, EINVAL), not a simple reply', async (t) => {
  const { client } = await start(t);
  await negotiate(t, client, { structured: true });
  client.send(rq(CMD.READ, SIZE - 512, 1024));
  const r = await client.reply();
  t.is(r.kind, 'structured');
  t.is(r.error, E.EINVAL);
  const last = r.chunks[r.chunks.length - 1]!;
  t.is(last.flags & DONE, DONE);
  const err = r.chunks.find((c) => (c.type & 0x8000) !== 0)!;
  t.is(err.type, 0x8001);
  t.true(err.payload.length <= 1000, 'qemu rejects non-data chunks over 1000 bytes');
  // and the connection carries on
  client.send(rq(CMD.READ, 0, 512));
  t.is((await client.reply()).error, 0);
});

test('BLOCK_STATUS with REQ_ONE: exactly one extent, no longer than the request', async (t) => {
  const { client, provider } = await start(t);
  await negotiate(t, client, { structured: true, meta: true });
  provider.disk.writeSync(0, pattern(4, 4096));
  for (const [offset, length] of [[0, SIZE], [0, 4096], [512, 100], [128 * 1024, 64 * 1024], [SIZE - 512, 512]] as const) {
    client.send(rq(CMD.BLOCK_STATUS, offset, length, F.REQ_ONE));
    const r = await client.reply();
    t.is(r.error, 0, `${offset}+${length}`);
    const chunks = r.chunks.filter((c) => c.type === CHUNK.BLOCK_STATUS);
    t.is(chunks.length, 1);
    const { extents } = V.parseBlockStatusPayload(chunks[0]!.payload);
    t.is(extents.length, 1, `${offset}+${length}: exactly one extent`);
    t.true(extents[0]!.length > 0 && extents[0]!.length <= length, `${offset}+${length}: extent ${extents[0]!.length}`);
    if (offset === 0) t.is(extents[0]!.flags & STATE_HOLE, 0, 'written data is not a hole');
  }
});

test('BLOCK_STATUS without REQ_ONE: contiguous non-zero extents, first n-1 shorter than the request, sound flags', async (t) => {
  const { client, provider } = await start(t);
  await negotiate(t, client, { structured: true, meta: true });
  provider.disk.writeSync(0, pattern(5, 4096));
  provider.disk.writeSync(256 * 1024, pattern(6, 100));
  client.send(rq(CMD.BLOCK_STATUS, 0, SIZE));
  const r = await client.reply();
  t.is(r.error, 0);
  const { extents } = V.parseBlockStatusPayload(r.chunks.find((c) => c.type === CHUNK.BLOCK_STATUS)!.payload);
  t.true(extents.length >= 1);
  t.true(extents.every((e) => e.length > 0 && e.length % 512 === 0));
  const headSum = extents.slice(0, -1).reduce((a, e) => a + e.length, 0);
  t.true(headSum < SIZE);
  // Walk the extents: the written bytes must never be reported as HOLE/ZERO.
  let pos = 0;
  for (const e of extents) {
    const end = pos + e.length;
    for (const written of [0, 4095, 256 * 1024, 256 * 1024 + 99]) {
      if (written >= pos && written < end) t.is(e.flags, 0, `byte ${written} reported with flags ${e.flags}`);
    }
    pos = end;
  }
});

test('BLOCK_STATUS out of range with structured replies: an error, connection still usable', async (t) => {
  const { client } = await start(t);
  await negotiate(t, client, { structured: true, meta: true });
  client.send(rq(CMD.BLOCK_STATUS, SIZE, 512));
  t.is((await client.reply()).error, E.EINVAL);
  client.send(rq(CMD.BLOCK_STATUS, 0, 512, F.REQ_ONE));
  t.is((await client.reply()).error, 0);
});

test('WRITE past the end: ENOSPC, and its payload is consumed (the next request still parses)', async (t) => {
  const { client } = await start(t);
  await negotiate(t, client);
  // A payload that looks like a request: if the server did not consume it, it would answer it.
  const decoy = rq(CMD.READ, 0, 512);
  const payload = Buffer.concat([V.requestFrame(decoy), Buffer.alloc(1024 - 28, 0x5a)]);
  const w = rq(CMD.WRITE, SIZE - 512, 1024);
  const r = rq(CMD.READ, 0, 512);
  client.track(w);
  client.track(r);
  client.write(Buffer.concat([V.requestFrame(w), payload, V.requestFrame(r)]));
  const replies = await client.replies(2);
  t.is(replies.get(w.cookie.toString('hex'))!.error, E.ENOSPC);
  t.is(replies.get(r.cookie.toString('hex'))!.error, 0);
  await sleep(50);
  t.is(client.unread, 0, 'the decoy inside the payload was not executed');
});

test('WRITE, TRIM, WRITE_ZEROES on a read-only export: EPERM, payload consumed, data unchanged', async (t) => {
  const { client, provider } = await start(t);
  const n = await negotiate(t, client, { exportName: 'ro' });
  t.is(n.eflags & TF.READ_ONLY, TF.READ_ONLY);
  const w = rq(CMD.WRITE, 0, 4096);
  client.send(w, Buffer.alloc(4096, 0x11));
  t.is((await client.reply()).error, E.EPERM);
  client.send(rq(CMD.TRIM, 0, 4096));
  t.is((await client.reply()).error, E.EPERM);
  client.send(rq(CMD.WRITE_ZEROES, 0, 4096));
  t.is((await client.reply()).error, E.EPERM);
  client.send(rq(CMD.READ, 0, 4096));
  t.deepEqual((await client.reply()).data, RO_PATTERN);
  t.deepEqual(provider.ro.readSync(0, 4096), RO_PATTERN);
});

test('unknown command: EINVAL, and the connection still works', async (t) => {
  const { client } = await start(t);
  await negotiate(t, client);
  client.send(rq(0x42, 0, 512));
  t.is((await client.reply()).error, E.EINVAL);
  client.send(rq(9, 0, 0));
  t.is((await client.reply()).error, E.EINVAL);
  client.send(rq(CMD.READ, 0, 512, 0x4000)); // unknown flag
  t.is((await client.reply()).error, E.EINVAL);
  client.send(rq(CMD.READ, 0, 512));
  const ok = await client.reply();
  t.deepEqual([ok.error, ok.data?.length], [0, 512]);
});

test('bad request magic: the server closes the connection', async (t) => {
  const { client, run } = await start(t);
  await negotiate(t, client);
  client.write(V.requestFrame(rq(CMD.READ, 0, 512), 0x25609514));
  t.true(await client.waitEof());
  t.is(client.unread, 0);
  await t.notThrowsAsync(run);
});

test('DISC: in-flight requests are answered first, then the server closes', async (t) => {
  const provider = new TestExports({ slowWritesMs: 150 });
  const { client, run } = await start(t, {}, provider);
  await negotiate(t, client);
  const frames: Buffer[] = [];
  const cookies: string[] = [];
  for (let i = 0; i < 3; i++) {
    const w = rq(CMD.WRITE, i * 4096, 4096);
    client.track(w);
    cookies.push(w.cookie.toString('hex'));
    frames.push(V.requestFrame(w), pattern(20 + i, 4096));
  }
  frames.push(V.requestFrame(rq(CMD.DISC, 0, 0)));
  client.write(Buffer.concat(frames));
  const replies = await client.replies(3);
  t.deepEqual([...replies.keys()].sort(), cookies.sort());
  t.true([...replies.values()].every((r) => r.error === 0));
  t.true(await client.waitEof(), 'closed after DISC');
  t.is(client.unread, 0, 'no reply to DISC');
  await t.notThrowsAsync(run);
  for (let i = 0; i < 3; i++) t.deepEqual(provider.disk.readSync(i * 4096, 4096), pattern(20 + i, 4096));
  t.is(provider.releases, provider.opens);
});

test('a client that sends half a request header and vanishes: run() resolves, nothing thrown, export released', async (t) => {
  const { client, run, provider } = await start(t);
  await negotiate(t, client);
  client.write(V.requestFrame(rq(CMD.READ, 0, 512)).subarray(0, 13));
  await sleep(20);
  client.sock.destroy();
  await t.notThrowsAsync(Promise.race([run, sleep(3000).then(() => { throw new Error('run() did not finish'); })]));
  t.is(provider.releases, provider.opens);
});

test('a client that vanishes mid-handshake (half an option) does not throw out of run()', async (t) => {
  const { client, run } = await start(t);
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  client.write(V.OPTIONS.goWithInfos.bytes.subarray(0, 20));
  await sleep(20);
  client.sock.destroy();
  await t.notThrowsAsync(Promise.race([run, sleep(3000).then(() => { throw new Error('run() did not finish'); })]));
});

// BUG (nbd/session.ts transmission(), lines ~322-327, with run()'s finally at ~100): for a
// WRITE the slot is taken (`acquireSlot`, inflight++) *before* the payload is read; when the
// client goes away mid-payload, `readFrame` rejects, the request is never dispatched, so the
// slot is never released and `run()`'s `await this.waitIdle()` waits forever: run() never
// settles, `handle.release()` is never called (the volume stays referenced), and
// NbdServer.close()/disconnectExport() wait on a session that cannot end. The session's own
// contract: "Runs the connection to its end; never rejects"; notes §1.2/§2.2: clients may
// vanish at any point (nbd-client right after GO, kernel-killed sockets).
test('a client that vanishes with a WRITE payload half sent: run() finishes and the export is released', async (t) => {
  const { client, run, provider } = await start(t);
  await negotiate(t, client);
  client.write(Buffer.concat([V.requestFrame(rq(CMD.WRITE, 0, 4096)), Buffer.alloc(1000, 1)]));
  await sleep(20);
  client.sock.destroy();
  await t.notThrowsAsync(Promise.race([run, sleep(3000).then(() => { throw new Error('run() did not finish'); })]));
  t.deepEqual(provider.disk.readSync(0, 4096), Buffer.alloc(4096), 'the partial write was not applied');
  t.is(provider.releases, provider.opens, 'export handle released');
});

test('handshake timeout: a silent client is disconnected (handshakeTimeoutMs 300)', async (t) => {
  const { client, run } = await start(t, { handshakeTimeoutMs: 300 });
  const t0 = Date.now();
  await client.greeting();
  t.true(await client.waitEof(3000), 'closed');
  const elapsed = Date.now() - t0;
  t.true(elapsed >= 250, `closed after ${elapsed} ms`);
  await t.notThrowsAsync(run);
});

test('handshake timeout also covers a client that stops mid-haggling', async (t) => {
  const { client, run } = await start(t, { handshakeTimeoutMs: 300 });
  await client.greeting();
  client.write(V.CLIENT_FLAGS.fixedNoZeroes.bytes);
  t.deepEqual((await client.option(OPT.LIST)).pop()!.type, REP.ACK);
  client.write(V.OPTIONS.goWithInfos.bytes.subarray(0, 10));
  t.true(await client.waitEof(3000));
  await t.notThrowsAsync(run);
});

test('the handshake timeout does not fire once transmission has started', async (t) => {
  const { client } = await start(t, { handshakeTimeoutMs: 300 });
  await negotiate(t, client);
  await sleep(600);
  t.false(client.eof);
  client.send(rq(CMD.READ, 0, 512));
  t.is((await client.reply()).error, 0);
});

/**
 * Bounds one client cannot escape, and replies a client cannot lose (issues 9.8, 17.6-17.9,
 * and the advertised-vs-enforced payload limit of issue 9):
 * - CACHE counts against the per-connection in-flight memory bound, and a Volume warms its
 *   cache one piece at a time instead of allocating the whole range;
 * - connections past `maxConnections` are refused with a message, others keep working;
 * - BLOCK_STATUS work is bounded by what the reply carries (REQ_ONE: one extent);
 * - replies to requests in flight when the client half-closes (after DISC or not) arrive;
 * - NBD_OPT_INFO answers from provider.info() without opening anything;
 * - the maximum block size advertised is the payload limit enforced.
 *
 * The client is the hand-written one in test/helpers/nbd-raw.ts (frames from the spec, not
 * from nbd/codec.ts); structured replies are parsed here by hand.
 */

import test, { type ExecutionContext } from 'ava';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { CACHE_PIECE_BYTES, type BlockBackend, type ExportHandle, type ExportInfo, type ExportProvider, type ExportSummary, type Extent, type ZeroOptions } from '../../nbd/backend.js';
import { NbdServer, type NbdServerOptions } from '../../nbd/server.js';
import { MAX_BLOCK_STATUS_EXTENTS, MAX_PAYLOAD } from '../../nbd/session.js';
import { ExtentMap } from '../../cow/extent-map.js';
import { PackedExtentMap } from '../../cow/packed-map.js';
import { MemoryBackend } from '../../src/backends/memory.js';
import { BlockCache } from '../../src/cache.js';
import { NotFoundError } from '../../src/errors.js';
import { silentLogger } from '../../src/log.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import type { Volume } from '../../src/volume/volume.js';
import {
  CMD, ERRNO, FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, INFO, OPT, REP, RawClient, SIMPLE_REPLY_MAGIC,
  clientFlagsFrame, infoGoData, requestFrame,
} from '../helpers/nbd-raw.js';

const MiB = 1024 * 1024;
const KiB = 1024;
// Spec values not in the helper (proto.md).
const REP_ERR_SHUTDOWN = 0x80000007;
const OPT_SET_META_CONTEXT = 10;
const STRUCTURED_REPLY_MAGIC = 0x668e33ef;
const REPLY_TYPE_BLOCK_STATUS = 5;
const REPLY_FLAG_DONE = 1;
const CMD_FLAG_REQ_ONE = 0x08;
const TFLAG_READ_ONLY = 0x0002;
const STATE_HOLE = 1;
const STATE_ZERO = 2;

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

// ------------------------------------------------------------------ providers and harness

class Provider implements ExportProvider {
  opens = 0;
  releases = 0;
  constructor(readonly backend: BlockBackend, readonly name = 'disk') {}
  async list(): Promise<ExportSummary[]> { return [{ name: this.name, description: 'test' }]; }
  async open(requested: string): Promise<ExportHandle> {
    if (requested !== this.name && requested !== '') throw new NotFoundError(`no export named ${JSON.stringify(requested)}`);
    this.opens++;
    let released = false;
    return { name: this.name, description: 'test', backend: this.backend, release: () => { if (!released) { released = true; this.releases++; } } };
  }
}

/** A provider that can describe an export from its "catalog" without opening it. */
class DescribingProvider extends Provider {
  infos = 0;
  async info(requested: string): Promise<ExportInfo> {
    if (requested !== this.name && requested !== '') throw new NotFoundError(`no export named ${JSON.stringify(requested)}`);
    this.infos++;
    return { name: this.name, size: 3 * MiB, readOnly: true, description: 'from the catalog' };
  }
}

async function startServer(t: ExecutionContext, provider: ExportProvider, opts: Partial<NbdServerOptions> = {}): Promise<{ server: NbdServer; sock: string }> {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-bounds-'));
  const sock = path.join(dir, 'nbd.sock');
  const server = new NbdServer(provider, { log: silentLogger(), ...opts });
  await server.listen({ path: sock });
  t.teardown(async () => { await server.close(); fs.rmSync(dir, { recursive: true, force: true }); });
  return { server, sock };
}

async function connect(t: ExecutionContext, sock: string): Promise<RawClient> {
  const c = await RawClient.connect(sock);
  t.teardown(() => c.destroy());
  return c;
}

async function waitFor(cond: () => boolean, what: string, timeoutMs = 5000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(5);
  }
}

/** Greeting, flags, STRUCTURED_REPLY, SET_META_CONTEXT base:allocation, GO. */
async function structuredGo(c: RawClient, name = 'disk'): Promise<void> {
  await c.greeting();
  await c.write(clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
  const sr = await c.option(OPT.STRUCTURED_REPLY);
  if (sr[sr.length - 1]!.type !== REP.ACK) throw new Error('STRUCTURED_REPLY refused');
  const n = Buffer.from(name);
  const q = Buffer.from('base:allocation');
  const meta = Buffer.alloc(4 + n.length + 4 + 4 + q.length);
  meta.writeUInt32BE(n.length, 0); n.copy(meta, 4);
  meta.writeUInt32BE(1, 4 + n.length);
  meta.writeUInt32BE(q.length, 8 + n.length); q.copy(meta, 12 + n.length);
  const sm = await c.option(OPT_SET_META_CONTEXT, meta);
  if (sm.map((r) => r.type).join() !== [REP.META_CONTEXT, REP.ACK].join()) throw new Error('base:allocation not selected');
  await c.go(name);
}

/** One structured BLOCK_STATUS reply (a single chunk with DONE): its extents. */
async function blockStatus(c: RawClient, cookie: bigint, offset: number, length: number, flags = 0): Promise<{ length: number; flags: number }[]> {
  await c.write(requestFrame({ type: CMD.BLOCK_STATUS, flags, cookie, offset: BigInt(offset), length }));
  const h = await c.read(20);
  if (h.readUInt32BE(0) !== STRUCTURED_REPLY_MAGIC) throw new Error('not a structured reply');
  const type = h.readUInt16BE(6);
  const payload = await c.read(h.readUInt32BE(16));
  if (type !== REPLY_TYPE_BLOCK_STATUS) throw new Error(`chunk type 0x${type.toString(16)}: ${payload.subarray(6).toString()}`);
  if (!(h.readUInt16BE(4) & REPLY_FLAG_DONE)) throw new Error('block status chunk without DONE');
  if (h.readBigUInt64BE(8) !== cookie) throw new Error('wrong cookie');
  const out: { length: number; flags: number }[] = [];
  for (let i = 4; i < payload.length; i += 8) out.push({ length: payload.readUInt32BE(i), flags: payload.readUInt32BE(i + 4) });
  return out;
}

async function volumeOn(size: number): Promise<Volume> {
  const store = new MemoryObjectStore();
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => BlockCache.open({ capacityBytes: 256 * MiB }) });
  await catalog.create('v', size);
  return (await catalog.open('v', { readOnly: false })).backend as Volume;
}

/** The rest of a BlockBackend over `mem` (a test backend spells out only what it changes). */
function passThrough(mem: MemoryBackend): Pick<BlockBackend, 'write' | 'flush' | 'trim' | 'zero' | 'blockStatus' | 'cache'> {
  return {
    write: (o, d) => mem.write(o, d),
    flush: () => mem.flush(),
    trim: (o, l) => mem.trim(o, l),
    zero: (o, l, z) => mem.zero(o, l, z),
    blockStatus: (o, l, m) => mem.blockStatus(o, l, m),
    cache: () => mem.cache(),
  };
}

// ================================================================== 9.8: CACHE and the in-flight bound

test('eight concurrent CACHE requests of 64 MiB with the in-flight bound at 1 MiB hold at most 1 MiB at once', async (t) => {
  const vol = await volumeOn(128 * MiB);
  await vol.write(0, Buffer.alloc(8 * MiB, 0x5a), false);
  await vol.flush(); // committed: warming really fetches from the store
  // Volume.cache warms through this.read: count the bytes of the reads it has in progress.
  let inProgress = 0;
  let maxInProgress = 0;
  let largest = 0;
  const orig = vol.read.bind(vol);
  vol.read = async (offset: number, length: number, into?: Buffer): Promise<Buffer> => {
    inProgress += length;
    maxInProgress = Math.max(maxInProgress, inProgress);
    largest = Math.max(largest, length);
    try {
      await sleep(1); // keep each piece in progress across a turn of the event loop
      return await orig(offset, length, into);
    } finally {
      inProgress -= length;
    }
  };
  const provider = new Provider(vol);
  const { sock } = await startServer(t, provider, { maxInflightBytes: 1 * MiB });
  const c = await connect(t, sock);
  await c.handshakeGo('disk');
  const frames = Array.from({ length: 8 }, (_, i) => requestFrame({ type: CMD.CACHE, cookie: BigInt(100 + i), offset: BigInt(i * 8 * MiB), length: 64 * MiB }));
  await c.write(Buffer.concat(frames)); // one write: the server sees all eight at once
  const cookies: bigint[] = [];
  for (let i = 0; i < 8; i++) {
    const r = await c.simpleReply(60_000);
    t.is(r.magic, SIMPLE_REPLY_MAGIC);
    t.is(r.error, ERRNO.OK);
    cookies.push(r.cookie);
  }
  t.deepEqual(cookies.sort(), frames.map((_, i) => BigInt(100 + i)).sort());
  t.true(maxInProgress > 0, 'CACHE warmed through Volume.read');
  t.true(maxInProgress <= 1 * MiB, `${maxInProgress / MiB} MiB held at once by CACHE requests, bound 1 MiB`);
  t.is(largest, CACHE_PIECE_BYTES, 'Volume.cache reads CACHE_PIECE_BYTES pieces, what the session counts per CACHE');
  // The warm-up changed nothing a read returns.
  vol.read = orig;
  t.true((await vol.read(0, 8 * MiB)).equals(Buffer.alloc(8 * MiB, 0x5a)));
});

// ================================================================== READs at once (BlockBackend.maxConcurrentReads)

test('a backend with maxConcurrentReads: 64 READs sent at once, never more executing than that, every reply right; READs still held when the client vanishes do not keep the server from closing', async (t) => {
  const mem = new MemoryBackend(8 * MiB);
  const data = Buffer.alloc(8 * MiB);
  for (let i = 0; i < data.length; i += 4) data.writeUInt32LE((i * 2654435761) >>> 0, i);
  await mem.write(0, data);
  let executing = 0;
  let maxExecuting = 0;
  const backend: BlockBackend = {
    size: mem.size,
    readOnly: false,
    maxConcurrentReads: 3,
    read: async (o, l, into) => {
      executing++;
      maxExecuting = Math.max(maxExecuting, executing);
      try {
        await sleep(1); // across a turn of the event loop, as a read that waits would be
        return await mem.read(o, l, into);
      } finally {
        executing--;
      }
    },
    ...passThrough(mem),
  };
  const { server, sock } = await startServer(t, new Provider(backend));
  const c = await connect(t, sock);
  await c.handshakeGo('disk');
  const len = 128 * KiB;
  const frames = Array.from({ length: 64 }, (_, i) => requestFrame({ type: CMD.READ, cookie: BigInt(i), offset: BigInt(i * len), length: len }));
  await c.write(Buffer.concat(frames)); // one write: the server sees all 64 at once
  const seen = new Set<bigint>();
  for (let i = 0; i < 64; i++) {
    const r = await c.simpleReply(30_000);
    t.is(r.error, ERRNO.OK);
    const got = await c.read(len);
    const at = Number(r.cookie) * len;
    t.true(got.equals(data.subarray(at, at + len)), `READ ${r.cookie}: the bytes at ${at}`);
    seen.add(r.cookie);
  }
  t.is(seen.size, 64, 'every READ answered once');
  t.true(maxExecuting <= 3, `${maxExecuting} READs executing at once, limit 3`);
  t.true(maxExecuting > 1, 'READs still ran side by side');
  // Again, and the client goes after two replies: the held READs are dispatched into a closed
  // connection and release their slots, so the server closes.
  const c2 = await connect(t, sock);
  await c2.handshakeGo('disk');
  await c2.write(Buffer.concat(frames));
  await c2.simpleReply(30_000);
  c2.destroy();
  const closed = await Promise.race([server.close().then(() => true), sleep(10_000).then(() => false)]);
  t.true(closed, 'the server closed with READs held for a vanished client');
});

// ================================================================== a client that leaves with requests buffered

/** A memory backend that answers READs on the spot (readNow), counting them and the turns they took. */
function countingReadNowBackend(size: number): { backend: BlockBackend; calls: () => number; maxPerTurn: () => number } {
  const mem = new MemoryBackend(size);
  let calls = 0;
  let inTurn = 0;
  let maxPerTurn = 0;
  const backend: BlockBackend = {
    size: mem.size,
    readOnly: false,
    readNow: (o, l, into) => {
      calls++;
      if (inTurn++ === 0) setImmediate(() => { inTurn = 0; });
      maxPerTurn = Math.max(maxPerTurn, inTurn);
      into.fill(7, 0, l);
      return true;
    },
    read: (o, l, into) => mem.read(o, l, into),
    ...passThrough(mem),
  };
  return { backend, calls: () => calls, maxPerTurn: () => maxPerTurn };
}

test('a client that sends 20,000 READs, never reads a reply and vanishes: the requests it left buffered are not served, and no turn of the event loop serves more than a bounded number', async (t) => {
  // Reviewed finding: once the socket was gone every reply "completed" at once, so the loop
  // served everything the reader held (up to 128 MiB of requests, millions) in one turn of
  // the event loop; 1M READs held the loop 4.2 s and another volume on the host lost its lease.
  const { backend, calls, maxPerTurn } = countingReadNowBackend(64 * MiB);
  const { server, sock } = await startServer(t, new Provider(backend), { maxInflightBytes: 8 * MiB });
  const c = await connect(t, sock);
  await c.handshakeGo('disk');
  c.sock.pause(); // from now on the client reads no reply: they back up in the server
  const len = 64 * KiB;
  const n = 20_000;
  const frames = Array.from({ length: n }, (_, i) => requestFrame({ type: CMD.READ, cookie: BigInt(i), offset: BigInt((i % 1000) * len), length: len }));
  await c.write(Buffer.concat(frames));
  await waitFor(() => calls() > 0, 'the first READs served');
  await sleep(200); // the server reads every request in; replies back up (the client reads none)
  const before = calls();
  t.true(before <= 128 + 1, `${before} READs served while the client read nothing (bounded by the in-flight limits)`);
  c.destroy();
  await waitFor(() => server.connectionCount === 0, 'the session to end');
  t.true(calls() - before <= 128, `${calls() - before} READs served after the client vanished (at most those in flight)`);
  t.true(maxPerTurn() <= 512, `${maxPerTurn()} READs in one turn of the event loop`);
});

test('a client that reads no reply is cut off lingerMs after its export is shut down (handoff), and its handle is released', async (t) => {
  // Reviewed finding: shutdown waited for every reply to be taken by the socket, which a peer
  // that reads nothing never lets happen: the session, its handle and its replies stayed.
  const { backend } = countingReadNowBackend(64 * MiB);
  const provider = new Provider(backend);
  const { server, sock } = await startServer(t, provider, { lingerMs: 200 });
  const c = await connect(t, sock);
  await c.handshakeGo('disk');
  c.sock.pause();
  const len = 1 * MiB;
  await c.write(Buffer.concat(Array.from({ length: 16 }, (_, i) => requestFrame({ type: CMD.READ, cookie: BigInt(i), offset: BigInt(i * len), length: len }))));
  await sleep(200); // 16 MiB of replies: more than the sockets hold
  t.is(server.connectionCount, 1);
  t.is(server.disconnectExport('disk'), 1);
  await waitFor(() => server.connectionCount === 0, 'the session to end', 5000);
  t.is(provider.releases, 1, 'its handle released');
});

test('before transmission a client cannot make the server buffer more than a few options: 200 MiB sent behind a LIST the provider is slow to answer', async (t) => {
  // Reviewed finding: the handshake's reader already had transmission's bound (128 MiB), so
  // any unauthenticated client could pin that much while a provider call was pending.
  const provider: ExportProvider = { list: () => sleep(1500).then(() => []), open: () => new Promise(() => {}) };
  const { sock } = await startServer(t, provider, { handshakeTimeoutMs: 60_000 });
  const c = await connect(t, sock);
  await c.greeting();
  await c.write(clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
  const list = Buffer.alloc(16);
  list.writeBigUInt64BE(0x49484156454f5054n, 0);
  list.writeUInt32BE(OPT.LIST, 8);
  c.sock.write(list);
  const junk = Buffer.alloc(1 * MiB, 0x41);
  for (let i = 0; i < 200; i++) c.sock.write(junk);
  await sleep(1000);
  const taken = c.sock.bytesWritten - c.sock.writableLength; // by the kernel: the server's buffer and the socket's
  t.true(taken < 16 * MiB, `${(taken / MiB).toFixed(1)} MiB taken from the client`);
});

// ================================================================== 9.8: --max-connections

test('a connection past maxConnections is refused with ERR_SHUTDOWN and a message; the others keep working', async (t) => {
  const provider = new Provider(new MemoryBackend(4 * MiB));
  const { server, sock } = await startServer(t, provider, { maxConnections: 2 });
  const a = await connect(t, sock);
  const b = await connect(t, sock);
  await a.handshakeGo('disk');
  await b.handshakeGo('disk');
  t.is(provider.opens, 2);

  const refused = await connect(t, sock);
  await refused.greeting();
  await refused.write(clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
  for (const option of [OPT.GO, OPT.INFO, OPT.LIST]) {
    const r = await refused.option(option, option === OPT.LIST ? undefined : infoGoData('disk'));
    t.is(r.length, 1);
    t.is(r[0]!.option, option);
    t.is(r[0]!.type, REP_ERR_SHUTDOWN, `option ${option} refused with ERR_SHUTDOWN`);
    t.regex(r[0]!.data.toString('utf8'), /connection limit \(2 connections\).*--max-connections/);
  }
  const abort = await refused.option(OPT.ABORT);
  t.is(abort[0]!.type, REP.ACK, 'ABORT is still acknowledged');
  t.true(await refused.waitClosed(2000), 'closed after ABORT');
  t.is(provider.opens, 2, 'a refused connection never reaches the provider');

  // The attached clients are unaffected.
  t.is((await a.writeAt(1n, 0n, Buffer.alloc(4096, 7))).error, ERRNO.OK);
  const r = await b.readAt(2n, 0n, 4096);
  t.is(r.reply.error, ERRNO.OK);
  t.deepEqual(r.data, Buffer.alloc(4096, 7));

  // EXPORT_NAME has no error reply: past the limit the connection is closed.
  const old = await connect(t, sock);
  await old.greeting();
  await old.write(clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
  await old.write(Buffer.concat([Buffer.from('IHAVEOPT'), Buffer.from([0, 0, 0, 1, 0, 0, 0, 4]), Buffer.from('disk')]));
  t.true(await old.waitClosed(2000));
  t.is(old.buffered, 0, 'nothing sent after the greeting');

  // A slot that frees up is usable again.
  await a.disconnect();
  t.true(await a.waitClosed(2000));
  await waitFor(() => server.connectionCount < 2, 'the first session to end');
  const c = await connect(t, sock);
  const { size } = await c.handshakeGo('disk');
  t.is(size, BigInt(4 * MiB));
});

test('NbdServer refuses a maxConnections that is not a positive integer', (t) => {
  for (const maxConnections of [0, -1, 1.5, Number.NaN]) {
    t.throws(() => new NbdServer(new Provider(new MemoryBackend(MiB)), { log: silentLogger(), maxConnections }), { message: /maximum connections/ });
  }
});

// ================================================================== 17.7: BLOCK_STATUS bounded work

/** 200k zero extents with never-written gaps between them (alternating flags), flushed. */
async function fragmentedVolume(): Promise<{ vol: Volume; size: number; extents: number }> {
  const extents = 200_000;
  const stride = 8 * KiB;
  const size = extents * stride;
  const vol = await volumeOn(size);
  for (let i = 0; i < extents; i++) await vol.zero(i * stride, 4 * KiB, { fua: false, mayTrim: false, fastZero: false });
  await vol.flush();
  return { vol, size, extents };
}

/** Counts the pieces every map lookup (write buffer and committed map) builds while `fn` runs: the work of a walk. */
async function countPieces<T>(fn: () => Promise<T>): Promise<{ result: T; pieces: number }> {
  type Lookup = { lookup: (this: unknown, o: number, l: number) => unknown[] };
  const protos = [ExtentMap.prototype, PackedExtentMap.prototype] as unknown as Lookup[];
  const origs = protos.map((p) => p.lookup);
  let pieces = 0;
  protos.forEach((proto, i) => {
    const orig = origs[i]!;
    proto.lookup = function (this: unknown, o: number, l: number) { const r = orig.call(this, o, l); pieces += r.length; return r; };
  });
  try {
    const result = await fn();
    return { result, pieces };
  } finally {
    protos.forEach((proto, i) => { proto.lookup = origs[i]!; });
  }
}

function checkExtents(t: ExecutionContext, got: Extent[], offset: number, stride: number): void {
  // Exact: zero extent (ZERO) then a never-written gap (HOLE|ZERO), every `stride` bytes.
  const want = got.map((_, i) => ({
    length: stride / 2,
    flags: (offset + i * (stride / 2)) % stride < stride / 2 ? STATE_ZERO : STATE_HOLE | STATE_ZERO,
  }));
  t.deepEqual(got.map((e) => ({ length: e.length, flags: e.flags })), want);
}

test('Volume.blockStatus over a whole 200k-extent volume: work bounded by the extent cap, REQ_ONE one extent', async (t) => {
  const { vol, size } = await fragmentedVolume();
  const whole = await countPieces(() => vol.blockStatus(0, size, MAX_BLOCK_STATUS_EXTENTS));
  t.is(whole.result.length, MAX_BLOCK_STATUS_EXTENTS, 'stopped at the cap');
  checkExtents(t, whole.result, 0, 8 * KiB);
  // Budget 4096 pieces, plus at most one 4 MiB region's pieces per layer (1024 here).
  t.true(whole.pieces <= 8192, `${whole.pieces} map pieces built for one BLOCK_STATUS (the volume has 400k)`);

  const one = await countPieces(() => vol.blockStatus(12 * KiB, size - 12 * KiB, 1));
  t.deepEqual(one.result, [{ length: 4 * KiB, flags: STATE_HOLE | STATE_ZERO }]);
  t.true(one.pieces <= 8192, `${one.pieces} pieces for REQ_ONE`);

  // Many same-flag pieces merge into one extent: the piece budget still bounds the walk.
  const merged = await volumeOn(64 * MiB);
  for (let i = 0; i < 16384; i++) await merged.write(i * 4 * KiB, Buffer.alloc(4 * KiB, i & 0xff), false);
  const m = await countPieces(() => merged.blockStatus(0, 64 * MiB, MAX_BLOCK_STATUS_EXTENTS));
  t.is(m.result.length, 1);
  t.is(m.result[0]!.flags, 0);
  t.true(m.result[0]!.length >= 16 * MiB && m.result[0]!.length % (4 * KiB) === 0, `one data extent of ${m.result[0]!.length}`);
  t.true(m.pieces <= 8192, `${m.pieces} pieces for 16384 same-flag pieces`);
});

test('MemoryBackend.blockStatus honours maxExtents', async (t) => {
  const b = new MemoryBackend(64 * MiB);
  for (let i = 0; i < 256; i += 2) b.writeSync(i * 64 * KiB, Buffer.alloc(1, 1));
  const all = await b.blockStatus(0, 64 * MiB, 1_000_000);
  t.is(all.length, 256);
  t.is((await b.blockStatus(0, 64 * MiB, 10)).length, 10);
  t.deepEqual(await b.blockStatus(64 * KiB, 64 * MiB - 64 * KiB, 1), [{ length: 64 * KiB, flags: STATE_HOLE | STATE_ZERO }]);
});

test('BLOCK_STATUS over the wire on a 200k-extent volume: at most MAX_BLOCK_STATUS_EXTENTS, REQ_ONE exactly one; the backend is asked for no more', async (t) => {
  const { vol, size } = await fragmentedVolume();
  const asked: number[] = [];
  const orig = vol.blockStatus.bind(vol);
  vol.blockStatus = (o: number, l: number, max: number): Promise<Extent[]> => { asked.push(max); return orig(o, l, max); };
  const { sock } = await startServer(t, new Provider(vol));
  const c = await connect(t, sock);
  await structuredGo(c);
  const whole = await blockStatus(c, 1n, 0, size);
  t.is(whole.length, MAX_BLOCK_STATUS_EXTENTS);
  checkExtents(t, whole, 0, 8 * KiB);
  const one = await blockStatus(c, 2n, 8 * KiB, size - 8 * KiB, CMD_FLAG_REQ_ONE);
  t.deepEqual(one, [{ length: 4 * KiB, flags: STATE_ZERO }]);
  t.deepEqual(asked, [MAX_BLOCK_STATUS_EXTENTS, 1]);
  // The client continues from where the reply ended.
  const covered = whole.reduce((s, e) => s + e.length, 0);
  const next = await blockStatus(c, 3n, covered, size - covered);
  checkExtents(t, next, covered, 8 * KiB);
});

test('REQ_ONE on a block whose first piece is shorter than a block: one whole block, status 0 (always safe)', async (t) => {
  const b = new MemoryBackend(MiB);
  // A backend that answers with one sub-block extent (as one stopping early may).
  const backend: BlockBackend = Object.assign(Object.create(b) as MemoryBackend, {
    blockStatus: async (): Promise<Extent[]> => [{ length: 100, flags: STATE_HOLE | STATE_ZERO }],
  });
  const { sock } = await startServer(t, new Provider(backend));
  const c = await connect(t, sock);
  await structuredGo(c);
  t.deepEqual(await blockStatus(c, 1n, 0, 64 * KiB, CMD_FLAG_REQ_ONE), [{ length: 512, flags: 0 }]);
});

// ================================================================== 17.9: replies after a half-close

class SlowFlush extends MemoryBackend {
  flushes = 0;
  override async flush(): Promise<void> { await sleep(100); this.flushes++; }
}

for (const withDisc of [true, false]) {
  test(`READ, FLUSH${withDisc ? ', DISC' : ''}, then the client shuts down its write side: both replies arrive, then the server closes`, async (t) => {
    const backend = new SlowFlush(MiB);
    backend.writeSync(0, Buffer.alloc(4096, 0x42));
    const provider = new Provider(backend);
    const { sock } = await startServer(t, provider);
    const c = await connect(t, sock);
    await c.handshakeGo('disk');
    const frames = [
      requestFrame({ type: CMD.READ, cookie: 1n, offset: 0n, length: 4096 }),
      requestFrame({ type: CMD.FLUSH, cookie: 2n, offset: 0n, length: 0 }),
    ];
    if (withDisc) frames.push(requestFrame({ type: CMD.DISC, cookie: 3n, offset: 0n, length: 0 }));
    await c.write(Buffer.concat(frames));
    c.sock.end(); // what libnbd does after DISC: shutdown(SHUT_WR)
    const read = await c.simpleReply();
    t.is(read.magic, SIMPLE_REPLY_MAGIC);
    t.is(read.cookie, 1n);
    t.is(read.error, ERRNO.OK);
    t.deepEqual(await c.read(4096), Buffer.alloc(4096, 0x42));
    const flush = await c.simpleReply();
    t.is(flush.cookie, 2n);
    t.is(flush.error, ERRNO.OK, 'the flush that ran is reported as done');
    t.true(backend.flushes >= 1);
    t.true(await c.waitClosed(5000), 'the server closes once everything is answered');
    t.is(c.buffered, 0, 'no reply to DISC, nothing else');
    await waitFor(() => provider.releases === provider.opens, 'the export to be released');
  });
}

// ================================================================== 17.6: INFO without an open

test('INFO with a provider that has info(): answered from it, nothing opened; GO still opens', async (t) => {
  const provider = new DescribingProvider(new MemoryBackend(3 * MiB));
  const { sock } = await startServer(t, provider);
  const c = await connect(t, sock);
  await c.greeting();
  await c.write(clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
  for (let i = 0; i < 3; i++) {
    const r = await c.option(OPT.INFO, infoGoData(i === 0 ? '' : 'disk', [INFO.NAME, INFO.DESCRIPTION, INFO.BLOCK_SIZE]));
    t.is(r[r.length - 1]!.type, REP.ACK);
    const byType = new Map(r.filter((x) => x.type === REP.INFO).map((x) => [x.data.readUInt16BE(0), x.data]));
    const exp = byType.get(INFO.EXPORT)!;
    t.is(exp.readBigUInt64BE(2), BigInt(3 * MiB));
    t.truthy(exp.readUInt16BE(10) & TFLAG_READ_ONLY, 'read-only as info() says');
    t.is(byType.get(INFO.NAME)!.subarray(2).toString(), 'disk', 'canonical name, also for ""');
    t.is(byType.get(INFO.DESCRIPTION)!.subarray(2).toString(), 'from the catalog');
    t.is(byType.get(INFO.BLOCK_SIZE)!.readUInt32BE(10), MAX_PAYLOAD);
  }
  const unknown = await c.option(OPT.INFO, infoGoData('nope'));
  t.is(unknown.length, 1);
  t.is(unknown[0]!.type, REP.ERR_UNKNOWN);
  t.is(provider.infos, 3);
  t.is(provider.opens, 0, 'INFO opened nothing');
  await c.go('disk');
  t.is(provider.opens, 1, 'GO opens');
});

// ================================================================== 9: one payload limit

test('the maximum block size advertised is the payload limit enforced (32 MiB)', async (t) => {
  t.is(MAX_PAYLOAD, 32 * MiB);
  const { sock } = await startServer(t, new Provider(new MemoryBackend(128 * MiB)));
  const c = await connect(t, sock);
  await c.greeting();
  await c.write(clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
  const r = await c.option(OPT.GO, infoGoData('disk', [INFO.BLOCK_SIZE]));
  const bs = r.find((x) => x.type === REP.INFO && x.data.readUInt16BE(0) === INFO.BLOCK_SIZE)!;
  const max = bs.data.readUInt32BE(10);
  t.is(max, MAX_PAYLOAD);
  // Exactly the maximum works both ways.
  const data = Buffer.alloc(max, 0x33);
  t.is((await c.writeAt(1n, 0n, data)).error, ERRNO.OK);
  // (read by hand: the helper's buffer grows by concatenation, too slow for 32 MiB)
  await c.write(requestFrame({ type: CMD.READ, cookie: 2n, offset: 0n, length: max }));
  const full = await new Promise<Buffer>((resolve) => {
    const parts: Buffer[] = [];
    let n = 0;
    const take = (): void => {
      const b = c.drain();
      parts.push(b);
      n += b.length;
      if (n >= 16 + max) { c.sock.off('data', take); resolve(Buffer.concat(parts)); }
    };
    c.sock.on('data', take);
    take();
  });
  t.is(full.length, 16 + max);
  t.is(full.readUInt32BE(0), SIMPLE_REPLY_MAGIC);
  t.is(full.readUInt32BE(4), ERRNO.OK, 'a READ of exactly the maximum is served');
  t.true(full.subarray(16).equals(data));
  // One block more is refused cleanly (the connection stays usable) ...
  const over = await c.readAt(3n, 0n, max + 512);
  t.is(over.reply.error, ERRNO.EINVAL, 'a READ past the advertised maximum is refused');
  t.is((await c.readAt(4n, 0n, 512)).reply.error, ERRNO.OK);
  // ... and a WRITE past it, whose payload we will not buffer, ends the connection.
  await c.write(requestFrame({ type: CMD.WRITE, cookie: 5n, offset: 0n, length: max + 512 }));
  t.true(await c.waitClosed(5000));
});

/**
 * Bad input over a raw socket against a real `baton serve` process (notes/nbd-protocol.md §3
 * "Malformed input"): broken handshakes, broken requests, vanishing and slow clients. Frames
 * are built by hand (test/helpers/nbd-raw.ts, written from the spec, not from nbd/codec.ts).
 *
 * Every test starts its own server with a well-behaved raw client already attached (it wrote a
 * sentinel before the bad client arrived), and ends by checking that this concurrent client is
 * still served and still reads its data, that a fresh real client (qemu-io) sees the data too,
 * and that the server process is alive without error-level log lines.
 */

import test, { type ExecutionContext } from 'ava';
import { randomBytes } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import {
  CMD, CMD_FLAG_FUA, ERRNO, FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT, INFO, NBDMAGIC, OPT, OPTION_REPLY_MAGIC, REP,
  REQUEST_MAGIC, RawClient, SIMPLE_REPLY_MAGIC, TFLAG, clientFlagsFrame, infoGoData, optionFrame, requestFrame,
} from '../helpers/nbd-raw.js';
import { run } from '../helpers/ext4.js';
import { has, startBatonServer, type BatonServer, type StartOptions } from '../helpers/server.js';

const MiB = 1024 * 1024;
const VOL = 'vol';
const SIZE = 8 * MiB;
const SENTINEL_OFF = 1 * MiB;
const PATTERN_OFF = 2 * MiB; // 64 KiB of 0x5c, checked by qemu-io
const PATTERN_LEN = 64 * 1024;
const HAS_QEMU_IO = has('qemu-io');

/** At most three servers of this file at once (2 cores, other files run concurrently). */
let slots = 3;
const queue: (() => void)[] = [];
function limited(body: (t: ExecutionContext) => Promise<void>): (t: ExecutionContext) => Promise<void> {
  return async (t) => {
    while (slots === 0) await new Promise<void>((r) => queue.push(r));
    slots--;
    try { await body(t); } finally { slots++; queue.shift()?.(); }
  };
}

interface Ctx {
  server: BatonServer;
  good: RawClient;
  sentinel: Buffer;
  cookie: () => bigint;
}

/** Server + a well-behaved client that attached and wrote its data before anything bad happens. */
async function setup(t: ExecutionContext, opts: StartOptions = {}): Promise<Ctx> {
  const readOnly = !!opts.readOnly;
  let store = opts.store;
  const sentinel = randomBytes(64 * 1024);
  let next = 1n;
  const cookie = (): bigint => next++;
  if (readOnly) {
    // A read-only server cannot take the sentinel: write it through a writable one first.
    const rw = await startBatonServer(t, { volumes: [{ name: VOL, size: SIZE }] });
    const c = await RawClient.connect(rw.socket);
    await c.handshakeGo(VOL);
    t.is((await c.writeAt(cookie(), BigInt(SENTINEL_OFF), sentinel)).error, 0);
    t.is((await c.writeAt(cookie(), BigInt(PATTERN_OFF), Buffer.alloc(PATTERN_LEN, 0x5c))).error, 0);
    t.is((await c.command({ type: CMD.FLUSH, cookie: cookie(), offset: 0n, length: 0 })).error, 0);
    await c.disconnect();
    await rw.stop();
    store = rw.store;
  }
  const server = await startBatonServer(t, { ...opts, ...(store ? { store } : { volumes: [{ name: VOL, size: SIZE }] }) });
  const good = await RawClient.connect(server.socket);
  t.teardown(() => good.destroy());
  const { size, eflags } = await good.handshakeGo(VOL);
  t.is(size, BigInt(SIZE));
  t.is(!!(eflags & TFLAG.READ_ONLY), readOnly);
  if (!readOnly) {
    t.is((await good.writeAt(cookie(), BigInt(SENTINEL_OFF), sentinel)).error, 0);
    t.is((await good.writeAt(cookie(), BigInt(PATTERN_OFF), Buffer.alloc(PATTERN_LEN, 0x5c))).error, 0);
  }
  return { server, good, sentinel, cookie };
}

/** The concurrent client still works and sees its data; so does a fresh real client; the server is fine. */
async function assertHealthy(t: ExecutionContext, ctx: Ctx): Promise<void> {
  t.false(ctx.good.closed, 'the well-behaved concurrent client was not disconnected');
  const c = ctx.cookie();
  const r = await ctx.good.readAt(c, BigInt(SENTINEL_OFF), ctx.sentinel.length);
  t.is(r.reply.magic, SIMPLE_REPLY_MAGIC);
  t.is(r.reply.cookie, c);
  t.is(r.reply.error, 0);
  t.true(r.data?.equals(ctx.sentinel), 'concurrent client reads back its sentinel');
  if (HAS_QEMU_IO) {
    const q = await run('qemu-io', ['-r', '-f', 'raw', ctx.server.uri(VOL), '-c', `read -P 0x5c ${PATTERN_OFF} ${PATTERN_LEN}`], { timeoutMs: 30_000 });
    t.is(q.code, 0, q.output);
    t.notRegex(q.stdout + q.stderr, /failed/i, q.output);
  } else {
    const fresh = await RawClient.connect(ctx.server.socket);
    await fresh.handshakeGo(VOL);
    const f = await fresh.readAt(1n, BigInt(PATTERN_OFF), PATTERN_LEN);
    t.true(f.data?.equals(Buffer.alloc(PATTERN_LEN, 0x5c)));
    fresh.destroy();
  }
  t.is(ctx.server.proc.exitCode, null, 'server still running');
  t.notRegex(ctx.server.stderr(), /"level":(50|60)/, 'no error/fatal log lines');
}

/** A new raw connection that has read the greeting. */
async function greeted(t: ExecutionContext, ctx: Ctx): Promise<RawClient> {
  const c = await RawClient.connect(ctx.server.socket);
  t.teardown(() => c.destroy());
  const flags = await c.greeting();
  t.is(flags, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
  return c;
}

/** A new raw connection in transmission (GO done, simple replies). */
async function attached(t: ExecutionContext, ctx: Ctx): Promise<RawClient> {
  const c = await RawClient.connect(ctx.server.socket);
  t.teardown(() => c.destroy());
  await c.handshakeGo(VOL);
  return c;
}

/** The server hung up within 5 s and sent nothing (more). */
async function assertHungUpSilently(t: ExecutionContext, c: RawClient, what: string): Promise<void> {
  t.true(await c.waitClosed(5000), `${what}: server closed the connection`);
  t.is(c.drain().length, 0, `${what}: server sent nothing before closing`);
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

// ------------------------------------------------------------------ handshake

// First, so its 15 s of waiting overlaps the other tests (the limiter queue is FIFO).
test('slow handshake: closed after --handshake-timeout 12 s, not before ~10 s; attached clients are not affected', limited(async (t) => {
  const ctx = await setup(t, { extraArgs: ['--handshake-timeout', '12'] });
  const start = Date.now();
  // A: reads the greeting and says nothing.
  const a = await greeted(t, ctx);
  // B: sends its flags, then an option header one byte per second (it would need 16 s).
  const b = await greeted(t, ctx);
  await b.write(clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
  const header = optionFrame(OPT.LIST);
  let stop = false;
  const trickle = (async (): Promise<void> => {
    for (let i = 0; i < header.length && !stop && !b.closed; i++) {
      await b.write(header.subarray(i, i + 1)).catch(() => {});
      await sleep(1000);
    }
  })();
  t.teardown(async () => { stop = true; await trickle; });
  const closedAt = (c: RawClient): Promise<number> => c.waitClosed(20_000).then(() => Date.now() - start);
  const [aAt, bAt] = [closedAt(a), closedAt(b)];

  await sleep(Math.max(0, 9000 - (Date.now() - start)));
  t.false(a.closed, 'silent client still open at ~9 s');
  t.false(b.closed, 'trickling client still open at ~9 s');
  // The attached client has been idle for 9 s too; it is in transmission, so no timeout applies.
  const mid = await ctx.good.readAt(ctx.cookie(), BigInt(SENTINEL_OFF), 512);
  t.is(mid.reply.error, 0);

  await sleep(Math.max(0, 15_000 - (Date.now() - start)));
  t.true(a.closed, 'silent client closed by ~15 s');
  t.true(b.closed, 'trickling client closed by ~15 s (the timeout covers the whole handshake, not idle gaps)');
  const [ta, tb] = [await aAt, await bAt];
  t.true(ta >= 10_000 && ta <= 15_000, `silent client closed at ${ta} ms`);
  t.true(tb >= 10_000 && tb <= 15_000, `trickling client closed at ${tb} ms`);
  t.is(a.drain().length, 0);
  t.is(b.drain().length, 0, 'no option reply to the unfinished header');
  stop = true;
  await trickle;
  await assertHealthy(t, ctx);
}));

test('greeting answered with NBDMAGIC instead of client flags: disconnect', limited(async (t) => {
  const ctx = await setup(t);
  const c = await greeted(t, ctx);
  const magic = Buffer.alloc(8);
  magic.writeBigUInt64BE(NBDMAGIC);
  await c.write(magic);
  await assertHungUpSilently(t, c, 'NBDMAGIC as client flags');
  await assertHealthy(t, ctx);
}));

test('unknown client flag bits: disconnect (spec: MUST close)', limited(async (t) => {
  const ctx = await setup(t);
  for (const flags of [0x4, 0x80000003, 0xffffffff]) {
    const c = await greeted(t, ctx);
    await c.write(clientFlagsFrame(flags));
    await c.write(optionFrame(OPT.LIST)).catch(() => {});
    await assertHungUpSilently(t, c, `client flags 0x${flags.toString(16)}`);
  }
  await assertHealthy(t, ctx);
}));

test('wrong option magic: disconnect without an option reply', limited(async (t) => {
  const ctx = await setup(t);
  for (const magic of [NBDMAGIC, 0n, IHAVEOPT ^ 1n, OPTION_REPLY_MAGIC, BigInt(REQUEST_MAGIC)]) {
    const c = await greeted(t, ctx);
    await c.write(clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
    await c.write(optionFrame(OPT.LIST, Buffer.alloc(0), { magic }));
    await assertHungUpSilently(t, c, `option magic 0x${magic.toString(16)}`);
  }
  await assertHealthy(t, ctx);
}));

test('truncated handshakes, then the client closes', limited(async (t) => {
  const ctx = await setup(t);
  const flags = clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
  const go = optionFrame(OPT.GO, infoGoData(VOL, [INFO.BLOCK_SIZE]));
  const cuts: [string, Buffer][] = [
    ['nothing after the greeting', Buffer.alloc(0)],
    ['2 of 4 client-flag bytes', flags.subarray(0, 2)],
    ['flags + 10 bytes of an option header', Buffer.concat([flags, go.subarray(0, 10)])],
    ['flags + GO header + half its data', Buffer.concat([flags, go.subarray(0, 16 + 4)])],
    ['flags + a full GO minus its last byte', Buffer.concat([flags, go.subarray(0, go.length - 1)])],
  ];
  for (const [what, bytes] of cuts) {
    const c = await greeted(t, ctx);
    if (bytes.length > 0) await c.write(bytes);
    c.sock.end(); // half-close: the server must notice and let go
    t.true(await c.waitClosed(5000), `${what}: server closed its side`);
    t.is(c.drain().length, 0, `${what}: no reply to an incomplete frame`);
  }
  // And plain resets at the same points.
  for (const [, bytes] of cuts) {
    const c = await greeted(t, ctx);
    if (bytes.length > 0) await c.write(bytes);
    c.destroy();
  }
  await sleep(200);
  await assertHealthy(t, ctx);
}));

test('huge option length: disconnect, nothing allocated or replied', limited(async (t) => {
  const ctx = await setup(t);
  for (const length of [0xfffffff0, 0x80000000, 256 * MiB]) {
    const c = await greeted(t, ctx);
    await c.write(clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
    await c.write(optionFrame(OPT.GO, infoGoData(VOL), { length }));
    await assertHungUpSilently(t, c, `option length ${length}`);
  }
  await assertHealthy(t, ctx);
}));

test('unknown option: ERR_UNSUP with its payload consumed, then GO still works', limited(async (t) => {
  const ctx = await setup(t);
  const c = await greeted(t, ctx);
  await c.write(clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
  // The payload looks like a GO frame: if it were not consumed, the server would answer it.
  const decoy = optionFrame(OPT.GO, infoGoData(VOL));
  for (const option of [0x7654321, 4 /* PEEK_EXPORT, withdrawn */, 0xffffffff]) {
    const replies = await c.option(option, decoy);
    t.is(replies.length, 1);
    const r = replies[0]!;
    t.is(r.magic, OPTION_REPLY_MAGIC);
    t.is(r.option, option, 'option echoed');
    t.is(r.type, REP.ERR_UNSUP);
  }
  const tls = await c.option(OPT.STARTTLS);
  t.true(tls[0]!.type === REP.ERR_UNSUP || tls[0]!.type === REP.ERR_POLICY, `STARTTLS answered 0x${tls[0]!.type.toString(16)}`);
  const { size } = await c.go(VOL);
  t.is(size, BigInt(SIZE));
  const r = await c.readAt(77n, BigInt(SENTINEL_OFF), ctx.sentinel.length);
  t.is(r.reply.error, 0);
  t.is(r.reply.cookie, 77n);
  t.true(r.data?.equals(ctx.sentinel));
  await assertHealthy(t, ctx);
}));

// ------------------------------------------------------------------ transmission

test('bad request magic after GO: disconnect without a reply', limited(async (t) => {
  const ctx = await setup(t);
  for (const magic of [0x25609514, 0x12560953, SIMPLE_REPLY_MAGIC, 0]) {
    const c = await attached(t, ctx);
    const ok = await c.readAt(1n, 0n, 512);
    t.is(ok.reply.error, 0);
    await c.write(requestFrame({ magic, type: CMD.READ, cookie: 2n, offset: 0n, length: 512 }));
    await assertHungUpSilently(t, c, `request magic 0x${magic.toString(16)}`);
  }
  await assertHealthy(t, ctx);
}));

test('READ or WRITE with offset + length past 2^64: EINVAL / ENOSPC, connection stays usable', limited(async (t) => {
  const ctx = await setup(t);
  const c = await attached(t, ctx);
  const cases: { offset: bigint; length: number }[] = [
    { offset: 0xfffffffffffffe00n, length: 1024 }, // wraps around 2^64
    { offset: 0xffffffffffffffffn, length: 1 }, // ends exactly at 2^64
    { offset: 0xffffffffffffffffn, length: 0xffffffff },
    { offset: 1n << 63n, length: 512 }, // negative as a signed 64-bit number
    { offset: BigInt(SIZE - 512), length: 1024 }, // just past the end
  ];
  for (const { offset, length } of cases) {
    const cookie = ctx.cookie();
    const r = await c.command({ type: CMD.READ, cookie, offset, length });
    t.is(r.magic, SIMPLE_REPLY_MAGIC);
    t.is(r.cookie, cookie);
    t.is(r.error, ERRNO.EINVAL, `READ offset=${offset} length=${length}`);
  }
  for (const offset of [0xfffffffffffffe00n, 1n << 63n]) {
    const cookie = ctx.cookie();
    const r = await c.writeAt(cookie, offset, Buffer.alloc(1024, 0xee));
    t.is(r.cookie, cookie);
    t.is(r.error, ERRNO.ENOSPC, `WRITE offset=${offset}`);
  }
  const r = await c.readAt(ctx.cookie(), BigInt(SENTINEL_OFF), ctx.sentinel.length);
  t.is(r.reply.error, 0);
  t.true(r.data?.equals(ctx.sentinel));
  await assertHealthy(t, ctx);
}));

test('WRITE beyond the end: ENOSPC, payload consumed, nothing written, next READ works', limited(async (t) => {
  const ctx = await setup(t);
  const c = await attached(t, ctx);
  const tail = Buffer.alloc(4096, 0x7e);
  t.is((await c.writeAt(ctx.cookie(), BigInt(SIZE - 4096), tail)).error, 0);
  // The payload is a run of valid READ requests: if the server parsed it as requests, stray replies would follow.
  const decoy = Buffer.concat(Array.from({ length: 37 }, () => requestFrame({ type: CMD.READ, cookie: 0xdeadn, offset: 0n, length: 512 }))).subarray(0, 1024);
  for (const [offset, len] of [[SIZE - 512, 1024], [SIZE, 512], [SIZE + 4096, 1024]] as const) {
    const cookie = ctx.cookie();
    const r = await c.writeAt(cookie, BigInt(offset), decoy.subarray(0, len));
    t.is(r.magic, SIMPLE_REPLY_MAGIC);
    t.is(r.cookie, cookie);
    t.is(r.error, ERRNO.ENOSPC, `WRITE offset=${offset} length=${len}`);
  }
  const cookie = ctx.cookie();
  const r = await c.readAt(cookie, BigInt(SIZE - 4096), 4096);
  t.is(r.reply.cookie, cookie);
  t.is(r.reply.error, 0);
  t.true(r.data?.equals(tail), 'the refused WRITE that straddled the end changed nothing');
  await sleep(200);
  t.is(c.drain().length, 0, 'no stray replies');
  await assertHealthy(t, ctx);
}));

test('unknown command (99, 8=RESIZE, 0xffff): EINVAL, session continues', limited(async (t) => {
  const ctx = await setup(t);
  const c = await attached(t, ctx);
  for (const type of [99, 8, 0xffff]) {
    const cookie = ctx.cookie();
    const r = await c.command({ type, cookie, offset: 0n, length: 0 });
    t.is(r.magic, SIMPLE_REPLY_MAGIC);
    t.is(r.cookie, cookie);
    t.is(r.error, ERRNO.EINVAL, `command ${type}`);
  }
  const r = await c.readAt(ctx.cookie(), BigInt(SENTINEL_OFF), ctx.sentinel.length);
  t.true(r.data?.equals(ctx.sentinel));
  await assertHealthy(t, ctx);
}));

test('unknown or misplaced flag bits: EINVAL (a WRITE payload still consumed); FUA accepted on any command', limited(async (t) => {
  const ctx = await setup(t);
  const c = await attached(t, ctx);
  const bad: [string, number, number][] = [
    ['READ + 0x8000', CMD.READ, 0x8000],
    ['READ + NO_HOLE', CMD.READ, 0x02],
    ['READ + REQ_ONE', CMD.READ, 0x08],
    ['FLUSH + FAST_ZERO', CMD.FLUSH, 0x10],
    ['TRIM + NO_HOLE', CMD.TRIM, 0x02],
    ['READ + PAYLOAD_LEN (extended headers only)', CMD.READ, 0x20],
  ];
  for (const [what, type, flags] of bad) {
    const cookie = ctx.cookie();
    const length = type === CMD.FLUSH ? 0 : 512;
    const r = await c.command({ type, flags, cookie, offset: 0n, length });
    t.is(r.cookie, cookie);
    t.is(r.error, ERRNO.EINVAL, what);
  }
  {
    const cookie = ctx.cookie();
    const r = await c.writeAt(cookie, BigInt(SENTINEL_OFF), Buffer.alloc(4096, 0xee), 0x40);
    t.is(r.cookie, cookie);
    t.is(r.error, ERRNO.EINVAL, 'WRITE + unknown flag 0x40');
  }
  // FUA: "MUST be accepted on any command, even by ignoring the bit".
  const fuaRead = await c.readAt(ctx.cookie(), BigInt(SENTINEL_OFF), ctx.sentinel.length, CMD_FLAG_FUA);
  t.is(fuaRead.reply.error, 0, 'READ + FUA');
  t.true(fuaRead.data?.equals(ctx.sentinel), 'the refused WRITE did not touch the sentinel');
  t.is((await c.command({ type: CMD.FLUSH, flags: CMD_FLAG_FUA, cookie: ctx.cookie(), offset: 0n, length: 0 })).error, 0, 'FLUSH + FUA');
  await assertHealthy(t, ctx);
}));

test('read-only server: WRITE, TRIM, WRITE_ZEROES get EPERM, the WRITE payload is consumed; READ and FLUSH work', limited(async (t) => {
  const ctx = await setup(t, { readOnly: true });
  const c = await attached(t, ctx);
  const w = ctx.cookie();
  const wr = await c.writeAt(w, BigInt(SENTINEL_OFF), Buffer.alloc(8192, 0xee));
  t.is(wr.cookie, w);
  t.is(wr.error, ERRNO.EPERM);
  for (const type of [CMD.TRIM, CMD.WRITE_ZEROES]) {
    const cookie = ctx.cookie();
    const r = await c.command({ type, cookie, offset: BigInt(SENTINEL_OFF), length: 4096 });
    t.is(r.cookie, cookie);
    t.is(r.error, ERRNO.EPERM, `command ${type}`);
  }
  t.is((await c.command({ type: CMD.FLUSH, cookie: ctx.cookie(), offset: 0n, length: 0 })).error, 0);
  const r = await c.readAt(ctx.cookie(), BigInt(SENTINEL_OFF), ctx.sentinel.length);
  t.is(r.reply.error, 0);
  t.true(r.data?.equals(ctx.sentinel));
  await assertHealthy(t, ctx);
}));

test('client vanishes mid-WRITE payload, mid-header, and with READs in flight', limited(async (t) => {
  const ctx = await setup(t);
  {
    const c = await attached(t, ctx);
    const hdr = requestFrame({ type: CMD.WRITE, cookie: 1n, offset: BigInt(PATTERN_OFF), length: MiB });
    await c.write(Buffer.concat([hdr, Buffer.alloc(100 * 1024, 0xee)]));
    await sleep(50);
    c.destroy();
  }
  {
    const c = await attached(t, ctx);
    await c.write(requestFrame({ type: CMD.READ, cookie: 1n, offset: 0n, length: 512 }).subarray(0, 11));
    c.destroy();
  }
  {
    const c = await attached(t, ctx);
    const reads = Array.from({ length: 32 }, (_, i) => requestFrame({ type: CMD.READ, cookie: BigInt(i), offset: BigInt(i * 256 * 1024), length: 256 * 1024 }));
    await c.write(Buffer.concat(reads));
    c.destroy();
  }
  await sleep(300);
  // The half-sent WRITE was never applied: the pattern under it is intact (qemu-io checks it in assertHealthy).
  await assertHealthy(t, ctx);
}));

test('frames split byte by byte and coalesced; DISC with writes in flight', limited(async (t) => {
  const ctx = await setup(t);
  const c = await RawClient.connect(ctx.server.socket);
  t.teardown(() => c.destroy());
  await c.greeting();
  const flags = clientFlagsFrame(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
  const go = optionFrame(OPT.GO, infoGoData(VOL));
  for (const b of Buffer.concat([flags, go])) await c.write(Buffer.from([b]));
  const hdr = await c.optionReply();
  t.is(hdr.type, REP.INFO);
  while ((await c.optionReply()).type !== REP.ACK) { /* skip infos */ }
  // One WRITE in dribbles, then three requests in one segment.
  const data = randomBytes(4096);
  const w = requestFrame({ type: CMD.WRITE, cookie: 10n, offset: 3n * BigInt(MiB), length: 4096 }, data);
  for (let i = 0; i < w.length; i += 997) await c.write(w.subarray(i, i + 997));
  t.is((await c.simpleReply()).cookie, 10n);
  await c.write(Buffer.concat([
    requestFrame({ type: CMD.READ, cookie: 11n, offset: 3n * BigInt(MiB), length: 4096 }),
    requestFrame({ type: CMD.FLUSH, cookie: 12n, offset: 0n, length: 0 }),
    requestFrame({ type: CMD.READ, cookie: 13n, offset: BigInt(SENTINEL_OFF), length: 4096 }),
  ]));
  const got = new Map<bigint, Buffer | null>();
  for (let i = 0; i < 3; i++) {
    const r = await c.simpleReply();
    t.is(r.error, 0);
    got.set(r.cookie, r.cookie === 12n ? null : await c.read(4096));
  }
  t.true(got.get(11n)?.equals(data));
  t.true(got.get(13n)?.equals(ctx.sentinel.subarray(0, 4096)));
  // DISC after 8 pipelined writes: all are handled (and replied to) before the server closes.
  const blocks = Array.from({ length: 8 }, () => randomBytes(64 * 1024));
  await c.write(Buffer.concat([
    ...blocks.map((b, i) => requestFrame({ type: CMD.WRITE, cookie: 100n + BigInt(i), offset: BigInt(4 * MiB + i * 64 * 1024), length: b.length }, b)),
    requestFrame({ type: CMD.DISC, cookie: 200n, offset: 0n, length: 0 }),
  ]));
  const cookies: bigint[] = [];
  for (let i = 0; i < 8; i++) {
    const r = await c.simpleReply();
    t.is(r.error, 0);
    cookies.push(r.cookie);
  }
  t.deepEqual(cookies.sort((a, b) => (a < b ? -1 : 1)), blocks.map((_, i) => 100n + BigInt(i)));
  t.true(await c.waitClosed(5000), 'server closes after DISC');
  t.is(c.drain().length, 0, 'no reply to DISC');
  const v = await ctx.good.readAt(ctx.cookie(), BigInt(4 * MiB), 8 * 64 * 1024);
  t.true(v.data?.equals(Buffer.concat(blocks)), 'writes before DISC are visible on another connection');
  await assertHealthy(t, ctx);
}));

test('a client that never reads its replies stalls only itself; memory stays bounded', limited(async (t) => {
  const ctx = await setup(t);
  const stalled = await attached(t, ctx);
  stalled.sock.pause();
  // 2000 pipelined 1 MiB READs (2 GiB of replies) that are never read.
  const reqs = Array.from({ length: 2000 }, (_, i) => requestFrame({ type: CMD.READ, cookie: BigInt(i), offset: BigInt((i % 8) * MiB), length: MiB }));
  stalled.sock.write(Buffer.concat(reqs));
  await sleep(1500);
  const started = Date.now();
  await assertHealthy(t, ctx);
  t.true(Date.now() - started < 10_000, 'other clients are served promptly');
  const rssKb = Number(/VmRSS:\s+(\d+)/.exec(await readFile(`/proc/${ctx.server.proc.pid}/status`, 'utf8').catch(() => 'VmRSS: 0'))?.[1] ?? 0);
  t.true(rssKb < 600 * 1024, `server RSS ${Math.round(rssKb / 1024)} MiB with 2 GiB of unread replies requested`);
  stalled.destroy();
  await sleep(200);
  await assertHealthy(t, ctx);
}));

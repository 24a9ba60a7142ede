/**
 * nbd/codec.ts against hand-written vectors from the spec (test/fixtures/nbd-vectors.ts):
 * every encoder produces its vector byte for byte, every decoder reads its vector, frames
 * survive a round trip through spec-side writers/parsers, malformed input is refused with
 * the right error class, and a seeded fuzz shows decoders only ever return or throw
 * BatonError subclasses.
 */

import test from 'ava';
import { BatonError, InvalidArgumentError, ProtocolError } from '../../src/errors.js';
import * as codec from '../../nbd/codec.js';
import * as V from '../fixtures/nbd-vectors.js';
import { seededRandom } from '../../src/store/decorators.js';

const { hex } = V;

// Spec constants written out here rather than imported, so a wrong constant in
// nbd/constants.ts cannot hide behind a matching test (§1.1).
const OPT = { EXPORT_NAME: 1, ABORT: 2, LIST: 3, STARTTLS: 5, INFO: 6, GO: 7, STRUCTURED_REPLY: 8, LIST_META: 9, SET_META: 10 };
const REP = { ACK: 1, SERVER: 2, INFO: 3, META_CONTEXT: 4, ERR_UNSUP: 0x80000001, ERR_TLS_REQD: 0x80000005 };
const INFO = { EXPORT: 0, NAME: 1, DESCRIPTION: 2, BLOCK_SIZE: 3 } as const;
const HANDSHAKE_FIXED = 0x1;
const HANDSHAKE_FIXED_NOZEROES = 0x3;

function dataOf(frame: Buffer): Buffer { return frame.subarray(V.OPTION_HEADER_LEN); }
function headerOf(frame: Buffer): Buffer { return frame.subarray(0, V.OPTION_HEADER_LEN); }

// ------------------------------------------------------------------ the vectors themselves

test('vectors: sizes match the spec layouts (sanity check of the hand-written hex)', (t) => {
  t.is(V.GREETING.length, 18);
  for (const [name, r] of Object.entries(V.REQUESTS)) t.is(r.bytes.length, 28, name);
  for (const [name, o] of Object.entries(V.OPTIONS)) {
    t.is(o.bytes.length, 16 + o.length, name);
    t.is(o.bytes.readUInt32BE(12), o.length, name);
  }
  for (const [name, r] of Object.entries(V.OPTION_REPLIES)) t.is(r.length, 20 + r.readUInt32BE(16), name);
  for (const [name, r] of Object.entries(V.SIMPLE_REPLIES)) t.is(r.length, 16, name);
  t.is(V.EXPORT_NAME_REPLY.noZeroes.length, 10);
  t.is(V.EXPORT_NAME_REPLY.withZeroes.length, 134);
  t.is(V.CHUNKS.noneDone.length, 20);
  t.is(V.CHUNKS.offsetHole.length, 20 + 12);
  t.is(V.CHUNKS.blockStatus2.length, 20 + 4 + 16);
  t.is(V.CHUNKS.errorEinval.length, 20 + 9);
  t.is(V.CHUNKS.offsetDataHeaderDone.length, 28);
  t.throws(() => hex('abc'));
  t.throws(() => hex('zz'));
});

// ------------------------------------------------------------------ encoders = vectors

test('encodeGreeting(0x0003) is NBDMAGIC, IHAVEOPT, 0x0003', (t) => {
  t.deepEqual(codec.encodeGreeting(0x0003), V.GREETING);
});

test('encodeOptionReply: ACK to GO has no data', (t) => {
  t.deepEqual(codec.encodeOptionReply(OPT.GO, REP.ACK), V.OPTION_REPLIES.ackGo);
});

test('encodeServerEntry inside a SERVER reply to LIST', (t) => {
  t.deepEqual(codec.encodeOptionReply(OPT.LIST, REP.SERVER, codec.encodeServerEntry('disk', 'scratch')), V.OPTION_REPLIES.serverDisk);
});

test('encodeInfoExport: u16 type 0, u64 size, u16 flags, 12 bytes', (t) => {
  const body = codec.encodeInfoExport(V.SIZE_1M, V.EFLAGS_RW);
  t.is(body.length, 12);
  t.deepEqual(codec.encodeOptionReply(OPT.GO, REP.INFO, body), V.OPTION_REPLIES.infoExport);
});

test('encodeInfoExport keeps all 64 bits of a size above 4 GiB with bit 31 set', (t) => {
  t.deepEqual(codec.encodeOptionReply(OPT.GO, REP.INFO, codec.encodeInfoExport(6 * 1024 ** 3, V.EFLAGS_RW)), V.OPTION_REPLIES.infoExport6G);
});

test('encodeInfoBlockSize: u16 type 3 + min/preferred/max, 14 bytes', (t) => {
  const body = codec.encodeInfoBlockSize(512, 4096, 32 * 1024 * 1024);
  t.is(body.length, 14);
  t.deepEqual(codec.encodeOptionReply(OPT.GO, REP.INFO, body), V.OPTION_REPLIES.infoBlockSize);
  t.deepEqual(codec.encodeOptionReply(OPT.GO, REP.INFO, codec.encodeInfoBlockSize(512, 4096, 0xffffffff)), V.OPTION_REPLIES.infoBlockSizeMaxU32);
});

test('encodeInfoString: NBD_INFO_NAME', (t) => {
  t.deepEqual(codec.encodeOptionReply(OPT.GO, REP.INFO, codec.encodeInfoString(INFO.NAME, 'disk')), V.OPTION_REPLIES.infoName);
});

test('encodeMetaContext in META_CONTEXT replies to SET (id 1) and LIST (id 0)', (t) => {
  t.deepEqual(codec.encodeOptionReply(OPT.SET_META, REP.META_CONTEXT, codec.encodeMetaContext(1, 'base:allocation')), V.OPTION_REPLIES.metaContextSet);
  t.deepEqual(codec.encodeOptionReply(OPT.LIST_META, REP.META_CONTEXT, codec.encodeMetaContext(0, 'base:allocation')), V.OPTION_REPLIES.metaContextList);
});

test('encodeOptionError: ERR_UNSUP with a message', (t) => {
  t.deepEqual(codec.encodeOptionError(OPT.STARTTLS, REP.ERR_UNSUP, 'unsupported'), V.OPTION_REPLIES.errUnsupStarttls);
});

test('STARTTLS replies: ACK with no data; ERR_TLS_REQD to an option sent before TLS', (t) => {
  t.deepEqual(codec.encodeOptionReply(OPT.STARTTLS, REP.ACK), V.OPTION_REPLIES.ackStarttls);
  t.deepEqual(codec.encodeOptionError(OPT.GO, REP.ERR_TLS_REQD, 'tls'), V.OPTION_REPLIES.errTlsReqdGo);
});

test('encodeOptionError caps the message at the 4096-byte string limit without splitting a character', (t) => {
  const r = V.parseOptionReply(codec.encodeOptionError(OPT.GO, REP.ERR_UNSUP, 'é'.repeat(5000)));
  t.true(r.data.length <= 4096);
  t.true(r.data.length >= 4000);
  t.is(r.data.toString('utf8'), 'é'.repeat(r.data.length / 2));
});

test('encodeExportNameReply: 10 bytes with NO_ZEROES, 134 without', (t) => {
  t.deepEqual(codec.encodeExportNameReply(V.SIZE_1M, V.EFLAGS_RW, true), V.EXPORT_NAME_REPLY.noZeroes);
  t.deepEqual(codec.encodeExportNameReply(V.SIZE_1M, V.EFLAGS_RW, false), V.EXPORT_NAME_REPLY.withZeroes);
});

test('encodeSimpleReply echoes the cookie verbatim', (t) => {
  t.deepEqual(codec.encodeSimpleReply(0, V.COOKIE), V.SIMPLE_REPLIES.ok);
  t.deepEqual(codec.encodeSimpleReply(22, V.COOKIE), V.SIMPLE_REPLIES.einval);
  t.deepEqual(codec.encodeSimpleReply(1, V.KERNEL_COOKIE), V.SIMPLE_REPLIES.epermKernelCookie);
});

test('encodeNoneChunk: NONE with DONE, length 0', (t) => {
  t.deepEqual(codec.encodeNoneChunk(V.COOKIE), V.CHUNKS.noneDone);
});

test('encodeOffsetDataHeader: header + u64 offset, length counts the data', (t) => {
  t.deepEqual(codec.encodeOffsetDataHeader(V.COOKIE, 0x1000n, 512, true), V.CHUNKS.offsetDataHeaderDone);
});

test('writeSimpleReply / writeOffsetDataHeader: the same bytes at the start of a reply buffer that holds the data after them, which they leave alone', (t) => {
  const data = Buffer.alloc(512, 0x5a);
  const simple = Buffer.concat([Buffer.alloc(16, 0xff), data]);
  codec.writeSimpleReply(simple, 0, V.COOKIE);
  t.deepEqual(simple.subarray(0, 16), V.SIMPLE_REPLIES.ok);
  t.deepEqual(simple.subarray(16), data);
  const chunk = Buffer.concat([Buffer.alloc(codec.OFFSET_DATA_HEADER_SIZE, 0xff), data]);
  codec.writeOffsetDataHeader(chunk, V.COOKIE, 0x1000n, 512, true);
  t.deepEqual(chunk.subarray(0, codec.OFFSET_DATA_HEADER_SIZE), V.CHUNKS.offsetDataHeaderDone);
  t.deepEqual(chunk.subarray(codec.OFFSET_DATA_HEADER_SIZE), data);
});

test('encodeOffsetHole: u64 offset, u32 size, length 12', (t) => {
  t.deepEqual(codec.encodeOffsetHole(V.COOKIE, 0x2000n, 0x1000, false), V.CHUNKS.offsetHole);
});

test('encodeBlockStatusChunk: type 5, context id, 2 extents', (t) => {
  t.deepEqual(codec.encodeBlockStatusChunk(V.COOKIE, 1, [{ length: 4096, flags: 0 }, { length: 12288, flags: 3 }], true), V.CHUNKS.blockStatus2);
});

test('encodeErrorChunk: type 0x8001, u32 error, u16 msglen, message', (t) => {
  t.deepEqual(codec.encodeErrorChunk(V.COOKIE, 22, 'bad', true), V.CHUNKS.errorEinval);
});

test('encodeErrorChunk keeps the payload within qemu\'s 1000-byte limit for non-data chunks, whole characters only', (t) => {
  const c = V.parseChunk(codec.encodeErrorChunk(V.COOKIE, 5, '€'.repeat(3000), true));
  t.is(c.type, 0x8001);
  t.true(c.payload.length <= 1000);
  const e = V.parseErrorPayload(c.payload);
  t.is(e.error, 5);
  t.is(6 + Buffer.byteLength(e.message), c.payload.length);
  t.is(e.message, '€'.repeat(e.message.length));
});

// ------------------------------------------------------------------ decoders read the vectors

test('decodeClientFlags reads each legal flag word', (t) => {
  t.is(codec.decodeClientFlags(V.CLIENT_FLAGS.fixedNoZeroes.bytes, HANDSHAKE_FIXED_NOZEROES), 0x3);
  t.is(codec.decodeClientFlags(V.CLIENT_FLAGS.fixed.bytes, HANDSHAKE_FIXED_NOZEROES), 0x1);
  t.is(codec.decodeClientFlags(V.CLIENT_FLAGS.fixed.bytes, HANDSHAKE_FIXED), 0x1);
  t.is(codec.decodeClientFlags(V.CLIENT_FLAGS.none.bytes, HANDSHAKE_FIXED_NOZEROES), 0x0);
  t.is(codec.decodeClientFlags(V.CLIENT_FLAGS.noZeroesOnly.bytes, HANDSHAKE_FIXED_NOZEROES), 0x2);
});

test('decodeOptionHeader reads every option vector', (t) => {
  for (const [name, o] of Object.entries(V.OPTIONS)) {
    t.deepEqual(codec.decodeOptionHeader(headerOf(o.bytes)), { option: o.option, length: o.length }, name);
  }
});

test('decodeInfoRequest reads GO/INFO payloads', (t) => {
  for (const o of [V.OPTIONS.goWithInfos, V.OPTIONS.goDefaultNoInfos, V.OPTIONS.infoBlockSize]) {
    t.deepEqual(codec.decodeInfoRequest(dataOf(o.bytes)), { name: o.name, infoTypes: [...o.infoTypes] });
  }
});

test('decodeMetaContextRequest reads LIST/SET payloads', (t) => {
  for (const o of [V.OPTIONS.setMetaBaseAllocation, V.OPTIONS.listMetaAll, V.OPTIONS.listMetaTwoQueries]) {
    t.deepEqual(codec.decodeMetaContextRequest(dataOf(o.bytes)), { exportName: o.exportName, queries: [...o.queries] });
  }
});

test('decodeRequest reads every command vector, flags and cookie included', (t) => {
  for (const [name, r] of Object.entries(V.REQUESTS)) {
    const d = codec.decodeRequest(r.bytes);
    t.is(d.flags, r.flags, name);
    t.is(d.type, r.type, name);
    t.is(d.offset, r.offset, name);
    t.is(d.length, r.length, name);
    t.deepEqual(d.cookie, r.bytes.subarray(8, 16), name);
  }
  t.deepEqual(codec.decodeRequest(V.REQUESTS.readMaxOffsetKernelCookie.bytes).cookie, V.KERNEL_COOKIE);
});

test('decodeRequest: the cookie is a copy, not a view of the (reusable) input buffer', (t) => {
  const frame = Buffer.from(V.REQUESTS.read.bytes);
  const d = codec.decodeRequest(frame);
  frame.fill(0xee);
  t.deepEqual(d.cookie, V.COOKIE);
});

test('decoders give the same answer for a frame that sits inside a larger buffer', (t) => {
  const embed = (b: Buffer): Buffer => Buffer.concat([Buffer.from('garbage!'), b, Buffer.from('more')]).subarray(8, 8 + b.length);
  for (const r of Object.values(V.REQUESTS)) t.deepEqual(codec.decodeRequest(embed(r.bytes)), codec.decodeRequest(Buffer.from(r.bytes)));
  for (const o of Object.values(V.OPTIONS)) t.deepEqual(codec.decodeOptionHeader(embed(headerOf(o.bytes))), codec.decodeOptionHeader(Buffer.from(headerOf(o.bytes))));
  const go = dataOf(V.OPTIONS.goWithInfos.bytes);
  t.deepEqual(codec.decodeInfoRequest(embed(go)), codec.decodeInfoRequest(Buffer.from(go)));
  const meta = dataOf(V.OPTIONS.listMetaTwoQueries.bytes);
  t.deepEqual(codec.decodeMetaContextRequest(embed(meta)), codec.decodeMetaContextRequest(Buffer.from(meta)));
  t.is(codec.decodeClientFlags(embed(V.CLIENT_FLAGS.fixedNoZeroes.bytes), 3), 3);
});

// ------------------------------------------------------------------ round trips

test('round trip: decodeRequest then the spec writer gives back the same 28 bytes', (t) => {
  for (const [name, r] of Object.entries(V.REQUESTS)) t.deepEqual(V.requestFrame(codec.decodeRequest(r.bytes)), r.bytes, name);
});

test('round trip: decodeOptionHeader / decodeInfoRequest / decodeMetaContextRequest then the spec writers', (t) => {
  for (const [name, o] of Object.entries(V.OPTIONS)) {
    const h = codec.decodeOptionHeader(headerOf(o.bytes));
    t.deepEqual(V.optionFrame(h.option, dataOf(o.bytes)), o.bytes, name);
  }
  for (const o of [V.OPTIONS.goWithInfos, V.OPTIONS.goDefaultNoInfos, V.OPTIONS.infoBlockSize]) {
    const d = codec.decodeInfoRequest(dataOf(o.bytes));
    t.deepEqual(V.infoData(d.name, d.infoTypes), dataOf(o.bytes));
  }
  for (const o of [V.OPTIONS.setMetaBaseAllocation, V.OPTIONS.listMetaAll, V.OPTIONS.listMetaTwoQueries]) {
    const d = codec.decodeMetaContextRequest(dataOf(o.bytes));
    t.deepEqual(V.metaData(d.exportName, d.queries), dataOf(o.bytes));
  }
});

test('round trip: spec writers with non-ASCII names, then the decoders', (t) => {
  for (const name of ['диск', '💾-vol', 'a\u{fffd}b', 'x'.repeat(4096), '']) {
    t.deepEqual(codec.decodeInfoRequest(V.infoData(name, [0, 1, 2, 3, 0x7fff])), { name, infoTypes: [0, 1, 2, 3, 0x7fff] });
    t.deepEqual(codec.decodeMetaContextRequest(V.metaData(name, ['base:allocation', name])), { exportName: name, queries: ['base:allocation', name] });
  }
});

test('round trip: encoder output parsed by the spec parser and re-encoded is stable', (t) => {
  const reply = V.parseOptionReply(codec.encodeOptionReply(OPT.GO, REP.INFO, codec.encodeInfoExport(V.SIZE_1M, V.EFLAGS_RW)));
  t.deepEqual(codec.encodeOptionReply(reply.option, reply.type, reply.data), V.OPTION_REPLIES.infoExport);
  const infoSize = reply.data.readBigUInt64BE(2);
  t.deepEqual(codec.encodeInfoExport(Number(infoSize), reply.data.readUInt16BE(10)), reply.data);

  const bs = V.parseChunk(codec.encodeBlockStatusChunk(V.COOKIE, 7, [{ length: 512, flags: 1 }, { length: 1024, flags: 2 }, { length: 4096, flags: 0 }], false));
  t.is(bs.type, 5);
  t.is(bs.flags & 1, 0);
  const parsed = V.parseBlockStatusPayload(bs.payload);
  t.is(parsed.contextId, 7);
  t.deepEqual(codec.encodeBlockStatusChunk(Buffer.from(bs.cookie), parsed.contextId, parsed.extents, false), Buffer.concat([V.hex('668e33ef 0000 0005'), bs.cookie, V.u32(bs.payload.length), bs.payload]));

  const err = V.parseChunk(codec.encodeErrorChunk(V.KERNEL_COOKIE, 28, 'no space left', true));
  const e = V.parseErrorPayload(err.payload);
  t.deepEqual(e, { error: 28, message: 'no space left' });
  t.deepEqual(codec.encodeErrorChunk(Buffer.from(err.cookie), e.error, e.message, (err.flags & 1) === 1), Buffer.concat([V.hex('668e33ef 0001 8001'), V.KERNEL_COOKIE, V.u32(err.payload.length), err.payload]));

  const hole = V.parseChunk(codec.encodeOffsetHole(V.COOKIE, 0xfffffffffffff000n, 0x1000, true));
  t.is(hole.payload.readBigUInt64BE(0), 0xfffffffffffff000n);
  t.is(hole.payload.readUInt32BE(8), 0x1000);
});

// ------------------------------------------------------------------ malformed input

test('short and long frames are refused with ProtocolError', (t) => {
  const cases: [string, (b: Buffer) => unknown, Buffer][] = [
    ['client flags', (b) => codec.decodeClientFlags(b, 3), V.CLIENT_FLAGS.fixed.bytes],
    ['option header', (b) => codec.decodeOptionHeader(b), headerOf(V.OPTIONS.list.bytes)],
    ['request', (b) => codec.decodeRequest(b), V.REQUESTS.read.bytes],
  ];
  for (const [name, fn, good] of cases) {
    t.throws(() => fn(good.subarray(0, good.length - 1)), { instanceOf: ProtocolError }, `${name} short`);
    t.throws(() => fn(Buffer.concat([good, Buffer.from([0])])), { instanceOf: ProtocolError }, `${name} long`);
    t.throws(() => fn(Buffer.alloc(0)), { instanceOf: ProtocolError }, `${name} empty`);
  }
});

test('wrong option magic is a ProtocolError', (t) => {
  const bad = [
    hex('49484156454f5055 | 00000003 | 00000000'), // IHAVEOPU: last byte off
    hex('0003e889045565a9 | 00000003 | 00000000'), // the option-REPLY magic
    hex('4e42444d41474943 | 00000003 | 00000000'), // NBDMAGIC
    hex('0000420281861253 | 00000003 | 00000000'), // oldstyle cliserv_magic
  ];
  for (const b of bad) t.throws(() => codec.decodeOptionHeader(b), { instanceOf: ProtocolError });
});

test('wrong request magic is a ProtocolError (reserved, reply and extended magics too)', (t) => {
  for (const magic of [0x25609514, 0x12560953, 0x96744668, 0x67446698, 0x668e33ef, 0x21e41c71, 0, 0xffffffff]) {
    t.throws(() => codec.decodeRequest(V.requestFrame({ flags: 0, type: 0, cookie: V.COOKIE, offset: 0n, length: 512 }, magic)), { instanceOf: ProtocolError }, magic.toString(16));
  }
});

test('unknown client flag bits are a ProtocolError (server MUST drop the connection)', (t) => {
  for (const b of [V.CLIENT_FLAGS.unknownBit2, V.CLIENT_FLAGS.unknownBit31, V.CLIENT_FLAGS.allBits, hex('00000007'), hex('00010001')]) {
    t.throws(() => codec.decodeClientFlags(b, HANDSHAKE_FIXED_NOZEROES), { instanceOf: ProtocolError }, b.toString('hex'));
  }
});

test('C_NO_ZEROES when NO_ZEROES was not offered is a ProtocolError', (t) => {
  t.throws(() => codec.decodeClientFlags(V.CLIENT_FLAGS.fixedNoZeroes.bytes, HANDSHAKE_FIXED), { instanceOf: ProtocolError });
  t.throws(() => codec.decodeClientFlags(V.CLIENT_FLAGS.noZeroesOnly.bytes, HANDSHAKE_FIXED), { instanceOf: ProtocolError });
});

test('INFO/GO payload: too short, name past the end, counts that do not add up → InvalidArgumentError', (t) => {
  const bad: [string, Buffer][] = [
    ['empty', Buffer.alloc(0)],
    ['5 bytes', hex('00000000 00')],
    ['name length only', hex('00000004')],
    ['name length past end', hex('0000000a | 6469736b | 0000')],
    ['name length 0xffffffff', hex('ffffffff | 0000')],
    ['name longer than 4096', Buffer.concat([V.u32(4097), Buffer.alloc(4097, 0x61), V.u16(0)])],
    ['name fills the payload, no count', hex('00000004 | 6469736b')],
    ['count 2, one type', hex('00000004 | 6469736b | 0002 | 0003')],
    ['count 1, two types', hex('00000004 | 6469736b | 0001 | 0003 0001')],
    ['count 0, trailing byte', hex('00000004 | 6469736b | 0000 | 00')],
    ['count 0xffff, none', hex('00000000 | ffff')],
    ['odd trailing byte after types', hex('00000000 | 0001 | 0003 | 01')],
  ];
  for (const [name, b] of bad) t.throws(() => codec.decodeInfoRequest(b), { instanceOf: InvalidArgumentError }, name);
});

test('meta context payload: lengths past the end or trailing bytes → InvalidArgumentError', (t) => {
  const good = dataOf(V.OPTIONS.listMetaTwoQueries.bytes);
  // Every strict prefix of a good payload is malformed.
  for (let n = 0; n < good.length; n++) {
    t.throws(() => codec.decodeMetaContextRequest(good.subarray(0, n)), { instanceOf: InvalidArgumentError }, `prefix ${n}`);
  }
  const bad: [string, Buffer][] = [
    ['trailing byte', Buffer.concat([good, hex('00')])],
    ['trailing query header', Buffer.concat([good, hex('00000000')])],
    ['name length past end', hex('00000010 | 6469736b | 00000000')],
    ['nqueries 2, one query', hex('00000004 | 6469736b | 00000002 | 00000005 | 626173653a')],
    ['nqueries 0xffffffff, none', hex('00000000 | ffffffff')],
    ['query length past end', hex('00000000 | 00000001 | 00000010 | 626173653a')],
    ['query length 0xffffffff', hex('00000000 | 00000001 | ffffffff')],
    ['name longer than 4096', Buffer.concat([V.u32(5000), Buffer.alloc(5000, 0x61), V.u32(0)])],
    ['query longer than 4096', Buffer.concat([V.u32(0), V.u32(1), V.u32(5000), Buffer.alloc(5000, 0x61)])],
  ];
  for (const [name, b] of bad) t.throws(() => codec.decodeMetaContextRequest(b), { instanceOf: InvalidArgumentError }, name);
});

// Invalid UTF-8 that the WHATWG decoder turns into U+FFFD sequences of a *different* byte length.
const INVALID_UTF8_DETECTABLE: [string, Buffer][] = [
  ['lone 0xff', hex('ff')],
  ['lone continuation byte', hex('80')],
  ['overlong NUL', hex('c080')],
  ['UTF-16 surrogate encoded in UTF-8', hex('eda080')],
  ['truncated 3-byte sequence', hex('e282')],
  ['code point above U+10FFFF', hex('f4908080')],
];
// Invalid UTF-8 whose U+FFFD replacement happens to have the same byte length (3 bytes → one U+FFFD).
const INVALID_UTF8_SAME_LENGTH: [string, Buffer][] = [
  ['truncated 4-byte sequence f0 9f 98', hex('f09f98')],
  ['truncated 4-byte sequence f4 8f bf + "A"', hex('f48fbf41')],
];

test('invalid UTF-8 or NUL in names and queries → InvalidArgumentError', (t) => {
  for (const [name, raw] of [...INVALID_UTF8_DETECTABLE, ['embedded NUL', hex('6469 00 736b')] as [string, Buffer]]) {
    const s = Buffer.concat([hex('64'), raw, hex('6b')]);
    t.throws(() => codec.decodeInfoRequest(V.infoData(s, [])), { instanceOf: InvalidArgumentError }, `info name: ${name}`);
    t.throws(() => codec.decodeMetaContextRequest(V.metaData(s, [])), { instanceOf: InvalidArgumentError }, `meta name: ${name}`);
    t.throws(() => codec.decodeMetaContextRequest(V.metaData('disk', ['base:allocation', s])), { instanceOf: InvalidArgumentError }, `query: ${name}`);
  }
});

// BUG (nbd/codec.ts decodeString, line ~104): validity is judged by whether the decoded
// string re-encodes to the same number of bytes. A truncated 4-byte sequence (3 bytes)
// decodes to a single U+FFFD, which is also 3 bytes, so the invalid name is accepted and
// silently becomes "\ufffd". proto.md "Conventions": a string "is a sequence of UTF-8 code
// points". (The same check is repeated for EXPORT_NAME in nbd/session.ts ~line 165.)
test('invalid UTF-8 whose replacement has the same byte length is refused too', (t) => {
  for (const [name, raw] of INVALID_UTF8_SAME_LENGTH) {
    t.throws(() => codec.decodeInfoRequest(V.infoData(raw, [])), { instanceOf: InvalidArgumentError }, `info name: ${name}`);
    t.throws(() => codec.decodeMetaContextRequest(V.metaData('disk', [raw])), { instanceOf: InvalidArgumentError }, `query: ${name}`);
  }
});

test('valid UTF-8 that contains U+FFFD itself is accepted', (t) => {
  t.is(codec.decodeInfoRequest(V.infoData(hex('efbfbd'), [])).name, '\ufffd');
});

// ------------------------------------------------------------------ fuzz

const prng = seededRandom;

type Decoder = { name: string; fn: (b: Buffer) => unknown; seeds: Buffer[] };

const DECODERS: Decoder[] = [
  { name: 'decodeClientFlags', fn: (b) => codec.decodeClientFlags(b, 3), seeds: [V.CLIENT_FLAGS.fixedNoZeroes.bytes, V.CLIENT_FLAGS.fixed.bytes] },
  { name: 'decodeClientFlags(no NO_ZEROES offered)', fn: (b) => codec.decodeClientFlags(b, 1), seeds: [V.CLIENT_FLAGS.fixedNoZeroes.bytes] },
  { name: 'decodeOptionHeader', fn: (b) => codec.decodeOptionHeader(b), seeds: Object.values(V.OPTIONS).map((o) => headerOf(o.bytes)) },
  { name: 'decodeInfoRequest', fn: (b) => codec.decodeInfoRequest(b), seeds: [V.OPTIONS.goWithInfos, V.OPTIONS.goDefaultNoInfos, V.OPTIONS.infoBlockSize].map((o) => dataOf(o.bytes)) },
  { name: 'decodeMetaContextRequest', fn: (b) => codec.decodeMetaContextRequest(b), seeds: [V.OPTIONS.setMetaBaseAllocation, V.OPTIONS.listMetaAll, V.OPTIONS.listMetaTwoQueries].map((o) => dataOf(o.bytes)) },
  { name: 'decodeRequest', fn: (b) => codec.decodeRequest(b), seeds: Object.values(V.REQUESTS).map((r) => r.bytes) },
];

const INTERESTING_U32 = [0, 1, 2, 3, 4, 5, 6, 0x7f, 0x80, 0xff, 0x100, 0x1000, 4096, 4097, 0x7fffffff, 0x80000000, 0xfffffffe, 0xffffffff];

function mutate(seed: Buffer, rnd: () => number): Buffer {
  const pick = (n: number): number => Math.floor(rnd() * n);
  let b = Buffer.from(seed);
  const rounds = 1 + pick(4);
  for (let i = 0; i < rounds; i++) {
    switch (pick(8)) {
      case 0: if (b.length) b[pick(b.length)] = pick(256); break; // random byte
      case 1: if (b.length) { const o = pick(b.length); b[o] = b[o]! ^ (1 << pick(8)); } break; // bit flip
      case 2: b = b.subarray(0, pick(b.length + 1)); break; // truncate
      case 3: b = Buffer.concat([b, Buffer.from(Array.from({ length: 1 + pick(8) }, () => pick(256)))]); break; // extend
      case 4: if (b.length >= 4) { const o = pick(b.length - 3); b.writeUInt32BE(INTERESTING_U32[pick(INTERESTING_U32.length)]!, o); } break; // length field
      case 5: if (b.length >= 2) { const o = pick(b.length - 1); b.writeUInt16BE([0, 1, 2, 0x7fff, 0xffff][pick(5)]!, o); } break;
      case 6: { const o = pick(b.length + 1); b = Buffer.concat([b.subarray(0, o), b.subarray(Math.min(b.length, o + 1 + pick(4)))]); break; } // delete
      default: { const o = pick(b.length + 1); b = Buffer.concat([b.subarray(0, o), Buffer.from([[0x00, 0xff, 0x80, 0xc0, 0xed, 0xf0][pick(6)]!]), b.subarray(o)]); break; } // insert
    }
  }
  return b;
}

test('fuzz: decoders only return or throw BatonError subclasses on mutated frames (seeded)', (t) => {
  const rnd = prng(0x5eed_2026);
  const stats = new Map<string, { ok: number; err: number }>();
  const N = 4000;
  for (let i = 0; i < N; i++) {
    for (const d of DECODERS) {
      const seed = d.seeds[Math.floor(rnd() * d.seeds.length)]!;
      const input = mutate(seed, rnd);
      const s = stats.get(d.name) ?? { ok: 0, err: 0 };
      stats.set(d.name, s);
      try {
        d.fn(input);
        s.ok++;
      } catch (err) {
        s.err++;
        if (!(err instanceof BatonError)) {
          t.fail(`${d.name}(${input.toString('hex')}) threw ${(err as Error)?.constructor?.name}: ${(err as Error)?.message}`);
          return;
        }
        t.true(err instanceof ProtocolError || err instanceof InvalidArgumentError, `${d.name} threw ${err.constructor.name}`);
      }
    }
  }
  // The mutations must exercise both outcomes, or the fuzz proves nothing.
  for (const [name, s] of stats) {
    t.true(s.err > 0, `${name}: no rejected input`);
    t.true(s.ok > 0, `${name}: no accepted input`);
  }
});

test('fuzz: random bytes of random length never escape as TypeError/RangeError (seeded)', (t) => {
  const rnd = prng(42);
  let rejected = 0;
  let escaped = 0;
  for (let i = 0; i < 3000; i++) {
    const len = Math.floor(rnd() * 48);
    const b = Buffer.from(Array.from({ length: len }, () => Math.floor(rnd() * 256)));
    for (const d of DECODERS) {
      try { d.fn(b); } catch (err) {
        if (err instanceof BatonError) rejected++;
        else if (escaped++ === 0) t.log(`${d.name}(${b.toString('hex')}) threw ${String(err)}`);
      }
    }
  }
  t.is(escaped, 0, 'no decoder threw anything but a BatonError');
  t.true(rejected > 0, 'random input was rejected at least sometimes (the fuzz reached the checks)');
});

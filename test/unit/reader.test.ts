/**
 * nbd/reader.ts over real Unix sockets: frames come out byte for byte whichever way they are
 * taken (whole, or lent as pieces), both when Node delivers 'data' events and after useSlabs()
 * switched the socket to reads into reused slabs; a frame a consumer took stays as it was
 * after the slab it was read into serves later reads.
 */

import test, { type ExecutionContext } from 'ava';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { PassThrough } from 'node:stream';
import { ConnectionClosedError, FrameReader } from '../../nbd/reader.js';
import { seededRandom } from '../../src/store/decorators.js';

/** A connected pair over a Unix socket: the server side (what a session reads) and the client side. */
async function socketPair(t: ExecutionContext): Promise<{ server: net.Socket; client: net.Socket }> {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-reader-'));
  const file = path.join(dir, 's.sock');
  let accepted!: (s: net.Socket) => void;
  const serverSide = new Promise<net.Socket>((r) => { accepted = r; });
  const listener = net.createServer((s) => accepted(s));
  await new Promise<void>((resolve) => listener.listen(file, resolve));
  const client = net.connect(file);
  await new Promise<void>((resolve, reject) => { client.once('connect', resolve); client.once('error', reject); });
  const server = await serverSide;
  t.teardown(async () => {
    client.destroy();
    server.destroy();
    await new Promise<void>((resolve) => listener.close(() => resolve()));
    fs.rmSync(dir, { recursive: true, force: true });
  });
  return { server, client };
}

/**
 * Frames of random sizes (28 bytes to 300 KiB) with random contents, sent in random pieces;
 * the reader takes each one a random way and every frame must come out as sent. Frames taken
 * whole are kept and compared again at the end, after many slabs were reused.
 */
async function roundTrip(t: ExecutionContext, slabs: boolean): Promise<void> {
  const { server, client } = await socketPair(t);
  const reader = new FrameReader(server);
  // true on a net.Socket of every Node we run on: if an upgrade changes Node's sockets, this says so.
  if (slabs) t.true(reader.useSlabs(), 'a net.Socket reads into slabs');
  t.is(reader.readsIntoSlabs, slabs);
  const rnd = seededRandom(11);
  const sizes = Array.from({ length: 400 }, () => (rnd() < 0.5 ? 28 : 1 + Math.floor(rnd() * 300 * 1024)));
  const frames = sizes.map((n) => randomBytes(n));
  void (async () => {
    const all = Buffer.concat(frames);
    for (let i = 0; i < all.length;) {
      const n = 1 + Math.floor(rnd() * 200 * 1024);
      if (!client.write(all.subarray(i, i + n))) await new Promise((r) => client.once('drain', r));
      i += n;
    }
  })();
  const kept: { want: Buffer; got: Buffer[] }[] = [];
  for (const want of frames) {
    const how = rnd();
    if (how < 0.4) {
      const got = reader.tryRead(want.length) ?? await reader.read(want.length);
      t.true(got.equals(want));
      kept.push({ want, got: [got] });
    } else {
      const lent = reader.tryLend(want.length) ?? await reader.lend(want.length);
      t.true(Buffer.concat(lent.chunks).equals(want));
      lent.release();
      lent.release(); // a second release is a no-op (a slab must not be freed twice)
    }
  }
  t.is(kept.filter((k) => !Buffer.concat(k.got).equals(k.want)).length, 0, 'frames taken earlier are unchanged');
}

test('frames from Node\'s data events, taken whole or lent', (t) => roundTrip(t, false));
test('frames read into reused slabs (useSlabs), taken whole or lent', (t) => roundTrip(t, true));

test('useSlabs on a stream that is not a socket: false, and data events still deliver', async (t) => {
  const stream = new PassThrough();
  const reader = new FrameReader(stream);
  t.false(reader.useSlabs());
  stream.write(Buffer.from('abcdef'));
  t.is((await reader.read(6)).toString(), 'abcdef');
  const pending = reader.lend(4);
  stream.end();
  await t.throwsAsync(pending, { instanceOf: ConnectionClosedError });
});

test('a peer that closes mid-frame: a waiting lend rejects with ConnectionClosedError (slabs)', async (t) => {
  const { server, client } = await socketPair(t);
  const reader = new FrameReader(server);
  t.true(reader.useSlabs());
  client.end(Buffer.alloc(1000, 7));
  await t.throwsAsync(reader.lend(2000), { instanceOf: ConnectionClosedError });
});

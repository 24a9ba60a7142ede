/**
 * The local-file backend (`raw:` stores): writes apply in call order (the BlockBackend
 * contract), though libuv's thread pool may run two calls' pwrites in either order.
 */
import test from 'ava';
import * as fsp from 'node:fs/promises';
import * as os from 'node:os';
import * as path from 'node:path';
import { FileBackend } from '../../src/backends/file.js';

const K = 4096;

async function backend(t: import('ava').ExecutionContext): Promise<FileBackend> {
  const dir = await fsp.mkdtemp(path.join(os.tmpdir(), 'baton-file-backend-'));
  const file = path.join(dir, 'disk.img');
  await fsp.writeFile(file, Buffer.alloc(64 * K));
  const b = await FileBackend.open(file, 64 * K);
  t.teardown(async () => { await b.close(); await fsp.rm(dir, { recursive: true, force: true }); });
  return b;
}

/** Make the next pwrite of the backend's file wait `ms` first (a pool thread that got to it late). */
function delayNextWrite(b: FileBackend, ms: number): void {
  const fh = (b as unknown as { fh: { write: (...a: unknown[]) => Promise<unknown> } }).fh;
  const original = fh.write.bind(fh);
  let armed = true;
  fh.write = async (...a: unknown[]) => {
    if (armed) { armed = false; await new Promise((r) => setTimeout(r, ms)); }
    return original(...a);
  };
}

test('overlapping writes and zeroes called together end as the last one called, even when the earlier one\'s pwrite runs late', async (t) => {
  const b = await backend(t);
  delayNextWrite(b, 50);
  const calls = [
    b.write(0, Buffer.alloc(2 * K, 0xa1), true), // its pwrite waits 50 ms
    b.write(K, Buffer.alloc(K, 0xb2), false), // overlaps its second half
    b.write(8 * K, Buffer.alloc(K, 0xc3), false), // disjoint: not held back
  ];
  await calls[2];
  t.deepEqual(await b.read(8 * K, K), Buffer.alloc(K, 0xc3), 'a disjoint write landed while the first still waits');
  await Promise.all(calls);
  t.deepEqual(await b.read(0, 2 * K), Buffer.concat([Buffer.alloc(K, 0xa1), Buffer.alloc(K, 0xb2)]));
  delayNextWrite(b, 50);
  const zeroes = [
    b.zero(8 * K, K, { fua: false, mayTrim: false, fastZero: false }), // waits 50 ms
    b.write(8 * K, Buffer.alloc(K, 0xd4), false),
  ];
  await Promise.all(zeroes);
  t.deepEqual(await b.read(8 * K, K), Buffer.alloc(K, 0xd4));
});

test('a failed write does not hold back the writes after it', async (t) => {
  const b = await backend(t);
  const fh = (b as unknown as { fh: { write: (...a: unknown[]) => Promise<unknown> } }).fh;
  const original = fh.write.bind(fh);
  let fail = true;
  fh.write = async (...a: unknown[]) => {
    if (fail) { fail = false; await new Promise((r) => setTimeout(r, 20)); throw Object.assign(new Error('injected EIO'), { code: 'EIO' }); }
    return original(...a);
  };
  const first = b.write(0, Buffer.alloc(K, 0x11), false);
  const second = b.write(0, Buffer.alloc(K, 0x22), false);
  await t.throwsAsync(first, { message: /write on .* failed: injected EIO/ });
  await second;
  t.deepEqual(await b.read(0, K), Buffer.alloc(K, 0x22));
});

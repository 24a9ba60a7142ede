/**
 * The real Debian NBD clients against a real `baton serve` process: nbdinfo, nbdcopy,
 * qemu-img, qemu-io, fio's nbd engine, nbd-client (list + GO without a kernel module), and a
 * differential oracle that runs the same qemu-io script against `nbdkit memory` and baton.
 * Each test starts its own server (Unix socket, or 127.0.0.1 for nbd-client) and skips when a
 * tool is missing.
 */

import test, { type ExecutionContext } from 'ava';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import { run, sha256, sha256File, type RunResult } from '../helpers/ext4.js';
import { BATON_BIN, baton, has, startBatonServer, tempDir, waitForSocket, type Teardown } from '../helpers/server.js';

const MiB = 1024 * 1024;

/**
 * At most two of this file's tests run at once: each drives a server plus CPU-heavy clients,
 * and on a 2-core machine more would only make timeouts flaky.
 */
let slots = 2;
const queue: (() => void)[] = [];
async function limited<T>(fn: () => Promise<T>): Promise<T> {
  while (slots === 0) await new Promise<void>((r) => queue.push(r));
  slots--;
  try { return await fn(); } finally { slots++; queue.shift()?.(); }
}

type Body = (t: ExecutionContext) => Promise<void>;

/** A test that runs when every tool exists and is skipped otherwise (a missing tool is not a failure). */
function needs(...tools: string[]): (title: string, body: Body) => void {
  const ok = tools.every((tool) => has(tool));
  return (title, body) => {
    if (ok) test(title, (t) => limited(() => body(t)));
    else test.skip(title, () => {});
  };
}

function check(t: { is(a: unknown, b: unknown, m?: string): void }, r: RunResult, what = 'exit status'): void {
  t.is(r.code, 0, `${what}\n${r.output}`);
}

/** qemu-io on an NBD URI; fails the command on any "failed" line (qemu-io keeps going after errors). */
function qemuIo(uri: string, cmds: string[], extra: string[] = []): Promise<RunResult> {
  return run('qemu-io', ['-f', 'raw', ...extra, uri, ...cmds.flatMap((c) => ['-c', c])], { timeoutMs: 60_000 });
}

function assertQemuIoOk(t: { is(a: unknown, b: unknown, m?: string): void; notRegex(s: string, r: RegExp, m?: string): void }, r: RunResult): void {
  t.is(r.code, 0, r.output);
  t.notRegex(r.stdout + r.stderr, /failed|error/i, r.output);
}

/** Drop qemu-io's timing lines ("64 KiB, 1 ops; 00.00 sec (...)"), which differ run to run. */
function normalizeQemuIo(s: string): string {
  return s.split('\n').filter((l) => !/ ops; [\d.:]+ sec /.test(l)).join('\n');
}

// ------------------------------------------------------------------ nbdinfo

needs('nbdinfo')('nbdinfo --json reports size, every capability, block sizes, name and description', async (t) => {
  const size = 64 * MiB;
  const server = await startBatonServer(t, { volumes: [{ name: 'vol', size }] });
  const r = await run('nbdinfo', ['--json', server.uri('vol')]);
  check(t, r);
  const info = JSON.parse(r.stdout) as { protocol: string; structured: boolean; exports: Record<string, unknown>[] };
  t.is(info.protocol, 'newstyle-fixed');
  t.true(info.structured);
  t.is(info.exports.length, 1);
  const e = info.exports[0]!;
  t.is(e['export-name'], 'vol');
  t.is(typeof e['description'], 'string');
  t.regex(e['description'] as string, /vol/);
  t.is(e['export-size'], size);
  t.is(e['is_read_only'], false);
  for (const cap of ['can_flush', 'can_fua', 'can_trim', 'can_zero', 'can_multi_conn', 'can_cache', 'can_fast_zero']) {
    t.is(e[cap], true, cap);
  }
  t.is(e['block_size_minimum'], 512);
  t.is(e['block_size_preferred'], 4096);
  t.is(e['block_size_maximum'], 32 * MiB);
  t.deepEqual(e['contexts'], ['base:allocation']);
});

needs('nbdinfo')('nbdinfo --json on a --read-only server: read-only, no trim or zero', async (t) => {
  const server = await startBatonServer(t, { volumes: [{ name: 'ro', size: 4 * MiB }], readOnly: true });
  const r = await run('nbdinfo', ['--json', server.uri('ro')]);
  check(t, r);
  const e = (JSON.parse(r.stdout) as { exports: Record<string, unknown>[] }).exports[0]!;
  t.is(e['is_read_only'], true);
  t.is(e['can_trim'], false);
  t.is(e['can_zero'], false);
  t.is(e['can_flush'], true);
});

needs('nbdinfo')('nbdinfo --list lists every volume with its size', async (t) => {
  const vols = [{ name: 'alpha', size: 1 * MiB }, { name: 'beta', size: 8 * MiB }, { name: 'gamma.2', size: 12 * MiB }];
  const server = await startBatonServer(t, { volumes: vols });
  const r = await run('nbdinfo', ['--list', '--json', server.uri('')]);
  check(t, r);
  const exports = (JSON.parse(r.stdout) as { exports: Record<string, unknown>[] }).exports;
  const got = exports.map((e) => ({ name: e['export-name'], size: e['export-size'] })).sort((a, b) => String(a.name).localeCompare(String(b.name)));
  t.deepEqual(got, vols);
  for (const e of exports) t.regex(String(e['description']), new RegExp(String(e['export-name']).replace('.', '\\.')));
  // Human output too.
  const h = await run('nbdinfo', ['--list', server.uri('')]);
  check(t, h);
  for (const v of vols) t.true(h.stdout.includes(`export="${v.name}"`), h.output);
});

needs('nbdinfo', 'qemu-io')('nbdinfo --map: holes, then data where a client wrote', async (t) => {
  const server = await startBatonServer(t, { volumes: [{ name: 'vol', size: 16 * MiB }] });
  type Extent = { offset: number; length: number; type: number; description: string };
  const map = async (): Promise<Extent[]> => {
    const r = await run('nbdinfo', ['--map', '--json', server.uri('vol')]);
    check(t, r, 'nbdinfo --map');
    return JSON.parse(r.stdout) as Extent[];
  };
  const before = await map();
  t.deepEqual(before.map((e) => [e.offset, e.length, e.type & 1]), [[0, 16 * MiB, 1]], JSON.stringify(before));
  assertQemuIoOk(t, await qemuIo(server.uri('vol'), ['write -P 0x61 4M 1M']));
  const after = await map();
  const covered = after.reduce((n, e) => n + e.length, 0);
  t.is(covered, 16 * MiB);
  const at = (off: number): Extent | undefined => after.find((e) => e.offset <= off && off < e.offset + e.length);
  t.is(at(0)!.type & 1, 1, 'before the write: hole');
  t.is(at(4 * MiB)!.type & 3, 0, 'the written MiB: data');
  t.is(at(5 * MiB - 1)!.type & 3, 0);
  t.is(at(5 * MiB)!.type & 1, 1, 'after the write: hole');
  t.is(at(16 * MiB - 1)!.type & 1, 1);
  t.regex(after.map((e) => e.description).join(','), /hole.*data.*hole/);
});

// ------------------------------------------------------------------ nbdcopy

async function randomFile(dir: string, name: string, size: number): Promise<{ file: string; hash: string }> {
  const data = randomBytes(size);
  const file = path.join(dir, name);
  await fsp.writeFile(file, data);
  return { file, hash: sha256(data) };
}

/**
 * The stores whose data paths differ under the same session: `file:` (the volume engine, which
 * keeps written pieces) and `ram:` (the memory backend: lent writes into reused socket
 * buffers, reads lent from its pages). The default store of a test is `file:`.
 */
const STORES = [{ store: undefined, title: '' }, { store: 'ram:', title: ' (ram:)' }] as const;

for (const { store, title } of STORES) needs('nbdcopy')(`nbdcopy a 64 MiB random file in and back out; again with --flush over 4 connections${title}`, async (t) => {
  const size = 64 * MiB;
  const server = await startBatonServer(t, { volumes: [{ name: 'vol', size }], logLevel: 'debug', ...(store ? { store } : {}) });
  const dir = tempDir(t);

  const a = await randomFile(dir, 'a.bin', size);
  check(t, await run('nbdcopy', [a.file, server.uri('vol')], { timeoutMs: 120_000 }), 'nbdcopy in');
  const outA = path.join(dir, 'a.out');
  check(t, await run('nbdcopy', [server.uri('vol'), outA], { timeoutMs: 120_000 }), 'nbdcopy out');
  t.is((await fsp.stat(outA)).size, size);
  t.is(await sha256File(outA), a.hash);

  // nbdcopy caps connections at its thread count (2 on 2 cores), so ask for 4 threads too.
  const attachedBefore = (server.stderr().match(/"attached \(GO\)"/g) ?? []).length;
  const b = await randomFile(dir, 'b.bin', size);
  check(t, await run('nbdcopy', ['--flush', '-C', '4', '-T', '4', b.file, server.uri('vol')], { timeoutMs: 120_000 }), 'nbdcopy --flush -C 4 in');
  const attached = (server.stderr().match(/"attached \(GO\)"/g) ?? []).length - attachedBefore;
  t.is(attached, 4, 'nbdcopy -C 4 -T 4 opened 4 connections (needs CAN_MULTI_CONN)');
  const outB = path.join(dir, 'b.out');
  check(t, await run('nbdcopy', ['-C', '4', '-T', '4', server.uri('vol'), outB], { timeoutMs: 120_000 }), 'nbdcopy -C 4 out');
  t.is(await sha256File(outB), b.hash);
  t.not(a.hash, b.hash);
  t.notRegex(server.stderr(), /"level":50/, 'no error-level server log lines');
});

// ------------------------------------------------------------------ qemu-img

needs('qemu-img', 'qemu-io')('qemu-img info, convert -n from a file with holes, compare (and compare catches a difference)', async (t) => {
  const size = 64 * MiB;
  const server = await startBatonServer(t, { volumes: [{ name: 'vol', size }] });
  const uri = server.uri('vol');
  const dir = tempDir(t);

  const info = await run('qemu-img', ['info', '--output=json', uri]);
  check(t, info, 'qemu-img info');
  const j = JSON.parse(info.stdout) as { 'virtual-size': number; format: string };
  t.is(j['virtual-size'], size);
  t.is(j.format, 'raw');

  // Source: sparse file with data islands (one unaligned) and holes between them.
  const src = path.join(dir, 'src.img');
  const fh = await fsp.open(src, 'w');
  await fh.truncate(size);
  for (const [off, len] of [[0, MiB], [5 * MiB + 512, MiB - 512], [17 * MiB + 3, 100_000], [40 * MiB, 2 * MiB], [63 * MiB, MiB]] as const) {
    await fh.write(randomBytes(len), 0, len, off);
  }
  await fh.close();

  // Dirty the target first: convert -n must write the holes as zeroes, not skip them.
  assertQemuIoOk(t, await qemuIo(uri, ['write -P 0x5a 0 64M']));
  check(t, await run('qemu-img', ['convert', '-n', '-f', 'raw', '-O', 'raw', src, uri], { timeoutMs: 120_000 }), 'qemu-img convert -n');
  const same = await run('qemu-img', ['compare', '-f', 'raw', '-F', 'raw', src, uri], { timeoutMs: 120_000 });
  t.is(same.code, 0, same.output);
  t.regex(same.stdout, /identical/i);

  assertQemuIoOk(t, await qemuIo(uri, ['write -P 0x01 33M 512']));
  const diff = await run('qemu-img', ['compare', '-f', 'raw', '-F', 'raw', src, uri], { timeoutMs: 120_000 });
  t.is(diff.code, 1, diff.output);
  t.regex(diff.stdout, new RegExp(`Content mismatch at offset ${33 * MiB}\\b`));
});

// ------------------------------------------------------------------ qemu-io

needs('qemu-io')('qemu-io: write -P, write -f (FUA), write -z, write -z -u, discard, flush, read -P; data persists across connections', async (t) => {
  const server = await startBatonServer(t, { volumes: [{ name: 'vol', size: 16 * MiB }] });
  const uri = server.uri('vol');
  const verify = [
    'read -P 0xab 0 4096', 'read -P 0x33 5000 3333', 'read -P 0xab 8333 1040051',
    'read -P 0xcd 1M 64k',
    'read -P 0 2M 128k', 'read -P 0xee 2176k 128k',
    'read -P 0 3M 128k', 'read -P 0xee 3200k 128k',
    'read -P 0x6b 4M 4k',
    'read -P 0 15M 1M',
  ];
  const first = await qemuIo(uri, [
    'write -P 0xab 0 1M',
    'write -P 0x33 5000 3333', // unaligned, inside the first MiB (read-modify-write)
    'write -f -P 0xcd 1M 64k', // FUA
    'write -P 0xee 2M 256k', 'write -z 2M 128k', // zero over data
    'write -P 0xee 3M 256k', 'write -z -u 3M 128k', // zero, may unmap
    'write -P 0x5a 4M 64k', 'discard 4M 64k', 'write -P 0x6b 4M 4k',
    'flush',
    ...verify,
  ]);
  assertQemuIoOk(t, first);
  t.is((first.stdout.match(/^wrote /gm) ?? []).length, 9, first.output);
  t.regex(first.stdout, /^discard 65536\/65536 bytes at offset 4194304/m);
  // A fresh connection (a fresh process) sees the same bytes.
  const second = await qemuIo(uri, verify);
  assertQemuIoOk(t, second);
  t.is((second.stdout.match(/^read /gm) ?? []).length, verify.length);
  // And a wrong pattern is really detected (the checks above are not vacuous).
  const wrong = await qemuIo(uri, ['read -P 0xac 0 4096']);
  t.is(wrong.code, 1, wrong.output);
  t.regex(wrong.stdout, /Pattern verification failed at offset 0/);
});

// ------------------------------------------------------------------ fio

for (const { store, title } of STORES) needs('fio')(`fio --ioengine=nbd randrw 4k with --verify=crc32c: exit 0, no verify errors${title}`, async (t) => {
  const server = await startBatonServer(t, { volumes: [{ name: 'vol', size: 64 * MiB }], ...(store ? { store } : {}) });
  const r = await run('fio', [
    '--name=baton', '--ioengine=nbd', `--uri=${server.uri('vol')}`,
    '--rw=randrw', '--bs=4k', '--size=32M', '--iodepth=16', '--verify=crc32c', '--verify_state_save=0', '--fsync=64',
    '--runtime=40', '--output-format=json',
  ], { timeoutMs: 90_000 });
  t.is(r.code, 0, r.output);
  const json = r.stdout.slice(r.stdout.indexOf('{'));
  const job = (JSON.parse(json) as { jobs: { error: number; read: { io_bytes: number }; write: { io_bytes: number } }[] }).jobs[0]!;
  t.is(job.error, 0, r.output);
  t.true(job.write.io_bytes > 0);
  t.true(job.read.io_bytes >= job.write.io_bytes, 'reads include the verify pass over every written block');
  t.notRegex(r.stderr, /verify|bad magic|crc32c|mismatch/i, r.output);
});

// ------------------------------------------------------------------ nbd-client over TCP

interface TcpServer {
  port: number;
  log(): string;
  stop(): Promise<number | null>;
}

/** `baton serve --listen 127.0.0.1:0` (startBatonServer always uses a Unix socket); port read from the "listening" log line. */
async function startTcpServer(t: Teardown, store: string): Promise<TcpServer> {
  const proc = spawn(process.execPath, [BATON_BIN, 'serve', '--listen', '127.0.0.1:0', '--store', store, '--log-level', 'debug'], { stdio: ['ignore', 'ignore', 'pipe'] });
  let err = '';
  const exited = new Promise<number | null>((resolve) => proc.once('exit', (code) => resolve(code)));
  t.teardown(async () => {
    if (proc.exitCode === null && proc.signalCode === null) proc.kill('SIGKILL');
    await exited;
  });
  const port = await new Promise<number>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no "listening" line: ${err}`)), 15_000);
    proc.stderr!.on('data', (d: Buffer) => {
      err += d.toString();
      const m = /"address":\{"host":"127\.0\.0\.1","port":(\d+)\}/.exec(err);
      if (m) { clearTimeout(timer); resolve(Number(m[1])); }
    });
    void exited.then(() => { clearTimeout(timer); reject(new Error(`baton serve exited: ${err}`)); });
  });
  return {
    port,
    log: () => err,
    stop: async () => { proc.kill('SIGTERM'); return exited; },
  };
}

// With the kernel nbd module present, nbd-client would really attach /dev/nbd0: not here.
const kernelNbd = fs.existsSync('/sys/module/nbd') || fs.existsSync('/dev/nbd0');
(kernelNbd ? (title: string) => test.skip(title, () => {}) : needs('nbd-client', 'nbdinfo', 'qemu-io'))('nbd-client -l over TCP, then GO and vanish (no kernel module): the server stays healthy', async (t) => {
  const dir = tempDir(t);
  const store = `file:${path.join(dir, 'store')}`;
  for (const [name, size] of [['vol', '64M'], ['other', '1M']] as const) {
    const c = baton(['create', name, '--size', size, '--store', store]);
    t.is(c.status, 0, c.stderr);
  }
  const server = await startTcpServer(t, store);
  const tcpUri = (name: string): string => `nbd://127.0.0.1:${server.port}/${name}`;
  assertQemuIoOk(t, await qemuIo(tcpUri('vol'), ['write -P 0x42 0 1M']));

  const list = await run('nbd-client', ['-l', '127.0.0.1', String(server.port)], { timeoutMs: 20_000 });
  t.is(list.code, 0, list.output);
  t.regex(list.stdout + list.stderr, /^vol: baton volume vol/m, list.output);
  t.regex(list.stdout + list.stderr, /^other: baton volume other/m, list.output);

  const logBefore = server.log().length;
  const nc = await run('nbd-client', ['127.0.0.1', String(server.port), '/dev/nbd0', '-N', 'vol'], { timeoutMs: 20_000 });
  t.not(nc.code, 0, `nbd-client cannot attach without the nbd module: ${nc.output}`);
  t.regex(nc.stdout + nc.stderr, /size = 64MB/, 'nbd-client completed GO and learned the size');
  // The server logged the GO (simple replies: the kernel path never asks for structured ones) and the close.
  await new Promise((r) => setTimeout(r, 300));
  const lines = server.log().slice(logBefore).split('\n').filter(Boolean).map((l) => JSON.parse(l) as { conn?: number; msg: string; export?: string; structured?: boolean; level: number });
  const go = lines.find((l) => l.msg === 'attached (GO)');
  t.truthy(go, server.log());
  t.is(go?.export, 'vol');
  t.is(go?.structured, false);
  t.truthy(lines.find((l) => l.msg === 'connection closed' && l.conn === go?.conn), 'the vanished client\'s connection was cleaned up');
  t.falsy(lines.find((l) => l.level >= 50), 'no error-level log line');

  // Still healthy: a fresh client sees the data written before.
  const info = await run('nbdinfo', ['--json', tcpUri('vol')]);
  check(t, info, 'nbdinfo after the vanished client');
  assertQemuIoOk(t, await qemuIo(tcpUri('vol'), ['read -P 0x42 0 1M']));
  t.is(await server.stop(), 0, 'graceful stop');
});

// ------------------------------------------------------------------ differential oracle

for (const { store, title } of STORES) needs('nbdkit', 'qemu-io', 'qemu-img')(`differential: one qemu-io script against nbdkit memory and baton gives the same output and the same bytes${title}`, async (t) => {
  const size = 64 * MiB;
  const server = await startBatonServer(t, { volumes: [{ name: 'vol', size }], ...(store ? { store } : {}) });
  const dir = tempDir(t);
  const ksock = path.join(dir, 'nbdkit.sock');
  const kit = spawn('nbdkit', ['-f', '-U', ksock, 'memory', String(size)], { stdio: ['ignore', 'ignore', 'pipe'] });
  const kitExit = new Promise<void>((resolve) => kit.once('exit', () => resolve()));
  t.teardown(async () => { if (kit.exitCode === null && kit.signalCode === null) kit.kill('SIGKILL'); await kitExit; });
  await waitForSocket(ksock);
  const kitUri = `nbd+unix:///?socket=${ksock}`;

  const script = [
    'write -P 0xab 0 64k', 'write -f -P 0xcd 1000 3000', 'write -P 0x11 65535 3',
    'write -z 131072 65536', 'write -z -u 200000 70000', 'write -P 0x77 270000 100000',
    // TRIM is a hint (a server may ignore it): rewrite the range so the final bytes are defined.
    'discard 278528 8192', 'write -P 0x5e 278528 8192', 'flush',
    'read -v 0 16', 'read -v 990 32', 'read -v 65530 16', 'read -v 199990 32', 'read -v 278500 64',
    'read -P 0xab 0 1000', 'read -P 0xcd 1000 3000', 'read -P 0 131072 65536',
    'read -P 0x42 0 512', // deliberately wrong: both must report the same mismatch
    'write -P 1 67108000 4096', 'read 67108352 1024', // beyond the end: both refuse
    'write -z 67100000 8864', 'read -P 0 67100000 8864',
    'write -P 0x98 4198400 4096', 'aio_write -P 0x99 4194304 4096', 'aio_flush', // one aio: completion order of two would vary
    'read -P 0x99 4194304 4096', 'read -v 4198396 8',
    'write -P 0x21 33554431 2', 'read -v 33554424 16',
  ];
  const [b, k] = [await qemuIo(server.uri('vol'), script), await qemuIo(kitUri, script)];
  t.is(b.code, k.code, `exit codes differ\nbaton:\n${b.output}\nnbdkit:\n${k.output}`);
  t.is(normalizeQemuIo(b.stdout + b.stderr), normalizeQemuIo(k.stdout + k.stderr));
  // Sanity: the script did hit both error paths on both servers.
  t.regex(b.stdout, /Pattern verification failed at offset 0, 512 bytes/);
  t.regex(b.stdout + b.stderr, /write failed/);
  // And the whole export is byte-identical.
  const cmp = await run('qemu-img', ['compare', '-f', 'raw', '-F', 'raw', server.uri('vol'), kitUri], { timeoutMs: 60_000 });
  t.is(cmp.code, 0, cmp.output);
});

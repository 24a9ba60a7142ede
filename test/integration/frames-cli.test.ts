/**
 * The data settings of issue 16 as a user meets them on a `file:` store: `create
 * --compression none`, `--encrypt` with and without a key (file, BATON_KEY_FILE, BATON_KEY),
 * bad keys, `info` showing how a volume stores data, `serve --compression off`; a real
 * `baton serve` and nbdcopy writing source-like text.
 */
import test, { type ExecutionContext } from 'ava';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { run } from '../helpers/ext4.js';
import { baton, has, startBatonServer, tempDir } from '../helpers/server.js';

const MiB = 1024 * 1024;
const withNbdcopy = has('nbdcopy') ? test : test.skip;

interface Info { name: string; storedBytes: number; writtenBytes?: number; writtenStoredBytes?: number; data?: { format: string; compression: string; encrypted: boolean; keyId?: string } }

function info(store: string, name: string, env: Record<string, string> = {}): Info {
  const r = baton(['info', name, '--store', store, '--json'], env);
  if (r.status !== 0) throw new Error(r.stderr);
  return JSON.parse(r.stdout) as Info;
}

function textFile(t: ExecutionContext, size: number): string {
  const line = 'export function add(a: number, b: number): number { return a + b; } // src/util.ts\n';
  const f = path.join(tempDir(t), 'text.bin');
  fs.writeFileSync(f, Buffer.from(line.repeat(Math.ceil(size / line.length))).subarray(0, size));
  return f;
}

test('create: --compression none, --encrypt needs a key (file, BATON_KEY_FILE, BATON_KEY), bad keys are clear errors; info says how data is stored', (t) => {
  const dir = tempDir(t);
  const store = `file:${dir}/store`;
  const key = path.join(dir, 'master.key');
  fs.writeFileSync(key, randomBytes(32));
  t.is(baton(['create', 'plain', '--size', '64M', '--store', store]).status, 0);
  t.is(baton(['create', 'flat', '--size', '64M', '--compression', 'none', '--store', store]).status, 0);
  t.deepEqual(info(store, 'plain').data, { format: 'framed', compression: 'lz4', encrypted: false });
  t.deepEqual(info(store, 'flat').data, { format: 'framed', compression: 'none', encrypted: false });
  const bad = baton(['create', 'x', '--size', '64M', '--compression', 'zstd', '--store', store]);
  t.is(bad.status, 2);
  t.regex(bad.stderr, /zstd.*invalid|Allowed choices/i);

  const nokey = baton(['create', 'sec', '--size', '64M', '--encrypt', '--store', store], { BATON_KEY_FILE: '', BATON_KEY: '' });
  t.is(nokey.status, 1);
  t.regex(nokey.stderr, /--key-file/);
  t.notRegex(nokey.stderr, /\n\s+at /, 'no stack trace');
  t.is(baton(['create', 'sec', '--size', '64M', '--encrypt', '--key-file', key, '--store', store]).status, 0);
  const sec = info(store, 'sec');
  t.true(sec.data?.encrypted);
  t.regex(sec.data?.keyId ?? '', /^[0-9a-f]{16}$/);
  t.is(baton(['create', 'sec2', '--size', '64M', '--encrypt', '--store', store], { BATON_KEY_FILE: key }).status, 0);
  t.is(info(store, 'sec2').data?.keyId, sec.data?.keyId, 'BATON_KEY_FILE: the same key id');
  t.is(baton(['create', 'sec3', '--size', '64M', '--encrypt', '--store', store], { BATON_KEY: fs.readFileSync(key).toString('hex') }).status, 0);
  t.is(info(store, 'sec3').data?.keyId, sec.data?.keyId, 'BATON_KEY as hex: the same key id');

  const short = path.join(dir, 'short.key');
  fs.writeFileSync(short, randomBytes(16).toString('hex'));
  for (const [args, env, re] of [
    [['--key-file', short], {}, /not a key/],
    [['--key-file', path.join(dir, 'missing.key')], {}, /cannot read the key file/],
    [[], { BATON_KEY: 'hunter2' }, /BATON_KEY: not a key/],
  ] as const) {
    const r = baton(['create', 'nope', '--size', '64M', '--encrypt', ...args, '--store', store], env);
    t.not(r.status, 0);
    t.regex(r.stderr, re);
    t.notRegex(r.stderr, /\n\s+at /, 'no stack trace');
  }
  const fork = baton(['fork', 'sec', 'sec-f', '--store', store], { BATON_KEY_FILE: '', BATON_KEY: '' });
  t.is(fork.status, 1, 'a fork of an encrypted volume needs the key');
  t.regex(fork.stderr, new RegExp(`${sec.data!.keyId}.*--key-file`));
  t.is(baton(['fork', 'sec', 'sec-f', '--key-file', key, '--store', store]).status, 0);
  t.is(baton(['snapshot', 'sec', 'snap', '--store', store], { BATON_KEY_FILE: '', BATON_KEY: '' }).status, 0, 'a snapshot needs no key');
});

withNbdcopy('serve --compression off stores new data uncompressed; the default compresses it; both read back', async (t) => {
  const dir = tempDir(t);
  const store = `file:${dir}/store`;
  const src = textFile(t, 16 * MiB);
  for (const name of ['a', 'b']) t.is(baton(['create', name, '--size', '64M', '--store', store]).status, 0);
  for (const [name, extra] of [['a', ['--compression', 'off']], ['b', []]] as const) {
    const srv = await startBatonServer(t, { store, extraArgs: ['--idle-grace', '0.2', ...extra] });
    const w = await run('nbdcopy', ['--flush', src, srv.uri(name)], { timeoutMs: 120_000 });
    t.is(w.code, 0, w.output);
    const out = path.join(dir, `${name}.out`);
    const r = await run('nbdcopy', [srv.uri(name), out], { timeoutMs: 120_000 });
    t.is(r.code, 0, r.output);
    t.true(fs.readFileSync(out).subarray(0, 16 * MiB).equals(fs.readFileSync(src)), `${name} reads back`);
    await srv.stop();
  }
  const a = info(store, 'a');
  const b = info(store, 'b');
  t.log(`serve --compression off: ${a.storedBytes} bytes stored; default: ${b.storedBytes}`);
  t.true(a.storedBytes >= 16 * MiB, 'uncompressed (frames and records add a little)');
  t.true(b.storedBytes < 4 * MiB, 'compressed');
  t.true((b.writtenStoredBytes ?? Infinity) < 4 * MiB && b.writtenBytes === 16 * MiB, 'accounting: logical and stored');
  t.regex(baton(['ls', '--store', store]).stdout, /^b\s+64 MiB\s+\S+ \S+\s+16 MiB \(0\.0\d\)/m, 'ls: written, and its stored ratio');
  t.regex(baton(['info', 'b', '--store', store]).stdout, /written:\s+16 MiB mapped \(\S+ \S+ stored: 0\.0\dx\)/);
});

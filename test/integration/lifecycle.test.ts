/**
 * The lifecycle verbs through the CLI (`baton rename`, `resize`, `expire`, `import`,
 * `export`), against real `baton serve` processes and real clients on a `file:` store: what
 * they print, their exit codes (2 for usage errors), and what a host serving the volume sees.
 */

import test from 'ava';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { runOk } from '../helpers/ext4.js';
import { baton, has, startBatonServer, tempDir } from '../helpers/server.js';

const MiB = 1024 * 1024;
const withNbdcopy = has('nbdcopy') ? test : test.skip;

function storeIn(t: { teardown(fn: () => void): void }): string {
  return `file:${path.join(tempDir(t, 'baton-life-'), 'store')}`;
}

function ok(t: { is(a: unknown, b: unknown, m?: string): void }, args: string[]): string {
  const r = baton(args);
  t.is(r.status, 0, `baton ${args.join(' ')}: ${r.stderr}`);
  return r.stdout;
}

function lsNames(store: string): string[] {
  const r = baton(['ls', '--store', store, '--json']);
  return (JSON.parse(r.stdout) as { name: string }[]).map((v) => v.name).sort();
}

test('baton rename: renames, refuses an existing name without --replace, exit 2 for usage errors', (t) => {
  const store = storeIn(t);
  ok(t, ['create', 'a', '--size', '4M', '--store', store]);
  ok(t, ['create', 'work', '--size', '4M', '--store', store]);
  t.is(ok(t, ['rename', 'a', 'b', '--store', store]), 'renamed a to b\n');
  t.deepEqual(lsNames(store), ['b', 'work']);

  const taken = baton(['rename', 'b', 'work', '--store', store]);
  t.is(taken.status, 1, taken.stderr);
  t.regex(taken.stderr, /volume "work" already exists .*add --replace to make b the new work/);
  t.deepEqual(lsNames(store), ['b', 'work'], 'nothing changed');

  for (const [args, re] of [
    [['rename', 'b', 'bad/name'], /invalid volume name "bad\/name"/],
    [['rename', 'b', 'b'], /already has that name/],
    [['rename', 'b', 'x', '--force'], /--force only makes sense with --replace/],
    [['rename', 'work@snap', 'x'], /is a snapshot: fork it/],
    [['rename', 'b'], /missing required argument/],
  ] as const) {
    const r = baton([...args, '--store', store]);
    t.is(r.status, 2, `${args.join(' ')}: ${r.stderr}`);
    t.regex(r.stderr, re);
    t.notRegex(r.stderr, /\n\s+at /, 'no stack trace');
  }
  const missing = baton(['rename', 'nope', 'x', '--store', store]);
  t.is(missing.status, 1);
  t.regex(missing.stderr, /no volume "nope"/);

  const j = JSON.parse(ok(t, ['rename', 'b', 'work', '--replace', '--json', '--store', store])) as { from: string; to: string; replaced: unknown };
  t.is(j.from, 'b');
  t.truthy(j.replaced);
  t.deepEqual(lsNames(store), ['work']);
});

withNbdcopy('baton rename --replace: a served source is refused; a served destination needs --force, and its host drops the old volume', async (t) => {
  const s = await startBatonServer(t, { volumes: [{ name: 'work', size: 8 * MiB }], extraArgs: ['--idle-grace', '60'] });
  const dir = tempDir(t);
  const put = async (name: string, fill: number): Promise<Buffer> => {
    const data = Buffer.alloc(MiB, fill);
    fs.writeFileSync(path.join(dir, 'in.bin'), data);
    await runOk('nbdcopy', ['--flush', path.join(dir, 'in.bin'), s.uri(name)]);
    return data;
  };
  await put('work', 0x41);
  ok(t, ['fork', 'work', 'try-2', '--store', s.store]);
  const attempt = await put('try-2', 0x42); // served now (idle grace 60 s)

  const src = baton(['rename', 'try-2', 'work', '--replace', '--store', s.store]);
  t.is(src.status, 1, src.stderr);
  t.regex(src.stderr, /rename try-2: it is being served by .*detach its clients/);

  // Stop serving try-2 (restart the server: its volumes close and give their leases back), serve work again.
  await s.stop();
  const s2 = await startBatonServer(t, { store: s.store, extraArgs: ['--idle-grace', '60'] });
  fs.writeFileSync(path.join(dir, 'in.bin'), Buffer.alloc(MiB, 0x43));
  await runOk('nbdcopy', ['--flush', path.join(dir, 'in.bin'), s2.uri('work')]);
  const dst = baton(['rename', 'try-2', 'work', '--replace', '--store', s.store]);
  t.is(dst.status, 1, dst.stderr);
  t.regex(dst.stderr, /work is being served by .*add --force/);
  const forced = baton(['rename', 'try-2', 'work', '--replace', '--force', '--store', s.store]);
  t.is(forced.status, 0, forced.stderr);
  t.regex(forced.stdout, /broke the lease of .* on work: it drops the old work/);
  t.regex(forced.stdout, /replaced work with try-2; the old work's data stays in the store because forks or snapshots still use it\n/);
  // The serving host finds its lease gone, drops the old work; the next attach gets the new one.
  const end = Date.now() + 15_000;
  while (!/lease lost|was removed and created again/.test(s2.stderr()) && Date.now() < end) await new Promise((r) => setTimeout(r, 50));
  t.regex(s2.stderr(), /lease lost|was removed and created again/);
  await runOk('nbdcopy', [s2.uri('work'), path.join(dir, 'out.bin')]);
  t.deepEqual(fs.readFileSync(path.join(dir, 'out.bin')).subarray(0, MiB), attempt);
  t.deepEqual(lsNames(s.store), ['work']);
});

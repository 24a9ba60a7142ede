/**
 * The `baton` command keeps its word (issue 9.4, 9.5 and the smaller CLI items of issue 9):
 * `rm --force` breaks the serving host's lease so it lets go; `rm` of a volume with
 * snapshots is refused unless they go too; help shows defaults the way they are typed;
 * options that would be silently ignored or fail later are refused at once with a clear
 * error; `diff` says when two volumes share no history; `create` on a store that lives in
 * the process says the volume is already gone.
 */
import test from 'ava';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { run, type RunResult } from '../helpers/ext4.js';
import { BATON_BIN, startBatonServer, tempDir } from '../helpers/server.js';
import { connectGo } from '../helpers/writer.js';
import { CMD } from '../helpers/nbd-raw.js';
import { openStore } from '../../src/store/open.js';

const MiB = 1024 * 1024;

/** `baton ARGS` without blocking this process's event loop; killed (code null) after timeoutMs. */
function baton(args: string[], opts: { timeoutMs?: number; env?: Record<string, string> } = {}): Promise<RunResult> {
  return run(process.execPath, [BATON_BIN, ...args], { timeoutMs: opts.timeoutMs ?? 30_000, ...(opts.env ? { env: opts.env } : {}) });
}

function fileStore(t: Parameters<typeof tempDir>[0]): string {
  return `file:${path.join(tempDir(t), 'store')}`;
}

const noStackTrace = /\n\s+at /;

// ------------------------------------------------------------------ 9.4: rm --force breaks the lease

test('rm --force of a served volume breaks the host\'s lease: the host fences it and disconnects its client', async (t) => {
  const store = fileStore(t);
  const server = await startBatonServer(t, {
    store, volumes: [{ name: 'v', size: 64 * MiB }],
    extraArgs: ['--lease-ttl', '2', '--idle-grace', '60', '--cache-dir', tempDir(t, 'baton-cache-')],
  });
  const { client } = await connectGo(server.socket, 'v');
  t.teardown(() => client.destroy());
  t.is((await client.writeAt(1n, 0n, Buffer.alloc(4096, 0xab))).error, 0);
  t.is((await client.command({ type: CMD.FLUSH, cookie: 2n, offset: 0n, length: 0 })).error, 0);

  const refused = await baton(['rm', 'v', '--store', store]);
  t.is(refused.code, 1, refused.output);
  t.regex(refused.stderr, /volume v is being served by .*--force removes it anyway \(and breaks that host's lease\)/);

  const rm = await baton(['rm', 'v', '--force', '--store', store]);
  t.is(rm.code, 0, rm.output);
  t.regex(rm.stdout, /broke the lease of \S+ on v: that host notices at its next lease renewal .*stops serving it and disconnects its clients/);
  t.regex(rm.stdout, /^removed v$/m);
  t.true(await client.waitClosed(30_000), 'the serving host disconnected the client of the removed volume');
  t.regex(server.stderr(), /lease lost: volume fenced, clients disconnected/);
  const status = await baton(['status', '--store', store, '--json']);
  t.deepEqual((JSON.parse(status.stdout) as { volume: string }[]).filter((l) => l.volume === 'v'), [], 'no lease on v is left');
});

test('rm --help says what --force does to the serving host, and documents --snapshots', async (t) => {
  const r = await baton(['rm', '--help']);
  t.is(r.code, 0);
  const help = r.stdout.replace(/\s+/g, ' ');
  t.regex(help, /--force remove even if a host is serving it: its lease is broken, so that host notices at its next lease renewal, stops serving the volume \(fenced\) and disconnects its clients/);
  t.regex(help, /--snapshots also remove the volume's snapshots/);
});

// ------------------------------------------------------------------ 9.5: snapshots belong to their volume

test('rm of a volume with snapshots is refused, listing them; rm --snapshots removes them first; a new volume of that name has none', async (t) => {
  const store = fileStore(t);
  for (const args of [['create', 'v', '--size', '1M'], ['snapshot', 'v', 'monday'], ['snapshot', 'v', 'tuesday']]) {
    const r = await baton([...args, '--store', store]);
    t.is(r.code, 0, r.output);
  }
  const refused = await baton(['rm', 'v', '--store', store]);
  t.is(refused.code, 2, refused.output);
  t.regex(refused.stderr, /^baton: volume v has 2 snapshots: v@monday, v@tuesday; remove them first \(baton rm NAME@SNAP\), or together with the volume: baton rm v --snapshots\n$/);
  const names = async (): Promise<string[]> => (JSON.parse((await baton(['ls', '--store', store, '--json'])).stdout) as { name: string }[]).map((v) => v.name).sort();
  t.deepEqual(await names(), ['v', 'v@monday', 'v@tuesday'], 'nothing was removed');
  const rm = await baton(['rm', 'v', '--snapshots', '--store', store]);
  t.is(rm.code, 0, rm.output);
  t.is(rm.stdout, 'removed snapshots v@monday, v@tuesday\nremoved v\n');
  t.deepEqual(await names(), []);
  t.is((await baton(['create', 'v', '--size', '1M', '--store', store])).code, 0);
  t.deepEqual(await names(), ['v'], 'the new v inherits no snapshot');
});

test('ls and info show which volume a snapshot is of, by identity', async (t) => {
  const store = fileStore(t);
  for (const args of [['create', 'v', '--size', '1M'], ['snapshot', 'v', 's']]) t.is((await baton([...args, '--store', store])).code, 0);
  const id = (JSON.parse((await baton(['info', 'v@s', '--store', store, '--json'])).stdout) as { snapshotOf: { id: string; volume: string } }).snapshotOf;
  t.is(id.volume, 'v');
  t.regex(id.id, /^[0-9a-f]{16}$/);
  const info = await baton(['info', 'v@s', '--store', store]);
  t.regex(info.stdout, new RegExp(`^of:\\s+volume v \\(id ${id.id}\\)$`, 'm'));
  // As an older baton left it: the volume's record gone, its snapshot not; then a new v.
  const direct = openStore(store);
  await direct.delete('volumes/v');
  await direct.close();
  t.is((await baton(['create', 'v', '--size', '1M', '--store', store])).code, 0);
  const ls = await baton(['ls', '--store', store]);
  t.regex(ls.stdout, /^v@s \(its volume was removed\)\s/m);
  const orphan = await baton(['info', 'v@s', '--store', store]);
  t.regex(orphan.stdout, new RegExp(`^of:\\s+a removed volume \\(id ${id.id}\\), not any volume named v now$`, 'm'));
  t.is((await baton(['rm', 'v', '--store', store])).code, 0, 'the new v is not held back by a snapshot that is not its own');
});

// ------------------------------------------------------------------ 9: smaller CLI items

test('help shows duration and size defaults as they are typed (1h, 2G), and the shown default is accepted', async (t) => {
  const serve = (await baton(['serve', '--help'])).stdout.replace(/\s+/g, ' ');
  t.regex(serve, /--gc-interval <duration> .*?\(default: 1h\)/);
  t.regex(serve, /--gc-grace <duration> .*?\(default: 1h\)/);
  t.regex(serve, /--cache-size <size> .*?\(default: 2G\)/);
  t.notRegex(serve, /3600000|2147483648/);
  const gc = (await baton(['gc', '--help'])).stdout.replace(/\s+/g, ' ');
  t.regex(gc, /--grace <duration> .*?\(default: 1h\)/);
  t.notRegex(gc, /3600000/);
  const store = fileStore(t);
  // (A short BATON_MAX_OPERATION_MS: a GC run waits half of it for forks in creation.)
  const r = await baton(['gc', '--grace', '1h', '--dry-run', '--json', '--store', store], { env: { BATON_MAX_OPERATION_MS: '1000' } });
  t.is(r.code, 0, r.output);
  t.is((JSON.parse(r.stdout) as { graceMs: number }).graceMs, 3_600_000, '1h as typed is one hour');
});

test('create on memory: (or ram:) says the volume is gone when the command exits', async (t) => {
  for (const store of ['memory:', 'ram:']) {
    const r = await baton(['create', 'v', '--size', '1G', '--store', store]);
    t.is(r.code, 0, r.output);
    t.regex(r.stderr, new RegExp(`note: ${store} keeps volumes only while the process that made them runs, so v is gone now that baton create exits; .*baton serve --store ${store} --create v --size 1G`));
  }
  const file = await baton(['create', 'v', '--size', '1G', '--store', fileStore(t)]);
  t.is(file.stderr, '', 'a lasting store gets no such note');
});

test('--log-level with an unknown level is a clear usage error listing the levels', async (t) => {
  const store = fileStore(t);
  const cases: [string[], Record<string, string> | undefined][] = [
    [['serve', '--log-level', 'bogus', '--store', store], undefined],
    [['gc', '--log-level', 'bogus', '--store', store], undefined],
    [['serve', '--store', store], { BATON_LOG_LEVEL: 'bogus' }],
  ];
  for (const [args, env] of cases) {
    const r = await baton(args, { timeoutMs: 20_000, ...(env ? { env } : {}) });
    t.is(r.code, 2, r.output);
    t.regex(r.stderr, /^baton: "bogus" is not a log level \(--log-level, \$BATON_LOG_LEVEL\): use one of trace, debug, info, warn, error, fatal, silent\n$/);
    t.notRegex(r.stderr, /custom levels|default level/);
    t.notRegex(r.stderr, noStackTrace);
  }
});

test('serve --size without --create is refused instead of ignored', async (t) => {
  const r = await baton(['serve', '--size', '1G', '--socket', path.join(tempDir(t), 'sock'), '--store', fileStore(t)], { timeoutMs: 20_000 });
  t.is(r.code, 2, r.output);
  t.regex(r.stderr, /--size is the size of the volume --create NAME makes; without --create it would do nothing/);
});

test('serve checks --cache-dir at start: a file, or a path under a file, is a clear error before it listens', async (t) => {
  const dir = tempDir(t);
  const file = path.join(dir, 'not-a-dir');
  fs.writeFileSync(file, 'x');
  for (const cacheDir of [file, path.join(file, 'sub')]) {
    const socket = path.join(dir, 'sock');
    const r = await baton(['serve', '--cache-dir', cacheDir, '--socket', socket, '--store', fileStore(t)], { timeoutMs: 20_000 });
    t.is(r.code, 2, r.output);
    t.regex(r.stderr, new RegExp(`--cache-dir ${cacheDir.replace(/[/.]/g, '\\$&')} cannot hold the read cache \\(.*\\): name a directory this user may write`));
    t.false(fs.existsSync(socket), 'it never listened');
  }
});

test('diff of two volumes without a common ancestor says they share no history', async (t) => {
  const store = fileStore(t);
  for (const args of [['create', 'a', '--size', '1M'], ['create', 'b', '--size', '1M'], ['fork', 'a', 'a2']]) t.is((await baton([...args, '--store', store])).code, 0);
  const unrelated = await baton(['diff', 'a', 'b', '--store', store]);
  t.is(unrelated.code, 0, unrelated.output);
  t.regex(unrelated.stderr, /a and b share no history \(neither descends from the other or from a common volume\): the ranges are everything either of them has written/);
  t.false((JSON.parse((await baton(['diff', 'a', 'b', '--json', '--store', store])).stdout) as { sharedHistory: boolean }).sharedHistory);
  const related = await baton(['diff', 'a', 'a2', '--store', store]);
  t.notRegex(related.stderr, /share no history/);
  t.true((JSON.parse((await baton(['diff', 'a2', 'a', '--json', '--store', store])).stdout) as { sharedHistory: boolean }).sharedHistory);
});

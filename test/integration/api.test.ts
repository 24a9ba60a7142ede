/**
 * The embeddable API (src/api.ts) alone, no CLI: a Deployment over a `file:` store in a temp
 * directory, its in-process NBD server attached by real clients (nbdcopy), typed errors with
 * stable codes, AbortSignal and progress, the per-volume events, and rename --replace while
 * the destination is served. Also: examples/workspace.ts type-checks against the published
 * types (dist/src/api.d.ts through package.json "exports") and runs.
 */

import anyTest, { type TestFn } from 'ava';
import { execFile } from 'node:child_process';
import { Writable } from 'node:stream';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { promisify } from 'node:util';
import { openDeployment, isBatonError, type BatonServer, type Deployment, type Progress, type VolumeEvent } from '../../src/api.js';
import { has, REPO_ROOT, tempDir, type Teardown } from '../helpers/server.js';

import { pino } from 'pino';

/** Each test's server log (debug level), printed only if the test failed: what the server saw then. */
const test = anyTest as TestFn<{ log: string[] }>;
test.beforeEach((t) => { t.context = { log: [] }; });
test.afterEach.always((t) => { if (!t.passed && t.context.log.length > 0) t.log(`server log:\n${t.context.log.join('')}`); });

const run = promisify(execFile);
const MiB = 1024 * 1024;
const withNbdcopy = has('nbdcopy') ? test : test.skip;

async function deployment(t: Teardown & { teardown(fn: () => unknown): void; context: { log: string[] } }, extra: Parameters<typeof openDeployment>[0] = {}): Promise<{ d: Deployment; dir: string }> {
  const dir = tempDir(t, 'baton-api-');
  const sink = t.context.log;
  const log = pino({ level: 'debug' }, new Writable({ write(chunk, _enc, done) { sink.push(String(chunk)); done(); } }));
  const d = await openDeployment({ store: `file:${path.join(dir, 'store')}`, hostId: 'api-test', cacheDir: path.join(dir, 'cache'), log, ...extra });
  t.teardown(() => d.close());
  return { d, dir };
}

async function serve(t: Teardown & { teardown(fn: () => unknown): void }, d: Deployment, dir: string): Promise<{ server: BatonServer; events: VolumeEvent[] }> {
  const server = await d.serve({ listen: { path: path.join(dir, 'nbd.sock') }, idleGraceMs: 300 });
  t.teardown(() => server.close());
  const events: VolumeEvent[] = [];
  for (const type of ['attached', 'detached', 'flushed', 'leaseLost', 'handedOff', 'dropped'] as const) server.on(type, (e) => events.push(e));
  return { server, events };
}

async function write(dir: string, uri: string, fill: number, bytes = MiB): Promise<Buffer> {
  const data = Buffer.alloc(bytes, fill);
  const file = path.join(dir, `in-${fill}.bin`);
  fs.writeFileSync(file, data);
  await run('nbdcopy', ['--flush', file, uri]);
  return data;
}

async function read(dir: string, uri: string, bytes = MiB): Promise<Buffer> {
  const file = path.join(dir, `out-${Math.random()}.bin`);
  await run('nbdcopy', [uri, file]);
  return fs.readFileSync(file).subarray(0, bytes);
}

async function until(what: string, cond: () => boolean | Promise<boolean>, ms = 15_000): Promise<void> {
  const end = Date.now() + ms;
  while (!(await cond())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

test('catalog verbs through the API: typed errors with stable codes, progress, abort', async (t) => {
  const { d } = await deployment(t);
  const v = await d.create('work', { size: 16 * MiB });
  t.is(v.size, 16 * MiB);
  const dup = await t.throwsAsync(d.create('work', { size: 16 * MiB }));
  t.true(isBatonError(dup, 'BATON_ERR_ALREADY_EXISTS'), dup?.message);
  const bad = await t.throwsAsync(d.create('no/slash', { size: 16 * MiB }));
  t.true(isBatonError(bad, 'BATON_ERR_INVALID_ARGUMENT'), bad?.message);
  const missing = await t.throwsAsync(d.info('nope'));
  t.true(isBatonError(missing, 'BATON_ERR_NOT_FOUND'), missing?.message);

  const phases: Progress[] = [];
  await d.fork('work', 'try-1', { onProgress: (p) => phases.push(p) });
  t.true(phases.some((p) => p.operation === 'fork' && p.finished === true), JSON.stringify(phases));
  await d.snapshot('work', 'before');
  t.deepEqual((await d.list({ accounting: false })).map((x) => x.name).sort(), ['try-1', 'work', 'work@before']);
  const diff = await d.diff('work', 'try-1');
  t.true(diff.sharedHistory);
  t.is(diff.differentBytes, 0);

  // An aborted signal stops the operation before it changes anything.
  const ac = new AbortController();
  ac.abort(new Error('the agent gave up'));
  for (const op of [d.fork('work', 'try-2', { signal: ac.signal }), d.rename('try-1', 'try-9', { signal: ac.signal }), d.rm('try-1', { signal: ac.signal }), d.gc({ signal: ac.signal })]) {
    const err = await t.throwsAsync(op);
    t.true(isBatonError(err, 'BATON_ERR_ABORTED'), err?.message);
    t.regex(err!.message, /the agent gave up/);
  }
  t.deepEqual((await d.list({ accounting: false })).map((x) => x.name).sort(), ['try-1', 'work', 'work@before'], 'nothing changed');

  // rename: onto an existing name only with replace; snapshots and a volume with snapshots are refused.
  const taken = await t.throwsAsync(d.rename('try-1', 'work'));
  t.true(isBatonError(taken, 'BATON_ERR_ALREADY_EXISTS'), taken?.message);
  t.regex(taken!.message, /--replace/);
  const snap = await t.throwsAsync(d.rename('work@before', 'x'));
  t.true(isBatonError(snap, 'BATON_ERR_INVALID_ARGUMENT'), snap?.message);
  const hasSnaps = await t.throwsAsync(d.rename('work', 'other'));
  t.true(isBatonError(hasSnaps, 'BATON_ERR_INVALID_ARGUMENT'), hasSnaps?.message);
  t.regex(hasSnaps!.message, /snapshots/);
  const r = await d.rename('try-1', 'try-one');
  t.is(r.replaced, null);
  t.deepEqual((await d.list({ accounting: false })).map((x) => x.name).sort(), ['try-one', 'work', 'work@before']);
  const rm = await d.rm('work', { snapshots: true });
  t.deepEqual(rm.removedSnapshots, ['work@before']);
  t.true(rm.keptForRelatives, 'try-one descends from work');
});

withNbdcopy('serve in-process: address, events (attached, detached, flushed, lease lost, handed off), rename --replace --force drops the old volume there', async (t) => {
  const { d, dir } = await deployment(t);
  const { server, events } = await serve(t, d, dir);
  t.true('path' in server.address);
  // Uncompressed: the flushed event counts the bytes put, and the test writes one repeated byte.
  await d.create('work', { size: 16 * MiB, compression: 'none' });
  const base = await write(dir, server.uri('work'), 0x41);
  t.true(events.some((e) => e.type === 'attached' && e.volume === 'work'));
  t.true(events.some((e) => e.type === 'detached' && e.volume === 'work'));
  t.true(events.some((e) => e.type === 'flushed' && e.volume === 'work' && e.bytes >= MiB), JSON.stringify(events));

  // A served source is refused: its host would go on taking writes the new name lacks.
  await d.fork('work', 'try-2');
  const mine = await write(dir, server.uri('try-2'), 0x42);
  const served = await t.throwsAsync(d.rename('try-2', 'work', { replace: true }));
  t.true(isBatonError(served, 'BATON_ERR_LEASE_HELD'), served?.message);
  t.regex(served!.message, /detach its clients/);
  await server.release('try-2');

  // The destination is served (open here, its lease held by the server): refused without
  // force; with it the server's lease is broken, and it drops the old work like a removed one.
  await write(dir, server.uri('work'), 0x43);
  t.is(server.exports.stateOf('work'), 'serving');
  const heldDst = await t.throwsAsync(d.rename('try-2', 'work', { replace: true }));
  t.true(isBatonError(heldDst, 'BATON_ERR_LEASE_HELD'), heldDst?.message);
  t.regex(heldDst!.message, /--force/);
  const r = await d.rename('try-2', 'work', { replace: true, force: true });
  t.truthy(r.replaced);
  await until('the old work dropped here', () => events.some((e) => (e.type === 'leaseLost' || e.type === 'dropped') && e.volume === 'work'));
  t.deepEqual((await read(dir, server.uri('work'))), mine, 'work is what try-2 wrote');
  t.notDeepEqual(mine, base);
  await t.throwsAsync(d.info('try-2'), { code: 'BATON_ERR_NOT_FOUND' } as never);

  // Handoff: the volume is served here; asked for by host-b, it is flushed and released.
  await write(dir, server.uri('work'), 0x44);
  t.is(server.exports.stateOf('work'), 'serving');
  const h = await d.handoff('work', 'host-b', { waitMs: 10_000 });
  t.true(h.ms >= 0);
  await until('handedOff event', () => events.some((e) => e.type === 'handedOff' && e.volume === 'work' && e.to === 'host-b'));
  const st = await d.status();
  t.true(st.every((l) => l.volume !== 'work' || l.holder !== 'api-test'), JSON.stringify(st));
});

test('import through the API: progress in bytes; an aborted import removes the volume it made', async (t) => {
  const { d, dir } = await deployment(t);
  const img = path.join(dir, 'disk.raw');
  fs.writeFileSync(img, Buffer.alloc(24 * MiB, 0x5a));
  const seen: Progress[] = [];
  const r = await d.importImage('disk', img, { onProgress: (p) => seen.push(p) });
  t.is(r.writtenBytes, 24 * MiB);
  t.like(seen[seen.length - 1], { operation: 'import', done: 24 * MiB, total: 24 * MiB, finished: true });
  const ac = new AbortController();
  // Aborted at its first progress report: the volume exists by then, nothing is written yet.
  const err = await t.throwsAsync(d.importImage('half', img, { signal: ac.signal, onProgress: (p) => { if (!p.finished) ac.abort(); } }));
  t.true(isBatonError(err, 'BATON_ERR_ABORTED'), err?.message);
  await t.throwsAsync(d.info('half'), { code: 'BATON_ERR_NOT_FOUND' } as never);
  t.deepEqual((await d.list({ accounting: false })).map((v) => v.name), ['disk']);
});

test('the example type-checks against the published types and runs', async (t) => {
  // Against dist/src/api.d.ts, reached as the package's "exports" (not the sources).
  const tsc = path.join(REPO_ROOT, 'node_modules', '.bin', 'tsc');
  await t.notThrowsAsync(run(tsc, ['-p', path.join(REPO_ROOT, 'examples', 'tsconfig.json')], { cwd: REPO_ROOT }));
  if (!has('nbdcopy')) { t.log('nbdcopy missing: the example was type-checked, not run'); return; }
  const { stdout } = await run(process.execPath, [path.join(REPO_ROOT, 'dist', 'examples', 'workspace.js')], { cwd: REPO_ROOT, timeout: 120_000 });
  t.regex(stdout, /volumes now: work\n/);
  t.regex(stdout, /work now holds what try-2 wrote/);
});

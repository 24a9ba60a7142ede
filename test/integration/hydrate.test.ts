/**
 * Issue 13 end to end, on Ceph RGW (a file: store with 20 ms added to every request when
 * radosgw is missing): host A builds the seed's workspace on ext4 (nbdfuse + loop: mkfs,
 * `git clone`, `npm ci --offline`, sync) and is SIGKILLed with the filesystem mounted. Host B,
 * a new process with an empty cache, attaches the volume and hydrates it in the background
 * (`--hydrate working-set`, the default) from the working set A left in the store: what A's
 * newest checkpoint recorded plus what A's log after it wrote.
 *
 * Checked: hydration started from that working set (the same chunk count the store's newest
 * checkpoint + log give, computed here in-process from the store) and fetched at least its
 * data; after it, B mounts (ext4 replays its journal) and every file of the clone and of
 * node_modules hashes as on A, while B's read cache misses (its `process stats` counters)
 * fetch almost nothing more; `e2fsck -fn` is clean.
 */

import test, { type ExecutionContext } from 'ava';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import { openStoreCatalog } from '../../src/catalog.js';
import type { CacheStats } from '../../src/cache.js';
import { attachLoop, isMountpoint, mountExt4, run, runOk, sha256File, startNbdfuse, type FuseExport, type LoopDevice, type Mount } from '../helpers/ext4.js';
import { hasS3, makeTestBucket, s3TestEnv } from '../helpers/s3.js';
import { BATON_BIN as BATON_BIN_PATH, baton, has, startBatonServer, tempDir, type BatonServer } from '../helpers/server.js';
import { git, makeNpmProject, makeSourceRepo, npmEnv } from '../helpers/workspace.js';
import { rngFrom } from '../helpers/writer.js';

const TOOLS = ['nbdfuse', 'fusermount3', 'losetup', 'mkfs.ext4', 'e2fsck', 'mount', 'umount', 'git', 'npm', 'sync'];
const missing = TOOLS.filter((tool) => !has(tool));
const isRoot = process.getuid?.() === 0;
const canRun = isRoot && missing.length === 0 && fs.existsSync('/dev/fuse') && fs.existsSync('/dev/loop-control');
const serial = canRun ? test.serial : test.serial.skip;
const withNbdcopy = has('nbdcopy') ? test : test.skip;
if (!canRun) console.warn(`hydrate: skipped (root: ${isRoot}, missing tools: ${missing.join(', ') || 'none'})`);

const VOLUME = 'ws';
const VOLUME_SIZE = 512 * 1024 * 1024;
const MiB = 1024 * 1024;

interface Target { label: string; store: string; env: Record<string, string>; storeArgs: string[]; catalog: () => ReturnType<typeof openStoreCatalog> }
interface Stack { fuse: FuseExport; loop: LoopDevice; mount: Mount | null; dir: string }

async function hashTree(root: string): Promise<Record<string, string>> {
  const out: [string, string][] = [];
  const walk = async (rel: string): Promise<void> => {
    for (const e of await fsp.readdir(path.join(root, rel), { withFileTypes: true })) {
      const r = path.join(rel, e.name);
      if (r === 'lost+found') continue;
      if (e.isDirectory()) await walk(r);
      else if (e.isSymbolicLink()) out.push([r, '->' + (await fsp.readlink(path.join(root, r)))]);
      else if (e.isFile()) out.push([r, await sha256File(path.join(root, r))]);
    }
  };
  await walk('');
  return Object.fromEntries(out.sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)));
}

async function startHost(t: ExecutionContext, target: Target): Promise<BatonServer> {
  const cache = path.join(tempDir(t, 'baton-hyd-cache-'), 'cache');
  return startBatonServer(t, {
    store: target.store, env: target.env,
    extraArgs: [...target.storeArgs, '--cache-dir', cache, '--lease-ttl', '60', '--stats-interval', '250ms', '--hydrate', 'working-set'],
  });
}

async function attach(t: ExecutionContext, server: BatonServer): Promise<Stack> {
  const fuse = await startNbdfuse(t, server.uri(VOLUME), tempDir(t, 'baton-hyd-fuse-'));
  const loop = await attachLoop(t, fuse.file);
  return { fuse, loop, mount: null, dir: tempDir(t, 'baton-hyd-mnt-') };
}

/** JSON log lines of a server with this msg. */
function lines(server: BatonServer, msg: string): Record<string, unknown>[] {
  const out: Record<string, unknown>[] = [];
  for (const l of server.stderr().split('\n')) {
    if (!l.includes(`"msg":"${msg}"`)) continue;
    try { out.push(JSON.parse(l) as Record<string, unknown>); } catch { /* partial line */ }
  }
  return out;
}

async function waitFor<T>(what: string, f: () => T | undefined, timeoutMs = 60_000): Promise<T> {
  const end = Date.now() + timeoutMs;
  for (;;) {
    const v = f();
    if (v !== undefined) return v;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** The read cache's counters from B's next `process stats` line after now. */
async function nextCacheStats(server: BatonServer): Promise<CacheStats> {
  const seen = lines(server, 'process stats').length;
  const l = await waitFor('a process stats line', () => lines(server, 'process stats')[seen]);
  return l.cache as CacheStats;
}

serial('a new host hydrates the working set a SIGKILLed host left, then serves the workspace from its cache', async (t) => {
  t.timeout(300_000);
  const t0 = Date.now();
  let target: Target;
  if (hasS3()) {
    const s3 = await s3TestEnv(t);
    const bucket = await makeTestBucket(s3);
    const store = `s3://${bucket}/hydrate`;
    target = {
      label: 'Ceph RGW', store, storeArgs: ['--endpoint', s3.endpoint],
      env: { AWS_ACCESS_KEY_ID: s3.accessKeyId, AWS_SECRET_ACCESS_KEY: s3.secretAccessKey, AWS_REGION: s3.region, BATON_HOME: tempDir(t, 'baton-hyd-home-') },
      catalog: () => openStoreCatalog(store, { endpoint: s3.endpoint, region: s3.region, credentials: { accessKeyId: s3.accessKeyId, secretAccessKey: s3.secretAccessKey }, cacheDir: tempDir(t, 'baton-hyd-c-') }),
    };
  } else {
    // A file: store is read in place (no cache): 20 ms per request makes it a remote store.
    const store = `file:${path.join(tempDir(t, 'baton-hyd-store-'), 'store')}`;
    target = {
      label: 'file: +20 ms', store, storeArgs: [], env: { BATON_HOME: tempDir(t, 'baton-hyd-home-'), BATON_FAULTS: '{"latencyMs":20}' },
      catalog: () => openStoreCatalog(store, { cacheDir: tempDir(t, 'baton-hyd-c-') }),
    };
  }
  t.log(`store: ${target.label}`);
  // Uncompressed frames: the bytes hydration fetches are then comparable with the working set's logical bytes.
  const created = baton(['create', VOLUME, '--size', String(VOLUME_SIZE), '--compression', 'none', '--store', target.store, ...target.storeArgs], target.env);
  if (created.status !== 0) throw new Error(`baton create failed: ${created.stderr}`);

  // ---- fixtures
  const work = tempDir(t, 'baton-hyd-work-');
  const src = path.join(work, 'src');
  await makeSourceRepo(src, rngFrom(13));
  const { app } = await makeNpmProject(work);

  // ---- host A: build the workspace, sync, SIGKILL with the filesystem mounted
  const a = await startHost(t, target);
  const sa = await attach(t, a);
  await runOk('mkfs.ext4', ['-q', '-F', sa.loop.dev], { timeoutMs: 120_000 });
  sa.mount = await mountExt4(t, sa.loop.dev, sa.dir);
  await git(['clone', '-q', '--no-hardlinks', src, path.join(sa.dir, 'repo')]);
  await fsp.cp(app, path.join(sa.dir, 'app'), { recursive: true });
  await runOk('npm', ['ci', '--offline', '--ignore-scripts'], { cwd: path.join(sa.dir, 'app'), env: npmEnv(work), timeoutMs: 180_000 });
  await runOk('sync', ['-f', sa.dir], { timeoutMs: 120_000 });
  const want = await hashTree(sa.dir);
  t.true(Object.keys(want).length > 400, `the workspace has its files (${Object.keys(want).length})`);
  t.log(`workspace built on A in ${((Date.now() - t0) / 1000).toFixed(1)} s: ${Object.keys(want).length} files`);
  await a.kill();
  if (isMountpoint(sa.dir)) await run('umount', ['-l', sa.dir], { timeoutMs: 20_000 });
  await sa.mount.unmount();
  await sa.loop.detach().catch(() => {});
  if (isMountpoint(sa.fuse.dir)) await run('fusermount3', ['-u', '-z', sa.fuse.dir], { timeoutMs: 20_000 });
  await sa.fuse.unmount();

  // ---- what A left in the store: the working set as any opener recovers it
  const catalog = target.catalog();
  const view = await catalog.loadMap(VOLUME);
  const recordedChunks = view.workingSetSnapshot().chunks.length;
  const plan = view.hydrationPlan('working-set');
  const planBytes = plan.reduce((n, r) => n + r.length, 0);
  await view.close();
  await catalog.store.close();
  t.true(recordedChunks > 0 && planBytes > 4 * MiB, `A left a working set: ${recordedChunks} chunks, ${(planBytes / MiB).toFixed(1)} MiB of data`);

  // ---- host B: empty cache; attaching opens the volume and starts hydration
  const b = await startHost(t, target);
  const tb = Date.now();
  const sb = await attach(t, b);
  const started = await waitFor('hydration started', () => lines(b, 'hydration started')[0]);
  t.is(started.workingSetChunks, recordedChunks, 'B hydrates exactly the working set recorded in the store');
  const done = await waitFor('hydration done', () => lines(b, 'hydration done')[0], 120_000);
  t.log(`B: hydration of ${recordedChunks} chunks done in ${done.ms as number} ms: ${((done.fetchedBytes as number) / MiB).toFixed(1)} MiB in ${done.requests as number} GETs (${((Date.now() - tb) / 1000).toFixed(1)} s after attach)`);
  const afterHydration = await nextCacheStats(b);
  // Each data byte of the plan lies in some block B fetched, by hydration or by the partition
  // scan of the attach just before (which hydration then skipped).
  t.true(afterHydration.bytesFetched >= planBytes, `B fetched ${afterHydration.bytesFetched} bytes, the recorded working set holds ${planBytes} bytes of data`);
  t.is(done.truncated, false);

  // ---- B serves the workspace: mount (journal replay), every file as on A
  sb.mount = await mountExt4(t, sb.loop.dev, sb.dir);
  const got = await hashTree(sb.dir);
  t.deepEqual(got, want, 'every file of the clone and of node_modules as A wrote it');
  const st = await runOk('git', ['-C', path.join(sb.dir, 'repo'), 'status', '--porcelain']);
  t.is(st.stdout, '');
  const afterReads = await nextCacheStats(b);
  const extra = afterReads.bytesFetched - afterHydration.bytesFetched;
  t.log(`reads after hydration: ${afterReads.hits - afterHydration.hits} block hits, ${afterReads.misses - afterHydration.misses} misses (${(extra / MiB).toFixed(2)} MiB fetched)`);
  t.true(extra <= Math.max(2 * MiB, 0.05 * afterHydration.bytesFetched), `reading the whole workspace after hydration fetched ${extra} more bytes`);
  await sb.mount.unmount();
  const e2 = await run('e2fsck', ['-fn', sb.loop.dev], { timeoutMs: 120_000 });
  t.is(e2.code, 0, e2.output);
  await sb.loop.detach();
  await sb.fuse.unmount();
  await b.stop();
  t.is(b.proc.exitCode, 0, b.stderr());
  t.log(`done in ${((Date.now() - t0) / 1000).toFixed(1)} s`);
});

withNbdcopy('baton prefetch warms a host\'s cache with the working set (JSON progress), and baton status shows the hydration', async (t) => {
  const dir = tempDir(t, 'baton-prefetch-');
  const store = `file:${path.join(dir, 'store')}`;
  // 5 ms per request: the read cache is used (a faulty store hides in-place reads).
  const env = { BATON_HOME: path.join(dir, 'home'), BATON_FAULTS: '{"latencyMs":5}' };
  const created = baton(['create', 'v', '--size', '64M', '--compression', 'none', '--store', store], env); // fetched bytes comparable with the 8 MiB written
  t.is(created.status, 0, created.stderr);
  const data = path.join(dir, 'data.bin');
  fs.writeFileSync(data, Buffer.alloc(8 * MiB, 0x61));
  const a = await startBatonServer(t, { store, env, extraArgs: ['--cache-dir', path.join(dir, 'ca'), '--idle-grace', '0.2'] });
  await runOk('nbdcopy', [data, a.uri('v'), '--flush'], { timeoutMs: 60_000 });
  await a.stop(); // closes the volume: a checkpoint with its working set
  const b = await startBatonServer(t, { store, env, extraArgs: ['--cache-dir', path.join(dir, 'cb'), '--idle-grace', '60', '--hydrate', 'off', '--stats-interval', '200ms'] });
  const p = await run(process.execPath, [BATON_BIN_PATH, 'prefetch', 'v', '--socket', b.socket, '--store', store, '--json'], { env, timeoutMs: 60_000 });
  t.is(p.code, 0, p.output);
  const progress = p.stderr.trim().split('\n').map((l) => JSON.parse(l) as { doneBytes: number; totalBytes: number; done: boolean; volume: string });
  const last = progress[progress.length - 1]!;
  t.true(last.done);
  t.is(last.volume, 'v');
  t.is(last.totalBytes, 8 * MiB, 'the working set: the 8 MiB written');
  t.is(last.doneBytes, last.totalBytes);
  const warmed = await nextCacheStats(b);
  t.true(warmed.bytesFetched >= 8 * MiB, `B fetched ${warmed.bytesFetched} bytes`);
  const out = path.join(dir, 'out.bin');
  await runOk('nbdcopy', [b.uri('v'), out], { timeoutMs: 60_000 });
  t.true(fs.readFileSync(out).subarray(0, 8 * MiB).equals(fs.readFileSync(data)));
  const after = await nextCacheStats(b);
  t.is(after.bytesFetched, warmed.bytesFetched, 'reading it back fetched nothing more');
  await b.stop();
  // --hydrate working-set (the default): baton status shows it once the volume is open.
  const c = await startBatonServer(t, { store, env, extraArgs: ['--cache-dir', path.join(dir, 'cc'), '--idle-grace', '60'] });
  await runOk('nbdcopy', [c.uri('v'), out], { timeoutMs: 60_000 });
  const hydration = await waitFor('hydration in baton status', () => {
    const st = baton(['status', '--store', store, '--json'], env);
    const l = (JSON.parse(st.stdout) as { volume: string; status?: { hydration?: { state: string; fetchedBytes: number } } }[]).find((x) => x.volume === 'v');
    return l?.status?.hydration?.state === 'done' ? l.status.hydration : undefined;
  }, 10_000);
  t.true(hydration.fetchedBytes >= 8 * MiB);
  const table = baton(['status', '--store', store], env);
  t.regex(table.stdout, /HYDRATION/);
  t.regex(table.stdout, /done 8(\.\d+)? MiB \(working-set\)/);
  await c.stop();
});

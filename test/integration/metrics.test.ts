/**
 * `baton serve --metrics` as a process, with real clients: /metrics scraped while nbdcopy and
 * fio run against it (the counters move by exactly what the clients did, and every scrape in
 * between parses and never goes backwards), the health endpoints as an orchestrator sees them
 * (ready only once the store answers and while the lease service does), and the startup
 * errors (an address in use, a malformed address) that keep NBD from starting half-configured.
 */
import test, { type ExecutionContext } from 'ava';
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as path from 'node:path';
import { run } from '../helpers/ext4.js';
import { hasRedis, startRedis } from '../helpers/redis.js';
import { BATON_BIN, baton, has, startBatonServer, tempDir, type BatonServer } from '../helpers/server.js';
import { httpGet, metricsPort, scrape, total, type Exposition } from '../helpers/prom.js';

const MiB = 1024 * 1024;

/** A test that runs when every tool exists and is skipped otherwise. */
function needs(...tools: string[]): typeof test | typeof test.skip {
  return tools.every((tool) => has(tool)) ? test : test.skip;
}

async function servedWithMetrics(t: ExecutionContext, size: number, extra: string[] = []): Promise<{ server: BatonServer; port: number }> {
  // --idle-grace: the volume (and its series) stays while the test reads its counters between clients.
  const server = await startBatonServer(t, { volumes: [{ name: 'vol', size }], extraArgs: ['--metrics', '127.0.0.1:0', '--idle-grace', '600', ...extra] });
  return { server, port: await metricsPort(() => server.stderr()) };
}

/**
 * Scrapes every `everyMs` until stopped; each scrape must parse (scrape() throws otherwise) and
 * no baton counter, histogram bucket or count may go down between two of them.
 */
function scrapeWhile(t: ExecutionContext, port: number, everyMs = 20, atLeast = 3): { stop(): Promise<Exposition[]> } {
  const got: Exposition[] = [];
  let stopped = false;
  // Until stopped, and at least `atLeast` scrapes: copies that end within a scrape or two
  // (a quiet machine, a small file) still leave enough scrapes to compare.
  const loop = (async () => {
    while (!stopped || got.length < atLeast) {
      got.push(await scrape(port));
      await new Promise((r) => setTimeout(r, everyMs));
    }
  })();
  return {
    async stop() {
      stopped = true;
      await loop;
      const monotonic = (name: string): boolean => !name.startsWith('baton_process_') && !name.startsWith('baton_nodejs_')
        && (name.endsWith('_total') || name.endsWith('_bucket') || name.endsWith('_count') || name.endsWith('_sum'));
      const key = (s: Exposition['samples'][number]): string => `${s.name}${JSON.stringify(s.labels)}`;
      for (let i = 1; i < got.length; i++) {
        const prev = new Map(got[i - 1]!.samples.filter((s) => monotonic(s.name)).map((s) => [key(s), s.value]));
        for (const s of got[i]!.samples) {
          if (!monotonic(s.name)) continue;
          const p = prev.get(key(s));
          if (p !== undefined && s.value < p) t.fail(`${key(s)} went from ${p} to ${s.value} between scrapes ${i - 1} and ${i}`);
        }
      }
      return got;
    },
  };
}

needs('nbdcopy')('nbdcopy in and out while /metrics is scraped: bytes written and read are exactly the file, one flush sample per FLUSH', async (t) => {
  const size = 24 * MiB;
  const { server, port } = await servedWithMetrics(t, size);
  const dir = tempDir(t);
  const src = path.join(dir, 'src.bin');
  fs.writeFileSync(src, randomBytes(size)); // random: no zero blocks nbdcopy could skip
  const scraper = scrapeWhile(t, port);
  const w = await run('nbdcopy', ['--flush', src, server.uri('vol')], { timeoutMs: 120_000 });
  t.is(w.code, 0, w.output);
  const afterWrite = await scrape(port);
  const r = await run('nbdcopy', [server.uri('vol'), 'null:'], { timeoutMs: 120_000 });
  t.is(r.code, 0, r.output);
  const scrapes = await scraper.stop();
  t.log(`${scrapes.length} scrapes during and after the copies, each parsed, no counter going down`);
  const e = await scrape(port);
  const v = { volume: 'vol' };
  t.is(total(afterWrite, 'baton_nbd_write_bytes_total', v), size);
  t.is(total(e, 'baton_nbd_write_bytes_total', v), size);
  t.is(total(e, 'baton_nbd_read_bytes_total', v), size);
  const flushes = total(e, 'baton_nbd_requests_total', { ...v, cmd: 'flush' });
  t.true(flushes >= 1, 'nbdcopy --flush sent FLUSH');
  t.is(total(e, 'baton_nbd_requests_total', { ...v, cmd: 'flush', result: 'ok' }), flushes);
  t.is(total(e, 'baton_nbd_flush_duration_seconds_count', v), flushes);
  t.is(total(e, 'baton_nbd_requests_total', { ...v, cmd: 'write', result: 'ok' }), total(e, 'baton_nbd_requests_total', { ...v, cmd: 'write' }));
  // What the flushes made durable: every byte, committed into the store (file:, so not retried).
  t.true(total(e, 'baton_volume_commit_bytes_total', v) >= size);
  t.is(total(e, 'baton_volume_dirty_bytes', v) + total(e, 'baton_volume_sealed_bytes', v), 0);
  t.true(total(e, 'baton_store_sent_bytes_total') >= size);
  // The read came from the store's files in place (file: needs no read cache): counted as gets.
  t.true(total(e, 'baton_store_received_bytes_total') >= size, String(total(e, 'baton_store_received_bytes_total')));
  t.true(total(e, 'baton_store_requests_total', { op: 'get', outcome: 'ok' }) >= size / (256 * 1024));
  t.is(total(e, 'baton_cache_fetched_bytes_total'), 0);
  t.true(total(e, 'baton_store_requests_total', { op: 'put', outcome: 'ok' }) >= 3, 'segments of 8 MiB and records');
  t.is(total(e, 'baton_lease_held', v), 1);
});

needs('fio')('fio randwrite with --fsync: FLUSH samples equal the syncs fio reports, write bytes its io_bytes', async (t) => {
  const { server, port } = await servedWithMetrics(t, 64 * MiB);
  const dir = tempDir(t);
  const before = await scrape(port);
  t.is(total(before, 'baton_nbd_write_bytes_total', { volume: 'vol' }), 0); // not attached yet: no series
  const scraper = scrapeWhile(t, port);
  const out = path.join(dir, 'fio.json');
  const r = await run('fio', [
    '--name=metrics', '--ioengine=nbd', `--uri=${server.uri('vol')}`, '--rw=randwrite', '--bs=4k', '--size=32M',
    '--number_ios=600', '--iodepth=8', '--fsync=16', '--output-format=json', `--output=${out}`,
  ], { timeoutMs: 120_000 });
  t.is(r.code, 0, r.output);
  await scraper.stop();
  const job = (JSON.parse(fs.readFileSync(out, 'utf8')) as { jobs: { error: number; write: { io_bytes: number; total_ios: number }; sync: { total_ios: number } }[] }).jobs[0]!;
  t.is(job.error, 0);
  t.is(job.write.total_ios, 600);
  t.true(job.sync.total_ios >= 600 / 16, `fio synced ${job.sync.total_ios} times`);
  const e = await scrape(port);
  const v = { volume: 'vol' };
  t.is(total(e, 'baton_nbd_write_bytes_total', v), job.write.io_bytes);
  t.is(total(e, 'baton_nbd_requests_total', { ...v, cmd: 'write', result: 'ok' }), job.write.total_ios);
  t.is(total(e, 'baton_nbd_flush_duration_seconds_count', v), job.sync.total_ios);
  t.is(total(e, 'baton_nbd_requests_total', { ...v, cmd: 'flush', result: 'ok' }), job.sync.total_ios);
  // Every FLUSH committed what was dirty: as many commits as flushes that found data, at most.
  const commits = total(e, 'baton_volume_commits_total', v);
  t.true(commits >= 1 && commits <= job.sync.total_ios, `${commits} commits`);
  t.is(total(e, 'baton_volume_commit_duration_seconds_count', v), commits);
});

test('health endpoints of a real serve: /healthz, /readyz with each check, 404 and 405 elsewhere; it still stops cleanly', async (t) => {
  const { server, port } = await servedWithMetrics(t, 16 * MiB);
  t.is((await httpGet(port, '/healthz')).status, 200);
  const ready = await httpGet(port, '/readyz');
  t.is(ready.status, 200, ready.body);
  const body = JSON.parse(ready.body) as { ready: boolean; checks: Record<string, { ok: boolean; detail: string }> };
  t.true(body.ready);
  t.deepEqual(Object.keys(body.checks).sort(), ['lease', 'listening', 'store']);
  t.regex(body.checks['lease']!.detail, /lease files in /);
  t.regex(body.checks['listening']!.detail, /^nbd\+unix:/);
  t.is((await httpGet(port, '/nope')).status, 404);
  t.is((await httpGet(port, '/metrics', 'DELETE')).status, 405);
  // The metrics listener is loopback-only when given a port (here 127.0.0.1:0), and says where.
  t.regex(server.stderr(), /"msg":"metrics listening"/);
  await server.stop();
  t.is(server.proc.exitCode, 0, server.stderr());
});

test('--metrics on an address in use: a clear error before anything is served; a malformed address is a usage error', async (t) => {
  const blocker = net.createServer();
  await new Promise<void>((res) => blocker.listen(0, '127.0.0.1', res));
  t.teardown(() => blocker.close());
  const port = (blocker.address() as net.AddressInfo).port;
  const dir = tempDir(t);
  const socket = path.join(dir, 'nbd.sock');
  const r = await new Promise<{ code: number | null; stderr: string }>((resolve) => {
    const p = spawn(process.execPath, [BATON_BIN, 'serve', '--socket', socket, '--store', `file:${path.join(dir, 'store')}`, '--metrics', `127.0.0.1:${port}`], { stdio: ['ignore', 'ignore', 'pipe'] });
    let err = '';
    p.stderr!.on('data', (d: Buffer) => { err += d.toString(); });
    const timer = setTimeout(() => p.kill('SIGKILL'), 30_000);
    p.once('exit', (code) => { clearTimeout(timer); resolve({ code, stderr: err }); });
  });
  t.is(r.code, 2, r.stderr);
  t.regex(r.stderr, new RegExp(`baton: --metrics 127\\.0\\.0\\.1:${port}: cannot listen: the address is in use \\(another process listens there\\): choose another port`));
  t.false(fs.existsSync(socket), 'NBD never started listening');
  const bad = baton(['serve', '--metrics', 'localhost:port', '--store', 'memory:']);
  t.is(bad.status, 2, bad.stderr);
  t.regex(bad.stderr, /--metrics must be PORT or HOST:PORT/);
});

test('/readyz is 503 while the store does not answer, /healthz 200: the listener starts before the store probe', async (t) => {
  // An endpoint nothing listens on: the startup probe keeps retrying (serve waits for the store).
  const closed = net.createServer();
  await new Promise<void>((res) => closed.listen(0, '127.0.0.1', res));
  const deadPort = (closed.address() as net.AddressInfo).port;
  await new Promise<void>((res) => closed.close(() => res()));
  const dir = tempDir(t);
  const p = spawn(process.execPath, [BATON_BIN, 'serve', '--socket', path.join(dir, 'nbd.sock'), '--store', 's3://bucket/x', '--endpoint', `http://127.0.0.1:${deadPort}`, '--metrics', '127.0.0.1:0', '--cache-dir', path.join(dir, 'cache')], {
    stdio: ['ignore', 'ignore', 'pipe'],
    env: { ...process.env, AWS_ACCESS_KEY_ID: 'x', AWS_SECRET_ACCESS_KEY: 'y', AWS_REGION: 'us-east-1', BATON_HOME: path.join(dir, 'home') },
  });
  let err = '';
  p.stderr!.on('data', (d: Buffer) => { err += d.toString(); });
  const exited = new Promise<void>((res) => p.once('exit', () => res()));
  t.teardown(async () => { p.kill('SIGKILL'); await exited; });
  const port = await metricsPort(() => err);
  t.is((await httpGet(port, '/healthz')).status, 200);
  const ready = await httpGet(port, '/readyz');
  t.is(ready.status, 503, ready.body);
  const body = JSON.parse(ready.body) as { ready: boolean; checks: Record<string, { ok: boolean; detail: string }> };
  t.deepEqual(body.checks['store'], { ok: false, detail: 'waiting for the store to pass its startup probe' });
  t.false(body.checks['listening']!.ok);
  // /metrics answers too: the process's series, no volume yet.
  const e = await scrape(port);
  t.true(e.samples.some((s) => s.name === 'baton_process_cpu_seconds_total'));
  t.false(e.samples.some((s) => 'volume' in s.labels));
});

(hasRedis() ? test : test.skip)('/readyz follows the lease service: 503 naming Redis while it is down, 200 once it is back', async (t) => {
  const redis = await startRedis(t);
  const server = await startBatonServer(t, { volumes: [{ name: 'vol', size: 16 * MiB }], extraArgs: ['--metrics', '127.0.0.1:0', '--redis', redis.url] });
  const port = await metricsPort(() => server.stderr());
  t.is((await httpGet(port, '/readyz')).status, 200);
  await redis.stop();
  const down = await httpGet(port, '/readyz');
  t.is(down.status, 503, down.body);
  const checks = (JSON.parse(down.body) as { checks: Record<string, { ok: boolean; detail: string }> }).checks;
  t.false(checks['lease']!.ok);
  t.regex(checks['lease']!.detail, /Redis/);
  t.true(checks['store']!.ok && checks['listening']!.ok);
  await redis.start();
  const deadline = Date.now() + 20_000;
  let status = 0;
  while (Date.now() < deadline && (status = (await httpGet(port, '/readyz')).status) !== 200) await new Promise((r) => setTimeout(r, 100));
  t.is(status, 200);
});

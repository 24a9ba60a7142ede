/**
 * The CLI against a store it cannot trust (issue 9.10, and 9's BATON_MAX_OPERATION_MS): real
 * `baton` processes, a local TCP server that accepts connections and never answers, and a
 * file: store two processes disagree about.
 */
import test, { type ExecutionContext } from 'ava';
import { spawn } from 'node:child_process';
import { createServer, type AddressInfo, type Socket } from 'node:net';
import { BATON_BIN, tempDir } from '../helpers/server.js';
import { run } from '../helpers/ext4.js';
import { INTERACTIVE_RETRY_BUDGET_MS } from '../../src/store/open.js';

/** A TCP server that accepts connections and never sends a byte. */
async function silentEndpoint(t: ExecutionContext): Promise<string> {
  const sockets = new Set<Socket>();
  const server = createServer((s) => {
    sockets.add(s);
    s.on('error', () => {});
    s.on('close', () => sockets.delete(s));
    s.resume();
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  t.teardown(() => {
    for (const s of sockets) s.destroy();
    server.close();
  });
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
}

/** The environment of a baton process in these tests: no store, endpoint or settings inherited. */
function cleanEnv(t: ExecutionContext, extra: Record<string, string> = {}): Record<string, string> {
  const env: Record<string, string> = {};
  for (const [k, v] of Object.entries(process.env)) {
    if (v !== undefined && !/^(BATON_|AWS_)/.test(k)) env[k] = v;
  }
  return {
    ...env,
    BATON_HOME: tempDir(t, 'baton-trust-home-'),
    AWS_ACCESS_KEY_ID: 'test', AWS_SECRET_ACCESS_KEY: 'test-secret', AWS_REGION: 'us-east-1',
    // run() starts from process.env: blank out what would change the outcome.
    BATON_MAX_OPERATION_MS: '', BATON_S3_ENDPOINT: '', BATON_FAULTS: '',
    ...extra,
  };
}

test('9.10: baton serve on an endpoint that never answers logs that it waits for the store, naming the endpoint', async (t) => {
  const endpoint = await silentEndpoint(t);
  const proc = spawn(process.execPath, [BATON_BIN, 'serve', '--store', 's3://bucket/prefix', '--endpoint', endpoint, '--listen', '127.0.0.1:0'], {
    env: cleanEnv(t), stdio: ['ignore', 'ignore', 'pipe'],
  });
  t.teardown(() => { if (proc.exitCode === null) proc.kill('SIGKILL'); });
  let stderr = '';
  const line = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no "waiting" line within 20 s; stderr:\n${stderr}`)), 20_000);
    proc.stderr!.on('data', (d: Buffer) => {
      stderr += d.toString();
      const found = stderr.split('\n').find((l) => l.includes('waiting for the store'));
      if (found !== undefined) {
        clearTimeout(timer);
        resolve(found);
      }
    });
    proc.on('exit', (code) => { clearTimeout(timer); reject(new Error(`serve exited ${code} before saying it waits:\n${stderr}`)); });
  });
  const entry = JSON.parse(line) as { level: number; msg: string; target: string };
  t.true(entry.msg.includes(endpoint), entry.msg);
  t.is(entry.target, `s3://bucket/prefix/ at ${endpoint}`);
  t.is(entry.level, 40, 'a warning');
  t.is(proc.exitCode, null, 'serve keeps waiting (and trying)');
});

test('9.10: baton ls on an endpoint that never answers fails within the interactive budget, naming the endpoint', async (t) => {
  const endpoint = await silentEndpoint(t);
  const t0 = performance.now();
  const r = await run(process.execPath, [BATON_BIN, 'ls', '--store', 's3://bucket', '--endpoint', endpoint], { env: cleanEnv(t), timeoutMs: 120_000 });
  const ms = performance.now() - t0;
  t.is(r.code, 1, r.output);
  t.true(ms < INTERACTIVE_RETRY_BUDGET_MS + 10_000, `took ${Math.round(ms)} ms (before the fix: 596 s)`);
  t.true(r.stderr.includes(endpoint), r.stderr);
  t.regex(r.stderr, /gave up after 30\.0 s/);
  t.regex(r.stderr, /check that the endpoint is up and reachable from this host/);
});

test('9: a process whose BATON_MAX_OPERATION_MS differs from the one recorded with the store is refused, with what to do', async (t) => {
  const store = `file:${tempDir(t, 'baton-trust-store-')}`;
  const created = await run(process.execPath, [BATON_BIN, 'create', 'work', '--size', '1M', '--store', store], { env: cleanEnv(t, { BATON_MAX_OPERATION_MS: '1000' }) });
  t.is(created.code, 0, created.output);
  const other = await run(process.execPath, [BATON_BIN, 'ls', '--store', store], { env: cleanEnv(t) });
  t.is(other.code, 1, other.output);
  t.regex(other.stderr, /is used with BATON_MAX_OPERATION_MS=1000 .*but this process has 60000 \(the default\)/);
  t.regex(other.stderr, /Run this process with BATON_MAX_OPERATION_MS=1000/);
  const same = await run(process.execPath, [BATON_BIN, 'ls', '--store', store], { env: cleanEnv(t, { BATON_MAX_OPERATION_MS: '1000' }) });
  t.is(same.code, 0, same.output);
  t.regex(same.stdout, /^work\b/m);
});

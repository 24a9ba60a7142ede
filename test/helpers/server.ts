/**
 * Start a real `baton serve` process for a test, on a Unix socket in a temp directory, and
 * register its teardown at once. Integration tests drive it with real NBD clients.
 */

import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';

export const REPO_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..', '..');
export const BATON_BIN = path.join(REPO_ROOT, 'dist', 'cli', 'bin.cjs');

export interface Teardown {
  teardown(fn: () => void | Promise<void>): void;
}

export interface BatonServer {
  /** Unix socket path. */
  socket: string;
  /** Store URL the server uses (file:DIR unless given). */
  store: string;
  dir: string;
  proc: ChildProcess;
  /** libnbd-style URI for an export. */
  uri(exportName: string): string;
  /** Collected stderr (pino JSON lines). */
  stderr(): string;
  /** Graceful stop (SIGTERM), resolves when the process exited. */
  stop(): Promise<void>;
  /** SIGKILL, for crash tests. */
  kill(): Promise<void>;
}

export interface StartOptions {
  volumes?: { name: string; size: number }[];
  readOnly?: boolean;
  /** Defaults to a fresh file: store in the test's temp dir; ram: or memory: serve one volume made by serve --create. */
  store?: string;
  extraArgs?: string[];
  env?: Record<string, string>;
  logLevel?: string;
}

export function tempDir(t: Teardown, prefix = 'baton-test-'): string {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), prefix));
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }));
  return dir;
}

export function baton(args: string[], env?: Record<string, string>): { status: number; stdout: string; stderr: string } {
  const r = spawnSync(process.execPath, [BATON_BIN, ...args], { encoding: 'utf8', env: { ...process.env, ...env } });
  return { status: r.status ?? -1, stdout: r.stdout, stderr: r.stderr };
}

export async function waitForSocket(socket: string, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const ok = await new Promise<boolean>((resolve) => {
      const s = net.connect(socket);
      s.once('connect', () => { s.destroy(); resolve(true); });
      s.once('error', () => resolve(false));
    });
    if (ok) return;
    if (Date.now() > deadline) throw new Error(`server socket ${socket} did not come up`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

export async function startBatonServer(t: Teardown, opts: StartOptions = {}): Promise<BatonServer> {
  const dir = tempDir(t);
  const store = opts.store ?? `file:${path.join(dir, 'store')}`;
  const env = { ...opts.env };
  // ram: and memory: volumes live in the serving process: it makes the one volume itself.
  const inProcess = store === 'ram:' || store === 'memory:';
  if (inProcess && (opts.volumes?.length ?? 0) > 1) throw new Error(`${store} serves one volume here (serve --create)`);
  const created = inProcess ? (opts.volumes ?? []).flatMap((v) => ['--create', v.name, '--size', String(v.size)]) : [];
  for (const v of inProcess ? [] : opts.volumes ?? []) {
    const r = baton(['create', v.name, '--size', String(v.size), '--store', store], env);
    if (r.status !== 0) throw new Error(`baton create failed: ${r.stderr}`);
  }
  const socket = path.join(dir, 'nbd.sock');
  const args = [BATON_BIN, 'serve', '--socket', socket, '--store', store, ...created, '--log-level', opts.logLevel ?? 'info', ...(opts.readOnly ? ['--read-only'] : []), ...(opts.extraArgs ?? [])];
  const proc = spawn(process.execPath, args, { stdio: ['ignore', 'ignore', 'pipe'], env: { ...process.env, ...env } });
  let err = '';
  proc.stderr!.on('data', (d: Buffer) => { err += d.toString(); });
  // BATON_TEST_LOG_DIR keeps every server's log in a file of its own, for a failure seen once.
  if (process.env.BATON_TEST_LOG_DIR) {
    const file = path.join(process.env.BATON_TEST_LOG_DIR, `serve-${Date.now()}-${proc.pid}.log`);
    fs.mkdirSync(process.env.BATON_TEST_LOG_DIR, { recursive: true });
    fs.writeFileSync(file, `${args.slice(1).join(' ')}\n${JSON.stringify(env)}\n`);
    proc.stderr!.on('data', (d: Buffer) => fs.appendFileSync(file, d));
  }
  const exited = new Promise<void>((resolve) => proc.once('exit', () => resolve()));
  const server: BatonServer = {
    socket,
    store,
    dir,
    proc,
    uri: (name) => `nbd+unix:///${name}?socket=${socket}`,
    stderr: () => err,
    stop: async () => {
      if (proc.exitCode === null && proc.signalCode === null) proc.kill('SIGTERM');
      await exited;
    },
    kill: async () => {
      if (proc.exitCode === null && proc.signalCode === null) proc.kill('SIGKILL');
      await exited;
    },
  };
  t.teardown(() => server.kill());
  try {
    await Promise.race([
      waitForSocket(socket),
      exited.then(() => { throw new Error(`baton serve exited early: ${err}`); }),
    ]);
  } catch (e) {
    await server.kill();
    throw e;
  }
  return server;
}

/** Is an external tool on PATH? Tests that need a missing tool are skipped, not failed. */
export function has(tool: string): boolean {
  return spawnSync('sh', ['-c', `command -v ${tool}`]).status === 0;
}

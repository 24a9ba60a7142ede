/**
 * A real Redis for lease tests, and a TCP proxy to partition one host from it.
 *
 * startRedis: `redis-server` on a Unix socket in a temp directory (no TCP port, no
 * persistence unless asked), teardown registered at once. restart() stops it and starts it
 * again on the same socket (data lost unless `keepData`, which SAVEs first); flushAll() is
 * FLUSHALL. Both are what "Redis lost the lease" looks like to baton.
 *
 * startTcpProxy: a tiny TCP proxy in Node on 127.0.0.1 (the OS picks a free port) that
 * forwards every connection to Redis's socket. Give one baton host `redis://127.0.0.1:PORT`
 * and the others the socket itself; then cut() partitions only that host:
 * - 'blackhole' (default): like a network that silently drops packets. Bytes in both
 *   directions are held, not delivered; new connections are accepted but not forwarded. On
 *   heal() the held bytes are delivered in order (TCP retransmits after a partition), so a
 *   command sent during the cut arrives late: the adversarial case for a lease.
 * - 'reset': every connection is reset and new ones are closed at once (a host whose
 *   connection is refused).
 */

import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as path from 'node:path';
import { Redis } from 'ioredis';
import { tempDir, type Teardown } from './server.js';

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** Is redis-server installed? Tests that need it are skipped, not failed. */
export function hasRedis(): boolean {
  return spawnSync('sh', ['-c', 'command -v redis-server']).status === 0;
}

export interface RedisServer {
  dir: string;
  socket: string;
  /** `unix:///DIR/redis.sock`, for `baton serve --redis`. */
  url: string;
  pid(): number | undefined;
  /** Run one command on a short-lived connection. */
  command(...args: (string | number)[]): Promise<unknown>;
  flushAll(): Promise<void>;
  /** Stop (SIGTERM, nothing saved) and start again on the same socket. */
  restart(o?: { keepData?: boolean; downMs?: number }): Promise<void>;
  /** Stop (SIGTERM); start() brings it back. */
  stop(): Promise<void>;
  start(): Promise<void>;
  /** Collected stdout+stderr of the current process. */
  output(): string;
}

export async function startRedis(t: Teardown): Promise<RedisServer> {
  const dir = tempDir(t, 'baton-redis-');
  const socket = path.join(dir, 'redis.sock');
  let proc: ChildProcess | null = null;
  let out = '';
  let exited: Promise<void> = Promise.resolve();

  const start = async (): Promise<void> => {
    out = '';
    const p = spawn('redis-server', [
      '--port', '0', '--unixsocket', socket, '--unixsocketperm', '700', '--dir', dir, '--dbfilename', 'dump.rdb',
      '--save', '', '--appendonly', 'no', '--daemonize', 'no', '--loglevel', 'warning',
    ], { stdio: ['ignore', 'pipe', 'pipe'] });
    p.stdout!.on('data', (d: Buffer) => { out += d.toString(); });
    p.stderr!.on('data', (d: Buffer) => { out += d.toString(); });
    proc = p;
    exited = new Promise((resolve) => p.once('exit', () => resolve()));
    const deadline = Date.now() + 10_000;
    for (;;) {
      if (p.exitCode !== null || p.signalCode !== null) throw new Error(`redis-server exited early: ${out}`);
      try {
        if (await command('PING') === 'PONG') return;
      } catch { /* not up yet */ }
      if (Date.now() > deadline) throw new Error(`redis-server did not answer on ${socket}: ${out}`);
      await sleep(20);
    }
  };

  const stop = async (): Promise<void> => {
    const p = proc;
    if (!p || p.exitCode !== null || p.signalCode !== null) return;
    p.kill('SIGTERM');
    const timer = setTimeout(() => p.kill('SIGKILL'), 5000);
    await exited;
    clearTimeout(timer);
  };

  const command = async (...args: (string | number)[]): Promise<unknown> => {
    const c = new Redis({ path: socket, lazyConnect: true, maxRetriesPerRequest: 0, enableOfflineQueue: false, retryStrategy: () => null, connectTimeout: 2000, commandTimeout: 5000 });
    c.on('error', () => {});
    try {
      await c.connect();
      return await c.call(String(args[0]), ...args.slice(1).map(String));
    } finally {
      c.disconnect();
    }
  };

  t.teardown(async () => {
    const p = proc;
    if (p && p.exitCode === null && p.signalCode === null) { p.kill('SIGKILL'); await exited; }
  });
  await start();
  return {
    dir,
    socket,
    url: `unix://${socket}`,
    pid: () => proc?.pid,
    command,
    flushAll: async () => { await command('FLUSHALL'); },
    restart: async (o = {}) => {
      if (o.keepData) await command('SAVE');
      else fs.rmSync(path.join(dir, 'dump.rdb'), { force: true });
      await stop();
      if (o.downMs) await sleep(o.downMs);
      await start();
    },
    stop,
    start,
    output: () => out,
  };
}

// ------------------------------------------------------------------ the partition proxy

export type CutMode = 'blackhole' | 'reset';

export interface TcpProxy {
  port: number;
  /** `redis://127.0.0.1:PORT`. */
  url: string;
  readonly isCut: boolean;
  /** Connections accepted so far. */
  readonly accepted: number;
  cut(mode?: CutMode): void;
  heal(): void;
  close(): Promise<void>;
}

interface Pair {
  client: net.Socket;
  upstream: net.Socket | null;
  /** Bytes held during a blackhole cut, per direction. */
  toUpstream: Buffer[];
  toClient: Buffer[];
}

/** A TCP proxy on 127.0.0.1 to `target` (a Unix socket path, or host and port). */
export async function startTcpProxy(t: Teardown, target: string | { host: string; port: number }): Promise<TcpProxy> {
  const pairs = new Set<Pair>();
  let mode: CutMode | null = null;
  let accepted = 0;

  const connectUpstream = (p: Pair): void => {
    const up = typeof target === 'string' ? net.connect(target) : net.connect(target.port, target.host);
    p.upstream = up;
    up.on('data', (d: Buffer) => {
      if (mode === 'blackhole') p.toClient.push(d);
      else if (!p.client.destroyed) p.client.write(d);
    });
    const end = (): void => { pairs.delete(p); p.client.destroy(); };
    up.on('error', end);
    up.on('close', end);
    for (const b of p.toUpstream.splice(0)) up.write(b);
  };

  const server = net.createServer((client) => {
    accepted++;
    if (mode === 'reset') { client.resetAndDestroy(); return; }
    client.setNoDelay(true);
    const p: Pair = { client, upstream: null, toUpstream: [], toClient: [] };
    pairs.add(p);
    client.on('data', (d: Buffer) => {
      if (mode === 'blackhole' || !p.upstream) p.toUpstream.push(d);
      else p.upstream.write(d);
    });
    const end = (): void => { pairs.delete(p); p.upstream?.destroy(); };
    client.on('error', end);
    client.on('close', end);
    if (mode === null) connectUpstream(p);
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => { server.off('error', reject); resolve(); });
  });
  const port = (server.address() as net.AddressInfo).port;

  const close = async (): Promise<void> => {
    for (const p of pairs) { p.client.destroy(); p.upstream?.destroy(); }
    pairs.clear();
    await new Promise<void>((resolve) => server.close(() => resolve()));
  };
  t.teardown(close);

  return {
    port,
    url: `redis://127.0.0.1:${port}`,
    get isCut() { return mode !== null; },
    get accepted() { return accepted; },
    cut: (m: CutMode = 'blackhole') => {
      mode = m;
      if (m === 'reset') {
        for (const p of pairs) { p.client.resetAndDestroy(); p.upstream?.destroy(); }
        pairs.clear();
      }
    },
    heal: () => {
      mode = null;
      for (const p of [...pairs]) {
        if (!p.upstream) { connectUpstream(p); continue; }
        for (const b of p.toUpstream.splice(0)) p.upstream.write(b);
        for (const b of p.toClient.splice(0)) if (!p.client.destroyed) p.client.write(b);
      }
    },
    close,
  };
}

/**
 * Real-kernel ext4 over baton without the kernel NBD module (notes/nbd-protocol.md §4.3):
 *   baton serve  ->  nbdfuse DIR URI (the export appears as the file DIR/nbd)
 *                ->  losetup -f --show DIR/nbd  ->  mkfs.ext4 / mount / e2fsck
 *
 * Every step registers its undo with t.teardown the moment it succeeded. AVA runs teardowns
 * in reverse order of registration, so after a failed assertion the filesystem is unmounted
 * first, then the loop device detached, then FUSE unmounted (and only then the server, whose
 * teardown was registered before all of these, is killed). Each undo is idempotent: the test
 * may already have done it explicitly.
 *
 * Also home to `run`, the small process runner the integration tests share.
 */

import { spawn, type ChildProcess } from 'node:child_process';
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import type { Teardown } from './server.js';

export interface RunResult {
  code: number | null;
  signal: NodeJS.Signals | null;
  stdout: string;
  stderr: string;
  /** stdout + stderr, for assertion messages. */
  output: string;
}

/** Run a command to completion (never throws for a non-zero exit); SIGKILL after timeoutMs. */
export function run(cmd: string, args: string[], opts: { timeoutMs?: number; env?: Record<string, string>; cwd?: string } = {}): Promise<RunResult> {
  return new Promise((resolve, reject) => {
    const p = spawn(cmd, args, { stdio: ['ignore', 'pipe', 'pipe'], cwd: opts.cwd, env: { ...process.env, ...opts.env } });
    let stdout = '';
    let stderr = '';
    p.stdout.on('data', (d: Buffer) => { stdout += d.toString(); });
    p.stderr.on('data', (d: Buffer) => { stderr += d.toString(); });
    const timer = setTimeout(() => {
      stderr += `\n[run: ${cmd} killed after ${opts.timeoutMs} ms]`;
      p.kill('SIGKILL');
    }, opts.timeoutMs ?? 60_000);
    p.once('error', (err) => { clearTimeout(timer); reject(err); });
    p.once('close', (code, signal) => {
      clearTimeout(timer);
      resolve({ code, signal, stdout, stderr, output: `${cmd} ${args.join(' ')}\n--- stdout\n${stdout}\n--- stderr\n${stderr}` });
    });
  });
}

/** Like run, but throws (with the output) unless the exit status is 0. */
export async function runOk(cmd: string, args: string[], opts: { timeoutMs?: number; env?: Record<string, string>; cwd?: string } = {}): Promise<RunResult> {
  const r = await run(cmd, args, opts);
  if (r.code !== 0) throw new Error(`command failed with status ${r.code ?? r.signal}: ${r.output}`);
  return r;
}

export function sha256(b: Buffer): string {
  return createHash('sha256').update(b).digest('hex');
}

export async function sha256File(file: string): Promise<string> {
  const h = createHash('sha256');
  for await (const chunk of fs.createReadStream(file)) h.update(chunk as Buffer);
  return h.digest('hex');
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

function alive(p: ChildProcess): boolean {
  return p.exitCode === null && p.signalCode === null;
}

// ------------------------------------------------------------------ nbdfuse

export interface FuseExport {
  dir: string;
  /** The export as a regular file: DIR/nbd. */
  file: string;
  proc: ChildProcess;
  stderr(): string;
  /** fusermount3 -u, then wait for nbdfuse to exit (it flushes and disconnects). Idempotent. */
  unmount(): Promise<void>;
}

function isMountpoint(dir: string): boolean {
  try {
    const want = path.resolve(dir);
    return fs.readFileSync('/proc/self/mountinfo', 'utf8').split('\n').some((l) => l.split(' ')[4] === want);
  } catch {
    return false;
  }
}

/** Start nbdfuse in its own session (setsid) on an empty directory; resolves when DIR/nbd exists. */
export async function startNbdfuse(t: Teardown, uri: string, dir: string, timeoutMs = 15_000): Promise<FuseExport> {
  const proc = spawn('nbdfuse', [dir, uri], { detached: true, stdio: ['ignore', 'ignore', 'pipe'] });
  let err = '';
  proc.stderr!.on('data', (d: Buffer) => { err += d.toString(); });
  const exited = new Promise<void>((resolve) => proc.once('exit', () => resolve()));
  const file = path.join(dir, 'nbd');
  let done = false;
  const unmount = async (): Promise<void> => {
    if (done) return;
    done = true;
    if (isMountpoint(dir)) {
      const r = await run('fusermount3', ['-u', dir], { timeoutMs: 20_000 });
      if (r.code !== 0) await run('fusermount3', ['-u', '-z', dir], { timeoutMs: 10_000 });
    }
    const deadline = Date.now() + 10_000;
    while (alive(proc) && Date.now() < deadline) await sleep(50);
    if (alive(proc)) { proc.kill('SIGKILL'); await exited; }
  };
  t.teardown(unmount);
  const deadline = Date.now() + timeoutMs;
  while (!fs.existsSync(file)) {
    if (!alive(proc)) throw new Error(`nbdfuse exited early (${proc.exitCode ?? proc.signalCode}): ${err}`);
    if (Date.now() > deadline) throw new Error(`nbdfuse did not create ${file} within ${timeoutMs} ms: ${err}`);
    await sleep(50);
  }
  return { dir, file, proc, stderr: () => err, unmount };
}

// ------------------------------------------------------------------ loop devices

export interface LoopDevice {
  dev: string;
  /** losetup -d. Idempotent. */
  detach(): Promise<void>;
}

export async function attachLoop(t: Teardown, file: string): Promise<LoopDevice> {
  const r = await runOk('losetup', ['-f', '--show', file], { timeoutMs: 20_000 });
  const dev = r.stdout.trim();
  if (!/^\/dev\/loop\d+$/.test(dev)) throw new Error(`losetup printed an unexpected device: ${JSON.stringify(r.stdout)}`);
  let done = false;
  const detach = async (): Promise<void> => {
    if (done) return;
    done = true;
    const d = await run('losetup', ['-d', dev], { timeoutMs: 20_000 });
    if (d.code !== 0) throw new Error(`losetup -d ${dev} failed: ${d.output}`);
  };
  t.teardown(detach);
  return { dev, detach };
}

// ------------------------------------------------------------------ mounts

export interface Mount {
  dir: string;
  /** umount (lazy as a last resort in teardown). Idempotent. */
  unmount(): Promise<void>;
}

export async function mountExt4(t: Teardown, dev: string, dir: string, options?: string): Promise<Mount> {
  await runOk('mount', ['-t', 'ext4', ...(options ? ['-o', options] : []), dev, dir], { timeoutMs: 30_000 });
  let done = false;
  const unmount = async (): Promise<void> => {
    if (done) return;
    done = true;
    if (!isMountpoint(dir)) return;
    const r = await run('umount', [dir], { timeoutMs: 60_000 });
    if (r.code !== 0) {
      await run('umount', ['-l', dir], { timeoutMs: 10_000 });
      throw new Error(`umount ${dir} failed (lazily unmounted instead): ${r.output}`);
    }
  };
  t.teardown(unmount);
  return { dir, unmount };
}

export { isMountpoint };

/** An export as a block device: nbdfuse file + loop device. */
export interface Stack {
  fuse: FuseExport;
  loop: LoopDevice;
}

/**
 * nbdfuse + loop for one export URI, checking the exported size; each layer's teardown is
 * registered as soon as it exists.
 */
export async function attachExport(t: Teardown, uri: string, fuseDir: string, size: number): Promise<Stack> {
  const fuse = await startNbdfuse(t, uri, fuseDir);
  const st = await fsp.stat(fuse.file);
  if (st.size !== size) throw new Error(`nbdfuse file for ${uri} has size ${st.size}, want ${size}`);
  const loop = await attachLoop(t, fuse.file);
  return { fuse, loop };
}

/** Unmount (if mounted), detach the loop device, unmount FUSE: the reverse of attachExport. */
export async function detachExport(s: Stack, mount?: Mount): Promise<void> {
  await mount?.unmount();
  await s.loop.detach();
  await s.fuse.unmount();
}

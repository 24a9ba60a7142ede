/**
 * The real Linux kernel NBD client (nbd.ko + nbd-client 3.24) in a small qemu VM, for hosts
 * whose kernel has no nbd module. The VM image is built by `scripts/vm/build.sh` (cached by a
 * stamp) and each scenario is one `scripts/vm/run.sh` (one VM boot, ~7-25 s under TCG).
 * Facts and design: shared notes `kernel-nbd-vm.md`.
 *
 * VMs are CPU-bound software emulation: run them one at a time (`test.serial`). Every qemu is
 * bounded by run.sh's wall-clock timeout, and killed with its process group when this process
 * exits, so a test never leaves one running.
 */

import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as os from 'node:os';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';

export type VmMode = 'netlink' | 'ioctl';
export type VmScenario = 'ext4' | 'readonly';

export interface VmScenarioOptions {
  /** Unix socket the NBD server already listens on (qemu connects when it starts). */
  socket: string;
  exportName: string;
  /** Connections (nbd-client -C); the server must advertise CAN_MULTI_CONN for more than 1. */
  conns: number;
  mode: VmMode;
  scenario: VmScenario;
  /**
   * Wall-clock limit for the whole VM run, seconds (run.sh kills qemu). Default 240: a run
   * takes ~20 s alone but over 100 s was seen on a 2-core host with a load of 10 (ava runs
   * two test files at once); a hang still ends.
   */
  timeoutSecs?: number;
  /** nbd-client -t inside the guest, seconds. Default 30. */
  nbdTimeoutSecs?: number;
  /**
   * Attach over TLS with this client directory (ca-cert.pem, client-cert.pem, client-key.pem;
   * run.sh --tls-dir). The server's certificate must name localhost.
   */
  tlsDir?: string;
}

export interface VmResult {
  /** The result file ended with `done` and had no `fail` line. */
  ok: boolean;
  /** The guest's step lines: `ok STEP [detail]`, `fail STEP detail`, `done`. */
  lines: string[];
  /** The guest's serial console (kernel messages, step output). */
  console: string;
  /** run.sh's exit status: 0 pass, 1 scenario failed, 124 wall-clock timeout, 2/3 setup. */
  exitCode: number;
  /** run.sh's stderr (its verdict, and the console tail on failure). */
  stderr: string;
  elapsedMs: number;
}

/** The repository root: the first ancestor of this module holding scripts/vm/run.sh (works from dist/ and from sources). */
function repoRoot(): string {
  let dir = path.dirname(fileURLToPath(import.meta.url));
  for (;;) {
    if (fs.existsSync(path.join(dir, 'scripts', 'vm', 'run.sh'))) return dir;
    const up = path.dirname(dir);
    if (up === dir) throw new Error('scripts/vm/run.sh not found above ' + fileURLToPath(import.meta.url));
    dir = up;
  }
}
const SCRIPTS = path.join(repoRoot(), 'scripts', 'vm');

function onPath(tool: string): boolean {
  return spawnSync('sh', ['-c', `command -v "$1"`, 'sh', tool], { stdio: 'ignore' }).status === 0;
}

/** Host tools the VM needs (qemu, and what build.sh copies into the guest). The kernel itself is checked by buildVm(). */
export const VM_TOOLS = ['qemu-system-x86_64', 'busybox', 'socat', 'nbd-client', 'mke2fs', 'e2fsck', 'cpio', 'xz', 'dpkg-deb'];

export function missingVmTools(): string[] {
  return VM_TOOLS.filter((tool) => !onPath(tool) && !fs.existsSync(`/usr/sbin/${tool}`) && !fs.existsSync(`/sbin/${tool}`));
}

export function hasVmTools(): boolean {
  return missingVmTools().length === 0;
}

/** $BATON_VM_CACHE, else /var/cache/baton-vm when it can be written, else a per-user temp dir. */
export function vmCacheDir(): string {
  const env = process.env['BATON_VM_CACHE'];
  if (env) return env;
  for (const dir of ['/var/cache/baton-vm', path.join(os.tmpdir(), `baton-vm-${process.getuid?.() ?? 'user'}`)]) {
    try {
      fs.mkdirSync(dir, { recursive: true });
      fs.accessSync(dir, fs.constants.W_OK);
      return dir;
    } catch {
      // not writable: try the next one
    }
  }
  throw new Error('no writable VM cache directory; set BATON_VM_CACHE');
}

/** Children still running, killed (whole process group) if this process exits first. */
const live = new Set<ChildProcess>();
process.once('exit', () => {
  for (const child of live) {
    try {
      if (child.pid !== undefined) process.kill(-child.pid, 'SIGKILL');
    } catch {
      // already gone
    }
  }
});

interface Ran {
  code: number;
  stdout: string;
  stderr: string;
  elapsedMs: number;
}

/** Runs a script in its own process group (detached) so the group can be killed at exit. */
function runScript(args: string[], env: NodeJS.ProcessEnv): Promise<Ran> {
  const started = Date.now();
  return new Promise((resolve, reject) => {
    const child = spawn('bash', args, { stdio: ['ignore', 'pipe', 'pipe'], detached: true, env });
    live.add(child);
    let stdout = '';
    let stderr = '';
    child.stdout!.on('data', (d: Buffer) => { stdout += d.toString(); });
    child.stderr!.on('data', (d: Buffer) => { stderr += d.toString(); });
    child.once('error', (err) => { live.delete(child); reject(err); });
    child.once('close', (code, signal) => {
      live.delete(child);
      resolve({ code: code ?? (signal ? 128 : -1), stdout, stderr, elapsedMs: Date.now() - started });
    });
  });
}

/** build.sh exit 3: the kernel package cannot be had on this machine (offline, no apt lists). Tests skip on it. */
export class VmUnavailableError extends Error {
  override name = 'VmUnavailableError';
}

let built: Promise<string> | undefined;

/**
 * Builds (or finds up to date) the VM kernel + initramfs, once per process. Resolves to the
 * cache directory. Rejects with VmUnavailableError when the kernel cannot be had (callers
 * skip), and with a plain Error for any other build failure (callers fail).
 */
export function buildVm(): Promise<string> {
  built ??= (async () => {
    const dir = vmCacheDir();
    const r = await runScript([path.join(SCRIPTS, 'build.sh'), dir], process.env);
    const message = `scripts/vm/build.sh ${dir} failed (exit ${r.code}):\n${r.stderr.trim()}`;
    if (r.code === 3) throw new VmUnavailableError(message);
    if (r.code !== 0) throw new Error(message);
    return dir;
  })();
  return built;
}

/** Boots one VM running `scenario` against the server on `socket`; resolves when qemu is gone. */
export async function runVmScenario(opts: VmScenarioOptions): Promise<VmResult> {
  const vmDir = await buildVm();
  const work = await fsp.mkdtemp(path.join(os.tmpdir(), 'baton-vm-run-'));
  try {
    const out = path.join(work, 'result');
    const consoleFile = path.join(work, 'console');
    const args = [
      path.join(SCRIPTS, 'run.sh'),
      '--socket', opts.socket,
      '--export', opts.exportName,
      '--conns', String(opts.conns),
      '--mode', opts.mode,
      '--scenario', opts.scenario,
      '--out', out,
      '--console', consoleFile,
      '--timeout', String(opts.timeoutSecs ?? 240),
      '--nbd-timeout', String(opts.nbdTimeoutSecs ?? 30),
      '--vm-dir', vmDir,
      '--no-build', // buildVm() above has just checked the stamp
      ...(opts.tlsDir ? ['--tls-dir', opts.tlsDir] : []),
    ];
    const r = await runScript(args, process.env);
    const read = (f: string): string => (fs.existsSync(f) ? fs.readFileSync(f, 'utf8') : '');
    const lines = read(out).split('\n').map((l) => l.trim()).filter((l) => l !== '');
    const ok = r.code === 0 && lines.at(-1) === 'done' && !lines.some((l) => l.startsWith('fail'));
    return { ok, lines, console: read(consoleFile), exitCode: r.code, stderr: r.stderr, elapsedMs: r.elapsedMs };
  } finally {
    await fsp.rm(work, { recursive: true, force: true });
  }
}

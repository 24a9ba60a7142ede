/**
 * "The seed's workspace": the fixtures of test/integration/seed-scenario.test.ts, shared with
 * bench/workspace-forks.ts. Built outside any volume, then cloned / installed onto one:
 *
 * - makeSourceRepo: a git repository of a few hundred files (text and binary) with 3 commits
 *   (initial; edits and additions; deletions and a rename), to `git clone` onto a volume;
 * - makeNpmProject: three packages packed with `npm pack`, a project depending on their tarballs
 *   (file:vendor/...), its lockfile, and a reference `npm ci --offline` install;
 * - npmEnv: npm's environment for all of that, fully offline (the registry is a closed loopback
 *   port: any registry request fails the command instead of leaving the machine);
 * - git / GIT: git with a fixed identity and no background gc.
 */

import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as fsp from 'node:fs/promises';
import * as path from 'node:path';
import { runOk } from './ext4.js';
import { randInt } from './writer.js';

/** `git` options for every call: identity, branch name, any owner, no automatic gc. */
export const GIT = ['-c', 'user.name=baton test', '-c', 'user.email=baton@example.invalid', '-c', 'init.defaultBranch=main', '-c', 'safe.directory=*', '-c', 'gc.auto=0'];

/** The packages makeNpmProject packs; the last one has a bin (`baton-seed-c` prints "baton-seed-c ok"). */
export const PACKAGES = ['baton-seed-a', 'baton-seed-b', 'baton-seed-c'];

export function npmEnv(work: string): Record<string, string> {
  const userconfig = path.join(work, 'npmrc');
  if (!fs.existsSync(userconfig)) fs.writeFileSync(userconfig, '');
  return {
    // A closed loopback port: any registry request fails the command instead of leaving the machine.
    npm_config_registry: 'http://127.0.0.1:9/',
    npm_config_offline: 'true',
    npm_config_audit: 'false',
    npm_config_fund: 'false',
    npm_config_update_notifier: 'false',
    npm_config_cache: path.join(work, 'npm-cache'),
    npm_config_userconfig: userconfig,
    npm_config_loglevel: 'warn',
  };
}

/** `git GIT... ARGS` (in cwd if given); throws unless it exits 0; resolves with its stdout. */
export async function git(args: string[], cwd?: string, timeoutMs = 120_000): Promise<string> {
  return (await runOk('git', [...GIT, ...args], { timeoutMs, ...(cwd ? { cwd } : {}) })).stdout;
}

/** A repository with a few hundred files and 3 commits, outside the volume. */
export async function makeSourceRepo(dir: string, rng: () => number): Promise<void> {
  await git(['init', '-q', dir]);
  const file = (d: number, i: number): string => path.join(dir, `pkg${d}`, i % 3 === 0 ? 'data' : 'src', `f${i}.${i % 3 === 0 ? 'bin' : 'txt'}`);
  const content = (d: number, i: number, v: number): Buffer => i % 3 === 0
    ? randomBytes(randInt(rng, 64, 24 * 1024))
    : Buffer.from(`// pkg${d} file ${i} version ${v}\n${'line of text '.repeat(randInt(rng, 1, 400))}\n`);
  for (let d = 0; d < 12; d++) {
    for (let i = 0; i < 26; i++) {
      await fsp.mkdir(path.dirname(file(d, i)), { recursive: true });
      await fsp.writeFile(file(d, i), content(d, i, 1));
    }
  }
  await git(['-C', dir, 'add', '-A']);
  await git(['-C', dir, 'commit', '-q', '-m', 'initial: 312 files']);
  for (let d = 0; d < 12; d += 3) for (let i = 1; i < 26; i += 2) await fsp.writeFile(file(d, i), content(d, i, 2));
  for (let n = 0; n < 20; n++) {
    const p = path.join(dir, 'extra', `new${n}.txt`);
    await fsp.mkdir(path.dirname(p), { recursive: true });
    await fsp.writeFile(p, `extra ${n}\n`);
  }
  await git(['-C', dir, 'add', '-A']);
  await git(['-C', dir, 'commit', '-q', '-m', 'second: edits and additions']);
  for (let n = 0; n < 10; n++) await fsp.rm(path.join(dir, 'extra', `new${n}.txt`));
  await git(['-C', dir, 'mv', 'pkg1', 'renamed1']);
  await git(['-C', dir, 'add', '-A']);
  await git(['-C', dir, 'commit', '-q', '-m', 'third: deletions and a rename']);
}

/**
 * Three packages packed with `npm pack`, a project that depends on their tarballs
 * (file:vendor/...), its lockfile, and a reference `npm ci --offline` install to compare with.
 */
export async function makeNpmProject(work: string): Promise<{ app: string; reference: string }> {
  const env = npmEnv(work);
  const vendor = path.join(work, 'app', 'vendor');
  await fsp.mkdir(vendor, { recursive: true });
  for (const [k, name] of PACKAGES.entries()) {
    const dir = path.join(work, 'pkgs', name);
    await fsp.mkdir(path.join(dir, 'lib'), { recursive: true });
    const pkg: Record<string, unknown> = { name, version: '1.0.0', description: 'baton seed fixture', main: 'index.js', license: 'MIT' };
    const files: string[] = [];
    for (let i = 0; i < 40; i++) {
      await fsp.writeFile(path.join(dir, 'lib', `m${i}.js`), `module.exports = ${JSON.stringify(`${name}/${i}:` + randomBytes(600 + 37 * i).toString('base64'))};\n`);
      files.push(`./lib/m${i}.js`);
    }
    await fsp.writeFile(path.join(dir, 'index.js'),
      `const { createHash } = require('crypto');\nconst h = createHash('sha256');\n${files.map((f) => `h.update(require(${JSON.stringify(f)}));`).join('\n')}\nmodule.exports = { name: ${JSON.stringify(name)}, sum: h.digest('hex') };\n`);
    if (k === 2) {
      pkg.bin = { [name]: 'bin/cli.js' };
      await fsp.mkdir(path.join(dir, 'bin'));
      await fsp.writeFile(path.join(dir, 'bin', 'cli.js'), `#!/usr/bin/env node\nconsole.log(require('..').name + ' ok');\n`, { mode: 0o755 });
    }
    await fsp.writeFile(path.join(dir, 'package.json'), JSON.stringify(pkg, null, 2) + '\n');
  }
  await runOk('npm', ['pack', ...PACKAGES.map((n) => `./pkgs/${n}`), '--pack-destination', vendor], { cwd: work, env, timeoutMs: 120_000 });
  const app = path.join(work, 'app');
  const deps = Object.fromEntries(PACKAGES.map((n) => [n, `file:vendor/${n}-1.0.0.tgz`]));
  await fsp.writeFile(path.join(app, 'package.json'), JSON.stringify({ name: 'baton-seed-app', version: '1.0.0', private: true, dependencies: deps }, null, 2) + '\n');
  await runOk('npm', ['install', '--package-lock-only', '--offline', '--ignore-scripts'], { cwd: app, env, timeoutMs: 120_000 });
  const reference = path.join(work, 'reference');
  await fsp.cp(app, reference, { recursive: true });
  await runOk('npm', ['ci', '--offline', '--ignore-scripts'], { cwd: reference, env, timeoutMs: 120_000 });
  return { app, reference };
}

/**
 * A bigger npm project for benchmarks: `packages` packages (default 340) of `files` files each
 * (default 28: about 10,000 files in node_modules with package.json and index.js), file sizes
 * from 100 B to 64 KiB, most of them small (log-uniform, as in a real node_modules), packed with
 * `npm pack` and locked like makeNpmProject's. Returns the project directory (not installed).
 */
export async function makeManyPackagesProject(work: string, rng: () => number, packages = 340, files = 28): Promise<{ app: string; files: number; bytes: number }> {
  const env = npmEnv(work);
  const root = path.join(work, 'bulk');
  const vendor = path.join(root, 'app', 'vendor');
  await fsp.mkdir(vendor, { recursive: true });
  const names: string[] = [];
  let count = 0;
  let bytes = 0;
  for (let p = 0; p < packages; p++) {
    const name = `baton-bulk-${String(p).padStart(3, '0')}`;
    names.push(name);
    const dir = path.join(root, 'pkgs', name);
    await fsp.mkdir(path.join(dir, 'lib'), { recursive: true });
    await fsp.writeFile(path.join(dir, 'package.json'), JSON.stringify({ name, version: '1.0.0', description: 'baton bench fixture', main: 'index.js', license: 'MIT' }, null, 2) + '\n');
    await fsp.writeFile(path.join(dir, 'index.js'), `module.exports = ${JSON.stringify(name)};\n`);
    count += 2;
    for (let f = 0; f < files; f++) {
      const size = Math.floor(100 * Math.exp(rng() * Math.log(65536 / 100)));
      const body = `// ${name} m${f}\nmodule.exports = ${JSON.stringify(randomBytes(Math.ceil((size * 3) / 4)).toString('base64'))};\n`;
      await fsp.writeFile(path.join(dir, 'lib', `m${f}.js`), body);
      count++;
      bytes += body.length;
    }
  }
  // One npm process packs them all (a process per package took minutes).
  for (let i = 0; i < names.length; i += 100) {
    await runOk('npm', ['pack', ...names.slice(i, i + 100).map((n) => `./pkgs/${n}`), '--pack-destination', vendor], { cwd: root, env, timeoutMs: 600_000 });
  }
  const app = path.join(root, 'app');
  const deps = Object.fromEntries(names.map((n) => [n, `file:vendor/${n}-1.0.0.tgz`]));
  await fsp.writeFile(path.join(app, 'package.json'), JSON.stringify({ name: 'baton-bulk-app', version: '1.0.0', private: true, dependencies: deps }, null, 2) + '\n');
  await runOk('npm', ['install', '--package-lock-only', '--offline', '--ignore-scripts'], { cwd: app, env, timeoutMs: 600_000 });
  return { app, files: count, bytes };
}

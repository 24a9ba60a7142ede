/**
 * An agent's day with baton's API: create a workspace, serve it, fork three attempts, keep
 * the one that worked as THE workspace, remove the others. README.md, "Embedding baton",
 * shows this file; the test suite runs it (test/integration/api.test.ts) and type-checks it
 * against the published types (examples/tsconfig.json).
 *
 *   node dist/examples/workspace.js [STORE]     # default: a new file: store in a temp dir
 *
 * The attempts' "agents" here are nbdcopy runs writing through NBD; yours would be VMs or
 * containers attaching server.uri(name) with qemu, nbd-client or nbdfuse.
 */

import { execFile } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { promisify } from 'node:util';
import { isBatonError, openDeployment } from 'baton';

const run = promisify(execFile); // the server runs in this process: never block its event loop

const MiB = 1024 * 1024;
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-example-'));
const store = process.argv[2] ?? `file:${path.join(tmp, 'store')}`;

// The same settings the CLI takes (and the same environment variables: BATON_STORE,
// BATON_REDIS_URL, BATON_HOST_ID...). Nothing is contacted yet.
const baton = await openDeployment({ store, hostId: 'example-host', log: process.env.BATON_LOG_LEVEL ?? 'silent', cacheDir: path.join(tmp, 'cache') });

// 1. The workspace.
await baton.create('work', { size: 64 * MiB });

// 2. Serve every volume over NBD from this process, on a Unix socket.
const server = await baton.serve({ listen: { path: path.join(tmp, 'nbd.sock') }, idleGraceMs: 1000 });
server.on('attached', (e) => console.log(`attached ${e.volume} (${e.connections} connection(s))`));
server.on('flushed', (e) => console.log(`flushed ${e.volume}: log record ${e.seq}, ${e.bytes} bytes to the store`));

/** An "agent" writes `fill` into the first MiB of a volume, through NBD, and flushes. */
async function agent(volume: string, fill: number): Promise<Buffer> {
  const data = Buffer.alloc(MiB, fill);
  const file = path.join(tmp, `${volume}.bin`);
  fs.writeFileSync(file, data);
  await run('nbdcopy', ['--flush', file, server.uri(volume)]);
  return data;
}

async function readBack(volume: string): Promise<Buffer> {
  const file = path.join(tmp, `${volume}.out`);
  await run('nbdcopy', [server.uri(volume), file]);
  return fs.readFileSync(file).subarray(0, MiB);
}

try {
  await agent('work', 0x30); // the workspace's starting point

  // 3. Three attempts, each an O(1) copy-on-write fork of the workspace's last flush.
  const attempts = ['try-1', 'try-2', 'try-3'];
  const results = new Map<string, Buffer>();
  for (const [i, name] of attempts.entries()) {
    await baton.fork('work', name);
    results.set(name, await agent(name, 0x31 + i));
  }
  console.log(await baton.diff('work', 'try-2').then((d) => `try-2 differs from work in ${d.differentBytes} bytes`));

  // 4. try-2 worked: make it THE workspace. Renaming needs the two volumes closed here (the
  //    agents are gone; release() does now what the idle grace would do a second later).
  const keep = 'try-2';
  await server.release(keep);
  await server.release('work');
  await baton.rename(keep, 'work', {
    replace: true,
    onProgress: (p) => console.log(`rename: ${p.phase}`),
  });

  // 5. The other attempts go. (Their data that the workspace shares stays in the store.)
  for (const name of attempts.filter((n) => n !== keep)) {
    await server.release(name);
    await baton.rm(name);
  }

  const names = (await baton.list({ accounting: false })).map((v) => v.name);
  console.log(`volumes now: ${names.join(', ')}`);
  if (names.join(',') !== 'work') throw new Error(`expected only work, found ${names.join(', ')}`);
  if (!(await readBack('work')).equals(results.get(keep)!)) throw new Error('work does not hold what try-2 wrote');
  console.log('work now holds what try-2 wrote');

  // Errors are typed, with stable codes:
  try {
    await baton.rename('work', 'work');
  } catch (err) {
    if (!isBatonError(err, 'BATON_ERR_INVALID_ARGUMENT')) throw err;
    console.log(`refused as expected: ${err.code}`);
  }
} finally {
  await server.close();
  await baton.close();
  fs.rmSync(tmp, { recursive: true, force: true });
}

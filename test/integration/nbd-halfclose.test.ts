/**
 * A real libnbd client (python3-libnbd) against a real `baton serve`: WRITE, READ and FLUSH
 * in flight, then nbd_shutdown, which sends DISC and shuts down the client's write side.
 * Every command must complete successfully: before the server's sockets were half-open
 * capable, Node closed our sending side when the client's FIN arrived and libnbd reported
 * the flush, which had run, as failed (ENOTCONN) (issue 17.9).
 *
 * Also `serve --max-connections` end to end (issue 9.8): a client past the limit is told why
 * (qemu prints the server's message), and the attached one keeps working.
 */

import test from 'ava';
import { spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { run } from '../helpers/ext4.js';
import { RawClient } from '../helpers/nbd-raw.js';
import { has, startBatonServer, tempDir } from '../helpers/server.js';

const MiB = 1024 * 1024;

// Debian's python3-libnbd is for the system interpreter, which may not be first on PATH.
const PYTHON = ['/usr/bin/python3', 'python3'].find((p) => spawnSync(p, ['-c', 'import nbd'], { stdio: 'ignore' }).status === 0);

const SCRIPT = `
import nbd, sys
h = nbd.NBD()
h.connect_uri(sys.argv[1])
cw = h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(b'\\x5a' * 65536)), 0)
cr = h.aio_pread(nbd.Buffer(4096), 0)
cf = h.aio_flush()
h.shutdown()  # NBD_CMD_DISC after the pending commands, then shutdown(SHUT_WR)
while h.aio_in_flight() > 0:
    h.poll(-1)
for name, c in (("write", cw), ("read", cr), ("flush", cf)):
    try:
        print(name, "ok" if h.aio_command_completed(c) else "not completed")
    except nbd.Error as e:
        print(name, "FAILED", e)
h2 = nbd.NBD()
h2.connect_uri(sys.argv[1])
print("readback", "ok" if h2.pread(65536, 0) == b'\\x5a' * 65536 else "wrong")
h2.shutdown()
`;

(PYTHON ? test : test.skip)('libnbd: WRITE, READ, FLUSH in flight, then DISC and a half-close: every command succeeds', async (t) => {
  const server = await startBatonServer(t, { volumes: [{ name: 'v', size: 64 * MiB }] });
  const dir = tempDir(t);
  const script = path.join(dir, 'halfclose.py');
  fs.writeFileSync(script, SCRIPT);
  for (let i = 0; i < 3; i++) {
    const r = await run(PYTHON!, [script, server.uri('v')], { timeoutMs: 60_000 });
    t.is(r.code, 0, r.output);
    t.deepEqual(r.stdout.trim().split('\n'), ['write ok', 'read ok', 'flush ok', 'readback ok'], `run ${i}: ${r.output}`);
  }
});

(has('qemu-io') ? test : test.skip)('serve --max-connections 1: a second client is refused with a message that names the limit; the first keeps working', async (t) => {
  const server = await startBatonServer(t, { volumes: [{ name: 'v', size: 64 * MiB }], extraArgs: ['--max-connections', '1'] });
  const first = await RawClient.connect(server.socket);
  t.teardown(() => first.destroy());
  await first.handshakeGo('v');
  const r = await run('qemu-io', ['-f', 'raw', '-c', 'read 0 512', server.uri('v')], { timeoutMs: 60_000 });
  t.not(r.code, 0, r.output);
  t.regex(r.output, /connection limit \(1 connections\)/, r.output);
  const read = await first.readAt(1n, 0n, 4096);
  t.is(read.reply.error, 0);
  t.regex(server.stderr(), /at the connection limit/);
});

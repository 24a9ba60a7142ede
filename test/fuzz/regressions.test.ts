/**
 * Server bugs the protocol fuzzer found, each as a hand-written case and as the fuzz input
 * that found it (replayed through the fuzzer, so the oracle that caught it still judges it).
 */

import test from 'ava';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import type { ExportHandle, ExportProvider, ExportSummary } from '../../nbd/backend.js';
import { NbdServer } from '../../nbd/server.js';
import { MemoryBackend } from '../../src/backends/memory.js';
import { NotFoundError } from '../../src/errors.js';
import { silentLogger } from '../../src/log.js';
import { metaData } from '../fixtures/nbd-vectors.js';
import { RawClient, clientFlagsFrame, requestFrame } from '../helpers/nbd-raw.js';
import { fileURLToPath } from 'node:url';
import { formatFailure, runFuzz, type RecordedInput } from './fuzzer.js';

const MiB = 1024 * 1024;
const OPT_EXPORT_NAME = 1;
const OPT_STRUCTURED_REPLY = 8;
const OPT_SET_META_CONTEXT = 10;
const REP_ACK = 1;
const REP_META_CONTEXT = 4;
const CMD_BLOCK_STATUS = 7;
const STRUCTURED_MAGIC = 0x668e33ef;
const CHUNK_ERROR = 0x8001;
const CHUNK_BLOCK_STATUS = 5;
const EINVAL = 22;

class TwoExports implements ExportProvider {
  private readonly backends = new Map([['a', new MemoryBackend(MiB)], ['b', new MemoryBackend(MiB)]]);
  async list(): Promise<ExportSummary[]> { return [...this.backends.keys()].map((name) => ({ name, description: '' })); }
  async open(name: string): Promise<ExportHandle> {
    const backend = this.backends.get(name);
    if (!backend) throw new NotFoundError(`no export ${name}`);
    return { name, description: '', backend, release: () => {} };
  }
}

/** STRUCTURED_REPLY, SET_META_CONTEXT(metaFor, base:allocation), EXPORT_NAME(attach), then one BLOCK_STATUS: its first chunk. */
async function blockStatusAfterExportName(metaFor: string, attach: string): Promise<{ type: number; payload: Buffer }> {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-fuzz-reg-'));
  const sock = path.join(dir, 'nbd.sock');
  const server = new NbdServer(new TwoExports(), { log: silentLogger() });
  await server.listen({ path: sock });
  const c = await RawClient.connect(sock);
  try {
    await c.greeting();
    await c.write(clientFlagsFrame(0x3));
    const sr = await c.option(OPT_STRUCTURED_REPLY);
    if (sr[0]!.type !== REP_ACK) throw new Error('STRUCTURED_REPLY refused');
    const sm = await c.option(OPT_SET_META_CONTEXT, metaData(metaFor, ['base:allocation']));
    if (sm.map((r) => r.type).join() !== [REP_META_CONTEXT, REP_ACK].join()) throw new Error('base:allocation not selected');
    await c.write(Buffer.concat([Buffer.from('IHAVEOPT'), Buffer.from([0, 0, 0, OPT_EXPORT_NAME]), Buffer.from([0, 0, 0, attach.length]), Buffer.from(attach)]));
    await c.read(10); // size + flags (NO_ZEROES on both sides)
    await c.write(requestFrame({ type: CMD_BLOCK_STATUS, cookie: 7n, offset: 0n, length: 4096 }));
    const h = await c.read(20);
    if (h.readUInt32BE(0) !== STRUCTURED_MAGIC) throw new Error('not a structured reply');
    return { type: h.readUInt16BE(6), payload: await c.read(h.readUInt32BE(16)) };
  } finally {
    c.destroy();
    await server.close();
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

test('fuzz finding 1: a meta context selected for one export does not carry over to EXPORT_NAME of another (BLOCK_STATUS gets EINVAL)', async (t) => {
  const other = await blockStatusAfterExportName('a', 'b');
  t.is(other.type, CHUNK_ERROR, `BLOCK_STATUS on b after SET_META_CONTEXT for a: chunk type 0x${other.type.toString(16)}`);
  t.is(other.payload.readUInt32BE(0), EINVAL);
  // The same export still works, as with GO.
  const same = await blockStatusAfterExportName('b', 'b');
  t.is(same.type, CHUNK_BLOCK_STATUS);
});

/** Findings as recorded (`npm run fuzz -- --seed S --dump I --save FILE`): they stay the same input when the generator changes. */
const found = path.join(path.dirname(fileURLToPath(import.meta.url)), '..', '..', '..', 'test', 'fuzz', 'found');

test('fuzz finding 1, as found: seed 5, input 3434 (SET_META_CONTEXT fz2, EXPORT_NAME ro@s, BLOCK_STATUS)', async (t) => {
  const recorded = JSON.parse(fs.readFileSync(path.join(found, 'seed5-input3434-export-name-meta-context.json'), 'utf8')) as RecordedInput;
  const report = await runFuzz({ seed: recorded.seed, inputs: recorded.index + 1, lanes: recorded.lanes, recorded, victim: false });
  t.is(report.inputs, 1);
  t.deepEqual(report.failures.map(formatFailure), []);
});

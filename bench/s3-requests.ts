/**
 * What a GET and a PUT cost baton's event loop: S3ObjectStore.get and .put (signed by baton,
 * sent with node's http: src/store/sigv4.ts) against the same requests through the AWS SDK's
 * GetObjectCommand and PutObjectCommand on the same store's client (what S3ObjectStore did
 * before), on radosgw (scripts/rgw.sh). The two sides alternate ROUNDS times; each side's CPU
 * (this process: user + system) per request and its wall time are reported as medians. The
 * store's own CPU (radosgw) is not counted: it is the same for both.
 *
 * - GET: ranged GETs of SIZES, 8 in flight.
 * - PUT: create-only PUTs (If-None-Match, a put id in the metadata, as every log record and
 *   segment is put) of PUT_SIZES, 8 in flight; and one 4 KiB PUT at a time, whose latency is a
 *   small FLUSH's round trip (p50 and p99 reported).
 *
 * Knobs: ROUNDS (5), COUNT (400 requests per side, size and round; PUTs of big bodies fewer:
 * 256 MiB per side and round at most), SIZES (4K,64K,580K,2M: the range asked of each object;
 * 580 KiB is a typical hydration GET of the seed's workspace), PUT_SIZES (4K,64K,8M: a small
 * log record, a bigger one, a segment).
 * Results: bench/results/s3-requests.md and .json. Run: `node dist/bench/s3-requests.js` (about two minutes).
 */
import { randomBytes } from 'node:crypto';
import * as path from 'node:path';
import { GetObjectCommand, PutObjectCommand } from '@aws-sdk/client-s3';
import { S3ObjectStore } from '../src/store/s3.js';
import { envNumber, fmt, machineInfo, makeTempDir, markdownTable, median, quantile, startRgwBucket, writeResults } from './lib.js';

const ROUNDS = Math.max(1, Math.floor(envNumber('ROUNDS', 5)));
const COUNT = Math.max(8, Math.floor(envNumber('COUNT', 400)));
const sizes = (v: string): number[] => v.split(',').map((s) => {
  const m = /^(\d+)([KM]?)$/i.exec(s.trim());
  if (m === null) throw new Error(`cannot read the size ${s}`);
  return Number(m[1]) * (m[2]!.toUpperCase() === 'K' ? 1024 : m[2]!.toUpperCase() === 'M' ? 1024 * 1024 : 1);
});
const SIZES = sizes(process.env.SIZES ?? '4K,64K,580K,2M');
const PUT_SIZES = sizes(process.env.PUT_SIZES ?? '4K,64K,8M');
const IN_FLIGHT = 8;
const OBJECTS = 64;
const PUT_BYTES_PER_RUN = 256 * 1024 * 1024;

interface Side { cpuUsPerReq: number[]; mibPerS: number[]; latMs: number[] }
type Who = 'sdk' | 'baton';

const sizeName = (size: number): string => (size >= 1024 * 1024 ? `${size / 1024 / 1024} MiB` : `${size / 1024} KiB`);

/** Each side's runs, alternating (a warm-up run of each first, not counted). */
async function compare(count: number, inFlight: number, bytesPerReq: number, req: Record<Who, (i: number) => Promise<void>>): Promise<Record<Who, Side>> {
  const sides: Record<Who, Side> = { sdk: { cpuUsPerReq: [], mibPerS: [], latMs: [] }, baton: { cpuUsPerReq: [], mibPerS: [], latMs: [] } };
  const run = async (fn: (i: number) => Promise<void>, side: Side): Promise<void> => {
    let next = 0;
    const c0 = process.cpuUsage();
    const t0 = performance.now();
    await Promise.all(Array.from({ length: inFlight }, async () => {
      while (next < count) {
        const i = next++;
        const s = performance.now();
        await fn(i);
        side.latMs.push(performance.now() - s);
      }
    }));
    const c = process.cpuUsage(c0);
    side.cpuUsPerReq.push((c.user + c.system) / count);
    side.mibPerS.push((count * bytesPerReq) / (1024 * 1024) / ((performance.now() - t0) / 1000));
  };
  await run(req.baton, { cpuUsPerReq: [], mibPerS: [], latMs: [] }); // warm both paths' connections
  await run(req.sdk, { cpuUsPerReq: [], mibPerS: [], latMs: [] });
  for (let r = 0; r < ROUNDS; r++) {
    const order: Who[] = r % 2 === 0 ? ['sdk', 'baton'] : ['baton', 'sdk'];
    for (const o of order) await run(req[o], sides[o]);
  }
  return sides;
}

async function main(): Promise<void> {
  const machine = machineInfo();
  const root = makeTempDir('baton-bench-s3-requests-');
  const { rgw, version } = await startRgwBucket(path.join(root, 'rgw'), 'bench');
  const prefix = 's3-requests';
  const store = new S3ObjectStore({ bucket: 'bench', prefix, endpoint: rgw.endpoint, credentials: { accessKeyId: rgw.env.AWS_ACCESS_KEY_ID!, secretAccessKey: rgw.env.AWS_SECRET_ACCESS_KEY! } });
  const getRows: string[][] = [];
  const putRows: string[][] = [];
  let qd1: string[] | null = null;
  const json: unknown[] = [];
  const row = (what: string, s: Record<Who, Side>): string[] => {
    const sdkCpu = median(s.sdk.cpuUsPerReq), batonCpu = median(s.baton.cpuUsPerReq);
    return [what, fmt(sdkCpu), fmt(batonCpu), `${(batonCpu / sdkCpu).toFixed(2)}×`, fmt(median(s.sdk.mibPerS)), fmt(median(s.baton.mibPerS))];
  };
  try {
    for (const size of SIZES) {
      // Objects a little bigger than the range, so the GET is a real ranged one (206).
      const body = randomBytes(size + 4096);
      await Promise.all(Array.from({ length: OBJECTS }, (_, i) => store.put(`o${size}-${i}`, body)));
      const want = body.subarray(100, 100 + size);
      const check = (i: number, b: Buffer): void => { if (b.length !== size || (i % 16 === 0 && !b.equals(want))) throw new Error(`GET ${i}: wrong bytes`); };
      const s = await compare(COUNT, IN_FLIGHT, size, {
        sdk: async (i) => {
          const res = await store.client.send(new GetObjectCommand({ Bucket: 'bench', Key: `${prefix}/o${size}-${i % OBJECTS}`, Range: `bytes=100-${100 + size - 1}` }));
          const a = await res.Body!.transformToByteArray();
          check(i, Buffer.from(a.buffer, a.byteOffset, a.byteLength));
        },
        baton: async (i) => check(i, await store.get(`o${size}-${i % OBJECTS}`, { offset: 100, length: size })),
      });
      getRows.push(row(sizeName(size), s));
      json.push({ op: 'get', size, sides: s });
      console.log(`GET ${getRows[getRows.length - 1]!.join(' | ')}`);
    }
    let n = 0;
    const putBoth = (body: Buffer): Record<Who, (i: number) => Promise<void>> => ({
      sdk: async () => {
        await store.client.send(new PutObjectCommand({ Bucket: 'bench', Key: `${prefix}/p${n++}`, Body: body, ContentLength: body.length, IfNoneMatch: '*', Metadata: { 'baton-put-id': randomBytes(8).toString('hex') } }));
      },
      baton: async () => { await store.put(`p${n++}`, body, { ifNoneMatch: true }); },
    });
    for (const size of PUT_SIZES) {
      const count = Math.max(16, Math.min(COUNT, Math.floor(PUT_BYTES_PER_RUN / size)));
      const s = await compare(count, IN_FLIGHT, size, putBoth(randomBytes(size)));
      putRows.push(row(sizeName(size), s));
      json.push({ op: 'put', size, count, sides: s });
      console.log(`PUT ${putRows[putRows.length - 1]!.join(' | ')}`);
    }
    const s = await compare(Math.min(COUNT, 200), 1, 4096, putBoth(randomBytes(4096)));
    const lat = (side: Side): string => `${fmt(quantile(side.latMs, 0.5))} / ${fmt(quantile(side.latMs, 0.99))}`;
    qd1 = ['4 KiB, one at a time', lat(s.sdk), lat(s.baton), fmt(median(s.sdk.cpuUsPerReq)), fmt(median(s.baton.cpuUsPerReq))];
    json.push({ op: 'put-qd1', size: 4096, sides: s });
    console.log(`PUT QD1 ${qd1.join(' | ')}`);
  } finally {
    await store.close();
    await rgw.stop();
  }
  const head = ['size', 'SDK: CPU µs / request', 'baton: CPU µs / request', 'baton ÷ SDK', 'SDK MiB/s', 'baton MiB/s'];
  const L = [
    '# s3-requests: CPU per GET and PUT, baton\'s signed requests against the SDK\'s commands',
    '',
    `${machine.date}, ${machine.hostname}, ${machine.nproc} CPUs (${machine.cpuModel}), load ${machine.loadavgAtStart.join(' ')}, node ${machine.node}, baton ${machine.batonCommit ?? '?'}`,
    `Store: ${version}, on loopback (payloads unsigned on both sides). ${ROUNDS} alternations of the two sides, medians. CPU: this process (user + system) per request.`,
    '',
    `Ranged GETs, ${COUNT} per side, size and round, ${IN_FLIGHT} in flight:`,
    '',
    markdownTable(head, getRows, ['l', 'r', 'r', 'r', 'r', 'r']),
    '',
    `Create-only PUTs (If-None-Match: *, a put id in the metadata), ${IN_FLIGHT} in flight, ${COUNT} per side, size and round (at most ${PUT_BYTES_PER_RUN / 1024 / 1024} MiB):`,
    '',
    markdownTable(head, putRows, ['l', 'r', 'r', 'r', 'r', 'r']),
    '',
    'One create-only 4 KiB PUT at a time (a small FLUSH\'s round trip):',
    '',
    markdownTable(['PUT', 'SDK: latency p50 / p99, ms', 'baton: latency p50 / p99, ms', 'SDK: CPU µs / PUT', 'baton: CPU µs / PUT'], qd1 ? [qd1] : [], ['l', 'r', 'r', 'r', 'r']),
    '',
  ];
  const out = writeResults('s3-requests', L.join('\n'), { machine, knobs: { ROUNDS, COUNT, SIZES, PUT_SIZES, IN_FLIGHT }, results: json });
  console.log(`\n${L.join('\n')}\nwrote ${out.md}`);
}

main().catch((err: unknown) => {
  console.error(err);
  process.exit(1);
});

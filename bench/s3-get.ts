/**
 * What a GET costs baton's event loop: S3ObjectStore.get (signed by baton, sent with node's
 * http: src/store/sigv4.ts) against the same ranged GET through the AWS SDK's GetObjectCommand
 * on the same store's client (what S3ObjectStore.get did before), on radosgw (scripts/rgw.sh),
 * 8 in flight. The two sides alternate ROUNDS times; each side's CPU (this process: user +
 * system) per GET and its wall time are reported as medians. The store's own CPU (radosgw) is
 * not counted: it is the same for both.
 *
 * Knobs: ROUNDS (5), COUNT (400 GETs per side and size), SIZES (4K,64K,580K,2M: the range
 * asked of each object; 580 KiB is a typical hydration GET of the seed's workspace).
 * Results: bench/results/s3-get.md and .json. Run: `node dist/bench/s3-get.js` (about a minute).
 */
import { randomBytes } from 'node:crypto';
import * as path from 'node:path';
import { GetObjectCommand } from '@aws-sdk/client-s3';
import { S3ObjectStore } from '../src/store/s3.js';
import { envNumber, fmt, machineInfo, makeTempDir, markdownTable, median, startRgwBucket, writeResults } from './lib.js';

const ROUNDS = Math.max(1, Math.floor(envNumber('ROUNDS', 5)));
const COUNT = Math.max(8, Math.floor(envNumber('COUNT', 400)));
const SIZES = (process.env.SIZES ?? '4K,64K,580K,2M').split(',').map((s) => {
  const m = /^(\d+)([KM]?)$/i.exec(s.trim());
  if (m === null) throw new Error(`SIZES: cannot read ${s}`);
  return Number(m[1]) * (m[2]!.toUpperCase() === 'K' ? 1024 : m[2]!.toUpperCase() === 'M' ? 1024 * 1024 : 1);
});
const IN_FLIGHT = 8;
const OBJECTS = 64;

interface Side { cpuUsPerGet: number[]; mibPerS: number[] }

async function main(): Promise<void> {
  const machine = machineInfo();
  const root = makeTempDir('baton-bench-s3-get-');
  const { rgw, version } = await startRgwBucket(path.join(root, 'rgw'), 'bench');
  const store = new S3ObjectStore({ bucket: 'bench', prefix: 's3-get', endpoint: rgw.endpoint, credentials: { accessKeyId: rgw.env.AWS_ACCESS_KEY_ID!, secretAccessKey: rgw.env.AWS_SECRET_ACCESS_KEY! } });
  const rows: string[][] = [];
  const json: unknown[] = [];
  try {
    for (const size of SIZES) {
      // Objects a little bigger than the range, so the GET is a real ranged one (206).
      const body = randomBytes(size + 4096);
      await Promise.all(Array.from({ length: OBJECTS }, (_, i) => store.put(`o${size}-${i}`, body)));
      const want = body.subarray(100, 100 + size);
      const sdkGet = async (key: string): Promise<Buffer> => {
        const res = await store.client.send(new GetObjectCommand({ Bucket: 'bench', Key: `s3-get/${key}`, Range: `bytes=100-${100 + size - 1}` }));
        const a = await res.Body!.transformToByteArray();
        return Buffer.from(a.buffer, a.byteOffset, a.byteLength);
      };
      const directGet = (key: string): Promise<Buffer> => store.get(key, { offset: 100, length: size });
      const sides: Record<'sdk' | 'baton', Side> = { sdk: { cpuUsPerGet: [], mibPerS: [] }, baton: { cpuUsPerGet: [], mibPerS: [] } };
      const run = async (get: (key: string) => Promise<Buffer>, side: Side): Promise<void> => {
        let next = 0;
        const c0 = process.cpuUsage();
        const t0 = performance.now();
        await Promise.all(Array.from({ length: IN_FLIGHT }, async () => {
          while (next < COUNT) {
            const i = next++;
            const b = await get(`o${size}-${i % OBJECTS}`);
            if (b.length !== size || (i % 16 === 0 && !b.equals(want))) throw new Error(`GET ${i}: wrong bytes`);
          }
        }));
        const c = process.cpuUsage(c0);
        side.cpuUsPerGet.push((c.user + c.system) / COUNT);
        side.mibPerS.push((COUNT * size) / (1024 * 1024) / ((performance.now() - t0) / 1000));
      };
      await run(directGet, { cpuUsPerGet: [], mibPerS: [] }); // warm both paths' connections
      await run(sdkGet, { cpuUsPerGet: [], mibPerS: [] });
      for (let r = 0; r < ROUNDS; r++) {
        const order: ('sdk' | 'baton')[] = r % 2 === 0 ? ['sdk', 'baton'] : ['baton', 'sdk'];
        for (const o of order) await run(o === 'sdk' ? sdkGet : directGet, sides[o]);
      }
      const sdkCpu = median(sides.sdk.cpuUsPerGet), batonCpu = median(sides.baton.cpuUsPerGet);
      rows.push([
        size >= 1024 * 1024 ? `${size / 1024 / 1024} MiB` : `${size / 1024} KiB`,
        fmt(sdkCpu), fmt(batonCpu), `${(batonCpu / sdkCpu).toFixed(2)}×`,
        fmt(median(sides.sdk.mibPerS)), fmt(median(sides.baton.mibPerS)),
      ]);
      json.push({ size, sides });
      console.log(rows[rows.length - 1]!.join(' | '));
    }
  } finally {
    await store.close();
    await rgw.stop();
  }
  const L = [
    '# s3-get: CPU per ranged GET, baton\'s signed GET against the SDK\'s GetObjectCommand',
    '',
    `${machine.date}, ${machine.hostname}, ${machine.nproc} CPUs (${machine.cpuModel}), load ${machine.loadavgAtStart.join(' ')}, node ${machine.node}, baton ${machine.batonCommit ?? '?'}`,
    `Store: ${version}. ${COUNT} GETs per side and size, ${IN_FLIGHT} in flight, ${ROUNDS} alternations, medians. CPU: this process (user + system) per GET.`,
    '',
    markdownTable(['range', 'SDK: CPU µs / GET', 'baton: CPU µs / GET', 'baton ÷ SDK', 'SDK MiB/s', 'baton MiB/s'],
      rows, ['l', 'r', 'r', 'r', 'r', 'r']),
    '',
  ];
  const out = writeResults('s3-get', L.join('\n'), { machine, knobs: { ROUNDS, COUNT, SIZES, IN_FLIGHT }, results: json });
  console.log(`\n${L.join('\n')}\nwrote ${out.md}`);
}

main().catch((err: unknown) => {
  console.error(err);
  process.exit(1);
});

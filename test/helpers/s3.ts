/**
 * A real S3 API for tests. With BATON_TEST_S3_ENDPOINT (+ AWS_ACCESS_KEY_ID/SECRET) set, tests
 * share that server (e.g. one `scripts/rgw.sh start` for a whole CI run); otherwise the first
 * call in a process starts a throwaway radosgw with scripts/rgw.sh (about 1.5 s) and stops it
 * when the process exits. Each test then makes its own bucket, so tests never see each
 * other's keys and need no cleanup inside the server.
 *
 * Stop paths: a normal exit runs `rgw.sh stop` synchronously from the 'exit' handler; a test
 * process killed without running handlers is covered by the watchdog rgw.sh starts
 * (RGW_WATCH_PID), which stops the cluster once this pid is gone.
 */
import { execFile, execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { accessSync, constants, existsSync, mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { delimiter, dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { CreateBucketCommand, S3Client } from '@aws-sdk/client-s3';

export interface S3TestEnv {
  endpoint: string;
  accessKeyId: string;
  secretAccessKey: string;
  region: string;
}

/** The part of an ava ExecutionContext we use (kept structural so helpers do not depend on ava). */
export interface LogContext {
  log(...values: unknown[]): void;
}

const RGW_BINARIES = ['radosgw', 'radosgw-admin', 'ceph-mon', 'ceph-osd', 'ceph', 'monmaptool', 'uuidgen', 'curl'];

function onPath(bin: string): boolean {
  for (const d of (process.env.PATH ?? '').split(delimiter)) {
    if (d === '') continue;
    try {
      accessSync(join(d, bin), constants.X_OK);
      return true;
    } catch {
      // not here
    }
  }
  return false;
}

let rgwPresent: boolean | undefined;

/** True when scripts/rgw.sh can start a server here (tests use it to skip, not fail). */
export function hasRgw(): boolean {
  rgwPresent ??= RGW_BINARIES.every(onPath);
  return rgwPresent;
}

/** True when S3 tests can run: a shared server is configured or radosgw is installed. */
export function hasS3(): boolean {
  return Boolean(process.env.BATON_TEST_S3_ENDPOINT) || hasRgw();
}

function findScript(): string {
  // Works from test/helpers (ts sources) and dist/test/helpers (compiled).
  let dir = dirname(fileURLToPath(import.meta.url));
  for (let i = 0; i < 6; i++) {
    const p = join(dir, 'scripts', 'rgw.sh');
    if (existsSync(p)) return p;
    dir = dirname(dir);
  }
  throw new Error('scripts/rgw.sh not found above ' + fileURLToPath(import.meta.url));
}

function parseEnvFile(text: string): Record<string, string> {
  const out: Record<string, string> = {};
  for (const line of text.split('\n')) {
    const m = /^([A-Z0-9_]+)=(.*)$/.exec(line.trim());
    if (m) out[m[1]!] = m[2]!;
  }
  return out;
}

let started: Promise<S3TestEnv> | undefined;

async function startRgw(): Promise<S3TestEnv> {
  if (!hasRgw()) {
    throw new Error(`radosgw is not installed (need ${RGW_BINARIES.join(', ')}): run scripts/install-deps.sh, or set BATON_TEST_S3_ENDPOINT`);
  }
  const script = findScript();
  const dir = mkdtempSync(join(tmpdir(), 'baton-rgw-'));
  // Registered before starting, so a start that fails half-way still cleans up.
  process.once('exit', () => {
    try {
      execFileSync('bash', [script, 'stop', dir], { stdio: 'ignore', timeout: 10_000 });
    } catch {
      // the watchdog will get it
    }
  });
  const t0 = Date.now();
  await new Promise<void>((resolve, reject) => {
    execFile(
      'bash',
      [script, 'start', dir],
      { env: { ...process.env, RGW_WATCH_PID: String(process.pid) }, timeout: 90_000 },
      (err, _stdout, stderr) => {
        startLog = stderr;
        if (err) reject(new Error(`scripts/rgw.sh start ${dir} failed: ${err.message}\n${stderr}`));
        else resolve();
      },
    );
  });
  const env = parseEnvFile(readFileSync(join(dir, 'env'), 'utf8'));
  const { BATON_S3_ENDPOINT: endpoint, AWS_ACCESS_KEY_ID: accessKeyId, AWS_SECRET_ACCESS_KEY: secretAccessKey } = env;
  if (!endpoint || !accessKeyId || !secretAccessKey) throw new Error(`scripts/rgw.sh wrote an incomplete ${join(dir, 'env')}`);
  startMs = Date.now() - t0;
  return { endpoint, accessKeyId, secretAccessKey, region: env.AWS_REGION ?? 'us-east-1' };
}

let startMs: number | undefined;
let startLog = '';

/** How long this process waited for radosgw to start (undefined if it did not start one). */
export function rgwStartMs(): number | undefined {
  return startMs;
}

export async function s3TestEnv(t?: LogContext): Promise<S3TestEnv> {
  const shared = process.env.BATON_TEST_S3_ENDPOINT;
  if (shared) {
    const accessKeyId = process.env.AWS_ACCESS_KEY_ID;
    const secretAccessKey = process.env.AWS_SECRET_ACCESS_KEY;
    if (!accessKeyId || !secretAccessKey) {
      throw new Error('BATON_TEST_S3_ENDPOINT is set but AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY are not: source the env file rgw.sh wrote');
    }
    return { endpoint: shared, accessKeyId, secretAccessKey, region: process.env.AWS_REGION ?? 'us-east-1' };
  }
  started ??= startRgw();
  // A failed start is not cached: the next test gets a fresh try and its own error.
  started.catch(() => { started = undefined; });
  const env = await started;
  t?.log(`S3 endpoint ${env.endpoint}${startMs !== undefined ? ` (radosgw started in ${startMs} ms)` : ''}`);
  // RGW_TRACE=1 makes rgw.sh time each start step; show that once.
  if (process.env.RGW_TRACE && startLog !== '') {
    t?.log(startLog);
    startLog = '';
  }
  return env;
}

export function s3Client(env: S3TestEnv): S3Client {
  return new S3Client({
    endpoint: env.endpoint,
    region: env.region,
    forcePathStyle: true,
    credentials: { accessKeyId: env.accessKeyId, secretAccessKey: env.secretAccessKey },
    requestChecksumCalculation: 'WHEN_REQUIRED',
    responseChecksumValidation: 'WHEN_REQUIRED',
  });
}

/** A new, empty bucket with a unique name (lower-case, valid for S3). */
export async function makeTestBucket(env: S3TestEnv): Promise<string> {
  const name = `baton-test-${Date.now().toString(36)}-${randomBytes(4).toString('hex')}`;
  const client = s3Client(env);
  try {
    await client.send(new CreateBucketCommand({ Bucket: name }));
  } finally {
    client.destroy();
  }
  return name;
}

/**
 * The `baton` command as a user meets it: create/ls/info/rm against the local store and a
 * real S3 API (radosgw), clear errors with the right exit codes, --help with examples.
 */
import test from 'ava';
import { baton, tempDir } from '../helpers/server.js';
import { hasRgw, makeTestBucket, s3TestEnv, type S3TestEnv } from '../helpers/s3.js';

function s3Env(e: S3TestEnv): Record<string, string> {
  return { AWS_ACCESS_KEY_ID: e.accessKeyId, AWS_SECRET_ACCESS_KEY: e.secretAccessKey, AWS_REGION: e.region, BATON_S3_ENDPOINT: e.endpoint };
}

async function lifecycle(t: import('ava').ExecutionContext, store: string, env: Record<string, string> = {}): Promise<void> {
  const c = baton(['create', 'alpha', '--size', '1G', '--store', store, '--json'], env);
  t.is(c.status, 0, c.stderr);
  t.like(JSON.parse(c.stdout), { name: 'alpha', size: 1024 ** 3 });
  t.is(baton(['create', 'beta', '--size', '512M', '--store', store], env).status, 0);

  const dup = baton(['create', 'alpha', '--size', '1G', '--store', store], env);
  t.is(dup.status, 1);
  t.regex(dup.stderr, /already exists/);

  const ls = baton(['ls', '--store', store, '--json'], env);
  t.is(ls.status, 0, ls.stderr);
  t.deepEqual((JSON.parse(ls.stdout) as { name: string }[]).map((v) => v.name), ['alpha', 'beta']);
  const table = baton(['ls', '--store', store], env);
  t.regex(table.stdout, /^NAME\s+SIZE\s+STORED\s+WRITTEN\s+EXCLUSIVE\s+SHARED\s+CREATED/m);
  t.regex(table.stdout, /alpha\s+1 GiB/);

  const info = baton(['info', 'beta', '--store', store, '--json'], env);
  t.is(info.status, 0);
  const beta = JSON.parse(info.stdout) as { storedBytes: number };
  t.like(beta, { name: 'beta', kind: 'volume', size: 512 * 1024 ** 2, writtenBytes: 0, exclusiveBytes: 0, sharedBytes: 0 });
  t.true(beta.storedBytes < 1024, 'a new volume stores only its small record');

  const rm = baton(['rm', 'alpha', '--store', store], env);
  t.is(rm.status, 0, rm.stderr);
  const missing = baton(['info', 'alpha', '--store', store], env);
  t.is(missing.status, 1);
  t.regex(missing.stderr, /no volume "alpha".*baton ls/);
  t.deepEqual((JSON.parse(baton(['ls', '--store', store, '--json'], env).stdout) as { name: string }[]).map((v) => v.name), ['beta']);
}

test('create, ls, info, rm on the local store', async (t) => {
  await lifecycle(t, `file:${tempDir(t)}/store`);
});

(hasRgw() ? test : test.skip)('create, ls, info, rm on S3 (radosgw)', async (t) => {
  const e = await s3TestEnv(t);
  const bucket = await makeTestBucket(e);
  await lifecycle(t, `s3://${bucket}/cli-test`, s3Env(e));
});

test('bad input gets a clear error and exit code 2, never a stack trace', (t) => {
  const store = `file:${tempDir(t)}/store`;
  const cases: [string[], RegExp][] = [
    [['create', 'x', '--size', 'lots', '--store', store], /not a size: "lots"/],
    [['create', 'bad/name', '--size', '1G', '--store', store], /invalid volume name/],
    [['create', 'x', '--size', '1000', '--store', store], /not a multiple of 4096/],
    [['ls', '--store', 'ftp://nowhere'], /--store.*must be file:DIR or s3:\/\/bucket/],
    [['serve', '--listen', 'nonsense', '--store', store], /--listen must be HOST:PORT/],
    [['frobnicate'], /unknown command/],
    [['gc', '--grace', 'soon', '--store', store], /not a duration: soon/],
    [['gc', '--grace', '1s', '--store', store], /grace period \(1000 ms\) must be at least twice/],
    [['gc', '--compact-below', '2', '--store', store], /not a fraction between 0 and 1: 2/],
    [['gc', '--store', 'ram:'], /gc needs an object store/],
  ];
  for (const [args, re] of cases) {
    const r = baton(args);
    t.is(r.status, 2, `${args.join(' ')}: ${r.stderr}`);
    t.regex(r.stderr, re);
    t.notRegex(r.stderr, /\n\s+at /, 'no stack trace');
  }
});

test('--help of every command has examples', (t) => {
  for (const cmd of [[], ['serve'], ['create'], ['ls'], ['info'], ['rm'], ['fork'], ['snapshot'], ['diff'], ['gc'], ['handoff'], ['status'], ['prefetch'], ['rename']]) {
    const r = baton([...cmd, '--help']);
    t.is(r.status, 0);
    t.regex(r.stdout, /Examples:\n\s+\$ baton /, `baton ${cmd.join(' ')} --help`);
  }
});

/**
 * src/authz.ts: the --authz file (its errors name file and line), pattern matching, and the
 * per-identity view of an ExportProvider (what LIST, INFO, GO and "" see).
 */

import test from 'ava';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import type { ExportHandle, ExportProvider, ExportSummary } from '../../nbd/backend.js';
import type { ClientIdentity } from '../../nbd/tls.js';
import { ANONYMOUS } from '../../nbd/tls.js';
import { AuthzPolicy, authorizedExports, matchesPattern } from '../../src/authz.js';
import { MemoryBackend } from '../../src/backends/memory.js';
import { InvalidArgumentError, NotFoundError } from '../../src/errors.js';

const psk = (name: string): ClientIdentity => ({ kind: 'psk', names: [name], display: `psk:${name}` });
const cert = (...names: string[]): ClientIdentity => ({ kind: 'x509', names, display: `x509:${names[0]}` });

test('parse: identities, several patterns, comments, blank lines, a quoted identity with spaces', (t) => {
  const p = AuthzPolicy.parse([
    '# tenants',
    '',
    'alice   tenant-a-*  shared   # trailing comment',
    '\t bob tenant-b-* ',
    '"John Doe" jd-home work@*',
    'ops *',
  ].join('\n'), 'authz.conf');
  t.deepEqual(p.rules.map((r) => [r.identity, r.patterns, r.line]), [
    ['alice', ['tenant-a-*', 'shared'], 3],
    ['bob', ['tenant-b-*'], 4],
    ['John Doe', ['jd-home', 'work@*'], 5],
    ['ops', ['*'], 6],
  ]);
});

test('parse errors name the file and the line', (t) => {
  const bad: [string, RegExp][] = [
    ['alice tenant-a-*\nbob\n', /^authz\.conf:2: "bob" has no export patterns/],
    ['alice ten*ant\n', /^authz\.conf:1: "ten\*ant" is not an export pattern/],
    ['alice a/b\n', /^authz\.conf:1: "a\/b" is not an export pattern/],
    ['alice x\n# c\nalice y\n', /^authz\.conf:3: "alice" already has a line \(line 1\)/],
    ['"alice x\n', /^authz\.conf:1: the quoted identity has no closing "/],
    ['"" x\n', /^authz\.conf:1: empty identity/],
    ['"a"x y\n', /^authz\.conf:1: expected a space after the quoted identity/],
  ];
  for (const [text, re] of bad) {
    const err = t.throws(() => AuthzPolicy.parse(text, 'authz.conf'), { instanceOf: InvalidArgumentError }, text);
    t.regex(err!.message, re);
  }
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-authz-'));
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }));
  t.throws(() => AuthzPolicy.load(path.join(dir, 'missing')), { message: /--authz .*missing: cannot read it/ });
  fs.writeFileSync(path.join(dir, 'a'), 'alice x\nbob\n');
  t.throws(() => AuthzPolicy.load(path.join(dir, 'a')), { message: new RegExp(`^${path.join(dir, 'a').replace(/[.]/g, '\\.')}:2: `) });
});

test('matching: a trailing * is a prefix; snapshots and forks go by their own names', (t) => {
  t.true(matchesPattern('tenant-a-*', 'tenant-a-db'));
  t.true(matchesPattern('tenant-a-*', 'tenant-a-db@monday'));
  t.false(matchesPattern('tenant-a-*', 'tenant-b-db'));
  t.false(matchesPattern('tenant-a-*', 'tenant-a'));
  t.true(matchesPattern('work', 'work'));
  t.false(matchesPattern('work', 'work@monday'), 'a volume\'s pattern does not cover its snapshots');
  t.false(matchesPattern('work', 'work-fork'), 'nor a fork named after it');
  t.true(matchesPattern('work@*', 'work@monday'));
  t.true(matchesPattern('*', 'anything'));
  const p = AuthzPolicy.parse('alice tenant-a-*\nalice.example shared\n');
  t.true(p.allows(psk('alice'), 'tenant-a-x'));
  t.false(p.allows(psk('bob'), 'tenant-a-x'), 'an identity not in the file gets nothing');
  t.false(p.allows(ANONYMOUS, 'tenant-a-x'), 'nor does a client without an identity');
  t.false(p.allows(psk('alice'), ''), '"" is never a name to allow');
  // A certificate's names: every line naming one of them counts.
  t.true(p.allows(cert('alice', 'alice.example'), 'shared'));
  t.true(p.allows(cert('alice', 'alice.example'), 'tenant-a-y'));
  t.false(p.allows(cert('mallory', 'alice-example'), 'shared'));
});

class Exports implements ExportProvider {
  opened: string[] = [];
  infos: string[] = [];
  constructor(private readonly names: string[]) {}
  async list(): Promise<ExportSummary[]> { return this.names.map((name) => ({ name, description: `d ${name}` })); }
  async open(name: string): Promise<ExportHandle> {
    if (!this.names.includes(name)) throw new NotFoundError(`no volume "${name}" in file:/srv/store (list them with: baton ls --store file:/srv/store)`);
    this.opened.push(name);
    return { name, description: `d ${name}`, backend: new MemoryBackend(4096), release: () => {} };
  }
  async info(name: string): Promise<{ name: string; size: number; readOnly: boolean; description: string }> {
    if (!this.names.includes(name)) throw new NotFoundError(`no volume "${name}" in file:/srv/store`);
    this.infos.push(name);
    return { name, size: 4096, readOnly: false, description: `d ${name}` };
  }
}

test('the view: LIST filtered; a forbidden export is refused exactly like a missing one and never opened; "" is the only allowed export', async (t) => {
  const inner = new Exports(['tenant-a-1', 'tenant-a-2', 'tenant-b-1', 'other']);
  const policy = AuthzPolicy.parse('alice tenant-a-*\nbob tenant-b-*\ncarol nothing-here\n');
  const view = authorizedExports(inner, () => policy);
  const a = view(psk('alice'));
  t.deepEqual((await a.list()).map((e) => e.name), ['tenant-a-1', 'tenant-a-2']);
  const forbidden = await t.throwsAsync(a.open('tenant-b-1'), { instanceOf: NotFoundError });
  const missing = await t.throwsAsync(a.open('tenant-a-9'), { instanceOf: NotFoundError });
  t.is(forbidden!.message, 'no export "tenant-b-1"');
  t.is(missing!.message, 'no export "tenant-a-9"', 'the inner message (naming the store) is not shown either');
  const fi = await t.throwsAsync(a.info!('tenant-b-1'), { instanceOf: NotFoundError });
  const mi = await t.throwsAsync(a.info!('tenant-a-9'), { instanceOf: NotFoundError });
  t.is(fi!.message.replace('tenant-b-1', 'X'), mi!.message.replace('tenant-a-9', 'X'));
  t.deepEqual(inner.opened, [], 'nothing forbidden was opened');
  t.deepEqual(inner.infos, [], 'nor described');
  // Two exports for alice: "" is ambiguous, and the message names only hers.
  const amb = await t.throwsAsync(a.open(''), { instanceOf: NotFoundError });
  t.regex(amb!.message, /may attach 2 exports; name one: tenant-a-1, tenant-a-2$/);
  t.notRegex(amb!.message, /tenant-b|other/);
  // bob has exactly one: "" is it (never the server's only volume, which is not his).
  const b = view(psk('bob'));
  t.is((await b.open('')).name, 'tenant-b-1');
  t.is((await b.info!('')).name, 'tenant-b-1');
  // carol's pattern matches nothing that exists: she sees nothing.
  const c = view(psk('carol'));
  t.deepEqual(await c.list(), []);
  await t.throwsAsync(c.open(''), { message: /no export this client may attach/ });
  // A client that proved nothing sees nothing.
  t.deepEqual(await view(ANONYMOUS).list(), []);
});

test('the view reads the current policy at every call (SIGHUP reload)', async (t) => {
  const inner = new Exports(['x', 'y']);
  let policy = AuthzPolicy.parse('alice x\n');
  const a = authorizedExports(inner, () => policy)(psk('alice'));
  t.deepEqual((await a.list()).map((e) => e.name), ['x']);
  policy = AuthzPolicy.parse('alice y\n');
  t.deepEqual((await a.list()).map((e) => e.name), ['y']);
  await t.throwsAsync(a.open('x'), { instanceOf: NotFoundError });
});

test('a provider without info(): the view has none either (INFO falls back to open, which checks)', (t) => {
  const inner: ExportProvider = { list: async () => [], open: async () => { throw new NotFoundError('no'); } };
  const v = authorizedExports(inner, () => AuthzPolicy.parse('a x\n'))(psk('a'));
  t.is(v.info, undefined);
});

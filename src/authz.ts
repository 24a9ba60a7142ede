/**
 * Authorization per export (`baton serve --authz FILE`): which exports a client identity
 * may see and attach. The identity is what the client proved in the TLS handshake
 * (nbd/tls.ts ClientIdentity): its PSK identity, or its verified certificate's subject CN
 * and subjectAltName values.
 *
 * The file: one line per identity, `IDENTITY PATTERN [PATTERN...]`, `#` starts a comment,
 * blank lines are ignored. An identity with spaces is written in double quotes. A pattern
 * is an export name, or a prefix followed by `*` (`tenant-a-*`; `*` alone is every export).
 * Snapshots and forks are matched by their own names: `work` does not cover `work@monday`
 * (write `work@*` for its snapshots), `tenant-a-*` covers `tenant-a-db@monday`. An identity
 * that is not in the file may attach nothing. A certificate with several names gets the
 * exports of every line naming one of them.
 *
 * What a client may not attach does not exist for it: NBD_OPT_LIST leaves it out, and
 * INFO/GO/EXPORT_NAME refuse it exactly as they refuse a missing export (ERR_UNKNOWN, the
 * same message; EXPORT_NAME closes). The default export "" is the only export the client
 * may attach, if there is exactly one. XXX: a forbidden name is refused without asking the
 * store, a missing one after a catalog lookup; the difference in timing is the only thing
 * that tells them apart.
 */

import * as fs from 'node:fs';
import type { ExportHandle, ExportInfo, ExportProvider, ExportSummary } from '../nbd/backend.js';
import type { ClientIdentity } from '../nbd/tls.js';
import { InvalidArgumentError, NotFoundError, errorMessage } from './errors.js';

const PATTERN_RE = /^(?:[A-Za-z0-9._@-]+\*?|\*)$/;

export interface AuthzRule {
  identity: string;
  patterns: readonly string[];
  /** 1-based line in the file. */
  line: number;
}

export class AuthzPolicy {
  private readonly byIdentity: ReadonlyMap<string, AuthzRule>;

  private constructor(readonly file: string, readonly rules: readonly AuthzRule[]) {
    this.byIdentity = new Map(rules.map((r) => [r.identity, r]));
  }

  /** Reads and parses `file`; InvalidArgumentError naming the file (and line) on any problem. */
  static load(file: string): AuthzPolicy {
    let text: string;
    try {
      text = fs.readFileSync(file, 'utf8');
    } catch (err) {
      throw new InvalidArgumentError(`--authz ${file}: cannot read it (${errorMessage(err)})`);
    }
    return AuthzPolicy.parse(text, file);
  }

  static parse(text: string, file = '<authz>'): AuthzPolicy {
    const rules: AuthzRule[] = [];
    const seen = new Map<string, number>();
    const lines = text.split('\n');
    for (let i = 0; i < lines.length; i++) {
      const line = i + 1;
      const where = `${file}:${line}`;
      const body = stripComment(lines[i]!).trim();
      if (body === '') continue;
      let identity: string;
      let rest: string;
      if (body.startsWith('"')) {
        const end = body.indexOf('"', 1);
        if (end < 0) throw new InvalidArgumentError(`${where}: the quoted identity has no closing "`);
        identity = body.slice(1, end);
        rest = body.slice(end + 1);
        if (rest !== '' && !/^\s/.test(rest)) throw new InvalidArgumentError(`${where}: expected a space after the quoted identity`);
      } else {
        const m = /^(\S+)(.*)$/.exec(body)!;
        identity = m[1]!;
        rest = m[2]!;
      }
      if (identity === '') throw new InvalidArgumentError(`${where}: empty identity`);
      const patterns = rest.trim().split(/\s+/).filter((p) => p !== '');
      if (patterns.length === 0) {
        throw new InvalidArgumentError(`${where}: "${identity}" has no export patterns (expected IDENTITY PATTERN [PATTERN...]; an identity that may attach nothing is simply left out)`);
      }
      for (const p of patterns) {
        if (!PATTERN_RE.test(p)) {
          throw new InvalidArgumentError(`${where}: "${p}" is not an export pattern: an export name (letters, digits, . _ - @) or a prefix ending in * ("*" only at the end)`);
        }
      }
      const earlier = seen.get(identity);
      if (earlier !== undefined) throw new InvalidArgumentError(`${where}: "${identity}" already has a line (line ${earlier}); put all its patterns on one line`);
      seen.set(identity, line);
      rules.push({ identity, patterns, line });
    }
    return new AuthzPolicy(file, rules);
  }

  /** May a client with this identity attach `exportName` (its canonical, non-empty name)? */
  allows(identity: ClientIdentity, exportName: string): boolean {
    if (exportName === '') return false;
    for (const n of identity.names) {
      const rule = this.byIdentity.get(n);
      if (rule && rule.patterns.some((p) => matchesPattern(p, exportName))) return true;
    }
    return false;
  }
}

/** `tenant-a-*` matches every name starting with `tenant-a-`; anything else matches itself. */
export function matchesPattern(pattern: string, name: string): boolean {
  return pattern.endsWith('*') ? name.startsWith(pattern.slice(0, -1)) : name === pattern;
}

function stripComment(line: string): string {
  // `#` starts a comment anywhere outside a quoted identity.
  let quoted = false;
  for (let i = 0; i < line.length; i++) {
    const c = line[i];
    if (c === '"') quoted = !quoted;
    else if (c === '#' && !quoted) return line.slice(0, i);
  }
  return line;
}

/**
 * `exportsFor` for NbdSession: each connection sees `inner` through the current policy (the
 * getter is read at every option, so a policy reloaded on SIGHUP applies to what clients ask
 * next; attached connections keep their export).
 */
export function authorizedExports(inner: ExportProvider, policy: () => AuthzPolicy): (identity: ClientIdentity) => ExportProvider {
  return (identity) => new AuthorizedView(inner, identity, policy);
}

/** The one refusal, for a forbidden export and a missing one alike. */
function noSuchExport(name: string): NotFoundError {
  return new NotFoundError(`no export "${name}"`);
}

class AuthorizedView implements ExportProvider {
  readonly info?: (name: string) => Promise<ExportInfo>;

  constructor(private readonly inner: ExportProvider, private readonly identity: ClientIdentity, private readonly policy: () => AuthzPolicy) {
    if (inner.info) {
      const innerInfo = inner.info.bind(inner);
      this.info = async (requested) => {
        const name = await this.resolve(requested);
        return innerInfo(name).catch((err: unknown) => { throw err instanceof NotFoundError ? noSuchExport(name) : err; });
      };
    }
  }

  async list(): Promise<ExportSummary[]> {
    const policy = this.policy();
    return (await this.inner.list()).filter((e) => policy.allows(this.identity, e.name));
  }

  async open(requested: string): Promise<ExportHandle> {
    const name = await this.resolve(requested);
    const h = await this.inner.open(name).catch((err: unknown) => { throw err instanceof NotFoundError ? noSuchExport(name) : err; });
    // The inner provider resolves only "" to another name, and `name` is never "".
    if (h.name !== name) {
      h.release();
      throw new Error(`internal error: export "${name}" opened as "${h.name}"`);
    }
    return h;
  }

  /**
   * The name to look up: `requested` if this identity may attach it; for "" the one export
   * it may attach, if there is exactly one (never another tenant's only volume). Otherwise
   * the refusal of a missing export.
   */
  private async resolve(requested: string): Promise<string> {
    if (requested !== '') {
      if (!this.policy().allows(this.identity, requested)) throw noSuchExport(requested);
      return requested;
    }
    const names = (await this.list()).map((e) => e.name);
    if (names.length === 1) return names[0]!;
    throw new NotFoundError(names.length === 0
      ? 'no export name given, and there is no export this client may attach'
      : `no export name given and this client may attach ${names.length} exports; name one: ${names.join(', ')}`);
  }
}

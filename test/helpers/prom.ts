/**
 * Reading what `serve --metrics` exposes, written from the Prometheus text format spec
 * (exposition_formats.md, "Text-based format"), not from prom-client: a strict parser, so a
 * malformed line fails the test that scraped it instead of being skipped.
 */

import * as http from 'node:http';

export interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

export interface Exposition {
  samples: Sample[];
  /** # TYPE per metric family. */
  types: Map<string, string>;
  /** # HELP per metric family. */
  help: Map<string, string>;
}

const METRIC_NAME = /^[a-zA-Z_:][a-zA-Z0-9_:]*$/;
const LABEL_NAME = /^[a-zA-Z_][a-zA-Z0-9_]*$/;

/** A float as Go's strconv.ParseFloat reads it (the spec's rule): NaN and Inf in any case (prom-client writes "Nan"). */
function parseValue(s: string, line: string): number {
  if (/^[+]?inf(inity)?$/i.test(s)) return Infinity;
  if (/^-inf(inity)?$/i.test(s)) return -Infinity;
  if (/^nan$/i.test(s)) return NaN;
  if (!/^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/.test(s)) throw new Error(`bad sample value "${s}" in: ${line}`);
  return Number(s);
}

/** Parses the whole body; throws on any line that is not a comment, blank, or a well-formed sample. */
export function parseExposition(text: string): Exposition {
  const out: Exposition = { samples: [], types: new Map(), help: new Map() };
  for (const line of text.split('\n')) {
    if (line === '') continue;
    if (line.startsWith('#')) {
      const m = /^# (HELP|TYPE) (\S+) ?(.*)$/.exec(line);
      if (!m) continue; // other comments are allowed
      if (!METRIC_NAME.test(m[2]!)) throw new Error(`bad metric name in: ${line}`);
      (m[1] === 'HELP' ? out.help : out.types).set(m[2]!, m[3]!);
      continue;
    }
    let i = 0;
    while (i < line.length && line[i] !== '{' && line[i] !== ' ') i++;
    const name = line.slice(0, i);
    if (!METRIC_NAME.test(name)) throw new Error(`bad metric name "${name}" in: ${line}`);
    const labels: Record<string, string> = {};
    if (line[i] === '{') {
      i++;
      while (line[i] !== '}') {
        const eq = line.indexOf('=', i);
        if (eq < 0) throw new Error(`bad labels in: ${line}`);
        const lname = line.slice(i, eq);
        if (!LABEL_NAME.test(lname)) throw new Error(`bad label name "${lname}" in: ${line}`);
        if (line[eq + 1] !== '"') throw new Error(`unquoted label value in: ${line}`);
        let j = eq + 2;
        let v = '';
        for (; j < line.length && line[j] !== '"'; j++) {
          if (line[j] === '\\') {
            j++;
            const c = line[j];
            if (c === 'n') v += '\n';
            else if (c === '\\' || c === '"') v += c;
            else throw new Error(`bad escape in: ${line}`);
          } else {
            v += line[j];
          }
        }
        if (j >= line.length) throw new Error(`unterminated label value in: ${line}`);
        if (lname in labels) throw new Error(`label ${lname} twice in: ${line}`);
        labels[lname] = v;
        i = j + 1;
        if (line[i] === ',') i++;
        else if (line[i] !== '}') throw new Error(`bad label separator in: ${line}`);
      }
      i++;
    }
    if (line[i] !== ' ') throw new Error(`no value in: ${line}`);
    const rest = line.slice(i + 1).split(' ');
    if (rest.length > 2) throw new Error(`trailing fields in: ${line}`);
    out.samples.push({ name, labels, value: parseValue(rest[0]!, line) });
  }
  return out;
}

/** Sum of the samples named `name` whose labels include `match`. */
export function total(e: Exposition, name: string, match: Record<string, string> = {}): number {
  let n = 0;
  for (const s of e.samples) {
    if (s.name !== name) continue;
    if (Object.entries(match).every(([k, v]) => s.labels[k] === v)) n += s.value;
  }
  return n;
}

export interface HttpAnswer {
  status: number;
  headers: http.IncomingHttpHeaders;
  body: string;
}

export function httpGet(port: number, path: string, method = 'GET', host = '127.0.0.1'): Promise<HttpAnswer> {
  return new Promise((resolve, reject) => {
    const req = http.request({ host, port, path, method, agent: false }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (d: string) => { body += d; });
      res.on('end', () => resolve({ status: res.statusCode ?? 0, headers: res.headers, body }));
      res.on('error', reject);
    });
    req.on('error', reject);
    req.setTimeout(10_000, () => req.destroy(new Error(`GET ${path}: no answer in 10 s`)));
    req.end();
  });
}

/** GET /metrics, asserting 200 and the text format's content type, parsed. */
export async function scrape(port: number): Promise<Exposition> {
  const r = await httpGet(port, '/metrics');
  if (r.status !== 200) throw new Error(`/metrics answered ${r.status}: ${r.body}`);
  if (!/^text\/plain; version=0\.0\.4/.test(String(r.headers['content-type']))) throw new Error(`/metrics content type ${r.headers['content-type']}`);
  return parseExposition(r.body);
}

/** The port from serve's "metrics listening" log line, waiting for it (stderr read through `stderr()`). */
export async function metricsPort(stderr: () => string, timeoutMs = 15_000): Promise<number> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    for (const l of stderr().split('\n')) {
      if (!l.includes('"metrics listening"')) continue;
      const j = JSON.parse(l) as { address: { port: number } };
      return j.address.port;
    }
    if (Date.now() > deadline) throw new Error(`no "metrics listening" line:\n${stderr()}`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

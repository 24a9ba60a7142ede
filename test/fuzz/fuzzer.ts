/**
 * The protocol fuzzer: starts the server under test in a child process (server.ts), runs
 * generated inputs against it over a Unix socket, each checked by the oracle (oracle.ts,
 * checker.ts), while a well-behaved client does verified I/O on another export, and watches
 * the server's memory, connections and log.
 *
 * Inputs are spread over `lanes` (input i runs in lane i % lanes, one after the other in its
 * lane); lane i owns volume fz<i>, whose contents only it changes, so its content model stays
 * exact whatever the other lanes do. Input i is generated from (seed, i) alone: a failure
 * prints the seed, the index and the commands that replay it.
 */

import { fork, type ChildProcess } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Checker, Violation, newStats, type Outcome, type Stats } from './checker.js';
import { Conn, Hang } from './conn.js';
import { generate, generateWellBehaved, type Input } from './gen.js';
import { ContentModel } from './model.js';
import { parse, type Parsed } from './oracle.js';
import { CF, CMD, E, MiB, laneVolume, roPattern, type ServerLimits, type World } from './proto.js';
import { Rng } from './rng.js';

export interface FuzzOptions {
  seed: number;
  inputs: number;
  /** Run this recorded input (saveInput's JSON) instead of generated ones. */
  recorded?: RecordedInput;
  lanes?: number;
  /** Run only this input (against a fresh server: content from earlier inputs is not there). */
  only?: number;
  /** Per-input time bound (ms) before it counts as a hang; 32 MiB payloads add to it. */
  timeoutMs?: number;
  /** Self-test faults in the server (see server.ts). */
  inject?: string;
  /** Stop after this many failures (default 1). */
  maxFailures?: number;
  /** Progress lines. */
  log?: (line: string) => void;
  progressEveryMs?: number;
  /** Server limits (smaller than the defaults, so inputs reach them cheaply). */
  limits?: Partial<ServerLimits>;
  /**
   * How long the server keeps a volume open after its last client (default 3 s, so lanes
   * reattach to an open volume; 0 makes every input open, recover and close it).
   */
  idleGraceMs?: number;
  /** Run the well-behaved client (default true). */
  victim?: boolean;
}

export interface Failure {
  index: number | string;
  lane: number;
  kind: string;
  message: string;
  notes: string[];
  replay: string[];
}

export interface FuzzReport {
  seed: number;
  lanes: number;
  inputs: number;
  seconds: number;
  inputsPerSecond: number;
  failures: Failure[];
  stats: Stats;
  victim: { sessions: number; requests: number; maxSessionMs: number };
  memory: { baselineOther: number; maxSteadyOther: number; peakOther: number; peakRss: number; maxRss: number; storeBytes: number; probes: number };
  serverLog: Record<string, number>;
  /** Log lines other than the expected protocol-error warning (first 50). */
  serverLogSamples: string[];
  stalls: number;
  modelKnown: number[];
  /** CPU time of the fuzzer and of the server process (the machine-independent cost). */
  cpu: { fuzzerMs: number; serverMs: number };
}

interface ServerStats {
  heap: number; external: number; rss: number; other: number; peakOther: number; peakRss: number; maxRss: number;
  storeBytes: number; storeObjects: number; cachedBytes: number; connections: number; cpuMs: number;
  handles: Record<string, number>; log: Record<string, number>; logSamples: string[];
}

const here = path.dirname(fileURLToPath(import.meta.url));

export const DEFAULT_LIMITS: ServerLimits = {
  // The defaults of nbd/session.ts are 128 in flight and 256 MiB: smaller bounds here are the
  // same mechanism, reached by inputs a fraction of the size (a single 32 MiB request still
  // goes through alone, as the session lets the first one past the byte bound).
  maxInflight: 32,
  maxInflightBytes: 16 * MiB,
  maxOptions: 128,
  maxOptionLength: 64 * 1024,
  handshakeTimeoutMs: 3000,
};

class Server {
  private nextId = 1;
  private readonly pending = new Map<number, (m: Record<string, unknown>) => void>();
  exited: string | null = null;
  private constructor(readonly child: ChildProcess, readonly socket: string, readonly dir: string) {
    child.on('message', (m: Record<string, unknown>) => {
      const id = m.id as number | undefined;
      if (id !== undefined) { const r = this.pending.get(id); this.pending.delete(id); r?.(m); }
    });
    child.on('exit', (code, signal) => { this.exited = `the server process exited (code ${code}, signal ${signal})`; for (const r of this.pending.values()) r({ exited: true }); this.pending.clear(); });
  }

  static async start(world: World, inject: string | undefined, idleGraceMs: number): Promise<Server> {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-fuzz-'));
    const socket = path.join(dir, 'nbd.sock');
    const cfg = { socket, world, idleGraceMs, gcIntervalMs: 2000, gcGraceMs: 1000, cacheBytes: 64 * MiB, ...(inject ? { inject } : {}) };
    const child = fork(path.join(here, 'server.js'), [JSON.stringify(cfg)], {
      // One GC thread: on a machine whose cores are shared, parallel GC helpers cost more CPU than they save.
      execArgv: ['--expose-gc', '--single-threaded-gc', ...(process.env.FUZZ_SERVER_NODE_ARGS ? process.env.FUZZ_SERVER_NODE_ARGS.split(' ') : []), ...(process.env.FUZZ_SERVER_PROF ? ['--cpu-prof', `--cpu-prof-dir=${process.env.FUZZ_SERVER_PROF}`] : [])],
      env: { ...process.env, BATON_MAX_OPERATION_MS: '500' },
      stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
    });
    const s = new Server(child, socket, dir);
    await new Promise<void>((resolve, reject) => {
      child.once('message', (m: { ready?: boolean }) => (m.ready ? resolve() : reject(new Error('server did not start'))));
      child.once('exit', (code) => reject(new Error(`the fuzz server exited at start (code ${code})`)));
    });
    return s;
  }

  call<T>(msg: Record<string, unknown>, timeoutMs: number): Promise<T | null> {
    if (this.exited) return Promise.resolve(null);
    const id = this.nextId++;
    return new Promise((resolve) => {
      const timer = setTimeout(() => { this.pending.delete(id); resolve(null); }, timeoutMs);
      this.pending.set(id, (m) => { clearTimeout(timer); resolve(m.exited ? null : (m as T)); });
      this.child.send({ ...msg, id });
    });
  }

  async stop(): Promise<Record<string, unknown> | null> {
    const r = await this.call<Record<string, unknown>>({ op: 'stop' }, 12_000);
    const until = Date.now() + 5000;
    while (!this.exited && Date.now() < until) await sleep(20);
    if (!this.exited) this.child.kill('SIGKILL');
    fs.rmSync(this.dir, { recursive: true, force: true });
    return r;
  }
}

const STEADY_GROWTH = 192 * MiB;
/** Stalled handshakes running beside the lanes at once. */
const MAX_STALLS = 16;
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));
/** Resolves at the deadline; unref'd, so a race it lost does not keep the process alive. */
const until = (deadline: number): Promise<void> => new Promise((r) => setTimeout(r, Math.max(0, deadline - Date.now())).unref());
const turn = (): Promise<void> => new Promise((r) => setImmediate(r));

export function replayCommands(seed: number, lanes: number, index: number): string[] {
  return [
    `npm run fuzz -- --seed ${seed} --lanes ${lanes} --only ${index}        # this input alone, fresh server`,
    `npm run fuzz -- --seed ${seed} --lanes ${lanes} --inputs ${index + 1}  # every input up to it (same volume history)`,
    `npm run fuzz -- --seed ${seed} --lanes ${lanes} --dump ${index}        # print the input's frames`,
  ];
}

export function makeWorld(lanes: number, limits: ServerLimits): World {
  return { lanes, laneSize: 40 * MiB, roName: 'ro@s', roSize: 8 * MiB, victimName: 'victim', victimSize: 16 * MiB, limits };
}

/** An input as JSON, so a finding stays reproducible when the generator changes. */
export interface RecordedInput {
  seed: number;
  index: number;
  lanes: number;
  lane: number;
  ending: Input['ending'];
  notes: string[];
  sends: { hex: string; cuts: number[]; waitAfter: boolean; pauseReadMs?: number }[];
}

export function recordInput(seed: number, lanes: number, index: number): RecordedInput {
  const world = makeWorld(lanes, DEFAULT_LIMITS);
  const { input } = inputFor(seed, index, world);
  return {
    seed, index, lanes, lane: input.lane, ending: input.ending, notes: input.notes,
    sends: input.sends.map((x) => ({ hex: x.bytes.toString('hex'), cuts: x.cuts, waitAfter: x.waitAfter, ...(x.pauseReadMs ? { pauseReadMs: x.pauseReadMs } : {}) })),
  };
}

function fromRecord(r: RecordedInput): Input {
  const sends = r.sends.map((x) => ({ bytes: Buffer.from(x.hex, 'hex'), cuts: x.cuts, waitAfter: x.waitAfter, ...(x.pauseReadMs ? { pauseReadMs: x.pauseReadMs } : {}) }));
  const stream = Buffer.concat(sends.map((x) => x.bytes));
  let pos = 0;
  for (const x of sends) { x.bytes = stream.subarray(pos, pos + x.bytes.length); pos += x.bytes.length; }
  return { index: r.index, lane: r.lane, sends, stream, ending: r.ending, notes: r.notes };
}

/** Generate input `index` (retrying, with the same stream, when it would attach to an export its lane does not own, or reuse a cookie). */
export function inputFor(seed: number, index: number, world: World): { input: Input; parsed: Parsed } {
  const lane = index % world.lanes;
  const rng = new Rng(seed, index);
  const own = new Set([laneVolume(lane), world.roName]);
  for (let attempt = 0; ; attempt++) {
    const input = generate(rng, { world, index, lane });
    const parsed = parseInput(input, world);
    // Two requests with one cookie (a byte mutation can make them): no client can tell their
    // simple replies apart (a READ's carries data, the other's not), so neither can the oracle.
    const cookies = parsed.events.flatMap((e) => (e.k === 'req' ? [e.req.cookieHex] : []));
    const unique = new Set(cookies).size === cookies.length;
    if (unique && (!parsed.tx || own.has(parsed.tx.exp.name))) return { input, parsed };
    if (attempt > 50) throw new Error(`input ${index}: could not generate one that stays on its lane's volumes`);
  }
}

function parseInput(input: Input, world: World): Parsed {
  const stream = input.stream;
  const sendEnds: number[] = [];
  let n = 0;
  for (const s of input.sends) { n += s.bytes.length; sendEnds.push(n); }
  return parse(stream, { world, sendEnds, waitAfter: input.sends.map((s) => s.waitAfter) });
}

interface ExecEnv {
  server: Server;
  world: World;
  models: Map<string, ContentModel>;
  stats: Stats;
  timeoutMs: number;
}

/** Apply what a burst's write-type requests did to the content model (arrival order). */
function applyOutcomes(model: ContentModel | null, readOnly: boolean, outs: { ev: Outcome['ev']; errno: number | null }[]): void {
  if (!model || readOnly) return;
  for (const { ev, errno } of outs.sort((a, b) => a.ev.seq - b.ev.seq)) {
    const r = ev.req;
    const t = r.type;
    if (t !== CMD.WRITE && t !== CMD.TRIM && t !== CMD.WRITE_ZEROES) continue;
    if (r.offset + BigInt(r.length) > BigInt(model.size) || r.length === 0) continue;
    const off = Number(r.offset);
    const valid = ev.allowed.has(0);
    if (errno === 0) {
      if (t === CMD.WRITE) model.write(off, ev.payload!);
      else if (t === CMD.WRITE_ZEROES) model.zero(off, r.length);
      else model.forget(off, r.length); // TRIM: contents undefined until rewritten
    } else if (errno === null || valid || (t === CMD.WRITE_ZEROES && r.flags & CF.FAST_ZERO && errno === E.ENOTSUP)) {
      // No reply (the client went away), or a valid request that failed: it may or may not have happened.
      model.forget(off, r.length);
    }
  }
}

/** Run one input; throws Violation (or Hang) on a failure. */
async function execute(input: Input, parsed: Parsed, env: ExecEnv): Promise<void> {
  let ending = input.ending;
  // Without DISC, a bad frame or a half-close the server has no reason to stop waiting in transmission.
  if (ending === 'wait' && !parsed.closes && parsed.tx) ending = 'end';
  // A stalled handshake costs the server's whole handshake timeout: one in three is run as
  // one, the others half-close instead (which the server must answer by closing at once).
  if (ending === 'wait' && parsed.stallsInHandshake && input.index % 3 !== 0 && input.lane >= 0) ending = 'end';
  const stall = ending === 'wait' && parsed.stallsInHandshake;
  // Bytes past where the server stops reading change nothing it owes. They are not sent in a
  // write of their own: one to a socket the server already closed fails with EPIPE, and Node
  // then drops replies we have not read yet. (Bytes right after the stop point in the same
  // small write, such as garbage after DISC, do go out: the kernel takes them with the rest.)
  const sends = parsed.closes ? clip(input.sends, parsed.stopAt) : input.sends;
  const totalBytes = sends.reduce((s, x) => s + x.bytes.length, 0);
  const budget = (stall ? env.world.limits.handshakeTimeoutMs + env.timeoutMs : env.timeoutMs) + Math.floor(totalBytes / (32 * MiB)) * 2000;
  const deadline = Date.now() + budget;
  const conn = await Conn.connect(env.server.socket, env.timeoutMs);
  const model = (name: string): ContentModel | null => env.models.get(name) ?? null;
  const checker = new Checker(conn, parsed, { world: env.world, model, deadline: () => deadline, noCloseCheck: ending === 'destroy-after', stats: env.stats });
  const checking = checker.run();
  checking.catch(() => {}); // awaited below
  const applied = new Set<number>();
  const applyThrough = (burst: number): void => {
    const tx = checker.tx;
    if (!tx) return;
    const outs = checker.outcomes.filter((o) => o.ev.burst <= burst && !applied.has(o.ev.seq));
    for (const o of outs) applied.add(o.ev.seq);
    applyOutcomes(model(tx.exp.name), tx.exp.readOnly, outs);
  };
  try {
    let sent = 0;
    let burst = 0;
    for (const s of sends) {
      if (checker.isFinished) break;
      let at = 0;
      for (const cut of [...s.cuts, s.bytes.length]) {
        if (cut <= at) continue;
        conn.writeNoWait(s.bytes.subarray(at, cut));
        at = cut;
        if (cut < s.bytes.length) await turn();
      }
      sent += s.bytes.length;
      if (s.pauseReadMs) { conn.sock.pause(); await sleep(s.pauseReadMs); conn.sock.resume(); }
      if (s.waitAfter) {
        await Promise.race([checker.waitThrough(sent), checking.catch(() => {}), until(deadline)]);
        applyThrough(burst);
        burst++;
      }
    }
    if (ending === 'end') conn.end();
    else if (ending === 'destroy-now') conn.destroy();
    else if (ending === 'destroy-after') {
      await Promise.race([checker.waitThrough(totalBytes), checking.catch(() => {}), until(deadline)]);
      conn.destroy();
    }
    await checking;
  } finally {
    conn.destroy();
    // Whatever has no reply may or may not have happened.
    const tx = checker.tx;
    if (tx) {
      const answered = new Set(checker.outcomes.map((o) => o.ev.seq));
      const missing = parsed.events.filter((e): e is Extract<typeof e, { k: 'req' }> => e.k === 'req' && !answered.has(e.seq)).map((ev) => ({ ev, errno: null }));
      const outs = checker.outcomes.filter((o) => !applied.has(o.ev.seq)).map((o) => ({ ev: o.ev, errno: o.errno as number | null }));
      applyOutcomes(model(tx.exp.name), tx.exp.readOnly, [...outs, ...missing]);
    } else if (parsed.tx) {
      // Transmission was predicted but the check stopped before it (a failure, or our destroy):
      // requests may still have run.
      const m = model(parsed.tx.exp.name);
      if (m && !parsed.tx.exp.readOnly) {
        const missing = parsed.events.filter((e): e is Extract<typeof e, { k: 'req' }> => e.k === 'req').map((ev) => ({ ev, errno: null }));
        applyOutcomes(m, false, missing);
      }
    }
  }
  // The lane's next input must not race a session of this one still finishing requests: wait
  // until no connection holds the volume (also: every session releases its export).
  // (A close we saw needs no wait: a session releases its export before it closes.)
  if (parsed.tx && !parsed.tx.exp.readOnly && !checker.sawClose) {
    const r = await env.server.call<{ ok: boolean }>({ op: 'idle', name: parsed.tx.exp.name }, env.timeoutMs);
    if (!r) throw new Violation(env.server.exited ? 'server-died' : 'leak', env.server.exited ?? `a session on ${parsed.tx.exp.name} still holds its export ${env.timeoutMs} ms after the input ended`);
  }
}

function clip(sends: Input['sends'], limit: number): Input['sends'] {
  const out: Input['sends'] = [];
  let pos = 0;
  for (const s of sends) {
    if (pos >= limit) break;
    let keep = Math.min(s.bytes.length, limit - pos);
    let cuts = s.cuts.filter((c) => c < keep);
    if (keep < s.bytes.length) {
      // Keep up to 64 bytes past the stop point if they share one small write with it.
      const pieceStart = cuts.length ? cuts[cuts.length - 1]! : 0;
      const nextCut = s.cuts.find((c) => c >= keep) ?? s.bytes.length;
      const extended = Math.min(nextCut, keep + 64);
      if (extended - pieceStart <= 16 * 1024) keep = extended;
      cuts = cuts.filter((c) => c < keep);
    }
    out.push(keep === s.bytes.length ? s : { ...s, bytes: s.bytes.subarray(0, keep), cuts });
    pos += keep;
  }
  return out;
}

export async function runFuzz(opts: FuzzOptions): Promise<FuzzReport> {
  const lanes = opts.lanes ?? 4;
  const limits: ServerLimits = { ...DEFAULT_LIMITS, ...opts.limits };
  const world = makeWorld(lanes, limits);
  const timeoutMs = opts.timeoutMs ?? 15_000;
  const maxFailures = opts.maxFailures ?? 1;
  const log = opts.log ?? ((): void => {});
  const server = await Server.start(world, opts.inject, opts.idleGraceMs ?? 3000);
  const models = new Map<string, ContentModel>();
  for (let i = 0; i < lanes; i++) models.set(laneVolume(i), new ContentModel(world.laneSize));
  models.set(world.roName, new ContentModel(world.roSize, (o, l) => roPattern(o, l, world.roSize)));
  models.set(world.victimName, new ContentModel(world.victimSize));
  const stats = newStats();
  const env: ExecEnv = { server, world, models, stats, timeoutMs };
  const failures: Failure[] = [];
  let stop = false;
  let done = 0;
  let stalls = 0;
  const fail = (f: Failure): void => {
    failures.push(f);
    if (failures.length >= maxFailures) stop = true;
  };
  const asFailure = (err: unknown, index: number | string, lane: number, notes: string[]): Failure => {
    const kind = err instanceof Violation ? err.kind : err instanceof Hang ? 'hang' : 'error';
    let message = err instanceof Error ? err.message : String(err);
    if (server.exited) message += ` [${server.exited}]`;
    return { index, lane, kind: server.exited ? 'server-died' : kind, message, notes, replay: typeof index === 'number' ? replayCommands(opts.seed, lanes, index) : [`npm run fuzz -- --seed ${opts.seed} --lanes ${lanes} --inputs ${opts.inputs}`] };
  };

  const started = Date.now();
  const cpu0 = process.cpuUsage();
  const serverCpu0 = (await server.call<ServerStats>({ op: 'stats' }, 10_000))?.cpuMs ?? 0;
  const timings: [number, number, number][] | null = process.env.FUZZ_PROFILE ? [] : null;
  const inFlight = new Map<number, number>(); // lane -> index being run
  const background = new Set<Promise<void>>();

  async function lane(l: number): Promise<void> {
    const indices: number[] = [];
    if (opts.recorded) { if (opts.recorded.lane === l) indices.push(opts.recorded.index); }
    else if (opts.only !== undefined) { if (opts.only % lanes === l) indices.push(opts.only); }
    else for (let i = l; i < opts.inputs; i += lanes) indices.push(i);
    for (const index of indices) {
      if (stop) return;
      const { input, parsed } = opts.recorded ? ((x) => ({ input: x, parsed: parseInput(x, world) }))(fromRecord(opts.recorded)) : inputFor(opts.seed, index, world);
      inFlight.set(l, index);
      const ending = input.ending;
      const isStall = ending === 'wait' && parsed.stallsInHandshake && index % 3 === 0;
      const t0 = performance.now();
      const run = execute(input, parsed, env).then(
        () => { done++; if (timings) timings.push([performance.now() - t0, index, input.sends.reduce((n, x) => n + x.bytes.length, 0)]); },
        (err: unknown) => { done++; fail(asFailure(err, index, l, input.notes)); },
      );
      if (isStall) {
        // A stalled handshake ends only by the server's handshake timer: let it run beside the lane.
        stalls++;
        background.add(run);
        void run.finally(() => background.delete(run));
        while (background.size >= MAX_STALLS) await Promise.race(background);
      } else {
        await run;
      }
    }
    inFlight.delete(l);
  }

  // The well-behaved client, on its own export, for as long as the lanes run.
  const victim = { sessions: 0, requests: 0, maxSessionMs: 0 };
  let lanesDone = false;
  async function wellBehaved(): Promise<void> {
    const rng = new Rng(opts.seed ^ 0x5eed, 0x7fffffff);
    for (let k = 0; !lanesDone && !stop; k++) {
      // Paced: a steady companion of the fuzz lanes, not a load of its own.
      if (k > 0) await sleep(50);
      const input = generateWellBehaved(new Rng(opts.seed ^ 0x5eed, rng.u32()), world, k);
      const parsed = parseInput(input, world);
      const t0 = Date.now();
      try {
        await execute(input, parsed, env);
      } catch (err) {
        const inputsThen = [...inFlight.entries()].map(([l, i]) => `lane ${l}: input ${i}`).join(', ');
        const f = asFailure(err, `well-behaved session ${k}`, -1, [`fuzz inputs running meanwhile: ${inputsThen}`, ...input.notes]);
        f.kind = `victim-${f.kind}`;
        fail(f);
        return;
      }
      victim.sessions++;
      victim.requests += parsed.events.filter((e) => e.k === 'req').length;
      victim.maxSessionMs = Math.max(victim.maxSessionMs, Date.now() - t0);
    }
  }

  // Memory, connections and the server's log, every ~3 s.
  const memory = { baselineOther: 0, maxSteadyOther: 0, peakOther: 0, peakRss: 0, maxRss: 0, storeBytes: 0, probes: 0 };
  const perConnection = limits.maxInflightBytes + Math.max(limits.maxInflightBytes / 2, 32 * MiB + 1024) + 32 * MiB;
  const probe = async (): Promise<ServerStats | null> => {
    const s = await server.call<ServerStats>({ op: 'stats', gc: true }, 30_000);
    if (!s) { if (!stop) fail({ index: 'probe', lane: -1, kind: 'server-died', message: server.exited ?? 'the server stopped answering', notes: [], replay: [] }); return null; }
    memory.probes++;
    if (memory.probes === 2) memory.baselineOther = s.other;
    if (memory.probes >= 2) memory.maxSteadyOther = Math.max(memory.maxSteadyOther, s.other);
    memory.peakOther = Math.max(memory.peakOther, s.peakOther);
    memory.peakRss = Math.max(memory.peakRss, s.peakRss);
    memory.maxRss = Math.max(memory.maxRss, s.maxRss);
    memory.storeBytes = s.storeBytes;
    const conns = lanes + MAX_STALLS + 2; // lanes, stalled handshakes, the well-behaved client
    if (s.connections > conns) fail({ index: 'probe', lane: -1, kind: 'leak', message: `${s.connections} connections open on the server, at most ${conns} expected`, notes: [], replay: [] });
    // Growth allowed past the baseline: 128 MiB, plus the 64 MiB the READ buffer pool
    // (nbd/buffer-pool.ts) may keep, which this measure does not subtract.
    if (memory.probes > 2 && s.other > memory.baselineOther + STEADY_GROWTH) {
      fail({ index: 'probe', lane: -1, kind: 'memory', message: `server memory (heap + buffers, less stored data, dirty data and cache) grew from ${mb(memory.baselineOther)} to ${mb(s.other)} after a full GC`, notes: [], replay: [] });
    }
    const peakBound = Math.max(memory.baselineOther, 64 * MiB) + perConnection * (lanes + 1) + 256 * MiB;
    if (s.peakOther > peakBound) {
      fail({ index: 'probe', lane: -1, kind: 'memory', message: `server memory peaked at ${mb(s.peakOther)}, above the bound ${mb(peakBound)} (baseline + ${mb(perConnection)} per connection)`, notes: [], replay: [] });
    }
    return s;
  };
  let probing = true;
  let wakeProber = (): void => {};
  const prober = (async (): Promise<void> => {
    while (probing && !stop) {
      await new Promise<void>((r) => { const t = setTimeout(r, 3000); wakeProber = () => { clearTimeout(t); r(); }; });
      if (probing && !stop) await probe();
    }
  })();

  const progressEvery = opts.progressEveryMs ?? 10_000;
  const progress = setInterval(() => {
    const secs = (Date.now() - started) / 1000;
    log(`${done} inputs in ${secs.toFixed(0)} s (${(done / secs).toFixed(0)}/s), ${victim.sessions} well-behaved sessions, server other-memory ${mb(memory.maxSteadyOther)} peak ${mb(memory.peakOther)}, store ${mb(memory.storeBytes)}`);
  }, progressEvery);
  progress.unref();

  const victimRun = opts.victim === false ? Promise.resolve() : wellBehaved();
  await Promise.all(Array.from({ length: lanes }, (_, l) => lane(l)));
  await Promise.all(background);
  const seconds = (Date.now() - started) / 1000;
  const cpu1 = process.cpuUsage(cpu0);
  const serverCpu1 = (await server.call<ServerStats>({ op: 'stats' }, 10_000))?.cpuMs ?? 0;
  lanesDone = true;
  await victimRun;
  probing = false;
  wakeProber();
  await prober;
  clearInterval(progress);
  if (timings) {
    timings.sort((a, b) => b[0] - a[0]);
    const sum = timings.reduce((x, t) => x + t[0], 0);
    log(`input time: total ${(sum / 1000).toFixed(1)} s, median ${timings[Math.floor(timings.length / 2)]?.[0].toFixed(1)} ms; slowest: ${timings.slice(0, 15).map(([ms, i, b]) => `#${i} ${ms.toFixed(0)}ms/${mb(b)}`).join(', ')}`);
  }

  // Every session must end once its client is gone.
  let last: ServerStats | null = null;
  if (!server.exited && failures.length === 0) {
    const until = Date.now() + 10_000;
    for (;;) {
      last = await probe();
      if (!last || last.connections === 0 || Date.now() > until) break;
      await sleep(100);
    }
    if (last && last.connections !== 0) fail({ index: 'end', lane: -1, kind: 'leak', message: `${last.connections} connections still open 10 s after every client left`, notes: [], replay: [] });
  }
  const stopped = await server.stop();
  const serverLog = (stopped?.log as Record<string, number> | undefined) ?? last?.log ?? {};
  // Log lines that mean something went wrong inside the server (a protocol error's warning is expected).
  const bad = Object.entries(serverLog).filter(([k]) => k.startsWith('error:') || k === 'warn: request failed' || k.includes('internal error'));
  if (bad.length > 0 && opts.inject === undefined) {
    fail({ index: 'log', lane: -1, kind: 'server-log', message: `the server logged: ${bad.map(([k, n]) => `${n}× ${k}`).join('; ')}`, notes: ((stopped?.logSamples as string[] | undefined) ?? []).slice(0, 5), replay: [] });
  }
  return {
    seed: opts.seed, lanes, inputs: done, seconds, inputsPerSecond: done / seconds, failures, stats, victim, memory, serverLog, stalls,
    serverLogSamples: (stopped?.logSamples as string[] | undefined) ?? [],
    modelKnown: [...models.values()].map((m) => m.knownFraction()),
    cpu: { fuzzerMs: (cpu1.user + cpu1.system) / 1000, serverMs: serverCpu1 - serverCpu0 },
  };
}

export function mb(n: number): string { return `${(n / MiB).toFixed(1)} MiB`; }

export function formatFailure(f: Failure): string {
  const lines = [`FAIL [${f.kind}] input ${f.index}${f.lane >= 0 ? ` (lane ${f.lane})` : ''}: ${f.message}`];
  if (f.notes.length) lines.push('  input:', ...f.notes.slice(0, 60).map((n) => `    ${n}`), ...(f.notes.length > 60 ? [`    ... ${f.notes.length - 60} more`] : []));
  if (f.replay.length) lines.push('  replay:', ...f.replay.map((r) => `    ${r}`));
  return lines.join('\n');
}

/** The frames of one input, as hex, for a minimal repro. */
export function dumpInput(seed: number, lanes: number, index: number, limits: Partial<ServerLimits> = {}): string {
  const world = makeWorld(lanes, { ...DEFAULT_LIMITS, ...limits });
  const { input, parsed } = inputFor(seed, index, world);
  const out = [`input ${index} (seed ${seed}, lane ${input.lane}), ending ${input.ending}`, ...input.notes.map((n) => `  ${n}`), 'expected:'];
  for (const e of parsed.events) {
    if (e.k === 'opt') out.push(`  option ${e.option} (${e.data.length} bytes) ending at ${e.end}: ${e.exp.t}${e.exp.t === 'error' ? ` ${e.exp.why}` : ''}`);
    else if (e.k === 'req') out.push(`  request ${e.seq} burst ${e.burst} type ${e.req.type} flags 0x${e.req.flags.toString(16)} offset ${e.req.offset} length ${e.req.length}: allowed {${[...e.allowed].join(',')}}`);
    else out.push(`  ${e.k} at ${e.k === 'export-name' ? e.end : e.at}${e.k === 'close' ? `: ${e.why}` : ''}`);
  }
  out.push('sends:');
  for (const s of input.sends) out.push(`  ${s.bytes.length} bytes${s.waitAfter ? ', then wait' : ''}: ${s.bytes.subarray(0, 256).toString('hex')}${s.bytes.length > 256 ? '...' : ''}`);
  return out.join('\n');
}

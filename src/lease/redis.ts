/**
 * RedisLeaseManager: the single-writer lease in Redis (`--redis URL`), for hosts on different
 * machines. Standalone, TLS, Unix socket, Sentinel and Cluster deployments (see openRedis).
 *
 * Safety argument. Redis is ADVISORY: it decides who SHOULD write, never who CAN. Replication
 * is asynchronous, a failover or a restart can lose a lease, and a paused holder can outlive
 * its TTL, so two hosts may briefly both believe they hold a volume. What keeps data safe is
 * the object store: each commit is a create-only put of the next log position tagged with the
 * writer's fencing token, and a new holder commits a takeover record under a token higher than
 * any in the log. For that, tokens here only grow: a per-volume counter (INCR, never reset by
 * us) and never at or below `minToken`, the highest token the caller saw in the log; if Redis
 * lost its data the script raises the counter past it. Redis buys liveness: one writer in the
 * normal case, a fast graceful handoff, and a holder that stops acknowledging writes
 * (validUntil) before anyone else can be granted the lease.
 *
 * Keys (the `{VOL}` hash tag puts both keys of a volume in one Cluster slot, so one Lua script
 * can touch both):
 * - `baton:lease:{VOL}`: hash {holder, token, reservedFor, handoffRequestedBy, handoffId,
 *   status (JSON)} with a PX TTL. `holder: ''` plus `reservedFor` is the reservation a
 *   graceful handoff leaves: only that host may acquire until it expires.
 * - `baton:lease:{VOL}:token`: the token counter; no TTL; only grows.
 * Every state change is one Lua script that checks holder AND token, so a late or duplicated
 * command from an old holder can never touch a newer lease.
 *
 * Handoff notification: requestHandoff sets handoffRequestedBy on the lease and PUBLISHes on
 * `baton:handoff:{VOL}` in the same script. A holder subscribes to that channel (on a separate
 * connection, open while this manager holds or waits for any lease). A message is only a
 * doorbell: anyone who can PUBLISH can send one, with any `to` and the token `baton status`
 * shows, and nothing checks it. So the holder never acts on what a message says; it runs a
 * renewal at once, and acts on the handoff request the RENEW script reads from the lease
 * record, which only REQUEST_HANDOFF writes, after its checks (someone holds the lease, and
 * it is not `to`). That costs one round trip per request and stays within milliseconds;
 * the scheduled renewals return the same request, so a lost message delays a handoff by at
 * most ttl/3. Callbacks fire once per request id. Releases publish on the same channel,
 * which wakes acquirers that wait; a revoke publishes too, so its holder re-checks at once.
 *
 * Clocks. The lease's expiry in Redis is the key's PX TTL, measured by the Redis server's
 * clock; the holder's validUntil is measured on its own performance.now() (CLOCK_MONOTONIC),
 * from before the renewal was sent. The margin (renewing.ts) covers rate differences between
 * the two, not jumps. Assumed, and what breaking it means:
 * - Redis stores a key's expiry as an absolute Unix time (see PEXPIRETIME) and compares it
 *   with its own wall clock. A forward step of the Redis host's clock expires leases early:
 *   another host may be granted a volume while its holder still acknowledges writes. Keep
 *   that host's clock slewed, never stepped (chrony: makestep only at start; ntpd: -x), as for any
 *   Redis lock.
 * - performance.now() does not advance while the holder's machine is suspended (or its VM
 *   paused), but Redis's clock does: after a suspend longer than the time left, the holder
 *   wakes up believing it holds a lease that expired, and another host may hold it, until
 *   its next renewal (due at once: the timers fired late) says otherwise and fires onLost.
 *   The same holds for a process paused by SIGSTOP or a long GC pause.
 * In both cases two hosts briefly both believe they hold the volume, and data stays safe for
 * the reason given above: the new holder committed a takeover record under a higher token at
 * the next log position before it acknowledged anything, so the old holder's next commit
 * (a create-only put of a position that is taken) fails and fences it; what the old holder
 * acknowledged before that is in the log, before the takeover. What is lost is only the
 * politeness: the old holder does not stop before the new one starts, and its clients can
 * read its last view of the volume until it is fenced.
 */

import { randomUUID } from 'node:crypto';
import * as net from 'node:net';
import { performance } from 'node:perf_hooks';
import { Cluster, Redis, type RedisOptions, type Result } from 'ioredis';
import { InvalidArgumentError, LeaseHeldError, StoreUnavailableError, errorMessage } from '../errors.js';
import { silentLogger, type Logger } from '../log.js';
import { checkVolumeName } from '../volumes.js';
import type { AcquireOptions, Lease, LeaseManager, LeaseRecord, LeaseStatus } from './lease.js';
import {
  RenewingLease, alreadyHolderError, checkAcquireOptions, checkHolderId, checkTtl, heldError, nobodyHoldsError, parseStatus,
  reservedError, type RenewResult, type RenewingLeaseArgs,
} from './renewing.js';

// ------------------------------------------------------------------ Lua

declare module 'ioredis' {
  interface RedisCommander<Context> {
    batonLeaseAcquire(lease: string, counter: string, holder: string, ttlMs: number, minToken: string): Result<unknown[], Context>;
    batonLeaseRenew(lease: string, holder: string, token: string, ttlMs: number, status: string): Result<unknown[], Context>;
    batonLeaseRelease(lease: string, holder: string, token: string, to: string, reserveMs: number, channel: string): Result<number, Context>;
    batonLeaseRequestHandoff(lease: string, to: string, id: string, channel: string): Result<unknown[], Context>;
    batonLeaseInspect(lease: string): Result<unknown[], Context>;
    batonLeaseRevoke(lease: string, counter: string, channel: string): Result<number, Context>;
  }
}

/**
 * KEYS: lease, counter. ARGV: holder, ttl ms, minToken.
 * -> {1, token} | {0, holder, token, pttl, reservedFor}
 * Free = no key, or no holder and reserved for this caller. Same holder = held (two processes
 * with one host id must not both write). The new token is above the counter, above a token
 * still in the hash, and above minToken (the counter is raised to it: Redis lost data).
 */
const ACQUIRE = `
local cur = redis.call('HMGET', KEYS[1], 'holder', 'token', 'reservedFor')
local holder = cur[1] or ''
local reserved = cur[3] or ''
if holder ~= '' or (reserved ~= '' and reserved ~= ARGV[1]) then
  return {0, holder, cur[2] or '', redis.call('PTTL', KEYS[1]), reserved}
end
local token = redis.call('INCR', KEYS[2])
local floor = math.max(tonumber(ARGV[3]) or 0, tonumber(cur[2] or '0') or 0)
if token <= floor then
  token = floor + 1
  redis.call('SET', KEYS[2], string.format('%d', token))
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', string.format('%d', token))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, token}
`;

/** KEYS: lease. ARGV: holder, token, ttl ms, status JSON or ''. -> {1, handoffTo, handoffId} | {0, holder, token} */
const RENEW = `
local cur = redis.call('HMGET', KEYS[1], 'holder', 'token', 'handoffRequestedBy', 'handoffId')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then
  return {0, cur[1] or '', cur[2] or ''}
end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'status', ARGV[4]) end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, cur[3] or '', cur[4] or ''}
`;

/**
 * KEYS: lease. ARGV: holder, token, to ('' = free it), reservation ms, channel. -> 1 | 0 (not ours)
 * With `to`: keep the key with holder '' and reservedFor = to for one TTL (and the token and
 * status, for `baton status`).
 */
const RELEASE = `
local cur = redis.call('HMGET', KEYS[1], 'holder', 'token', 'status')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'holder', '', 'token', ARGV[2], 'reservedFor', ARGV[3])
  if cur[3] then redis.call('HSET', KEYS[1], 'status', cur[3]) end
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
redis.call('PUBLISH', ARGV[5], cjson.encode({type = 'released', to = ARGV[3], token = ARGV[2]}))
return 1
`;

/** KEYS: lease. ARGV: to, request id, channel. -> {1, holder, token} | {0, reservedFor} (nobody holds) | {2} (to holds it) */
const REQUEST_HANDOFF = `
local cur = redis.call('HMGET', KEYS[1], 'holder', 'token', 'reservedFor')
local holder = cur[1] or ''
if holder == '' then return {0, cur[3] or ''} end
if holder == ARGV[1] then return {2} end
redis.call('HSET', KEYS[1], 'handoffRequestedBy', ARGV[1], 'handoffId', ARGV[2])
redis.call('PUBLISH', ARGV[3], cjson.encode({type = 'handoff', to = ARGV[1], id = ARGV[2], token = cur[2]}))
return {1, holder, cur[2]}
`;

/** KEYS: lease. -> flat [field, value, ..., 'pttl', ms] or [] (one round trip, one snapshot). */
const INSPECT = `
local h = redis.call('HGETALL', KEYS[1])
if #h == 0 then return h end
h[#h + 1] = 'pttl'
h[#h + 1] = tostring(redis.call('PTTL', KEYS[1]))
return h
`;

/**
 * KEYS: lease, counter. ARGV: channel. -> 1 (a host held it) | 0 (free, or only reserved)
 * Deletes the lease (a holder, or the reservation a handoff left) and keeps the counter,
 * raised to the deleted token if it was ever below it (only grow: the next ACQUIRE INCRs
 * past every token handed out). Both keys carry the `{VOL}` hash tag: one Cluster slot. The
 * PUBLISH makes the holder re-check at once (its renewal then finds the lease gone).
 */
const REVOKE = `
local cur = redis.call('HMGET', KEYS[1], 'holder', 'token')
if not cur[2] then return 0 end
local token = tonumber(cur[2]) or 0
if token > (tonumber(redis.call('GET', KEYS[2]) or '0') or 0) then
  redis.call('SET', KEYS[2], string.format('%d', token))
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[1], cjson.encode({type = 'revoked', token = cur[2]}))
if cur[1] and cur[1] ~= '' then return 1 end
return 0
`;

const LEASE_SCRIPTS = {
  batonLeaseAcquire: { numberOfKeys: 2, lua: ACQUIRE },
  batonLeaseRenew: { numberOfKeys: 1, lua: RENEW },
  batonLeaseRelease: { numberOfKeys: 1, lua: RELEASE },
  batonLeaseRequestHandoff: { numberOfKeys: 1, lua: REQUEST_HANDOFF },
  batonLeaseInspect: { numberOfKeys: 1, lua: INSPECT },
  batonLeaseRevoke: { numberOfKeys: 2, lua: REVOKE },
};

const leaseKey = (vol: string): string => `baton:lease:{${vol}}`;
const counterKey = (vol: string): string => `baton:lease:{${vol}}:token`;
const channelOf = (vol: string): string => `baton:handoff:{${vol}}`;
/** Lease keys only (not `:token`): volume names cannot contain braces, so `}` ends the key. */
const LEASE_MATCH = 'baton:lease:{*}';

// ------------------------------------------------------------------ URLs and connections

export type RedisClient = Redis | Cluster;

export type RedisTarget =
  | { kind: 'single'; options: RedisOptions; display: string }
  | { kind: 'cluster'; nodes: { host: string; port: number }[]; redisOptions: RedisOptions; display: string };

const URL_FORMS = 'redis://HOST[:PORT][/DB], rediss://HOST[:PORT][/DB], unix:///PATH/TO/SOCKET[?db=N], ' +
  'redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTERNAME[/DB], redis+cluster://HOST:PORT[,HOST:PORT...]';

function badUrl(url: string, why: string): InvalidArgumentError {
  return new InvalidArgumentError(`--redis ${redact(url)}: ${why}; use one of ${URL_FORMS}`);
}

/** The URL with any password replaced, for messages and logs. */
export function redact(url: string): string {
  return url.replace(/^([a-z+]+:\/\/)([^@/]*)@/i, (_m, scheme: string, auth: string) => {
    const i = auth.indexOf(':');
    return i < 0 ? `${scheme}${auth}@` : `${scheme}${auth.slice(0, i)}:***@`;
  }).replace(/([?&](?:password|sentinelPassword)=)[^&]*/g, '$1***');
}

function parseDb(url: string, s: string | null | undefined): number | undefined {
  if (s === null || s === undefined || s === '') return undefined;
  if (!/^\d{1,5}$/.test(s)) throw badUrl(url, `database "${s}" is not a number`);
  return Number(s);
}

function parseHostPort(url: string, s: string, defaultPort: number): { host: string; port: number } {
  const m = /^(?:\[([0-9a-fA-F:.]+)\]|([^:[\]]+))(?::(\d{1,5}))?$/.exec(s);
  if (!m) throw badUrl(url, `"${s}" is not HOST[:PORT]`);
  const port = m[3] ? Number(m[3]) : defaultPort;
  if (port < 1 || port > 65535) throw badUrl(url, `port ${port} out of range`);
  return { host: m[1] ?? m[2] ?? '', port };
}

function parseAuth(auth: string | undefined): { username?: string; password?: string } {
  if (!auth) return {};
  const i = auth.indexOf(':');
  const user = decodeURIComponent(i < 0 ? auth : auth.slice(0, i));
  const pass = i < 0 ? '' : decodeURIComponent(auth.slice(i + 1));
  // `redis://secret@host` is a password by convention (Redis < 6 has no users).
  if (i < 0) return user ? { password: user } : {};
  return { ...(user ? { username: user } : {}), ...(pass ? { password: pass } : {}) };
}

/**
 * `--redis` URL -> ioredis connection options. Accepted:
 * redis://[[user]:pass@]host[:port][/db], rediss://... (TLS), unix:///path[?db=N&password=P],
 * redis+sentinel://[[user]:pass@]h1:26379,h2:26379/mastername[/db][?sentinelPassword=P],
 * redis+cluster://[[user]:pass@]h1:6379,h2:6379.
 */
export function parseRedisUrl(url: string): RedisTarget {
  const display = redact(url);
  const scheme = /^([a-z+]+):/i.exec(url)?.[1]?.toLowerCase();
  if (scheme === 'redis+sentinel' || scheme === 'redis+cluster') {
    const m = /^[a-z+]+:\/\/(?:([^@/]*)@)?([^/?#]+)(\/[^?#]*)?(?:\?([^#]*))?$/i.exec(url);
    if (!m) throw badUrl(url, 'cannot parse it');
    const auth = parseAuth(m[1]);
    const query = new URLSearchParams(m[4] ?? '');
    const sentinel = scheme === 'redis+sentinel';
    const nodes = m[2]!.split(',').filter(Boolean).map((h) => parseHostPort(url, h, sentinel ? 26379 : 6379));
    if (nodes.length === 0) throw badUrl(url, 'no hosts');
    const parts = (m[3] ?? '').split('/').filter(Boolean);
    if (!sentinel) {
      if (parts.length > 0) throw badUrl(url, 'Redis Cluster has no databases or master names: give only hosts');
      return { kind: 'cluster', nodes, redisOptions: { ...auth }, display };
    }
    const name = parts[0] ? decodeURIComponent(parts[0]) : '';
    if (!name || parts.length > 2) throw badUrl(url, 'give the master name after the hosts: redis+sentinel://h1:26379,h2:26379/mymaster');
    const db = parseDb(url, parts[1]);
    const sentinelPassword = query.get('sentinelPassword');
    return {
      kind: 'single',
      options: { sentinels: nodes, name, ...auth, ...(db !== undefined ? { db } : {}), ...(sentinelPassword ? { sentinelPassword } : {}) },
      display,
    };
  }
  let u: URL;
  try { u = new URL(url); } catch { throw badUrl(url, 'not a URL'); }
  if (scheme === 'unix') {
    const p = decodeURIComponent(u.pathname);
    if (u.host || !p.startsWith('/') || p === '/') throw badUrl(url, 'give an absolute socket path: unix:///run/redis/redis.sock');
    const db = parseDb(url, u.searchParams.get('db'));
    const password = u.searchParams.get('password');
    return { kind: 'single', options: { path: p, ...(db !== undefined ? { db } : {}), ...(password ? { password } : {}) }, display };
  }
  if (scheme === 'redis' || scheme === 'rediss') {
    if (!u.hostname) throw badUrl(url, 'no host');
    const host = u.hostname.replace(/^\[(.*)\]$/, '$1');
    const port = u.port ? Number(u.port) : 6379;
    const dbPath = u.pathname.replace(/^\//, '');
    const db = parseDb(url, dbPath || u.searchParams.get('db'));
    const auth = parseAuth(u.username || u.password ? `${u.username}:${u.password}` : undefined);
    if (!u.username && u.password) delete auth.username;
    const options: RedisOptions = { host, port, ...auth, ...(db !== undefined ? { db } : {}) };
    if (scheme === 'rediss') options.tls = net.isIP(host) ? {} : { servername: host };
    return { kind: 'single', options, display };
  }
  throw badUrl(url, `unknown scheme "${scheme ?? ''}"`);
}

export interface OpenRedisOptions {
  /** A command without a reply within this fails (default 2000 ms). */
  commandTimeoutMs?: number;
  /** Give up connecting after this (default 3000 ms). */
  connectTimeoutMs?: number;
  connectionName?: string;
  log?: Logger;
}

/** Reconnect quickly and forever after a connection was established; commands never queue. */
const retryStrategy = (times: number): number => Math.min(100 * times, 1000);

/**
 * Connect to the Redis the URL names, fail fast: no offline queue (a command while
 * disconnected fails at once instead of running late), one retry per request, a short command
 * timeout, and a connect that gives up after connectTimeoutMs with a message naming the URL.
 * The lease scripts are registered (EVALSHA with EVAL fallback).
 */
export async function openRedis(url: string, opts: OpenRedisOptions = {}): Promise<RedisClient> {
  const target = parseRedisUrl(url);
  const commandTimeout = opts.commandTimeoutMs ?? 2000;
  const connectTimeout = opts.connectTimeoutMs ?? 3000;
  const log = opts.log ?? silentLogger();
  const common = {
    lazyConnect: true,
    maxRetriesPerRequest: 1,
    // A command whose reply was lost must fail, not run again later after a reconnect.
    autoResendUnfulfilledCommands: false,
    commandTimeout,
    connectTimeout,
    ...(opts.connectionName ? { connectionName: opts.connectionName } : {}),
  };
  let client: RedisClient;
  if (target.kind === 'cluster') {
    client = new Cluster(target.nodes, {
      lazyConnect: true,
      enableOfflineQueue: false,
      scripts: LEASE_SCRIPTS,
      clusterRetryStrategy: retryStrategy,
      slotsRefreshTimeout: Math.min(connectTimeout, 2000),
      redisOptions: { ...target.redisOptions, ...common, replyMapping: 'legacy' },
    });
  } else {
    client = new Redis({
      ...target.options,
      ...common,
      replyMapping: 'legacy',
      enableOfflineQueue: false,
      retryStrategy,
      scripts: LEASE_SCRIPTS,
      ...('sentinels' in target.options ? { sentinelRetryStrategy: (n: number) => (n > 2 ? null : 100 * n), sentinelCommandTimeout: commandTimeout } : {}),
    });
  }
  let lastError: unknown;
  // Always listen: an unhandled 'error' event would crash the process on a Redis restart.
  client.on('error', (err: unknown) => {
    lastError = err;
    log.debug({ redis: target.display, err: errorMessage(err) }, 'redis connection error');
  });
  let timer: NodeJS.Timeout | undefined;
  try {
    await Promise.race([
      client.connect(),
      new Promise<never>((_, reject) => { timer = setTimeout(() => reject(new Error(`no answer within ${connectTimeout} ms`)), connectTimeout + 200); }),
    ]);
  } catch (err) {
    client.disconnect();
    const why = errorMessage(lastError ?? err);
    throw new StoreUnavailableError(`cannot reach Redis at ${target.display}: start it or fix --redis (${why})`, { cause: lastError ?? err });
  } finally {
    clearTimeout(timer);
  }
  return client;
}

// ------------------------------------------------------------------ pub/sub

type MessageFn = (msg: Record<string, unknown>) => void;

/**
 * Channel subscriptions on one extra connection (a subscribed connection can run no other
 * command). Opened with the first subscription, closed with the last. Failures are logged
 * and ignored: pub/sub only makes handoffs and waits faster; renewals and polling are the
 * guarantee.
 */
class Subscriptions {
  readonly #client: RedisClient;
  readonly #log: Logger;
  readonly #display: string;
  readonly #handlers = new Map<string, Set<MessageFn>>();
  #conn: RedisClient | null = null;
  #ops: Promise<unknown> = Promise.resolve();

  readonly #timeoutMs: number;

  constructor(client: RedisClient, display: string, log: Logger, timeoutMs: number) {
    this.#client = client;
    this.#display = display;
    this.#log = log;
    this.#timeoutMs = timeoutMs;
  }

  /** Subscribe `fn` to `channel`; resolves once subscribed (or once that failed). Returns the remover. */
  async add(channel: string, fn: MessageFn): Promise<() => void> {
    let set = this.#handlers.get(channel);
    const first = !set;
    if (!set) { set = new Set(); this.#handlers.set(channel, set); }
    set.add(fn);
    if (first) {
      await this.#serial(async () => {
        if (!this.#handlers.has(channel)) return;
        const fresh = !this.#conn;
        const conn = await this.#connection();
        if (!fresh) await conn.subscribe(channel); // a fresh connection subscribed to every channel
      });
    }
    let removed = false;
    return () => {
      if (removed) return;
      removed = true;
      const s = this.#handlers.get(channel);
      if (!s?.delete(fn) || s.size > 0) return;
      this.#handlers.delete(channel);
      void this.#serial(async () => {
        if (this.#handlers.has(channel) || !this.#conn) return;
        if (this.#handlers.size === 0) { this.#conn.disconnect(); this.#conn = null; return; }
        await this.#conn.unsubscribe(channel);
      });
    };
  }

  close(): Promise<void> {
    this.#handlers.clear();
    return this.#serial(async () => { this.#conn?.disconnect(); this.#conn = null; });
  }

  #serial(fn: () => Promise<void>): Promise<void> {
    const p = this.#ops.then(fn).catch((err: unknown) => {
      this.#log.debug({ redis: this.#display, err: errorMessage(err) }, 'lease pub/sub unavailable; relying on renewals');
    });
    this.#ops = p;
    return p;
  }

  /** The subscriber connection; a new one subscribes to every channel that has handlers. */
  async #connection(): Promise<RedisClient> {
    if (this.#conn) return this.#conn;
    const c = this.#client;
    const conn: RedisClient = c instanceof Cluster ? c.duplicate() : c.duplicate();
    conn.on('error', (err: unknown) => this.#log.debug({ redis: this.#display, err: errorMessage(err) }, 'lease pub/sub connection error'));
    conn.on('message', (channel: string, message: string) => {
      const fns = this.#handlers.get(channel);
      if (!fns) return;
      let msg: unknown;
      try { msg = JSON.parse(message); } catch { return; }
      if (!msg || typeof msg !== 'object') return;
      for (const f of [...fns]) f(msg as Record<string, unknown>);
    });
    // Bounded: a slow subscriber must not delay an acquire (pub/sub is only the fast path).
    let timer: NodeJS.Timeout | undefined;
    try {
      await Promise.race([
        (async () => {
          await conn.connect();
          if (this.#handlers.size > 0) await conn.subscribe(...this.#handlers.keys());
        })(),
        new Promise<never>((_, reject) => { timer = setTimeout(() => reject(new Error(`no answer within ${this.#timeoutMs} ms`)), this.#timeoutMs); }),
      ]);
    } catch (err) {
      conn.disconnect();
      throw err;
    } finally {
      clearTimeout(timer);
    }
    this.#conn = conn;
    return conn;
  }
}

// ------------------------------------------------------------------ the manager

export interface RedisLeaseOptions extends OpenRedisOptions {
  /** Lease TTL in ms (default 5000); renewals every ttl/3. */
  ttlMs?: number;
  /** false: leases are never renewed (test hook: a holder that hangs). Default true. */
  renew?: boolean;
  /** How often a waiting acquire retries when no release message wakes it (default 100 ms). */
  pollMs?: number;
}

const str = (v: unknown): string => (v === null || v === undefined || v === false ? '' : String(v));

class RedisLease extends RenewingLease {
  readonly #mgr: RedisLeaseManager;

  constructor(mgr: RedisLeaseManager, a: RenewingLeaseArgs) {
    super(a);
    this.#mgr = mgr;
  }

  protected async renewOnce(status: LeaseStatus | undefined): Promise<RenewResult> {
    const r = await this.#mgr._run(() => this.#mgr.client.batonLeaseRenew(
      leaseKey(this.volume), this.holder, String(this.token), this.ttlMs, status ? JSON.stringify(status) : ''));
    if (Number(r[0]) !== 1) {
      const holder = str(r[1]);
      return { held: false, reason: holder ? `${holder} holds it now (token ${str(r[2])})` : 'the lease is gone from Redis: it expired before it was renewed, was revoked (`baton rm --force`), or Redis lost it' };
    }
    const to = str(r[1]);
    const id = str(r[2]);
    return to && id ? { held: true, handoff: { to, id } } : { held: true };
  }

  protected async releaseOnce(to: string | undefined): Promise<boolean> {
    const r = await this.#mgr._run(() => this.#mgr.client.batonLeaseRelease(
      leaseKey(this.volume), this.holder, String(this.token), to ?? '', this.ttlMs, channelOf(this.volume)));
    return Number(r) === 1;
  }

  // message(): RenewingLease's (a doorbell, never an instruction); the simulator's lease runs the same code.
}

export class RedisLeaseManager implements LeaseManager {
  readonly description: string;
  readonly client: RedisClient;
  readonly #display: string;
  readonly #ttlMs: number;
  readonly #renew: boolean;
  readonly #pollMs: number;
  readonly #commandTimeoutMs: number;
  readonly #log: Logger;
  readonly #subs: Subscriptions;
  readonly #leases = new Set<RedisLease>();
  #closed = false;

  /** Takes ownership of `client` (from openRedis, or any client: the scripts are defined if missing). */
  constructor(client: RedisClient, opts: RedisLeaseOptions & { url: string }) {
    this.client = client;
    this.#display = redact(opts.url);
    this.description = `redis ${this.#display}`;
    this.#ttlMs = checkTtl(opts.ttlMs);
    this.#renew = opts.renew ?? true;
    this.#pollMs = opts.pollMs ?? 100;
    this.#commandTimeoutMs = opts.commandTimeoutMs ?? 2000;
    this.#log = opts.log ?? silentLogger();
    for (const [name, def] of Object.entries(LEASE_SCRIPTS)) {
      if (typeof (client as unknown as Record<string, unknown>)[name] !== 'function') client.defineCommand(name, def);
    }
    this.#subs = new Subscriptions(client, this.#display, this.#log, this.#commandTimeoutMs);
  }

  async acquire(volume: string, holder: string, options: AcquireOptions = {}): Promise<Lease> {
    checkVolumeName(volume);
    checkHolderId(holder);
    const { waitMs, minToken } = checkAcquireOptions(options);
    this.#checkOpen();
    // Fail fast while disconnected (commands would fail anyway; do not even try to subscribe).
    if (this.client.status !== 'ready') {
      throw new StoreUnavailableError(`cannot reach Redis at ${this.#display}: start it or fix --redis (connection ${this.client.status})`);
    }
    const deadline = performance.now() + waitMs;
    let lease: RedisLease | undefined;
    let wake: (() => void) | null = null;
    // Subscribe BEFORE acquiring, so a handoff request right after the acquire is not missed.
    const unsubscribe = await this.#subs.add(channelOf(volume), (msg) => {
      if (lease) lease.message(msg);
      else if (msg.type === 'released') wake?.();
    });
    try {
      for (;;) {
        const startedAt = performance.now();
        const r = await this._run(() => this.client.batonLeaseAcquire(leaseKey(volume), counterKey(volume), holder, this.#ttlMs, String(minToken)));
        if (Number(r[0]) === 1) {
          const token = Number(r[1]);
          const l: RedisLease = new RedisLease(this, {
            volume, holder, token, ttlMs: this.#ttlMs, startedAt, renew: this.#renew, log: this.#log,
            ended: () => { this.#leases.delete(l); unsubscribe(); },
          });
          lease = l;
          this.#leases.add(l);
          l.start();
          this.#log.info({ volume, holder, token }, 'lease acquired');
          return l;
        }
        const [, curHolder, curToken, pttl, reserved] = r;
        const err: LeaseHeldError = str(curHolder)
          ? heldError(volume, str(curHolder), str(curToken), Number(pttl), holder)
          : reservedError(volume, str(reserved), Number(pttl));
        const left = deadline - performance.now();
        if (left <= 0) throw err;
        this.#checkOpen();
        await new Promise<void>((resolve) => {
          const done = (): void => { clearTimeout(t); wake = null; resolve(); };
          const t = setTimeout(done, Math.min(this.#pollMs, left));
          wake = done;
        });
      }
    } catch (err) {
      unsubscribe();
      throw err;
    }
  }

  async inspect(volume: string): Promise<LeaseRecord | null> {
    checkVolumeName(volume);
    const flat = await this._run(() => this.client.batonLeaseInspect(leaseKey(volume)));
    const h = new Map<string, string>();
    for (let i = 0; i + 1 < flat.length; i += 2) h.set(str(flat[i]), str(flat[i + 1]));
    if (!h.has('token')) return null;
    const rec: LeaseRecord = { volume, holder: h.get('holder') ?? '', token: Number(h.get('token')), ttlMs: Math.max(0, Number(h.get('pttl') ?? 0)) };
    const reservedFor = h.get('reservedFor');
    const handoff = h.get('handoffRequestedBy');
    const status = parseStatus(h.get('status'));
    if (reservedFor) rec.reservedFor = reservedFor;
    if (handoff) rec.handoffRequestedBy = handoff;
    if (status) rec.status = status;
    return rec;
  }

  async list(): Promise<LeaseRecord[]> {
    const nodes: Redis[] = this.client instanceof Cluster ? this.client.nodes('master') : [this.client];
    const keys = new Set<string>();
    for (const node of nodes) {
      let cursor = '0';
      do {
        const [next, batch] = await this._run(() => node.scan(cursor, 'MATCH', LEASE_MATCH, 'COUNT', 1000));
        cursor = next;
        for (const k of batch) keys.add(k);
      } while (cursor !== '0');
    }
    const prefix = 'baton:lease:{';
    const vols = [...keys].filter((k) => k.startsWith(prefix) && k.endsWith('}')).map((k) => k.slice(prefix.length, -1)).sort();
    const out: LeaseRecord[] = [];
    for (const v of vols) {
      let r: LeaseRecord | null;
      try { r = await this.inspect(v); } catch (err) { if (err instanceof InvalidArgumentError) continue; throw err; }
      if (r) out.push(r);
    }
    return out;
  }

  async requestHandoff(volume: string, to: string): Promise<void> {
    checkVolumeName(volume);
    checkHolderId(to, 'handoff target');
    this.#checkOpen();
    const r = await this._run(() => this.client.batonLeaseRequestHandoff(leaseKey(volume), to, randomUUID(), channelOf(volume)));
    const code = Number(r[0]);
    if (code === 0) throw nobodyHoldsError(volume, to, str(r[1]) || undefined);
    if (code === 2) throw alreadyHolderError(volume, to);
  }

  async revoke(volume: string): Promise<boolean> {
    checkVolumeName(volume);
    this.#checkOpen();
    const r = await this._run(() => this.client.batonLeaseRevoke(leaseKey(volume), counterKey(volume), channelOf(volume)));
    return Number(r) === 1;
  }

  async ping(): Promise<void> {
    this.#checkOpen();
    // Like acquire: disconnected is an answer at once, not after a queued command times out.
    if (this.client.status !== 'ready') throw new StoreUnavailableError(`cannot reach Redis at ${this.#display} (connection ${this.client.status})`);
    await this._run(() => this.client.ping());
  }

  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    await Promise.all([...this.#leases].map((l) => l.closeByManager()));
    await this.#subs.close();
    this.client.disconnect();
  }

  /** @internal Run a Redis command; any failure becomes a StoreUnavailableError naming the URL. */
  async _run<T>(fn: () => Promise<T>): Promise<T> {
    try {
      return await fn();
    } catch (err) {
      const msg = errorMessage(err);
      if ((err as Error | undefined)?.name === 'ReplyError') {
        throw new StoreUnavailableError(`Redis at ${this.#display} refused a lease command: ${msg}`, { cause: err });
      }
      if (/timed out/i.test(msg)) {
        throw new StoreUnavailableError(`Redis at ${this.#display} did not answer within ${this.#commandTimeoutMs} ms: is it overloaded or unreachable? (check --redis)`, { cause: err });
      }
      throw new StoreUnavailableError(`cannot reach Redis at ${this.#display}: start it or fix --redis (${msg})`, { cause: err });
    }
  }

  #checkOpen(): void {
    if (this.#closed) throw new InvalidArgumentError('the lease manager is closed');
  }
}

/** Connect (fail fast, see openRedis) and return a lease manager that owns the connection. */
export async function openRedisLeaseManager(url: string, opts: RedisLeaseOptions = {}): Promise<RedisLeaseManager> {
  const ttlMs = checkTtl(opts.ttlMs);
  // A renewal must fail (and be retried) well inside the TTL, not hang past the deadline.
  // (ttl/3: one renewal interval; a timed-out renewal still leaves time for a retry.)
  const commandTimeoutMs = opts.commandTimeoutMs ?? Math.max(500, Math.min(2000, Math.floor(ttlMs / 3)));
  const client = await openRedis(url, { ...opts, commandTimeoutMs, connectionName: opts.connectionName ?? 'baton-lease' });
  return new RedisLeaseManager(client, { ...opts, ttlMs, commandTimeoutMs, url });
}

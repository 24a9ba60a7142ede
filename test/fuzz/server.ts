/**
 * The server under fuzz, in its own process (so its memory is its own and a crash is seen as
 * one): wired as `baton serve --store memory:` wires it (cli/baton.ts): StoreCatalog over an
 * in-memory object store, VolumeExports with a local lease, NbdServer on a Unix socket,
 * background compaction and GC. Volumes: fz0..fzN-1 (one per fuzz lane), ro with a known
 * pattern and its snapshot ro@s (read-only), victim (the well-behaved client's).
 *
 * Started by fuzzer.ts with fork(); talks over the IPC channel:
 *   -> { op: 'idle', id, name }   resolves when no connection holds a handle to `name`
 *                                 (every request of its sessions answered, handles released)
 *   -> { op: 'stats', id, gc }    memory (after a full GC if asked), connections, store bytes
 *   -> { op: 'stop', id }         close the server gracefully, report, exit
 *   <- { ready: true } once listening; { id, ... } answers.
 *
 * Faults for the fuzzer's self-tests (`inject`, test code only, nothing in the server):
 *   corrupt-read  fuzz volumes return one wrong byte in reads that start on a 64 KiB boundary
 *   zero-lie      fuzz volumes report every extent as ZERO
 *   hang-flush    flushes on fuzz volumes never finish
 *   leak          every attach keeps 2 MiB alive for good
 *   victim-rot    the victim volume returns a wrong byte once it has served 200 reads
 */

import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Writable } from 'node:stream';
import pino from 'pino';
import type { BlockBackend, ExportHandle, ExportInfo, ExportProvider, ExportSummary, Extent, ZeroOptions } from '../../nbd/backend.js';
import { NbdServer } from '../../nbd/server.js';
import { BlockCache } from '../../src/cache.js';
import { VolumeExports } from '../../src/exports.js';
import { LocalLeaseManager } from '../../src/lease/local.js';
import { BackgroundMaintenance } from '../../src/maintenance.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import type { PutOptions } from '../../src/store/object-store.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import type { Volume } from '../../src/volume/volume.js';
import { MiB, laneVolume, roPattern, type World } from './proto.js';

export interface ServerConfig {
  socket: string;
  world: World;
  idleGraceMs: number;
  gcIntervalMs: number;
  gcGraceMs: number;
  cacheBytes: number;
  inject?: string;
}

/** Counts the bytes it holds, so memory can be judged without the volumes' stored data. */
class CountingStore extends MemoryObjectStore {
  bytes = 0;
  private readonly sizes = new Map<string, number>();
  override async put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    await super.put(key, body, options);
    this.bytes += body.length - (this.sizes.get(key) ?? 0);
    this.sizes.set(key, body.length);
  }
  override async delete(key: string): Promise<void> {
    await super.delete(key);
    this.bytes -= this.sizes.get(key) ?? 0;
    this.sizes.delete(key);
  }
}

/** Log lines that say something went wrong inside the server, counted by message. */
const logCounts = new Map<string, number>();
const logSamples: string[] = [];
const logSink = new Writable({
  write(chunk: Buffer, _enc, cb): void {
    for (const line of chunk.toString('utf8').split('\n')) {
      if (!line) continue;
      try {
        const o = JSON.parse(line) as { level: number; msg: string; err?: string };
        const key = `${o.level >= 50 ? 'error' : 'warn'}: ${o.msg}`;
        logCounts.set(key, (logCounts.get(key) ?? 0) + 1);
        // A sample of everything but the warning every malformed client causes.
        if (logSamples.length < 50 && o.msg !== 'closing connection after protocol error') logSamples.push(line.slice(0, 500));
      } catch { /* not JSON */ }
    }
    cb();
  },
});

/** Wraps the provider: counts open handles per export (the fuzzer waits for a lane's to drop to 0) and injects self-test faults. */
class CountingProvider implements ExportProvider {
  readonly handles = new Map<string, number>();
  private idleWaiters: { name: string; resolve: () => void }[] = [];
  private readonly leaked: Buffer[] = [];
  readonly info?: (name: string) => Promise<ExportInfo>;
  constructor(private readonly inner: VolumeExports, private readonly world: World, private readonly inject: string | undefined) {
    this.info = (name) => inner.info(name);
  }
  list(): Promise<ExportSummary[]> { return this.inner.list(); }
  async open(name: string): Promise<ExportHandle> {
    const h = await this.inner.open(name);
    this.handles.set(h.name, (this.handles.get(h.name) ?? 0) + 1);
    if (this.inject === 'leak') this.leaked.push(Buffer.alloc(2 * MiB, 1));
    let released = false;
    return {
      name: h.name,
      description: h.description,
      backend: this.faulty(h.name, h.backend),
      release: () => {
        if (released) return;
        released = true;
        h.release();
        const n = (this.handles.get(h.name) ?? 1) - 1;
        if (n === 0) this.handles.delete(h.name); else this.handles.set(h.name, n);
        if (n === 0) {
          const ready = this.idleWaiters.filter((w) => w.name === h.name);
          this.idleWaiters = this.idleWaiters.filter((w) => w.name !== h.name);
          for (const w of ready) w.resolve();
        }
      },
    };
  }
  whenIdle(name: string): Promise<void> {
    if (!this.handles.get(name)) return Promise.resolve();
    return new Promise((resolve) => this.idleWaiters.push({ name, resolve }));
  }

  private victimReads = 0;
  private faulty(name: string, b: BlockBackend): BlockBackend {
    const inj = this.inject;
    const isLane = /^fz\d+$/.test(name);
    if (!inj || inj === 'leak') return b;
    if (inj === 'victim-rot' && name === this.world.victimName) {
      return wrap(b, {
        read: async (off, len, into) => {
          const d = await b.read(off, len, into);
          if (++this.victimReads > 200 && d.length > 0) d[0] = d[0]! ^ 0x40;
          return d;
        },
      });
    }
    if (!isLane) return b;
    if (inj === 'corrupt-read') {
      return wrap(b, { read: async (off, len, into) => { const d = await b.read(off, len, into); if (off % 65536 === 0 && d.length >= 512) d[100] = d[100]! ^ 0x01; return d; } });
    }
    if (inj === 'zero-lie') {
      return wrap(b, { blockStatus: async (off, len, max) => (await b.blockStatus(off, len, max)).map((e) => ({ length: e.length, flags: 2 })) });
    }
    if (inj === 'hang-flush') {
      return wrap(b, { flush: () => new Promise<void>(() => {}) });
    }
    return b;
  }
}

function wrap(b: BlockBackend, over: Partial<Pick<BlockBackend, 'read' | 'blockStatus' | 'flush'>>): BlockBackend {
  return {
    get size() { return b.size; },
    get readOnly() { return b.readOnly; },
    read: over.read ?? ((o, l, i) => b.read(o, l, i)),
    write: (o, d, f) => b.write(o, d, f),
    ...(b.writeLent ? { writeLent: (o: number, c: readonly Buffer[], f: boolean) => b.writeLent!(o, c, f) } : {}),
    flush: over.flush ?? (() => b.flush()),
    trim: (o, l, f) => b.trim(o, l, f),
    zero: (o: number, l: number, z: ZeroOptions) => b.zero(o, l, z),
    blockStatus: over.blockStatus ?? ((o: number, l: number, m: number): Promise<Extent[]> => b.blockStatus(o, l, m)),
    cache: (o, l) => b.cache(o, l),
  };
}

async function main(): Promise<void> {
  const cfg = JSON.parse(process.argv[2]!) as ServerConfig;
  const w = cfg.world;
  const log = pino({ level: 'warn' }, logSink);
  const store = new CountingStore();
  const cache = await BlockCache.open({ capacityBytes: cfg.cacheBytes });
  const catalog = new StoreCatalog({ store, log, cache: async () => cache });

  for (let i = 0; i < w.lanes; i++) await catalog.create(laneVolume(i), w.laneSize);
  await catalog.create(w.victimName, w.victimSize);
  const roBase = w.roName.split('@')[0]!;
  await catalog.create(roBase, w.roSize);
  {
    const ov = await catalog.open(roBase, { readOnly: false });
    for (let off = 0; off < w.roSize / 2; off += MiB) await ov.backend.write(off, roPattern(off, Math.min(MiB, w.roSize / 2 - off), w.roSize), false);
    await ov.backend.flush();
    await ov.close();
  }
  await catalog.snapshot(roBase, w.roName.split('@')[1]!);

  const leaseDir = fs.mkdtempSync(path.join(os.tmpdir(), 'baton-fuzz-lease-'));
  const leases = new LocalLeaseManager(leaseDir, { ttlMs: 30_000, log });
  const exports = new VolumeExports(catalog, {
    readOnly: false, idleGraceMs: cfg.idleGraceMs, log,
    lease: { manager: leases, hostId: 'fuzz', onHeld: 'refuse', waitMs: 0, address: `unix:${cfg.socket}` },
  });
  const provider = new CountingProvider(exports, w, cfg.inject);
  const server = new NbdServer(provider, { log, ...w.limits });
  exports.setDisconnector((name) => server.disconnectExport(name));
  await server.listen({ path: cfg.socket });
  const maintenance = new BackgroundMaintenance(catalog, exports, { intervalMs: cfg.gcIntervalMs, graceMs: cfg.gcGraceMs, compactBelow: 0.5, log });
  maintenance.start();

  // Memory the fuzzer may hold against the server: everything but the volumes' data (the
  // store's bytes, dirty and sealed data in the engines, the read cache), sampled every
  // 100 ms for the peak, and after a full GC on request for the steady state.
  const volumes = (): Volume[] => exports.writableVolumes().map((x) => x.volume);
  const accounted = (): number => store.bytes + cache.stats.cachedBytes + volumes().reduce((s, vol) => { const st = vol.stats(); return s + st.dirtyBytes + st.sealedBytes; }, 0);
  const sample = (): { heap: number; external: number; rss: number; other: number } => {
    const m = process.memoryUsage();
    return { heap: m.heapUsed, external: m.external + m.arrayBuffers, rss: m.rss, other: m.heapUsed + m.external - accounted() };
  };
  let peakOther = 0;
  let peakRss = 0;
  const sampler = setInterval(() => {
    const s = sample();
    peakOther = Math.max(peakOther, s.other);
    peakRss = Math.max(peakRss, s.rss);
  }, 100);
  sampler.unref();

  process.on('message', (msg: { op: string; id: number; name?: string; gc?: boolean; resetPeak?: boolean }) => {
    const answer = (x: object): void => { process.send?.({ id: msg.id, ...x }); };
    if (msg.op === 'idle') {
      void provider.whenIdle(msg.name!).then(() => answer({ ok: true }));
    } else if (msg.op === 'stats') {
      if (msg.gc && typeof globalThis.gc === 'function') globalThis.gc();
      const s = sample();
      const out = {
        ...s, peakOther, peakRss, storeBytes: store.bytes, storeObjects: store.size, cachedBytes: cache.stats.cachedBytes,
        connections: server.connectionCount, handles: Object.fromEntries(provider.handles),
        log: Object.fromEntries(logCounts), logSamples: logSamples.slice(0, 10),
        maxRss: process.resourceUsage().maxRSS * 1024,
        cpuMs: (process.cpuUsage().user + process.cpuUsage().system) / 1000,
      };
      if (msg.resetPeak) peakOther = 0;
      answer(out);
    } else if (msg.op === 'stop') {
      void (async () => {
        await maintenance.stop();
        await server.close();
        await exports.close();
        await leases.close();
        fs.rmSync(leaseDir, { recursive: true, force: true });
        answer({ ok: true, log: Object.fromEntries(logCounts), logSamples });
        setTimeout(() => process.exit(0), 50);
      })();
    }
  });
  process.on('disconnect', () => process.exit(0));
  process.send?.({ ready: true });
}

main().catch((err: unknown) => {
  process.stderr.write(`fuzz server failed to start: ${err instanceof Error ? err.stack : String(err)}\n`);
  process.exit(2);
});

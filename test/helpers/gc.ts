/** Garbage collection from tests: `baton gc` in seconds instead of hours, and what a store holds. */
import { LocalDirObjectStore } from '../../src/store/local-dir.js';
import { listAll } from '../../src/store/object-store.js';
import { run } from './ext4.js';
import { BATON_BIN } from './server.js';

/** Operations bounded by 1 s: every baton process of a GC test must run with it (serve too). */
export const GC_TEST_ENV = { BATON_MAX_OPERATION_MS: '1000' };
export const GC_TEST_GRACE = '2s';

/** Bytes of every volume object in a file: store (what the store would bill). */
export async function storeObjectBytes(store: string, prefix = 'vol/'): Promise<number> {
  const s = new LocalDirObjectStore(store.slice('file:'.length));
  try {
    return (await listAll(s, prefix)).reduce((n, o) => n + o.size, 0);
  } finally {
    await s.close();
  }
}

export interface GcJson { deletedObjects: number; deletedBytes: number; markedObjects: number; youngUnreferenced: number; awaitingMarkAge?: number; storedBytes: number; referencedBytes: number; compacted?: { name: string; result?: { rewrittenBytes: number; objects: number }; skipped?: string }[] }

/**
 * `baton gc --json` every grace period until a run marks nothing, finds nothing young and has
 * nothing awaiting its mark's age (everything freed is deleted). `firstRun` goes to the first run only (e.g. --compact);
 * `storeArgs` and `env` to every run (S3 endpoint and credentials).
 */
export async function gcUntilQuiet(store: string, o: { firstRun?: string[]; storeArgs?: string[]; env?: Record<string, string>; maxRuns?: number } = {}): Promise<GcJson[]> {
  const runs: GcJson[] = [];
  for (let i = 0; i < (o.maxRuns ?? 6); i++) {
    const args = [BATON_BIN, 'gc', '--store', store, ...(o.storeArgs ?? []), '--grace', GC_TEST_GRACE, '--json', ...(i === 0 ? o.firstRun ?? [] : [])];
    const r = await run(process.execPath, args, { timeoutMs: 300_000, env: { ...o.env, ...GC_TEST_ENV } });
    if (r.code !== 0) throw new Error(`baton gc exited ${r.code ?? r.signal}: ${r.output}`);
    const j = JSON.parse(r.stdout) as GcJson;
    runs.push(j);
    // A candidate named by a younger mark (an earlier run's) is not re-marked: markedObjects is 0
    // while it ages, so the loop goes on until nothing awaits its mark's age either.
    if (i > 0 && j.markedObjects === 0 && j.youngUnreferenced === 0 && !j.awaitingMarkAge) break;
    await new Promise((res) => setTimeout(res, 2200));
  }
  return runs;
}

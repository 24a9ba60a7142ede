/** Opens the volume catalog a `--store` URL names. */

import * as path from 'node:path';
import { BlockCache } from './cache.js';
import { batonHome } from './config.js';
import type { Logger } from './log.js';
import { silentLogger } from './log.js';
import { openStore, parseStoreUrl, type OpenStoreOptions } from './store/open.js';
import { StoreCatalog } from './volume/catalog.js';
import { loadMasterKey, type MasterKey } from './volume/keys.js';
import type { VolumeOptions } from './volume/volume.js';
import { FileCatalog, MemoryCatalog, type VolumeCatalog } from './volumes.js';

export interface CatalogOptions extends OpenStoreOptions {
  log?: Logger;
  cacheDir?: string;
  cacheSize?: number;
  volume?: Partial<Omit<VolumeOptions, 'store' | 'cache' | 'log' | 'readOnly' | 'frameKeys'>>;
  /** The master key file (--key-file); without it, BATON_KEY_FILE or BATON_KEY, read when an encrypted volume needs it (keys.ts). */
  keyFile?: string;
}

export function defaultCacheDir(): string {
  return process.env.BATON_CACHE_DIR || path.join(batonHome(), 'cache');
}

/**
 * `file:DIR`, `s3://bucket/prefix`, `memory:` are object stores under the volume engine.
 * Two plain backends without the engine exist for benchmarks and local use:
 * `ram:` (sparse memory, like nbdkit memory) and `raw:DIR` (one sparse file per volume,
 * FLUSH = fdatasync: durable on this disk only).
 */
export function openCatalog(url: string, opts: CatalogOptions = {}): VolumeCatalog {
  // One parser for every store URL (src/store/open.ts): `raw:~/x` means what `file:~/x` does.
  const loc = parseStoreUrl(url);
  if (loc.kind === 'ram') return new MemoryCatalog();
  if (loc.kind === 'raw') return new FileCatalog(loc.dir);
  return openStoreCatalog(url, opts);
}

export function openStoreCatalog(url: string, opts: CatalogOptions = {}): StoreCatalog {
  const store = openStore(url, opts);
  let cache: Promise<BlockCache> | null = null;
  let master: { key: MasterKey | null } | undefined;
  return new StoreCatalog({
    store,
    log: opts.log ?? silentLogger(),
    cache: () => (cache ??= BlockCache.open({ dir: opts.cacheDir ?? defaultCacheDir(), capacityBytes: opts.cacheSize ?? 2 * 1024 ** 3, ...(opts.log ? { log: opts.log } : {}) })),
    ...(opts.volume ? { volume: opts.volume } : {}),
    masterKey: () => (master ??= { key: loadMasterKey(opts.keyFile) }).key,
  });
}

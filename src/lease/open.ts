/**
 * Which lease manager a configuration means: Redis when `--redis` is given; otherwise lease
 * files on this machine — next to the store for `file:DIR` (so every process using that
 * directory sees them), else under $BATON_HOME/leases. The local lease keeps two processes
 * on one machine from serving a volume at once; across machines, use Redis (the store-level
 * fence keeps data safe either way).
 */

import { createHash } from 'node:crypto';
import * as path from 'node:path';
import { batonHome } from '../config.js';
import type { Logger } from '../log.js';
import { parseStoreUrl, storeLocationKey } from '../store/open.js';
import type { LeaseManager } from './lease.js';

export interface LeaseManagerOptions {
  redis?: string;
  storeUrl: string;
  ttlMs: number;
  log?: Logger;
}

/**
 * The lease directory of a store. Derived from parseStoreUrl, the parser the store itself
 * uses, never by parsing the URL again: every spelling of one store (`file:~/s` from any
 * working directory, `file:///abs`, `file://localhost/abs`, %-escapes) must reach the same
 * lease files, or two processes hold one volume with one token. For `file:DIR` the files live
 * inside DIR (so even two paths to DIR through symlinks meet there); for any other store, in
 * one directory per store under $BATON_HOME/leases, named after the store's canonical key (so
 * equal volume names in two buckets do not share a lease). Throws InvalidArgumentError for a
 * URL that names no store.
 */
export function localLeaseDir(storeUrl: string): string {
  const loc = parseStoreUrl(storeUrl);
  if (loc.kind === 'file') return path.join(loc.dir, '.leases');
  return path.resolve(batonHome(), 'leases', createHash('sha256').update(storeLocationKey(loc)).digest('hex').slice(0, 16));
}

export async function openLeaseManager(o: LeaseManagerOptions): Promise<LeaseManager> {
  if (o.redis) {
    const { openRedisLeaseManager } = await import('./redis.js');
    return openRedisLeaseManager(o.redis, { ttlMs: o.ttlMs, ...(o.log ? { log: o.log } : {}) });
  }
  const { LocalLeaseManager } = await import('./local.js');
  return new LocalLeaseManager(localLeaseDir(o.storeUrl), { ttlMs: o.ttlMs, ...(o.log ? { log: o.log } : {}) });
}

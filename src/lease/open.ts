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
import type { LeaseManager } from './lease.js';

export interface LeaseManagerOptions {
  redis?: string;
  storeUrl: string;
  ttlMs: number;
  log?: Logger;
}

export function localLeaseDir(storeUrl: string): string {
  if (storeUrl.startsWith('file:')) {
    let dir = storeUrl.slice('file:'.length);
    if (dir.startsWith('//')) dir = dir.slice(2);
    return path.join(path.resolve(dir), '.leases');
  }
  // One directory per store, so equal volume names in two buckets do not share a lease.
  return path.join(batonHome(), 'leases', createHash('sha256').update(storeUrl).digest('hex').slice(0, 16));
}

export async function openLeaseManager(o: LeaseManagerOptions): Promise<LeaseManager> {
  if (o.redis) {
    const { openRedisLeaseManager } = await import('./redis.js');
    return openRedisLeaseManager(o.redis, { ttlMs: o.ttlMs, ...(o.log ? { log: o.log } : {}) });
  }
  const { LocalLeaseManager } = await import('./local.js');
  return new LocalLeaseManager(localLeaseDir(o.storeUrl), { ttlMs: o.ttlMs });
}

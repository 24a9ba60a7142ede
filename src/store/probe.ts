/**
 * probeStore: refuse a store that would make fencing a lie, before serving from it.
 *
 * baton's safety (who may write a volume) rests on one primitive: a create-only put
 * (If-None-Match: *) of a key that exists must fail. A store that silently overwrites instead
 * (s3rver, some gateways) would let two hosts both believe they hold a volume. The probe also
 * checks read-after-write, which the volume engine assumes after every acknowledged put.
 *
 * Invariants: the probe key is random under `_probe/`, so concurrent probes of the same store
 * never collide; it is deleted afterwards, also when the probe fails.
 */
import { randomBytes } from 'node:crypto';
import { StoreUnsafeError, errorMessage, isBatonError } from '../errors.js';
import type { ObjectStore } from './object-store.js';

export const PROBE_PREFIX = '_probe/';

export interface ProbeResult {
  store: string;
  key: string;
  elapsedMs: number;
}

const HOW_TO_FIX =
  'baton needs conditional writes (If-None-Match: *), which AWS S3, Cloudflare R2, MinIO and Ceph RGW support; ' +
  'use one of them, or the local store (--store file:DIR)';

export async function probeStore(store: ObjectStore): Promise<ProbeResult> {
  const t0 = performance.now();
  const key = `${PROBE_PREFIX}${Date.now().toString(36)}-${randomBytes(8).toString('hex')}`;
  const first = randomBytes(64);
  const second = randomBytes(64);
  let failed = false;
  try {
    await store.put(key, first, { ifNoneMatch: true });

    const back = await store.get(key);
    if (!back.equals(first)) {
      throw new StoreUnsafeError(`store ${store.description} returned different bytes right after a put of ${key} (no read-after-write consistency); baton cannot run on it`);
    }

    let overwrote = false;
    try {
      await store.put(key, second, { ifNoneMatch: true });
      overwrote = true;
    } catch (err) {
      if (isBatonError(err, 'BATON_ERR_NOT_SUPPORTED')) {
        throw new StoreUnsafeError(`store ${store.description} does not support create-only puts (If-None-Match: *): ${errorMessage(err)}. ${HOW_TO_FIX}`);
      }
      if (!isBatonError(err, 'BATON_ERR_PRECONDITION_FAILED')) throw err;
    }
    if (overwrote) {
      throw new StoreUnsafeError(
        `store ${store.description} accepted a second create-only put of ${key}: it ignores If-None-Match: *, ` +
        `and baton's fencing relies on it (two hosts could both write one volume). ${HOW_TO_FIX}`,
      );
    }

    const after = await store.get(key);
    if (!after.equals(first)) {
      throw new StoreUnsafeError(`store ${store.description} refused a create-only put of ${key} but changed the object anyway; baton's fencing relies on If-None-Match: *. ${HOW_TO_FIX}`);
    }
    return { store: store.description, key, elapsedMs: performance.now() - t0 };
  } catch (err) {
    failed = true;
    throw err;
  } finally {
    try {
      await store.delete(key);
    } catch (err) {
      // Do not hide the probe's own verdict behind a cleanup failure.
      if (!failed) throw err;
    }
  }
}

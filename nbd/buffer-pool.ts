/**
 * A small pool of READ reply buffers. Large reads (nbdcopy asks for 256 KiB at a time)
 * would otherwise allocate and drop a fresh buffer per request, and the garbage collector
 * ends up costing more than the copy itself. A buffer comes back to the pool only after the
 * socket is done with it (the write callback), so a reply can never see its bytes change.
 */

const MIN_POOLED = 16 * 1024;
const MAX_POOLED_BYTES = 64 * 1024 * 1024;

const free = new Map<number, Buffer[]>();
let pooledBytes = 0;

/**
 * An empty pool is refilled a slab at a time: allocating hundreds of 256 KiB buffers one by
 * one made the first pass of a sequential read visibly slower than the next (each large
 * allocation is external memory V8 accounts for, and may collect for).
 */
const SLAB_BYTES = 4 * 1024 * 1024;

export function acquireBuffer(size: number): Buffer {
  if (size < MIN_POOLED) return Buffer.allocUnsafe(size);
  const list = free.get(size);
  const b = list?.pop();
  if (b) { pooledBytes -= size; return b; }
  const n = Math.floor(SLAB_BYTES / size);
  if (n < 2) return Buffer.allocUnsafeSlow(size);
  const slab = Buffer.allocUnsafeSlow(n * size);
  // The rest of the slab waits in the pool (what the pool's bound refuses is simply dropped).
  for (let i = 1; i < n; i++) releaseBuffer(slab.subarray(i * size, (i + 1) * size));
  return slab.subarray(0, size);
}

/** Give back a buffer from acquireBuffer that nothing references any more. */
export function releaseBuffer(b: Buffer): void {
  if (b.length < MIN_POOLED || pooledBytes + b.length > MAX_POOLED_BYTES) return;
  let list = free.get(b.length);
  if (!list) { list = []; free.set(b.length, list); }
  list.push(b);
  pooledBytes += b.length;
}

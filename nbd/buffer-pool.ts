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
 * An empty pool is refilled a slab at a time for the sizes clients use for bulk reads
 * (powers of two, 64 KiB to 1 MiB: nbdcopy's 256 KiB, the kernel's and qemu's): allocating
 * hundreds of 256 KiB buffers one by one made the first pass of a sequential read visibly
 * slower than the next (each large allocation is external memory V8 accounts for, and may
 * collect for). Only those sizes: a pooled piece keeps its whole slab alive, and slabs for
 * every odd size a client (or the fuzzer) asks for once would pin far more than the pool's
 * bound (the fuzzer saw the server grow by 220 MiB).
 */
const SLAB_BYTES = 4 * 1024 * 1024;
const SLAB_SIZES = new Set([64 * 1024, 128 * 1024, 256 * 1024, 512 * 1024, 1024 * 1024]);

export function acquireBuffer(size: number): Buffer {
  if (size < MIN_POOLED) return Buffer.allocUnsafe(size);
  const list = free.get(size);
  const b = list?.pop();
  if (b) { pooledBytes -= size; return b; }
  if (!SLAB_SIZES.has(size)) return Buffer.allocUnsafe(size);
  const n = SLAB_BYTES / size;
  const slab = Buffer.allocUnsafeSlow(SLAB_BYTES);
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

/**
 * Small READ replies (header and data in one buffer, below MIN_POOLED) are carved from a
 * shared slab instead of each allocating a fresh ArrayBuffer (a 4 KiB Buffer.allocUnsafe is
 * one: Node's own pool takes only sizes under 4 KiB): at 80,000 random 4 KiB reads a second
 * that allocation and its collection were a few percent of the server's time. A piece is
 * never handed out twice: the carving only moves forward, and a full slab is left to the
 * garbage collector, which frees it once no piece of it is referenced (the socket holds a
 * reply's until it was sent), so nothing can change a reply's bytes while it is in flight.
 */
const CARVE_SLAB_BYTES = 256 * 1024;
let carveSlab = Buffer.alloc(0);
let carved = 0;

/** A buffer of `size` (< MIN_POOLED) bytes nobody else holds, carved from the current slab. */
export function carveBuffer(size: number): Buffer {
  if (!(size > 0 && size < MIN_POOLED)) throw new RangeError(`carveBuffer(${size}): only for 1 to ${MIN_POOLED - 1} bytes`);
  if (carved + size > carveSlab.length) {
    carveSlab = Buffer.allocUnsafeSlow(CARVE_SLAB_BYTES);
    carved = 0;
  }
  const b = carveSlab.subarray(carved, carved + size);
  carved += (size + 7) & ~7; // the next piece starts 8-byte aligned
  return b;
}

/** The largest size carveBuffer takes. */
export const CARVE_MAX = MIN_POOLED - 1;

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

export function acquireBuffer(size: number): Buffer {
  if (size >= MIN_POOLED) {
    const list = free.get(size);
    const b = list?.pop();
    if (b) { pooledBytes -= size; return b; }
  }
  return Buffer.allocUnsafe(size);
}

/** Give back a buffer from acquireBuffer that nothing references any more. */
export function releaseBuffer(b: Buffer): void {
  if (b.length < MIN_POOLED || pooledBytes + b.length > MAX_POOLED_BYTES) return;
  let list = free.get(b.length);
  if (!list) { list = []; free.set(b.length, list); }
  list.push(b);
  pooledBytes += b.length;
}

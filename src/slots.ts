/**
 * Slots: at most `size` holders at once; the others wait in the order they asked. A release
 * hands its slot straight to the first waiter (the count never drops in between, so a new
 * caller cannot slip past the bound while a waiter is being woken).
 *
 * Used for segment uploads (Volume: uploadConcurrency) and cache writes in libuv's thread pool
 * (cache.ts: MAX_SLAB_WRITES).
 */
export class Slots {
  #inUse = 0;
  readonly #waiting: (() => void)[] = [];
  /** The most held at once so far (tests check the bound with it). */
  maxInUse = 0;

  constructor(readonly size: number) {
    if (!Number.isSafeInteger(size) || size < 1) throw new Error(`Slots: size must be a positive integer (got ${size})`);
  }

  /** Resolves once the caller holds a slot; it must release() it exactly once. */
  acquire(): Promise<void> {
    if (this.#inUse < this.size) {
      this.#inUse++;
      if (this.#inUse > this.maxInUse) this.maxInUse = this.#inUse;
      return Promise.resolve();
    }
    return new Promise<void>((resolve) => { this.#waiting.push(resolve); });
  }

  release(): void {
    const next = this.#waiting.shift();
    if (next) next(); // the slot passes on
    else this.#inUse--;
  }
}

/**
 * What a volume must contain, as far as the fuzzer knows: bytes per 64 KiB page (absent =
 * zeroes) and a "known" bit per 512-byte sector. A sector becomes unknown when the spec lets
 * its contents be anything (TRIM, a write whose reply never came, a FAST_ZERO refused) and
 * known again only when a whole-sector write covers it; a partial write to an unknown sector
 * leaves it unknown. Reads are compared only where the model knows.
 */

const PAGE = 64 * 1024;
const SECTOR = 512;
const ZEROES = Buffer.alloc(PAGE);

export interface Range { offset: number; length: number }

export interface Mismatch { offset: number; expected: number; got: number }

export class ContentModel {
  private readonly pages = new Map<number, Buffer>();
  private readonly known: Uint8Array;

  constructor(readonly size: number, init?: (offset: number, length: number) => Buffer) {
    this.known = new Uint8Array(Math.ceil(size / SECTOR)).fill(1);
    if (init) {
      for (let off = 0; off < size; off += PAGE) {
        const len = Math.min(PAGE, size - off);
        const b = init(off, len);
        if (b.some((x) => x !== 0)) this.page(off / PAGE).set(b);
      }
    }
  }

  private page(i: number): Buffer {
    let p = this.pages.get(i);
    if (!p) { p = Buffer.alloc(PAGE); this.pages.set(i, p); }
    return p;
  }

  /** The modelled bytes (unknown sectors included, as last written). */
  private bytesAt(offset: number, length: number, out: Buffer, outOff: number): void {
    let done = 0;
    while (done < length) {
      const pos = offset + done;
      const pi = Math.floor(pos / PAGE);
      const po = pos - pi * PAGE;
      const n = Math.min(PAGE - po, length - done);
      const p = this.pages.get(pi);
      if (p) p.copy(out, outOff + done, po, po + n);
      else out.fill(0, outOff + done, outOff + done + n);
      done += n;
    }
  }

  private isKnown(sector: number): boolean { return this.known[sector] === 1; }

  write(offset: number, data: Buffer | readonly Buffer[]): void {
    const parts = Buffer.isBuffer(data) ? [data] : data;
    let pos = offset;
    for (const part of parts) {
      let done = 0;
      while (done < part.length) {
        const at = pos + done;
        const pi = Math.floor(at / PAGE);
        const po = at - pi * PAGE;
        const n = Math.min(PAGE - po, part.length - done);
        part.copy(this.page(pi), po, done, done + n);
        done += n;
      }
      pos += part.length;
    }
    this.markWritten(offset, pos - offset);
  }

  zero(offset: number, length: number): void {
    let done = 0;
    while (done < length) {
      const at = offset + done;
      const pi = Math.floor(at / PAGE);
      const po = at - pi * PAGE;
      const n = Math.min(PAGE - po, length - done);
      const p = this.pages.get(pi);
      if (p) {
        if (po === 0 && n === PAGE) this.pages.delete(pi);
        else p.fill(0, po, po + n);
      }
      done += n;
    }
    this.markWritten(offset, length);
  }

  /** Whole sectors covered by a write become known; partially covered ones keep their state. */
  private markWritten(offset: number, length: number): void {
    if (length <= 0) return;
    const first = Math.ceil(offset / SECTOR);
    const end = offset + length;
    const last = end === this.size ? Math.ceil(end / SECTOR) : Math.floor(end / SECTOR);
    if (last > first) this.known.fill(1, first, last);
  }

  /** Every sector the range touches becomes unknown. */
  forget(offset: number, length: number): void {
    if (length <= 0) return;
    const first = Math.floor(offset / SECTOR);
    const last = Math.ceil(Math.min(offset + length, this.size) / SECTOR);
    if (last > first) this.known.fill(0, first, last);
  }

  knownFraction(): number {
    let n = 0;
    for (const k of this.known) n += k;
    return n / this.known.length;
  }

  /**
   * Compare `data` (read at `offset`) with the model where it knows, skipping `exclude`
   * (ranges a concurrent write of the same burst may have changed). Returns the first
   * mismatch.
   */
  verify(offset: number, data: Buffer, exclude: readonly Range[] = []): Mismatch | null {
    return this.scan(offset, data.length, exclude, (at, len, dataOff) => {
      const want = Buffer.allocUnsafe(len);
      this.bytesAt(at, len, want, 0);
      if (want.equals(data.subarray(dataOff, dataOff + len))) return null;
      for (let i = 0; i < len; i++) {
        if (want[i] !== data[dataOff + i]) return { offset: at + i, expected: want[i]!, got: data[dataOff + i]! };
      }
      return null;
    });
  }

  /** Where the model knows a non-zero byte inside the range (for BLOCK_STATUS ZERO and holes). */
  nonZeroKnown(offset: number, length: number, exclude: readonly Range[] = []): Mismatch | null {
    return this.scan(offset, length, exclude, (at, len) => {
      // Page by page: an absent page is all zeroes, a present one is compared with zeroes natively.
      let done = 0;
      while (done < len) {
        const pos = at + done;
        const pi = Math.floor(pos / PAGE);
        const po = pos - pi * PAGE;
        const n = Math.min(PAGE - po, len - done);
        const p = this.pages.get(pi);
        if (p && !p.subarray(po, po + n).equals(ZEROES.subarray(0, n))) {
          for (let i = po; i < po + n; i++) if (p[i] !== 0) return { offset: pi * PAGE + i, expected: p[i]!, got: 0 };
        }
        done += n;
      }
      return null;
    });
  }

  /** Calls `fn` on maximal runs of known, not excluded bytes inside [offset, offset+length). */
  private scan(offset: number, length: number, exclude: readonly Range[], fn: (at: number, len: number, dataOff: number) => Mismatch | null): Mismatch | null {
    const end = Math.min(offset + length, this.size);
    let runStart = -1;
    const flush = (runEnd: number): Mismatch | null => {
      if (runStart < 0) return null;
      const s = runStart;
      runStart = -1;
      return fn(s, runEnd - s, s - offset);
    };
    let pos = offset;
    while (pos < end) {
      const sector = Math.floor(pos / SECTOR);
      const sEnd = Math.min((sector + 1) * SECTOR, end);
      let ok = this.isKnown(sector);
      if (ok) for (const x of exclude) if (x.offset < sEnd && pos < x.offset + x.length) { ok = false; break; }
      if (ok) { if (runStart < 0) runStart = pos; }
      else { const m = flush(pos); if (m) return m; }
      pos = sEnd;
    }
    return flush(end);
  }
}

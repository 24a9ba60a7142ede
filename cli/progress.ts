/**
 * Progress of a long CLI command (prefetch, import, export) on stderr, fed by the API's
 * progress callback (src/api.ts Progress): a bar redrawn in place with \r on a terminal
 * (bytes, rate, ETA), or one JSON line per second and one at the end otherwise:
 * {"volume","doneBytes","totalBytes","bytesPerSecond","etaSeconds","elapsedMs","done"}.
 */

import type { Progress as ApiProgress } from '../src/api.js';
import { formatSize } from '../src/size.js';

export class Progress {
  private done = 0;
  private total = 0;
  private t0 = 0;
  private timer: NodeJS.Timeout | null = null;
  private finished = false;
  constructor(private readonly volume: string, private readonly json: boolean) {}

  /** An update from the API; the first one starts the clock and the periodic redraw. */
  update(p: ApiProgress): void {
    if (this.finished) return;
    if (p.done !== undefined) this.done = p.done;
    if (p.total !== undefined) this.total = p.total;
    if (this.t0 === 0 && p.total === undefined) return; // a phase without bytes (a conversion): the bar starts with the bytes
    if (this.t0 === 0) {
      this.t0 = performance.now();
      this.timer = setInterval(() => this.draw(false), this.json ? 1000 : 200);
      this.draw(false);
    }
    if (p.finished) {
      this.finished = true;
      this.stop();
      this.draw(true);
    }
  }

  stop(): void { if (this.timer) clearInterval(this.timer); this.timer = null; }

  private draw(last: boolean): void {
    const ms = performance.now() - this.t0;
    const rate = ms > 0 ? this.done / (ms / 1000) : 0;
    const eta = rate > 0 ? (this.total - this.done) / rate : null;
    if (this.json) {
      process.stderr.write(JSON.stringify({ volume: this.volume, doneBytes: this.done, totalBytes: this.total, bytesPerSecond: Math.round(rate), etaSeconds: eta === null ? null : Math.round(eta * 10) / 10, elapsedMs: Math.round(ms), done: last }) + '\n');
      return;
    }
    const frac = this.total > 0 ? this.done / this.total : 1;
    const width = 30;
    const filled = Math.round(frac * width);
    const bar = '#'.repeat(filled) + '.'.repeat(width - filled);
    const etaText = last ? `in ${(ms / 1000).toFixed(1)}s` : eta === null ? 'ETA -' : `ETA ${Math.ceil(eta)}s`;
    process.stderr.write(`\r${this.volume} [${bar}] ${(frac * 100).toFixed(0).padStart(3)}% ${formatSize(this.done)}/${formatSize(this.total)} ${formatSize(Math.round(rate))}/s ${etaText}\x1b[K${last ? '\n' : ''}`);
  }
}

/** Sizes as users write them: "10G", "512M", "64k", "4096" (1024-based, like qemu-img and nbdkit). */

import { InvalidArgumentError } from './errors.js';

const UNITS = ['', 'k', 'm', 'g', 't', 'p'];

export function parseSize(v: string): number {
  const m = /^(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b)?$/i.exec(v.trim());
  if (!m) throw new InvalidArgumentError(`not a size: "${v}" (examples: 10G, 512M, 64k, 4096)`);
  const n = Number(m[1]) * 1024 ** UNITS.indexOf((m[2] ?? '').toLowerCase());
  if (!Number.isSafeInteger(Math.round(n))) throw new InvalidArgumentError(`size too large: ${v}`);
  return Math.round(n);
}

export function formatSize(n: number): string {
  if (n < 1024) return `${n} B`;
  let i = 0;
  let v = n;
  while (v >= 1024 && i < UNITS.length - 1) { v /= 1024; i++; }
  const s = Number.isInteger(v) ? String(v) : v.toFixed(v < 10 ? 2 : 1);
  return `${s} ${UNITS[i]!.toUpperCase()}iB`;
}

/** A size the way parseSize reads it back, in the largest unit that divides it exactly: 2G, 512M, 4096. */
export function formatSizeArg(n: number): string {
  for (let i = UNITS.length - 1; i > 0; i--) {
    const u = 1024 ** i;
    if (n >= u && n % u === 0) return `${n / u}${UNITS[i]!.toUpperCase()}`;
  }
  return String(n);
}

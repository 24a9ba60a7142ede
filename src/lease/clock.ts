/**
 * The clocks leases are measured on, and what is assumed about them.
 *
 * Lease FILES (LocalLeaseManager) are judged by processes other than their writer, so their
 * expiry must be on a clock every process on the machine reads alike and that never steps:
 *
 * - monoMs(): CLOCK_MONOTONIC, through process.hrtime.bigint() (libuv's uv_hrtime reads
 *   clock_gettime(CLOCK_MONOTONIC) on Linux). It is system-wide: one origin (boot) for every
 *   process of one kernel, so a deadline one process writes is a deadline another can check.
 *   It is never stepped (NTP only slews its rate, by at most 500 ppm) and it stops while
 *   the machine is suspended, for every process at once, so a suspend moves holder and
 *   acquirer alike. performance.now(), on which a holder keeps validUntil (renewing.ts), is
 *   the same clock minus this process's start, so the holder's deadline and the lease file's
 *   expiry are on ONE clock: the holder stops strictly before the file expires.
 * - bootId: /proc/sys/kernel/random/boot_id, new at every boot. CLOCK_MONOTONIC restarts at
 *   each boot, so a monotonic expiry means something only with the boot it was taken in: a
 *   lease file from an earlier boot of this machine is expired (its holder cannot have
 *   survived the reboot).
 * - wallMs(): Date.now(), which CAN step (an NTP step, a VM resume, an admin). It is used only
 *   where no shared monotonic clock exists: a lease file without a boot id (written by an
 *   older baton, or on a system without /proc), and a file written by another machine that
 *   shares the directory (a different boot id and hostname). There it is what the code did
 *   before, with the same weakness: a forward step expires such a lease early. Redis is the
 *   lease to use across machines.
 *
 * Assumed: a process in another time namespace (Linux >= 5.6, CLOCK_MONOTONIC offset per
 * namespace; used by CRIU restores, not by Docker or Podman by default) does not share a lease
 * directory with this one; processes whose hostname is equal run on one machine (the pid check
 * assumes the same). Breaking either can only let two hosts believe they hold a volume: the
 * store's create-only log puts still fence the stale one (see local.ts), so data stays safe.
 */

import * as fs from 'node:fs';

export interface LeaseClock {
  /** The boot this process runs in; null where unknown (then only the wall clock is used). */
  readonly bootId: string | null;
  /** CLOCK_MONOTONIC in ms: system-wide within one boot, never stepped. */
  monoMs(): number;
  /** The wall clock in ms (Date.now()): only for files without a usable monotonic expiry. */
  wallMs(): number;
}

function readBootId(): string | null {
  try {
    const id = fs.readFileSync('/proc/sys/kernel/random/boot_id', 'utf8').trim();
    return /^[0-9a-f-]{8,64}$/i.test(id) ? id : null;
  } catch {
    return null;
  }
}

const BOOT_ID = readBootId();

export const systemClock: LeaseClock = {
  bootId: BOOT_ID,
  monoMs: () => Number(process.hrtime.bigint() / 1_000_000n),
  // Date.now is looked up at each call (not bound once) so that a test that steps it steps this.
  wallMs: () => Date.now(),
};

/**
 * Per-export request counters: what the session records as each request completes, for
 * `serve --metrics` (src/metrics.ts reads them at scrape time). The provider decides whether
 * an export has them (ExportHandle.stats); without them the session records nothing.
 *
 * This is on the path of every request, so recording is array increments into storage made
 * once per export: no allocation, no label lookup, no Map. Label sets are bounded by
 * construction: one slot per command (unknown command types share `other`) and per result
 * (ok, or an NBD errno; any other errno shares `other`).
 */

import assert from 'node:assert/strict';
import { DurationHistogram } from '../src/histogram.js';
import * as C from './constants.js';
import { COMMAND_NAMES } from './validate.js';

/** Command label per slot; slot = NBD command type (0..7), `other` past them. */
export const COMMAND_LABELS = ['read', 'write', 'disc', 'flush', 'trim', 'cache', 'write_zeroes', 'block_status', 'other'] as const;
const OTHER_COMMAND = COMMAND_LABELS.length - 1;
// A command's slot is its type: the labels must name the types the session validates.
for (const [type, name] of Object.entries(COMMAND_NAMES)) assert.equal(COMMAND_LABELS[Number(type)], name, `command ${type}`);

/** Result label per slot: `ok` for success, else the errno the client got. */
export const RESULT_LABELS = ['ok', 'eperm', 'eio', 'enomem', 'einval', 'enospc', 'eoverflow', 'enotsup', 'eshutdown', 'other'] as const;
const ERRNOS: readonly number[] = [0, C.NBD_EPERM, C.NBD_EIO, C.NBD_ENOMEM, C.NBD_EINVAL, C.NBD_ENOSPC, C.NBD_EOVERFLOW, C.NBD_ENOTSUP, C.NBD_ESHUTDOWN];
const OTHER_RESULT = RESULT_LABELS.length - 1;

/** errno -> result slot, for every errno below 128 (the NBD ones are all small). */
const RESULT_OF_ERRNO = new Uint8Array(128).fill(OTHER_RESULT);
ERRNOS.forEach((errno, slot) => { RESULT_OF_ERRNO[errno] = slot; });

export class RequestStats {
  /** Requests per (command, result): requests[command * RESULT_LABELS.length + result]. */
  readonly requests = new Float64Array(COMMAND_LABELS.length * RESULT_LABELS.length);
  /** Payload bytes of successful READs (sent to clients) and WRITEs (taken from them). */
  readBytes = 0;
  writeBytes = 0;
  /** FLUSH: dispatch to the backend's answer (success or failure), before the reply is written. */
  readonly flushSeconds = new DurationHistogram();

  /**
   * One request answered with `errno` (0: success). `bytes`: the payload a successful READ or
   * WRITE moved (ignored otherwise). `startedAt`: performance.now() when a FLUSH went to the
   * backend, or -1 for one that never reached it (refused by validation or shutdown): only
   * FLUSHes the backend answered are timed.
   */
  done(type: number, errno: number, bytes: number, startedAt: number): void {
    const cmd = type >= 0 && type < OTHER_COMMAND ? type : OTHER_COMMAND;
    const result = errno >= 0 && errno < 128 ? RESULT_OF_ERRNO[errno]! : OTHER_RESULT;
    this.requests[cmd * RESULT_LABELS.length + result]!++;
    if (errno === 0) {
      if (type === C.NBD_CMD_READ) this.readBytes += bytes;
      else if (type === C.NBD_CMD_WRITE) this.writeBytes += bytes;
    }
    if (type === C.NBD_CMD_FLUSH && startedAt >= 0) this.flushSeconds.observe((performance.now() - startedAt) / 1000);
  }

  /** Requests of command label `cmd` with result label `result` (tests, diagnostics). */
  count(cmd: (typeof COMMAND_LABELS)[number], result: (typeof RESULT_LABELS)[number]): number {
    return this.requests[COMMAND_LABELS.indexOf(cmd) * RESULT_LABELS.length + RESULT_LABELS.indexOf(result)]!;
  }
}

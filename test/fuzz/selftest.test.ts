/**
 * The fuzzer's checks can fail: each run injects one fault into the server process
 * (test/fuzz/server.ts `inject`, a wrapper around the exports, nothing in the server's own
 * code) and must be reported as the failure that fault is, with the seed and input that
 * replay it. Without this, a fuzzer whose oracle accepted everything would pass too.
 */

import test from 'ava';
import { runFuzz } from './fuzzer.js';

const cases: { inject: string; kind: RegExp; message: RegExp; inputs: number; timeoutMs?: number }[] = [
  { inject: 'corrupt-read', kind: /^data$/, message: /read 0x[0-9a-f]+, the model says/, inputs: 3000 },
  { inject: 'zero-lie', kind: /^data$/, message: /reported ZERO, but byte/, inputs: 3000 },
  { inject: 'hang-flush', kind: /^hang$/, message: /no reply|did not close/, inputs: 500 },
  // A leaking server on a starved CI machine can answer a large READ later than the usual 5 s
  // per input; that was once reported as a hang before the memory check saw the growth.
  // Either memory check may see the leak first: steady growth over the baseline, or the peak
  // over its bound (which one depends on how fast the machine runs the inputs: on a quiet one
  // the peak came first in 5 of 5 runs, on the CI machine the growth did).
  { inject: 'leak', kind: /^memory$/, message: /grew from|peaked at .* above the bound/, inputs: 20_000, timeoutMs: 30_000 },
  { inject: 'victim-rot', kind: /^victim-data$/, message: /the model says/, inputs: 20_000 },
];

for (const c of cases) {
  test.serial(`an injected fault is found: ${c.inject}`, async (t) => {
    const r = await runFuzz({ seed: 77, inputs: c.inputs, lanes: 4, inject: c.inject, maxFailures: 1, timeoutMs: c.timeoutMs ?? 5000 });
    const f = r.failures[0];
    t.truthy(f, `no failure reported after ${r.inputs} inputs`);
    if (!f) return;
    t.log(`${f.kind}: ${f.message.slice(0, 200)} (after ${r.inputs} inputs)`);
    t.regex(f.kind, c.kind);
    t.regex(f.message, c.message);
    if (typeof f.index === 'number') t.true(f.replay.some((l) => l.includes(`--seed 77`) && l.includes(`--only ${f.index}`)), 'the failure says how to replay it');
  });
}

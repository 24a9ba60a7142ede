/**
 * The CI budget of the NBD protocol fuzzer (issue 10, "Protocol fuzzing at scale"): 20,000
 * generated inputs against a live server process over a Unix socket, each checked for the
 * spec's answer or a clean disconnect within its time bound, with the server's memory probed
 * and a well-behaved client doing verified I/O on another export all along. The seed is
 * fixed, so a failure here replays with the command it prints; `npm run fuzz -- --inputs
 * 1000000` is the long run (random seed, printed).
 *
 * The assertions on coverage keep the test from passing by doing nothing: the inputs must
 * reach transmission, every command must be both served and refused, base:allocation must
 * be negotiated and BLOCK_STATUS answered, READ data must be verified, the memory probes
 * must have run and the well-behaved client must have done its I/O.
 */

import test from 'ava';
import { formatFailure, mb, runFuzz } from './fuzzer.js';

const SEED = 20_261_201;
const INPUTS = 20_000;

test.serial(`${INPUTS} fuzz inputs: every answer is the spec's or a clean disconnect, memory bounded, the well-behaved client unaffected`, async (t) => {
  const r = await runFuzz({ seed: SEED, inputs: INPUTS, lanes: 4, maxFailures: 5, log: (l) => t.log(l), progressEveryMs: 30_000 });
  t.log(`${r.inputs} inputs in ${r.seconds.toFixed(1)} s = ${r.inputsPerSecond.toFixed(0)} inputs/s; CPU ${(r.cpu.fuzzerMs / 1000).toFixed(1)} s fuzzer + ${(r.cpu.serverMs / 1000).toFixed(1)} s server`);
  t.log(`transmission reached ${r.stats.transmissions} times (${r.stats.structured} structured), ${r.stats.blockStatusOk} BLOCK_STATUS replies checked, ${mb(r.stats.readsVerifiedBytes)} READ data verified, ${r.stalls} stalled handshakes`);
  t.log(`well-behaved client: ${r.victim.sessions} sessions, ${r.victim.requests} requests, slowest ${r.victim.maxSessionMs} ms`);
  t.log(`server memory: baseline ${mb(r.memory.baselineOther)}, steady max ${mb(r.memory.maxSteadyOther)}, sampled peak ${mb(r.memory.peakOther)}, RSS peak ${mb(r.memory.maxRss)}`);
  t.deepEqual(r.failures.map(formatFailure), [], 'no failures');
  t.is(r.inputs, INPUTS);

  const results = r.stats.results;
  const count = (k: string): number => results.get(k) ?? 0;
  for (const cmd of ['READ', 'WRITE', 'FLUSH', 'TRIM', 'CACHE', 'WRITE_ZEROES', 'BLOCK_STATUS']) {
    t.true(count(`${cmd}:OK`) > 0, `${cmd} served`);
    t.true([...results.keys()].some((k) => k.startsWith(`${cmd}:`) && !k.endsWith(':OK')), `${cmd} refused`);
  }
  for (const errno of ['EINVAL', 'EPERM', 'ENOSPC', 'EOVERFLOW']) t.true([...results.keys()].some((k) => k.endsWith(`:${errno}`)), `${errno} seen`);
  t.true(r.stats.transmissions > INPUTS / 2, 'most inputs reach transmission');
  t.true(r.stats.blockStatusOk > 100, 'BLOCK_STATUS answered and checked');
  t.true(r.stats.readsVerifiedBytes > 100 * 1024 * 1024, 'READ data verified against the model');
  t.true(r.stats.optReplies.get('SET_META:META_CONTEXT')! > 0 && r.stats.optReplies.get('EXPORT_NAME:answer')! > 0);
  t.true(r.stalls > 0, 'stalled handshakes were closed by the server');
  t.true(r.memory.probes >= 3, 'memory probed');
  t.true(r.victim.sessions > 50 && r.victim.requests > 500, 'the well-behaved client ran');
});

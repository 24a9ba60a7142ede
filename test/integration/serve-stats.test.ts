/**
 * `baton serve --stats-interval`: the periodic `process stats` line (RSS, heap, event-loop
 * delay since the previous line) that bench/soak.ts reads to bound each server's memory and
 * event-loop delay.
 */
import test from 'ava';
import { startBatonServer } from '../helpers/server.js';

interface StatsLine { msg: string; level: number; rss: number; heapUsed: number; eldP50Ms: number; eldP99Ms: number; eldMaxMs: number; eldP99SinceStartMs: number; eldMaxSinceStartMs: number; cpuPct: number; intervalMs: number }

function statsLines(stderr: string): StatsLine[] {
  const out: StatsLine[] = [];
  for (const l of stderr.split('\n')) {
    try {
      const j = JSON.parse(l) as StatsLine;
      if (j.msg === 'process stats') out.push(j);
    } catch { /* not a JSON line */ }
  }
  return out;
}

test('serve --stats-interval logs RSS, heap and event-loop delay at info level each interval', async (t) => {
  const server = await startBatonServer(t, { store: 'memory:', extraArgs: ['--stats-interval', '200ms'] });
  const deadline = Date.now() + 30_000;
  while (statsLines(server.stderr()).length < 2 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
  const lines = statsLines(server.stderr());
  t.true(lines.length >= 2, server.stderr());
  for (const s of lines.slice(0, 2)) {
    t.is(s.level, 30);
    t.true(s.rss > 1024 * 1024 && s.heapUsed > 0, JSON.stringify(s));
    // Delays are how late the monitor's 10 ms tick ran, never negative; p50 <= p99 <= max.
    t.true(s.eldP50Ms >= 0 && s.eldP50Ms <= s.eldP99Ms && s.eldP99Ms <= s.eldMaxMs, JSON.stringify(s));
    t.true(s.eldP99SinceStartMs >= 0 && s.eldP99SinceStartMs <= s.eldMaxSinceStartMs, JSON.stringify(s));
    t.true(s.intervalMs >= 150 && s.cpuPct >= 0, JSON.stringify(s));
  }
});

test('serve logs no process stats without --stats-interval', async (t) => {
  // No sleep decides this: a server with the option, started after this one, has logged three
  // lines by the time we look, so this one had the time to log some too.
  const quiet = await startBatonServer(t, { store: 'memory:' });
  const loud = await startBatonServer(t, { store: 'memory:', extraArgs: ['--stats-interval', '100ms'] });
  const deadline = Date.now() + 30_000;
  while (statsLines(loud.stderr()).length < 3 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
  t.true(statsLines(loud.stderr()).length >= 3);
  t.is(statsLines(quiet.stderr()).length, 0, quiet.stderr());
});

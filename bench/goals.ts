/**
 * The end of `npm run bench`: every goal row the scenarios of this run wrote (their result
 * JSON's `goals`), in one table, with ✓/✗. A result file older than this run (BENCH_STARTED,
 * set by run.sh, milliseconds) is left out, so a scenario that was skipped or failed cannot
 * lend an old row to this run's table. Also written to bench/results/goals.md.
 */

import * as fs from 'node:fs';
import * as path from 'node:path';
import { RESULTS_DIR, goalsTable, machineInfo, type GoalRow } from './lib.js';

const since = Number(process.env.BENCH_STARTED ?? 0);
const rows: GoalRow[] = [];
const from: string[] = [];
for (const f of fs.existsSync(RESULTS_DIR) ? fs.readdirSync(RESULTS_DIR).sort() : []) {
  if (!f.endsWith('.json')) continue;
  const p = path.join(RESULTS_DIR, f);
  if (fs.statSync(p).mtimeMs < since) continue;
  let goals: unknown;
  try { goals = (JSON.parse(fs.readFileSync(p, 'utf8')) as { goals?: unknown }).goals; } catch { continue; }
  if (!Array.isArray(goals) || goals.length === 0) continue;
  rows.push(...(goals as GoalRow[]));
  from.push(f);
}
const m = machineInfo();
const passed = rows.filter((r) => r.pass === true).length;
const failed = rows.filter((r) => r.pass === false).length;
const unknown = rows.length - passed - failed;
const md = [
  '# Goals of this bench run\n',
  `${m.date.slice(0, 16).replace('T', ' ')} UTC, ${m.nproc} cores, load average ${m.loadavgAtStart.join(' ')} at the end, baton ${m.batonCommit ?? '?'}; rows from ${from.join(', ') || 'no result file of this run'}.\n`,
  rows.length ? goalsTable(rows) : 'No scenario of this run wrote goal rows.\n',
  `${passed} met, ${failed} missed${unknown ? `, ${unknown} not measured` : ''}. Each ratio compares baton with its peer measured in the same run (see each scenario's report in bench/results/).\n`,
].join('\n');
fs.mkdirSync(RESULTS_DIR, { recursive: true });
fs.writeFileSync(path.join(RESULTS_DIR, 'goals.md'), md);
process.stdout.write('\n' + md);

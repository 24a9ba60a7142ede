/**
 * How many store round trips a fork or snapshot waits for in sequence (catalog.ts derive). On virtual time every request takes
 * exactly 10 ms (NORMAL), so an operation's virtual time divided by 10 is the number of
 * round trips it waited for one after the other, whatever runs in parallel.
 */
import test from 'ava';
import { keys } from '../../src/volume/format.js';
import type { Volume } from '../../src/volume/volume.js';
import { MiB, NORMAL, setup, type Sent } from '../helpers/virtual-store.js';

type S = ReturnType<typeof setup>;

/** Time `op` on the virtual clock, in round trips of NORMAL.replyMs. */
async function rounds(s: S, op: () => Promise<unknown>): Promise<number> {
  const t0 = s.world.now();
  await s.world.drive(op());
  return (s.world.now() - t0) / NORMAL.replyMs;
}

/** A volume `name` with `n` flushed writes of 64 KiB (a log), closed. */
async function written(s: S, name: string, n: number): Promise<void> {
  await s.world.drive(s.catalog.create(name, 64 * MiB));
  const v = (await s.world.drive(s.catalog.open(name, { readOnly: false }))).backend as Volume;
  await s.world.drive(v.takeover(1));
  for (let i = 0; i < n; i++) {
    await s.world.drive(v.write(i * MiB, Buffer.alloc(65536, i + 1), false));
    await s.world.drive(v.flush());
  }
  await s.world.drive(v.close());
}

test('a fork and a snapshot wait for 6 round trips (a fork of a snapshot 5), whatever the log holds', async (t) => {
  const s = setup();
  await written(s, 'src', 3);
  t.is(await rounds(s, () => s.catalog.fork('src', 'f1')), 6, 'fork: the record; attributes, checkpoints and log; meta and marker; name; the source check; the settled marker');
  t.is(await rounds(s, () => s.catalog.snapshot('src', 'snap')), 6, 'snapshot');
  t.is(await rounds(s, () => s.catalog.fork('src@snap', 'f2')), 5, 'fork of a snapshot: its fork point is in its record, nothing to list');
  t.is(await rounds(s, () => s.catalog.fork('f1', 'f3')), 6, 'fork of a (settled) fork never written to (its point is its parent\'s)');
  const f3 = await s.world.drive(s.catalog.record('f3'));
  const src = await s.world.drive(s.catalog.record('src'));
  t.is(f3.parent?.id, src.id, 'f3 starts where f1 did');
  t.is(f3.parent?.seq, (await s.world.drive(s.catalog.record('f1'))).parent?.seq);
});

test('a fork of a resized source reads its attribute records, then its fork point again (8 round trips), and has the new size', async (t) => {
  const s = setup();
  await written(s, 'src', 2);
  await s.world.drive(s.catalog.resize('src', 128 * MiB));
  t.is(await rounds(s, () => s.catalog.fork('src', 'f')), 8);
  t.is((await s.world.drive(s.catalog.record('f'))).size, 128 * MiB);
});

test('the fork point is the end of the log: data past the newest checkpoint is in the fork', async (t) => {
  const s = setup();
  await written(s, 'src', 3); // closing wrote a checkpoint at the end of its log
  const v = (await s.world.drive(s.catalog.open('src', { readOnly: false }))).backend as Volume;
  await s.world.drive(v.takeover(2));
  await s.world.drive(v.write(3 * MiB, Buffer.alloc(65536, 4), false));
  await s.world.drive(v.flush()); // past the checkpoint; still open, so no checkpoint after it
  await s.world.drive(s.catalog.fork('src', 'f'));
  const f = (await s.world.drive(s.catalog.open('f', { readOnly: true }))).backend as Volume;
  for (let i = 0; i < 4; i++) t.true((await s.world.drive(f.read(i * MiB, 65536))).equals(Buffer.alloc(65536, i + 1)), `write ${i} is in the fork`);
  await s.world.drive(f.close());
  await s.world.drive(v.close());
});

test('a log longer than a listing page below the newest checkpoint: listed again after the checkpoint (one more round trip), the point is the end of the log', async (t) => {
  const s = setup();
  await s.world.drive(s.catalog.create('src', 64 * MiB));
  const src = await s.world.drive(s.catalog.record('src'));
  // The fork point reads only the keys: a log of 1,103 records, a checkpoint at 1,050.
  for (let seq = 1; seq <= 1103; seq++) await s.inner.put(keys.log(src.id, seq), Buffer.alloc(1));
  await s.inner.put(keys.checkpoint(src.id, 1050), Buffer.alloc(1));
  const listed: string[] = [];
  const fate = s.net.fate;
  s.net.fate = (r) => { if (r.op === 'list') listed.push(r.key); return fate(r); };
  t.is(await rounds(s, () => s.catalog.snapshot('src', 'snap')), 7);
  t.is((await s.world.drive(s.catalog.record('src@snap'))).parent?.seq, 1103);
  t.is(listed.filter((k) => k === keys.logPrefix(src.id)).length, 2, 'the log was listed twice');
});

test('rm of the source before a fork\'s source check: the fork is undone', async (t) => {
  const s = setup();
  await written(s, 'src', 1);
  let reads = 0;
  s.net.onLand = (r) => {
    // As the fork's marker lands, src's name goes (rm on another host): the check after its name finds it gone.
    if (r.op === 'put' && r.key.includes('/forks/') && ++reads === 1) void s.inner.delete(keys.volumeRecord('src'));
  };
  const err = await s.world.drive(s.catalog.fork('src', 'f').then(() => null, (e: unknown) => e as Error));
  t.regex(err?.message ?? '', /src was removed while f was being made from it; nothing was created/);
  await s.world.quiesce();
  t.deepEqual(await s.records(), [], 'nothing was created');
});

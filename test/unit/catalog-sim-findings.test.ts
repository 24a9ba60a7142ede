/**
 * Two findings of the deterministic simulator (test/sim), played as exact sequences:
 * - F1: an undone fork attempt's requests landing after their client gave up: the undo's
 *   delete of the name (every try of it, inside the retrying store) removing the record the
 *   next attempt made, or a late try of the undone attempt's own name put re-creating the
 *   name before the next attempt puts it;
 * - F3: a create whose name put resolves only after GC's grace: GC deletes its meta (no
 *   record names it yet) before the name lands, leaving a volume without its meta.
 * The catalog runs on a virtual World (the test's clock and timers) over a simulated network
 * in front of the in-memory store, whose stamps follow the same clock, with the retrying
 * store (src/store/decorators.ts) on the same World (test/helpers/virtual-store.ts). Every request lands within M of being
 * issued, or never: the design's bound, which the network asserts, so each test stays inside
 * what the design claims.
 */
import test from 'ava';
import { StoreUnavailableError, isBatonError } from '../../src/errors.js';
import { listAll } from '../../src/store/object-store.js';
import { keys, timeBounds } from '../../src/volume/format.js';
import { collectGarbage } from '../../src/volume/gc.js';
import { G, M, MiB, NORMAL, setup, type Sent } from '../helpers/virtual-store.js';

test('the test world: the bounds these tests assume', (t) => {
  const b = timeBounds(M);
  t.is(b.forkBudgetMs, M / 2);
  t.true(b.minGraceMs <= G);
});

// ------------------------------------------------------------------ F1

test('F1: every try of the undo\'s delete lands late, the second more than M after the first was issued; the fork made again survives them', async (t) => {
  const s = setup();
  await s.world.drive(s.catalog.create('src', 64 * MiB));
  let slowPut = true;
  let deleteTries = 0;
  const late: Sent[] = [];
  s.net.fate = (r) => {
    // Attempt 1: its name lands at once but the reply takes longer than the budget: undone.
    if (r.op === 'put' && r.key === keys.volumeRecord('f') && slowPut) { slowPut = false; return { landMs: 5, replyMs: M / 2 + 1_000 }; }
    // The undo's delete: its first two tries get no answer (the client gives up after 2 s and
    // the retrying store tries again) and land 9 s after they were issued; the third is normal.
    if (r.op === 'delete' && r.key === keys.volumeRecord('f') && ++deleteTries <= 2) { late.push(r); return { landMs: 0.9 * M, replyMs: 2_000 }; }
    return NORMAL;
  };
  const info = await s.world.drive(s.catalog.fork('src', 'f'));
  t.is(info.name, 'f');
  const made = await s.world.drive(s.catalog.record('f'));
  await s.world.quiesce(); // the late deletes land
  t.is(late.length, 2, 'two tries of the undo\'s delete were sent and landed late');
  t.true(late[1]!.issuedAt + 0.9 * M > late[0]!.issuedAt + M, 'the second try lands more than M after the first was issued');
  t.deepEqual(s.net.beyondBound, [], 'no request landed more than M after it was issued');
  const rec = await s.world.drive(s.catalog.record('f')).catch(() => null);
  t.truthy(rec, 'the fork whose call returned success still exists');
  t.is(rec?.id, made.id);
  t.truthy(await s.inner.head(keys.meta(made.id)));
  t.is((await s.metas()).length, 2, 'metas of src and f only: the undone attempt\'s is gone');
});

test('F1: a late try of the undone attempt\'s own name put lands right after the undo\'s delete; the fork is made again, not shadowed', async (t) => {
  const s = setup();
  await s.world.drive(s.catalog.create('src', 64 * MiB));
  let first: Sent | null = null;
  s.net.fate = (r) => {
    // Attempt 1's first name put gets no answer within 6 s (more than the budget) and is
    // held; the retrying store tries again, and that try lands: attempt 1 is over budget.
    if (r.op === 'put' && r.key === keys.volumeRecord('f') && first === null) { first = r; return { landMs: 'held', replyMs: M / 2 + 1_000 }; }
    return NORMAL;
  };
  // The held first try lands 20 ms after the undo's delete did (within M of its issue): the
  // name holds the undone attempt's record again, before the next attempt puts it.
  s.net.onLand = (r) => {
    if (r.op === 'delete' && r.key === keys.volumeRecord('f') && first !== null && s.net.held.has(first)) {
      const f = first;
      s.world.setTimeout(() => s.net.land(f), 20);
    }
  };
  const info = await s.world.drive(s.catalog.fork('src', 'f').then((v) => v, (err: unknown) => err as Error));
  t.false(info instanceof Error, `the fork succeeds${info instanceof Error ? `, not: ${info.message}` : ''}`);
  await s.world.quiesce();
  t.truthy(first, 'the first try was held');
  t.false(s.net.held.has(first!), 'and it landed');
  t.true(s.net.log.some((l) => l.includes(`put ${keys.volumeRecord('f')} lands (issued at ${first!.issuedAt})`)));
  t.deepEqual(s.net.beyondBound, [], 'no request landed more than M after it was issued');
  const undoneId = (JSON.parse(first!.body!.toString()) as { id: string }).id;
  const rec = await s.world.drive(s.catalog.record('f'));
  t.not(rec.id, undoneId, 'the name holds the fork made again, not the undone attempt');
  t.truthy(await s.inner.head(keys.meta(rec.id)), 'the fork names a meta that exists');
  t.is(await s.inner.head(keys.meta(undoneId)), null, 'the undone attempt\'s meta is gone');
  t.is((await s.metas()).length, 2, 'metas of src and f only');
});

// ------------------------------------------------------------------ F3

test('F3: a create whose name put resolves only after GC deleted its meta: the created volume has its meta and forks open', async (t) => {
  const s = setup({ attempts: 1, delayMs: 100 });
  // An outage of the name: each try gets no answer for 25 s and never lands, until the
  // third, issued at about 50 s, which lands 9 s after it was issued (within M).
  let tries = 0;
  s.net.fate = (r) => {
    if (r.op === 'put' && r.key === keys.volumeRecord('v')) {
      tries++;
      if (tries <= 2) return { landMs: null, replyMs: 25_000, error: () => new StoreUnavailableError('503 Slow Down (test network)') };
      if (tries === 3) return { landMs: 0.9 * M, replyMs: 0.9 * M + 10 };
    }
    return NORMAL;
  };
  // GC runs while the create is in progress: the first (at 21 s) marks v's meta (older than
  // G, no record names it) and writes its mark after its fixed-point wait (M/2); the second
  // (at 48 s, its mark G old by its clock) deletes it, at about 53 s, before the name lands.
  const gcRuns: Promise<unknown>[] = [];
  const gc = (): void => { gcRuns.push(collectGarbage(s.catalog, { graceMs: G, maxOperationMs: M, world: s.world })); };
  s.world.setTimeout(gc, G + 1_000);
  s.world.setTimeout(gc, 48_000);
  const created = await s.world.drive(s.catalog.create('v', 64 * MiB).then((v) => v, (err: unknown) => err));
  await s.world.drive(Promise.all(gcRuns));
  const results = await Promise.all(gcRuns) as { deletedObjects: number }[];
  t.is(results.length, 2);
  t.true(results[1]!.deletedObjects >= 1, 'the second GC run deleted the meta of the attempt in progress');
  t.deepEqual(s.net.beyondBound, [], 'no request landed more than M after it was issued');
  await s.world.quiesce();
  if (created instanceof Error) {
    // Failing is fine if it says so and leaves nothing behind.
    t.true(isBatonError(created, 'BATON_ERR_TIMEOUT'), created.message);
    t.regex(created.message, /nothing was created/);
    t.deepEqual(await s.records(), []);
    return;
  }
  const rec = await s.world.drive(s.catalog.record('v'));
  t.truthy(await s.inner.head(keys.meta(rec.id)), 'the created volume has its meta');
  t.deepEqual(await s.metas(), [keys.meta(rec.id)], 'and only its own (the undone attempt\'s is gone)');
  await s.world.drive(s.catalog.fork('v', 'f'));
  const opened = await s.world.drive(s.catalog.open('f', { readOnly: true }));
  t.is(opened.backend.size, 64 * MiB, 'a fork of it opens (its ancestry is whole)');
  await s.world.drive(opened.close());
  // GC afterwards keeps it whole.
  for (let i = 0; i < 2; i++) {
    await s.world.drive(s.world.sleep(G + 1));
    await s.world.drive(collectGarbage(s.catalog, { graceMs: G, maxOperationMs: M, world: s.world }));
  }
  t.truthy(await s.inner.head(keys.meta(rec.id)), 'GC keeps the meta of the record that names it');
});

test('a create slower than the budget every time: TimeoutError, nothing created, nothing left behind', async (t) => {
  const s = setup();
  s.net.fate = (r) => (r.op === 'put' && r.key === keys.volumeRecord('v') ? { landMs: 5, replyMs: M / 2 + 1_000 } : NORMAL);
  const err = await s.world.drive(s.catalog.create('v', 64 * MiB).then(() => null, (e: unknown) => e as Error));
  t.truthy(err, 'the create fails');
  t.true(isBatonError(err, 'BATON_ERR_TIMEOUT'), err?.message);
  t.regex(err!.message, /creating v took too long.*nothing was created/);
  await s.world.quiesce();
  t.deepEqual(await s.records(), []);
  t.deepEqual(await s.metas(), []);
  t.true(s.world.now() >= 3 * M, 'each undone attempt was waited out (M) before the next');
});

test('a fork whose source is removed while it is made: NotFound, and a late try of its name put does not leave it behind', async (t) => {
  const s = setup();
  await s.world.drive(s.catalog.create('src', 64 * MiB));
  let first: Sent | null = null;
  s.net.fate = (r) => {
    // The fork's first name put is held (no answer in 2 s, within the budget); the retry lands.
    if (r.op === 'put' && r.key === keys.volumeRecord('f') && first === null) { first = r; return { landMs: 'held', replyMs: 2_000 }; }
    return NORMAL;
  };
  s.net.onLand = (r) => {
    // As the retried name put lands, the source is removed (rm on another host); the held
    // try lands 20 ms after the fork's undo deleted the name (within M of its issue).
    if (r.op === 'put' && r.key === keys.volumeRecord('f') && r !== first) void s.inner.delete(keys.volumeRecord('src'));
    if (r.op === 'delete' && r.key === keys.volumeRecord('f') && first !== null && s.net.held.has(first)) {
      const f = first;
      s.world.setTimeout(() => s.net.land(f), 20);
    }
  };
  const err = await s.world.drive(s.catalog.fork('src', 'f').then(() => null, (e: unknown) => e as Error));
  t.true(isBatonError(err, 'BATON_ERR_NOT_FOUND'), err?.message);
  t.regex(err!.message, /src was removed while f was being made from it; nothing was created/);
  await s.world.quiesce();
  t.false(s.net.held.has(first!), 'the held try landed');
  t.deepEqual(s.net.beyondBound, []);
  t.deepEqual(await s.records(), [], 'nothing was created, as it says');
  t.is((await s.metas()).length, 1, 'the source\'s meta only (rm by hand left it; GC takes it)');
});

// ------------------------------------------------------------------ F4

test('F4: an earlier try of a create\'s name put lands after a quick rm; the name stays removed (create returns only once that try cannot land)', async (t) => {
  const s = setup();
  let first: Sent | null = null;
  s.net.fate = (r) => {
    // The first try of the name put gets no answer within 2 s; the retrying store tries again
    // and that try lands. The first lands too, 0.9 M after it was sent.
    if (r.op === 'put' && r.key === keys.volumeRecord('v') && first === null) { first = r; return { landMs: 0.9 * M, replyMs: 2_000 }; }
    return NORMAL;
  };
  await s.world.drive(s.catalog.create('v', 64 * MiB));
  t.truthy(first, 'the first try was sent');
  await s.world.drive(s.catalog.remove('v')); // right after create returned
  await s.world.quiesce(); // whatever is still on its way lands
  t.deepEqual(s.net.beyondBound, [], 'no request landed more than M after it was issued');
  t.deepEqual(await s.records(), [], 'the removed name did not come back');
  t.deepEqual(await s.metas(), [], 'and no meta is left');
});

test('F4: a create whose name put needed no retry returns at once (no wait)', async (t) => {
  const s = setup();
  const t0 = s.world.now();
  await s.world.drive(s.catalog.create('v', 64 * MiB));
  t.true(s.world.now() - t0 < 100, `create took ${s.world.now() - t0} ms of virtual time`);
});

test('F6 (simulator seed 1980): a meta put whose first try landed unanswered, and whose retry met it gone again, is undone and made again (not PRECONDITION_FAILED)', async (t) => {
  // Seen by the simulator: the first try of a snapshot's meta put lost its reply; the retry
  // met "already exists" (the first try's meta), then the host stalled for a minute before
  // the read-back, GC deleted the unnamed meta as older than its grace, and the read-back
  // found nothing: the retrying store threw the 412. The catalog must not name a meta that
  // is not there, nor fail with a conflict nobody else caused.
  const s = setup();
  let metaPuts = 0;
  s.net.fate = (r) => {
    if (r.op !== 'put' || !r.key.endsWith('/meta')) return NORMAL;
    metaPuts++;
    if (metaPuts === 1) return { landMs: 5, replyMs: 3 }; // times out, lands later
    if (metaPuts === 2) return { landMs: 5, replyMs: 3 * M }; // 412, answered after the stall
    return NORMAL;
  };
  s.net.onLand = (r) => {
    // The stall of the second try: GC deletes the meta nothing names (older than its grace by the time the client looks).
    if (r.op === 'put' && r.key.endsWith('/meta') && metaPuts === 2) void s.inner.delete(r.key);
  };
  const err = await s.world.drive(s.catalog.create('v', 64 * MiB).then(() => null, (e: unknown) => e as Error));
  t.is(err, null, err?.message);
  await s.world.quiesce();
  const rec = await s.world.drive(s.catalog.record('v'));
  t.truthy(await s.inner.head(keys.meta(rec.id)), 'the created volume has its meta');
  t.deepEqual(await s.metas(), [keys.meta(rec.id)], 'nothing else is left behind');
});

// ------------------------------------------------------------------ a name used again

test('rm whose record delete was retried, then create of the same name: the late first try of the delete does not remove the new volume', async (t) => {
  const s = setup();
  await s.world.drive(s.catalog.create('w', 64 * MiB));
  const old = await s.world.drive(s.catalog.record('w'));
  let tries = 0;
  const late: Sent[] = [];
  s.net.fate = (r) => {
    // rm's delete of the record: its first try gets no answer (the client gives up after 2 s
    // and the retrying store tries again, which lands at once) and lands 0.9 M after it was sent.
    if (r.op === 'delete' && r.key === keys.volumeRecord('w') && ++tries === 1) { late.push(r); return { landMs: 0.9 * M, replyMs: 2_000 }; }
    return NORMAL;
  };
  await s.world.drive(s.catalog.remove('w'));
  // The user makes `w` again at once (or rename --replace lands its new `w`).
  await s.world.drive(s.catalog.create('w', 64 * MiB));
  const made = await s.world.drive(s.catalog.record('w'));
  t.not(made.id, old.id);
  await s.world.quiesce(); // the late try lands, if it has not yet
  t.is(late.length, 1, 'the first try of the delete was sent and landed late');
  t.deepEqual(s.net.beyondBound, [], 'no request landed more than M after it was issued');
  const rec = await s.world.drive(s.catalog.record('w')).catch(() => null);
  t.truthy(rec, 'the volume made after rm returned still exists');
  t.is(rec?.id, made.id);
});

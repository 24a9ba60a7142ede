/**
 * TurnBudget (src/clock.ts): the bulk work of a process (segment uploads' encoding and body
 * assembly, the S3 store's body writes) shares each turn of the event loop, so that no turn
 * holds the loop for many slices at once.
 */
import test from 'ava';
import { BlockCache } from '../../src/cache.js';
import { TurnBudget, systemWorld, turnBudget, type World } from '../../src/clock.js';
import { silentLogger } from '../../src/log.js';
import { MemoryObjectStore } from '../../src/store/memory.js';
import { StoreCatalog } from '../../src/volume/catalog.js';
import type { Volume } from '../../src/volume/volume.js';

const MiB = 1024 * 1024;

/** systemWorld whose turns (each resolved yield) are numbered. */
function countingWorld(): World & { turn: number } {
  const w = { ...systemWorld, turn: 0 } as World & { turn: number };
  w.yield = () => new Promise((r) => setImmediate(() => { w.turn++; r(); }));
  return w;
}

test('a take alone resolves in the turn it was asked in', async (t) => {
  const w = countingWorld();
  const b = new TurnBudget(w, 1000);
  const before = w.turn;
  await b.take(10);
  await b.take(10);
  t.is(w.turn, before, 'no turn passed');
});

test('concurrent takers get at most the budget per turn (the last take may go over), in the order they asked', async (t) => {
  const w = countingWorld();
  const b = new TurnBudget(w, 1000);
  const grants: { turn: number; who: number; i: number }[] = [];
  const order: string[] = [];
  await Promise.all(Array.from({ length: 8 }, async (_, who) => {
    for (let i = 0; i < 4; i++) {
      order.push(`${who}.${i}`);
      await b.take(300);
      grants.push({ turn: w.turn, who, i });
    }
  }));
  t.is(grants.length, 32);
  const perTurn = new Map<number, number>();
  for (const g of grants) perTurn.set(g.turn, (perTurn.get(g.turn) ?? 0) + 300);
  for (const [turn, bytes] of perTurn) t.true(bytes <= 1000 + 300 - 1, `turn ${turn}: ${bytes} bytes`);
  t.true(perTurn.size >= Math.ceil((32 * 300) / 1200), `spread over ${perTurn.size} turns`);
  t.is(b.asked, 32 * 300);
  // Granted in the order asked: the first 4 asks (one per worker, before any grant) went first.
  t.deepEqual(grants.slice(0, 4).map((g) => g.who), [0, 1, 2, 3]);
});

test('waiting takes go by priority (lower first), then in the order asked', async (t) => {
  const w = countingWorld();
  const b = new TurnBudget(w, 1000);
  await b.take(1000); // this turn's budget is spent
  const order: string[] = [];
  const asks = [['a', 5], ['b', -1], ['c', 3], ['d', 0], ['e', -1], ['f', 3]] as const;
  await Promise.all(asks.map(async ([name, priority]) => { await b.take(1000, priority); order.push(name); }));
  t.deepEqual(order, ['b', 'e', 'd', 'c', 'f', 'a']);
  t.true(b.ticket() < b.ticket(), 'tickets increase');
});

test('a volume\'s segment uploads go through its World\'s turn budget (encoding and body assembly)', async (t) => {
  const world = countingWorld();
  const store = new MemoryObjectStore();
  const catalog = new StoreCatalog({ store, log: silentLogger(), cache: () => BlockCache.open({ capacityBytes: 64 * MiB }), volume: { world, segmentBytes: 4 * MiB } });
  await catalog.create('v', 256 * MiB);
  const v = (await catalog.open('v', { readOnly: false })).backend as Volume;
  await v.takeover(1);
  const budget = turnBudget(world);
  const before = budget.asked;
  const data = Buffer.alloc(16 * MiB);
  for (let i = 0; i < data.length; i += 4) data.writeUInt32LE(i * 2654435761 >>> 0, i); // not compressible to nothing
  await v.write(0, data, false);
  await v.flush();
  const asked = budget.asked - before;
  t.true(asked >= 16 * MiB, `16 MiB in segments: ${asked} bytes of encoding and assembly went through the budget`);
  t.true((await v.read(0, data.length)).equals(data));
  await v.close();
});

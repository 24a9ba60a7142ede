/**
 * RecencyList (the working set's recency order) against the obvious model, a Map in insertion
 * order with delete + set per touch, over random operations.
 */
import test from 'ava';
import { seededRandom } from '../../src/store/decorators.js';
import { RecencyList } from '../../src/volume/working-set.js';

test('random touches and drops keep the same order, size and membership as a Map in insertion order', (t) => {
  for (const seed of [1, 2, 3]) {
    const r = seededRandom(seed);
    const list = new RecencyList();
    const model = new Map<number, true>();
    const range = [8, 200, 5000][seed - 1]!;
    for (let i = 0; i < 20_000; i++) {
      const x = r();
      if (x < 0.8) {
        const v = Math.floor(r() * range);
        const fresh = !model.has(v);
        model.delete(v);
        model.set(v, true);
        t.is(list.touch(v), fresh);
      } else if (x < 0.95) {
        const oldest = model.keys().next();
        if (!oldest.done) model.delete(oldest.value);
        list.dropOldest();
      } else if (x < 0.951) {
        model.clear();
        list.clear();
      }
      if (i % 997 === 0) t.deepEqual(list.oldestFirst(), [...model.keys()], `seed ${seed}, step ${i}`);
      if (list.size !== model.size) { t.fail(`size ${list.size} against ${model.size} at step ${i}`); return; }
    }
    t.deepEqual(list.oldestFirst(), [...model.keys()]);
    const last = [...model.keys()].pop();
    t.is(list.mostRecent, last);
    for (let v = 0; v < range; v++) if (list.has(v) !== model.has(v)) { t.fail(`membership of ${v}`); return; }
  }
});

test('the slots of dropped values are reused: the arrays stop growing at the most values held at once', (t) => {
  const list = new RecencyList();
  for (let v = 0; v < 100_000; v++) {
    list.touch(v);
    if (list.size > 100) list.dropOldest();
  }
  t.is(list.size, 100);
  t.deepEqual(list.oldestFirst(), Array.from({ length: 100 }, (_, i) => 99_900 + i));
  t.true((list as unknown as { values: Float64Array }).values.length <= 128, 'grown to 128 slots at most');
});

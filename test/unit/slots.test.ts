/** Slots (src/slots.ts): the bound, first come first served, a release handing its slot on. */
import test from 'ava';
import { Slots } from '../../src/slots.js';

test('at most size holders; waiters get slots in the order they asked; a new caller never slips past a woken waiter', async (t) => {
  const s = new Slots(2);
  const order: number[] = [];
  let holding = 0;
  const job = async (i: number): Promise<void> => {
    await s.acquire();
    holding++;
    t.true(holding <= 2, `${holding} held`);
    order.push(i);
    await new Promise((r) => setImmediate(r));
    holding--;
    s.release();
  };
  const first = Array.from({ length: 6 }, (_, i) => job(i));
  // A caller arriving while slots are being handed over queues behind the earlier ones.
  await new Promise((r) => setImmediate(r));
  const late = job(6);
  await Promise.all([...first, late]);
  t.deepEqual(order, [0, 1, 2, 3, 4, 5, 6]);
  t.is(s.maxInUse, 2);
  // All released: two can be taken at once again.
  await s.acquire();
  await s.acquire();
  t.is(s.maxInUse, 2);
});

test('a size that is not a positive integer is refused', (t) => {
  t.throws(() => new Slots(0), { message: /positive integer/ });
  t.throws(() => new Slots(1.5), { message: /positive integer/ });
});

/**
 * Where things are by default, and how user-facing addresses are parsed. One machine with
 * nothing configured gets: a store directory under ~/.local/share/baton, NBD on
 * 127.0.0.1:10809 (loopback only unless another address is asked for).
 */

import * as os from 'node:os';
import * as path from 'node:path';
import { InvalidArgumentError } from './errors.js';
import type { ListenAddress } from '../nbd/server.js';

export const DEFAULT_LISTEN = '127.0.0.1:10809';

export function batonHome(): string {
  if (process.env.BATON_HOME) return process.env.BATON_HOME;
  const xdg = process.env.XDG_DATA_HOME || path.join(os.homedir(), '.local', 'share');
  return path.join(xdg, 'baton');
}

/** $BATON_STORE, else file: under $BATON_HOME (default ~/.local/share/baton). */
export function defaultStoreUrl(): string {
  return process.env.BATON_STORE || `file:${path.join(batonHome(), 'store')}`;
}

export function parseListen(v: string): ListenAddress {
  const m = /^(?:\[([^\]]+)\]|([^:]+)):(\d{1,5})$/.exec(v.trim());
  if (!m) throw new InvalidArgumentError(`--listen must be HOST:PORT (for example 127.0.0.1:10809), got "${v}"`);
  const port = Number(m[3]);
  if (port > 65535) throw new InvalidArgumentError(`port out of range: ${port}`);
  return { host: (m[1] ?? m[2])!, port };
}

/**
 * Stores whose volumes live only as long as the process that opened them (`memory:` under
 * the engine, `ram:` without it): a volume `baton create` makes there is gone when it exits.
 */
export function isProcessLocalStore(url: string): boolean {
  return url === 'memory:' || url === 'memory://' || url === 'ram:';
}

/**
 * Is `host` (a --listen address) reachable only from this machine? Literal loopback
 * addresses (127.0.0.0/8, ::1, ::ffff:127.x) and `localhost` are; anything else, including
 * 0.0.0.0, :: and host names, is treated as reachable from the network.
 */
export function isLoopbackHost(host: string): boolean {
  const h = host.toLowerCase();
  if (h === 'localhost' || h === '::1' || h === '0:0:0:0:0:0:0:1') return true;
  const v4 = h.startsWith('::ffff:') ? h.slice(7) : h;
  return /^127\.\d{1,3}\.\d{1,3}\.\d{1,3}$/.test(v4);
}

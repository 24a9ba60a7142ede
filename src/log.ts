/**
 * Logging: pino, JSON lines on stderr (stdout is reserved for data and --json output).
 */
import { pino, type Logger } from 'pino';
import { InvalidArgumentError } from './errors.js';

export type { Logger };

/** pino's levels, least to most severe, and `silent`. */
export const LOG_LEVELS = ['trace', 'debug', 'info', 'warn', 'error', 'fatal', 'silent'] as const;

export function makeLogger(level: string = process.env.BATON_LOG_LEVEL ?? 'info'): Logger {
  // Checked here, not left to pino, whose error speaks of its own internals ("default level must be included in custom levels").
  if (!(LOG_LEVELS as readonly string[]).includes(level)) {
    throw new InvalidArgumentError(`"${level}" is not a log level (--log-level, $BATON_LOG_LEVEL): use one of ${LOG_LEVELS.join(', ')}`);
  }
  return pino({ level, base: { svc: 'baton' } }, pino.destination({ dest: 2, sync: true }));
}

export function silentLogger(): Logger {
  return pino({ level: 'silent' });
}

/**
 * Logging: pino, JSON lines on stderr (stdout is reserved for data and --json output).
 */
import { pino, type Logger } from 'pino';

export type { Logger };

export function makeLogger(level: string = process.env.BATON_LOG_LEVEL ?? 'info'): Logger {
  return pino({ level, base: { svc: 'baton' } }, pino.destination({ dest: 2, sync: true }));
}

export function silentLogger(): Logger {
  return pino({ level: 'silent' });
}

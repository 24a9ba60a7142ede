import { engineWorkload } from './engine.js';
import type { Workload } from './run.js';
export const servedWorkload: Workload = engineWorkload;

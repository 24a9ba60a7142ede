/** Opens the volume catalog a `--store` URL names. */

import * as path from 'node:path';
import { InvalidArgumentError } from './errors.js';
import { FileCatalog, MemoryCatalog, type VolumeCatalog } from './volumes.js';

export function openCatalog(url: string): VolumeCatalog {
  if (url === 'memory:' || url === 'memory') return new MemoryCatalog();
  if (url.startsWith('file:')) {
    let dir = url.slice('file:'.length);
    if (dir.startsWith('//')) dir = dir.slice(2);
    if (!dir) throw new InvalidArgumentError('--store file: needs a directory, for example file:/var/lib/baton');
    return new FileCatalog(path.resolve(dir));
  }
  if (url.startsWith('s3://')) {
    throw new InvalidArgumentError('s3:// stores are not available in this version yet; use --store file:DIR');
  }
  throw new InvalidArgumentError(`--store must be file:DIR or memory:, got "${url}"`);
}

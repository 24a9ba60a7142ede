#!/usr/bin/env node
/**
 * The installed `baton` command (package.json "bin"): sizes libuv's thread pool, then runs
 * the CLI (baton.ts).
 *
 * Why a CommonJS file of its own: libuv starts its pool on the first job and reads
 * UV_THREADPOOL_SIZE then, once per process, and Node's ES module loader reads module files
 * through the pool, so an ES module runs too late to set it. This file is loaded
 * synchronously, before any pool job.
 *
 * Why 16 threads: every file-system call of the `file:` store and of the block cache, and
 * each DNS lookup of an S3 endpoint, is a pool job. A commit uploads up to 16 segments at
 * once (Volume's uploadConcurrency), each an open, a write, an fdatasync, a link and a
 * directory fsync; with the default 4 threads, four fdatasyncs held the pool and the other
 * uploads (and any DNS lookup) queued behind them. 1 GiB `nbdcopy --flush` into a `file:`
 * volume, one run: 1.50-1.65 s with 4 threads, 1.29-1.34 s with 16, nbdkit file 1.04 s.
 * A UV_THREADPOOL_SIZE set by the user wins. `node dist/cli/baton.js` runs the same CLI with
 * libuv's default pool.
 */
const POOL_THREADS = 16;
if (process.env.UV_THREADPOOL_SIZE === undefined) process.env.UV_THREADPOOL_SIZE = String(POOL_THREADS);
void import('./baton.js');

/**
 * LocalDirObjectStore: the embedded default store (`file:DIR`), one file per object under DIR.
 *
 * Crash safety (what a resolved put promises after power loss): the body is written to a
 * temp file and fdatasync'ed; then `link(tmp, final)` for a create-only put (atomic, EEXIST is
 * the precondition failure, the same fencing primitive as S3's If-None-Match: *) and the temp
 * name is unlinked at once, or `rename(tmp, final)` for a plain put (atomic replace); then the
 * destination directory is fsync'ed so the new name is durable (puts into one directory share
 * that fsync: a put waits for one that started after its link or rename, see #syncDir).
 * Directories are fsync'ed into
 * their parent when first used by this process. Readers never see a partial object.
 *
 * Temp files, and why they cannot leak: they live in one directory, `DIR/.tmp/` (list() skips
 * names starting with '.', and no key escapes to one), named `<pid>-<nonce>-<random>`. A crash can
 * leave one behind: before its link (garbage), or after it (a second name of the object, so
 * deleting the object would free nothing). The first put of each store instance sweeps
 * `.tmp/`, removing those whose process is gone, those with this process's pid but not its
 * nonce (a predecessor's: a recycled pid), and any older than STALE_TMP_MS (a pid recycled by
 * a live stranger), never this process's own. Removing a temp another process is still writing
 * cannot corrupt anything: its link or rename then fails (ENOENT) and so does its put; and
 * after the link, the temp name is only a second name. One directory keeps the sweep's cost
 * at the number of temps, not objects. (Stores written before this layout may hold
 * `.tmp-*` files beside objects; nothing removes those.) A live store instance also keeps one
 * empty temp of its own made ahead for its next put (#takeTemp: creating a file is the
 * slowest metadata call of a put); close() removes it, and one made longer ago than
 * SPARE_TEMP_MAX_AGE_MS (well inside STALE_TMP_MS, so never one another process's sweep
 * could take) is not used but removed.
 *
 * Layout, and why:
 * - Key "vol/abc/log/1" is the file `DIR/vol/abc/log/1@`. Objects end in '@' and directories
 *   do not (segments are escaped: '%' -> %25, '@' -> %40, a leading '.' -> %2E), so key "a" and
 *   key "a/b" can coexist: S3 allows both and baton uses both shapes. A segment longer than
 *   254 bytes after escaping is refused (InvalidArgumentError): file names stop at 255.
 * - Each file starts with a fixed 4096-byte header: "BATONOB1", u32be JSON length, JSON
 *   {etag, metadata}, zero padding. Metadata lives inside the object file because one file is
 *   replaced by one rename: a sidecar file could not change atomically with the body, and
 *   xattrs are missing or limited on some filesystems (tmpfs, some overlay setups). The fixed
 *   size makes size = file size - 4096 (list needs only stat) and puts a ranged read at a
 *   known position (one pread, no header read), and keeps bodies 4 KiB-aligned in the file.
 * - Files are immutable once named: a reader's open fd sees one whole version.
 * - delete removes emptied directories; a put racing with that rmdir sees ENOENT and retries.
 */
import { randomBytes } from 'node:crypto';
import { close as fsClose, closeSync, constants as fsc, fdatasync as fsFdatasync, fstat as fsFstat, fsync as fsFsync, linkSync, open as fsOpen, openSync, read as fsRead, readFileSync, readSync, readvSync, renameSync, stat as fsStat, unlinkSync, writev as fsWritev, writevSync, type Dirent, type Stats } from 'node:fs';
import { mkdir, open, readdir, rmdir, stat, unlink, type FileHandle } from 'node:fs/promises';
import { dirname, join, resolve } from 'node:path';
import {
  BatonError,
  CorruptError,
  InvalidArgumentError,
  IoError,
  NotFoundError,
  PreconditionFailedError,
} from '../errors.js';
import { compareKeys, rangeError, validateKey, validateMetadata, validateRange } from './memory.js';
import type { ByteRange, ListOptions, LocalObjects, LocalReadCounts, ObjectHead, ObjectInfo, ObjectStore, PutOptions } from './object-store.js';

const MAGIC = Buffer.from('BATONOB1', 'latin1');
export const LOCAL_HEADER_SIZE = 4096;
const OBJ_SUFFIX = '@';
/** A listing fetches this many files' stats ahead of the one it yields (#walk). */
const LIST_AHEAD = 32;
/** Temp files' directory under the root (see the invariants above). */
export const TMP_DIR = '.tmp';
/**
 * Temp names are `<pid>-<this process's nonce>-<random>`: a temp with our pid and another
 * nonce is a predecessor's (a recycled pid); with ours, it belongs to a live put of this
 * process, maybe through another store instance on the same directory.
 */
export const PROCESS_NONCE = randomBytes(4).toString('hex');
/** A temp file older than this is stale whoever made it: no put takes an hour between write and link. */
export const STALE_TMP_MS = 60 * 60 * 1000;
const PUT_RETRIES = 5;

/** Whether a process with this pid exists on this machine (EPERM: it does, it is not ours). */
function processExists(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return errnoOf(err) === 'EPERM';
  }
}

interface Header {
  etag: string;
  metadata: Record<string, string>;
}

function errnoOf(err: unknown): string | undefined {
  return typeof err === 'object' && err !== null && 'code' in err && typeof err.code === 'string' ? err.code : undefined;
}

function escapeSegment(seg: string): string {
  let out = seg.replace(/%/g, '%25').replace(/@/g, '%40');
  if (out.startsWith('.')) out = '%2E' + out.slice(1);
  return out;
}

function unescapeSegment(name: string): string | undefined {
  if (name.includes('@')) return undefined;
  try {
    return name.replace(/%([0-9A-Fa-f]{2})/g, (_m, hex: string) => String.fromCharCode(parseInt(hex, 16)));
  } catch {
    return undefined;
  }
}

function encodeHeader(h: Header): Buffer {
  const json = Buffer.from(JSON.stringify(h), 'utf8');
  if (12 + json.length > LOCAL_HEADER_SIZE) {
    throw new InvalidArgumentError(`metadata too large for the local store (${json.length} bytes encoded, at most ${LOCAL_HEADER_SIZE - 12})`);
  }
  const buf = Buffer.alloc(LOCAL_HEADER_SIZE);
  MAGIC.copy(buf, 0);
  buf.writeUInt32BE(json.length, 8);
  json.copy(buf, 12);
  return buf;
}

function decodeHeader(buf: Buffer, what: string): Header {
  if (buf.length < LOCAL_HEADER_SIZE || !buf.subarray(0, 8).equals(MAGIC)) {
    throw new CorruptError(`${what}: not a baton object file (bad header); it was not written by baton or is damaged`);
  }
  const n = buf.readUInt32BE(8);
  if (12 + n > LOCAL_HEADER_SIZE) throw new CorruptError(`${what}: object header length ${n} is invalid`);
  try {
    const parsed: unknown = JSON.parse(buf.toString('utf8', 12, 12 + n));
    if (typeof parsed === 'object' && parsed !== null && 'etag' in parsed && 'metadata' in parsed) {
      const { etag, metadata } = parsed;
      if (typeof etag === 'string' && typeof metadata === 'object' && metadata !== null) {
        const m: Record<string, string> = {};
        for (const [k, v] of Object.entries(metadata)) if (typeof v === 'string') m[k] = v;
        return { etag, metadata: m };
      }
    }
  } catch {
    // fall through
  }
  throw new CorruptError(`${what}: object header is not valid JSON {etag, metadata}`);
}

async function readFully(fh: FileHandle, buf: Buffer, position: number, what: string): Promise<void> {
  let done = 0;
  while (done < buf.length) {
    const { bytesRead } = await fh.read(buf, done, buf.length - done, position + done);
    if (bytesRead === 0) throw new CorruptError(`${what}: file ended early (wanted ${buf.length} bytes at ${position})`);
    done += bytesRead;
  }
}

/**
 * The most one write system call of an object's body carries. Why not all 8 MiB of a segment
 * at once: on Linux 6.x a file's page cache takes folios as large as the write (up to 2 MiB
 * and more), and where the kernel hands free memory back to a hypervisor (virtio-balloon free
 * page reporting: the microVMs agents run in, this machine among them) the large free blocks
 * those come from are the ones given back, so every 4 KiB of them faults at the host when the
 * copy touches it. Measured here (`dd if=/dev/shm/1g of=new-file`, right after 1.5 GiB was
 * freed): 0.37-0.45 s of system time per GiB with bs=256K, 1.2-1.5 s with 512K, 1.7-3.3 s
 * with 8M (bench/README.md, session 17); a `file:` volume's 1 GiB `nbdcopy --flush`
 * took 3.9-4.8 s with one pwritev per segment (system time 4.7-6.7 s) and 1.9-2.0 s with
 * 256 KiB per call (0.8 s). `nbdkit file` gets 256 KiB per write from nbdcopy. Elsewhere a
 * 256 KiB write costs the same per byte as a larger one (a system call per 256 KiB).
 */
export const WRITE_CHUNK_BYTES = 256 * 1024;

/**
 * A put's calls to the file system, and where each runs. The waits for the disk (fdatasync,
 * fsync) and the writes of large bodies go to libuv's thread pool, so the event loop serves
 * other requests meanwhile; so does the temp file's creation, made ahead of the put
 * (#takeTemp), since it is slow. The other metadata calls (close, link, unlink, rename, open a
 * directory) and the write of a small body (a log record) are made on the event loop: each
 * costs microseconds (no wait for the disk: the journal takes them in memory), where a trip
 * through the pool costs tens, and a small flush's put made nine trips one after another
 * (fio 4 KiB write + FLUSH at QD1 on a `file:` volume: 691 pairs/s against nbdkit file's
 * 3,619; bench/README.md, issue 11, session 19). A call that does wait on the event loop (a
 * journal that is full) holds every volume of this process for as long: the price of a local
 * store, which already reads on the event loop (#readOpened).
 */
const SYNC_WRITE_BYTES = 64 * 1024;

/** A temp file created for a put, open for writing. */
interface TempFile { path: string; fd: number; made: number }

/** A temp made ahead (#takeTemp) older than this is removed, not used (the file's top: the sweep's age bound). */
const SPARE_TEMP_MAX_AGE_MS = STALE_TMP_MS / 4;

/** Close and remove a temp no put will use. */
function discardTemp(t: TempFile): void {
  try { closeSync(t.fd); } catch { /* closed */ }
  unlinkQuietly(t.path);
}

function unlinkQuietly(path: string): void {
  try { unlinkSync(path); } catch { /* gone already, or left for the sweep */ }
}

function openAsync(path: string, flags: number, mode: number): Promise<number> {
  return new Promise((resolve, reject) => fsOpen(path, flags, mode, (err, fd) => (err ? reject(err) : resolve(fd))));
}

function fdatasyncAsync(fd: number): Promise<void> {
  return new Promise((resolve, reject) => fsFdatasync(fd, (err) => (err ? reject(err) : resolve())));
}

function fsyncAsync(fd: number): Promise<void> {
  return new Promise((resolve, reject) => fsFsync(fd, (err) => (err ? reject(err) : resolve())));
}

function writevAsync(fd: number, bufs: Buffer[], position: number): Promise<number> {
  return new Promise((resolve, reject) => fsWritev(fd, bufs, position, (err, n) => (err ? reject(err) : resolve(n))));
}

/**
 * Write `bufs` back to back from position 0, WRITE_CHUNK_BYTES per pwritev at most (a
 * segment's pieces are many: one call gathers several); on the event loop when they are at
 * most SYNC_WRITE_BYTES in all, else in the thread pool.
 */
async function writeFully(fd: number, bufs: readonly Buffer[]): Promise<void> {
  const sync = partsLength(bufs) <= SYNC_WRITE_BYTES;
  // Where the next write starts: bufs[i] at offset `off` (the file at `position`). A position,
  // not a shrinking copy of the list: a random writer's segment has thousands of pieces.
  let position = 0;
  let i = 0;
  let off = 0;
  const chunk: Buffer[] = [];
  for (;;) {
    while (i < bufs.length && off === bufs[i]!.length) { i++; off = 0; }
    if (i === bufs.length) return;
    chunk.length = 0;
    let room = WRITE_CHUNK_BYTES;
    for (let k = i, o = off; k < bufs.length && room > 0; k++, o = 0) {
      const b = bufs[k]!;
      const n = Math.min(b.length - o, room);
      if (n > 0) chunk.push(n === b.length ? b : b.subarray(o, o + n));
      room -= n;
    }
    const bytesWritten = sync ? writevSync(fd, chunk, position) : await writevAsync(fd, chunk, position);
    position += bytesWritten;
    // A short write (rare: signals, quotas) continues after the last byte written.
    let skip = bytesWritten;
    while (i < bufs.length && skip >= bufs[i]!.length - off) { skip -= bufs[i]!.length - off; i++; off = 0; }
    off += skip;
  }
}

/**
 * Open object files kept for LocalObjects.read, so that a read from the store costs one pread
 * (as a read from a cache file would), not open + fstat + pread + close. Why this is safe:
 * baton reads in place only objects that are never replaced, and a file's bytes never
 * change once it has its name; a put or delete through this store forgets its key's file at
 * once. What an open file costs: a deleted object's space is freed when its file is closed,
 * so files are closed when idle for IDLE_FD_MS (one timer, unref'd, while any is open) and
 * at most MAX_OPEN_FILES stay open.
 */
/**
 * How many object files may stay open: a quarter of this process's open-file limit (the
 * rest is for sockets, the cache file, the lease), between 64 and 4096. Too few costs a lot:
 * random reads over a 1 GiB volume (about 140 objects) with 128 kept files reopened a file
 * on most reads and ran at a third of the speed.
 */
export function keptFilesBudget(procLimits: string | null): number {
  const m = procLimits === null ? null : /^Max open files\s+(\d+|unlimited)/m.exec(procLimits);
  const soft = m === null ? 1024 : m[1] === 'unlimited' ? Infinity : Number(m[1]);
  return Math.max(64, Math.min(4096, Math.floor(soft / 4)));
}
const MAX_OPEN_FILES = keptFilesBudget((() => { try { return readFileSync('/proc/self/limits', 'utf8'); } catch { return null; } })());
const IDLE_FD_MS = 5_000;

/** The smallest view buffer (#view): a framed read of 256 KiB spans a little more. */
const VIEW_SCRATCH_MIN = 1024 * 1024 + 64 * 1024;

/** preadv exactly the parts' bytes at `position` (a short read goes on where it stopped), or CorruptError at the file's end. */
function preadvFully(fd: number, key: string, parts: readonly Buffer[], position: number): void {
  let bufs = parts;
  let pos = position;
  for (;;) {
    let want = 0;
    for (const b of bufs) want += b.length;
    if (want === 0) return;
    const n = readvSync(fd, bufs as Buffer[], pos);
    if (n === want) return;
    if (n === 0) throw new CorruptError(`get ${key}: file ended early (wanted ${want} more bytes at ${pos - LOCAL_HEADER_SIZE})`);
    let i = 0;
    let k = n;
    while (k >= bufs[i]!.length) { k -= bufs[i]!.length; i++; }
    bufs = [bufs[i]!.subarray(k), ...bufs.slice(i + 1)];
    pos += n;
  }
}

/**
 * Read `length` bytes at `position` into out[outOff..] (a short read goes on where it stopped),
 * or CorruptError at the file's end. preadvFully of one part, without the subarray and the list
 * that would cost per read: this is every 4 KiB random read's (LocalObjects.readNow).
 */
function preadFully(fd: number, key: string, out: Buffer, outOff: number, length: number, position: number): void {
  let done = 0;
  while (done < length) {
    const n = readSync(fd, out, outOff + done, length - done, position + done);
    if (n === 0) throw new CorruptError(`get ${key}: file ended early (wanted ${length - done} more bytes at ${position + done - LOCAL_HEADER_SIZE})`);
    done += n;
  }
}

function partsLength(parts: readonly Buffer[]): number {
  let n = 0;
  for (const p of parts) n += p.length;
  return n;
}

interface OpenedFile { fh: FileHandle; size: number }

/**
 * `opened`: what `fh` resolved to, once it has (LocalObjects.readNow reads only such files).
 * `used`: read since #sweep last looked at it (its second chance: see #sweep).
 */
interface OpenFile { fh: Promise<OpenedFile>; opened: OpenedFile | null; readers: number; lastUsed: number; used: boolean; forgotten: boolean }

/** fsync a directory: opened and closed on the event loop, the fsync in the pool (writeFully's note). */
async function fsyncDir(path: string): Promise<void> {
  const fd = openSync(path, fsc.O_RDONLY | fsc.O_DIRECTORY);
  try {
    await fsyncAsync(fd);
  } finally {
    closeSync(fd);
  }
}

export class LocalDirObjectStore implements ObjectStore {
  readonly description: string;
  readonly root: string;
  /** Directories whose entry in their parent this process has fsync'ed (or found and fsync'ed). */
  readonly #durableDirs = new Set<string>();
  readonly #tmpDir: string;
  readonly #open = new Map<string, OpenFile>(); // insertion order, with second chances = roughly least recently used first (#sweep)
  #sweepTimer: ReturnType<typeof setTimeout> | null = null;
  readonly #reads: LocalReadCounts = { ok: 0, notFound: 0, error: 0, bytes: 0 };
  /** The buffer every view reads into (#view). */
  #viewScratch = Buffer.alloc(0);
  readonly local: LocalObjects = {
    read: (key, offset, length, out, outOff) => this.#readInPlace(key, offset, length, out, outOff),
    readNow: (key, offset, length, out, outOff) => this.#readNow(key, offset, length, (fd) => preadFully(fd, key, out, outOff, length, LOCAL_HEADER_SIZE + offset)),
    readvNow: (key, offset, parts) => this.#readNow(key, offset, partsLength(parts), (fd) => preadvFully(fd, key, parts, LOCAL_HEADER_SIZE + offset)),
    view: (key, offset, length, use) => this.#view(key, offset, length, use),
    readv: (key, offset, parts) => this.#withFile(key, offset, partsLength(parts), (fd) => preadvFully(fd, key, parts, LOCAL_HEADER_SIZE + offset)),
    putParts: (key, parts, options) => this.#put(key, parts, options),
    keys: (prefix, options) => this.#keys(prefix, options),
    reads: this.#reads,
  };
  /** Root made durable, `.tmp/` made and swept; once per process (reset if it failed). */
  #tmpReady: Promise<void> | null = null;

  readonly #maxOpenFiles: number;

  /** `maxOpenFiles`: object files kept open for LocalObjects.read (default: keptFilesBudget). */
  constructor(dir: string, options: { maxOpenFiles?: number } = {}) {
    this.#maxOpenFiles = options.maxOpenFiles ?? MAX_OPEN_FILES;
    this.root = resolve(dir);
    this.description = `file:${this.root}`;
    this.#tmpDir = join(this.root, TMP_DIR);
  }

  #prepareTmp(): Promise<void> {
    if (this.#tmpReady !== null) return this.#tmpReady;
    const p = (async () => {
      await this.#ensureDir([]);
      try {
        await mkdir(this.#tmpDir);
      } catch (err) {
        if (errnoOf(err) !== 'EEXIST') throw err;
      }
      await this.sweepTemps();
    })();
    this.#tmpReady = p;
    p.catch(() => { if (this.#tmpReady === p) this.#tmpReady = null; });
    return p;
  }

  /**
   * Removes stale temp files (see the invariants at the top); returns how many. Runs before
   * this instance's first put. Best effort: a file it cannot remove is left for the next
   * process.
   */
  async sweepTemps(now: number = Date.now()): Promise<number> {
    let names: string[];
    try {
      names = await readdir(this.#tmpDir);
    } catch {
      return 0;
    }
    let removed = 0;
    for (const name of names) {
      const path = join(this.#tmpDir, name);
      const m = /^(\d+)-([^-]*)/.exec(name);
      const pid = Number(m?.[1] ?? NaN);
      const ours = pid === process.pid && m?.[2] === PROCESS_NONCE;
      if (ours) continue;
      let stale = Number.isSafeInteger(pid) && pid > 0 && (pid === process.pid || !processExists(pid));
      if (!stale) {
        try {
          stale = now - (await stat(path)).mtimeMs > STALE_TMP_MS;
        } catch {
          continue; // gone already
        }
      }
      if (!stale) continue;
      try {
        await unlink(path);
        removed++;
      } catch {
        // gone already, or not ours to remove: the next process tries again
      }
    }
    return removed;
  }

  #paths(key: string): { dir: string; dirSegs: string[]; file: string } {
    validateKey(key);
    const segs = key.split('/');
    const last = segs.pop() as string;
    const dirSegs = segs.map(escapeSegment);
    const dir = join(this.root, ...dirSegs);
    return { dir, dirSegs, file: join(dir, escapeSegment(last) + OBJ_SUFFIX) };
  }

  #ioError(op: string, key: string, err: unknown): BatonError {
    if (err instanceof BatonError) return err;
    const code = errnoOf(err);
    const where = `${op} ${key} in ${this.description}`;
    switch (code) {
      case 'ENAMETOOLONG':
        return new InvalidArgumentError(`${where}: a key segment is too long for a file name (255 bytes after escaping)`);
      case 'ENOSPC':
      case 'EDQUOT':
        return new IoError(`${where}: no space left on the device holding ${this.root}: free space or move the store`, { cause: err });
      case 'EACCES':
      case 'EPERM':
      case 'EROFS':
        return new IoError(`${where}: permission denied or read-only filesystem (${code}): check ownership and mount of ${this.root}`, { cause: err });
      default:
        return new IoError(`${where}: ${err instanceof Error ? err.message : String(err)}`, { cause: err });
    }
  }

  /** mkdir -p below root, fsync'ing each level into its parent (also when another process made it). */
  async #ensureDir(dirSegs: string[]): Promise<void> {
    let parent = this.root;
    if (!this.#durableDirs.has(parent)) {
      // The root (and any missing ancestors, e.g. ~/.local/share/baton/store on first use)
      // must be durable in their parents too, or the first puts could vanish with them.
      const first = await mkdir(parent, { recursive: true });
      if (first !== undefined) {
        for (let d = parent; ; d = dirname(d)) {
          await fsyncDir(dirname(d));
          if (d === first || dirname(d) === d) break;
        }
      }
      this.#durableDirs.add(parent);
    }
    for (const seg of dirSegs) {
      const p = join(parent, seg);
      if (!this.#durableDirs.has(p)) {
        try {
          await mkdir(p);
        } catch (err) {
          if (errnoOf(err) !== 'EEXIST') throw err;
        }
        // Also on EEXIST: whoever created it may not have fsync'ed the parent yet, and our put
        // must not resolve before the path to it is durable.
        await fsyncDir(parent);
        this.#durableDirs.add(p);
      }
      parent = p;
    }
  }

  #forgetDirs(dir: string): void {
    for (const d of this.#durableDirs) if (d === dir || d.startsWith(dir + '/')) this.#durableDirs.delete(d);
  }

  async get(key: string, range?: ByteRange): Promise<Buffer> {
    const { file } = this.#paths(key);
    if (range !== undefined) validateRange(range);
    let opened: { fh: FileHandle; size: number };
    try {
      opened = await this.#openForRead(key, file);
    } catch (err) {
      throw this.#ioError('get', key, err);
    }
    const { fh, size } = opened;
    try {
      if (range === undefined) {
        const buf = Buffer.allocUnsafe(LOCAL_HEADER_SIZE + size);
        await readFully(fh, buf, 0, `get ${key}`);
        decodeHeader(buf, `get ${key}`);
        return buf.subarray(LOCAL_HEADER_SIZE);
      }
      if (range.offset + range.length > size) throw rangeError(key, range, size);
      const buf = Buffer.allocUnsafe(range.length);
      await readFully(fh, buf, LOCAL_HEADER_SIZE + range.offset, `get ${key}`);
      return buf;
    } catch (err) {
      throw this.#ioError('get', key, err);
    } finally {
      await fh.close();
    }
  }

  async head(key: string): Promise<ObjectHead | null> {
    const { file } = this.#paths(key);
    let fh: FileHandle;
    try {
      fh = await open(file, 'r');
    } catch (err) {
      const code = errnoOf(err);
      if (code === 'ENOENT' || code === 'ENOTDIR') return null;
      throw this.#ioError('head', key, err);
    }
    try {
      const st = await fh.stat();
      const buf = Buffer.allocUnsafe(LOCAL_HEADER_SIZE);
      await readFully(fh, buf, 0, `head ${key}`);
      const h = decodeHeader(buf, `head ${key}`);
      return { key, size: st.size - LOCAL_HEADER_SIZE, lastModified: st.mtime, etag: h.etag, metadata: h.metadata };
    } catch (err) {
      throw this.#ioError('head', key, err);
    } finally {
      await fh.close();
    }
  }

  put(key: string, body: Buffer, options?: PutOptions): Promise<void> {
    return this.#put(key, [body], options);
  }

  async #readInPlace(key: string, offset: number, length: number, out: Buffer, outOff: number): Promise<void> {
    await this.#withFile(key, offset, length, (fd) => preadvFully(fd, key, [out.subarray(outOff, outOff + length)], LOCAL_HEADER_SIZE + offset));
  }

  /**
   * LocalObjects.view: the bytes are read into one buffer of this store's, shared by every
   * view: `use` runs in the same synchronous run as the read into it (inside #withFile's
   * readFn, after its last await), so no other view can read into it meanwhile. A read that
   * kept a buffer of its own across the await for the file needed one per read in flight: at
   * 64 reads in flight (nbdcopy) the engine's pool of eight ran dry and a 1 MiB buffer was
   * allocated per read (GC was a tenth of a framed read's CPU). What `use` throws is passed
   * on as it is, not counted as a failed read.
   */
  async #view<T>(key: string, offset: number, length: number, use: (bytes: Buffer) => T): Promise<T> {
    const outcome = await this.#withFile(key, offset, length, (fd): { ok: true; value: T } | { ok: false; err: unknown } => {
      if (this.#viewScratch.length < length) this.#viewScratch = Buffer.allocUnsafe(Math.max(length, VIEW_SCRATCH_MIN));
      const bytes = this.#viewScratch.subarray(0, length);
      preadvFully(fd, key, [bytes], LOCAL_HEADER_SIZE + offset);
      try {
        return { ok: true, value: use(bytes) };
      } catch (err) {
        return { ok: false, err };
      }
    });
    if (!outcome.ok) throw outcome.err;
    return outcome.value;
  }

  /**
   * Runs `readFn` on the open file of `key` (opened and kept open on first use) for a read of
   * [offset, offset + length), counting it, and resolves to what it returned; readFn is
   * synchronous and runs after the last await here, so #view's use runs in the same
   * synchronous run as its read.
   */
  async #withFile<T>(key: string, offset: number, length: number, readFn: (fd: number) => T): Promise<T> {
    validateRange({ offset, length });
    let f = this.#open.get(key);
    const opening = !f;
    if (f) {
      f.used = true;
    } else {
      const { file } = this.#paths(key);
      const entry: OpenFile = { fh: this.#openForRead(key, file), opened: null, readers: 0, lastUsed: 0, used: false, forgotten: false };
      entry.fh.then((o) => { entry.opened = o; }, () => {});
      this.#open.set(key, (f = entry));
    }
    f.readers++;
    f.lastUsed = Date.now();
    if (opening) this.#sweep(false);
    try {
      let opened: OpenedFile;
      try {
        opened = await f.fh;
      } catch (err) {
        if (this.#open.get(key) === f) this.#open.delete(key); // not kept: the next read tries again
        throw this.#readFailed(key, err);
      }
      return this.#readOpened(key, opened, offset, length, readFn);
    } finally {
      f.readers--;
      if (f.forgotten && f.readers === 0) void this.#closeFile(f);
    }
  }

  /**
   * LocalObjects.readNow: #readInPlace without a wait, for an object whose file is open
   * already (a random reader's objects, read moments ago, mostly are): no promise, no trip
   * through the event loop. False, with nothing read or counted, when it is not open.
   * Synchronous from the lookup to the read, so nothing can close the file in between
   * (#forgetFile and #sweep run on other turns, and a forgotten file is not in #open).
   */
  #readNow(key: string, offset: number, length: number, readFn: (fd: number) => void): boolean {
    const f = this.#open.get(key);
    const opened = f?.opened;
    if (!f || !opened) return false;
    validateRange({ offset, length });
    f.used = true;
    f.lastUsed = Date.now();
    this.#readOpened(key, opened, offset, length, readFn);
    return true;
  }

  /**
   * The read of an open file, counted. Synchronous, as the block cache's reads of its own
   * file were before a local store bypassed it: what a volume reads it mostly wrote moments
   * ago or reads again, so it is in the page cache, where a pread costs microseconds and a
   * trip through libuv's thread pool (4 threads) costs tens: at 32 reads in flight the pool
   * was a quarter of the speed. A read of cold data blocks the event loop for one disk read.
   */
  #readOpened<T>(key: string, opened: OpenedFile, offset: number, length: number, readFn: (fd: number) => T): T {
    try {
      if (offset + length > opened.size) throw rangeError(key, { offset, length }, opened.size);
      const result = readFn(opened.fh.fd);
      this.#reads.ok++;
      this.#reads.bytes += length;
      return result;
    } catch (err) {
      throw this.#readFailed(key, err);
    }
  }

  /** A failed read as the caller sees it (#ioError), counted. */
  #readFailed(key: string, err: unknown): Error {
    const e = this.#ioError('get', key, err);
    if (e instanceof NotFoundError) this.#reads.notFound++;
    else this.#reads.error++;
    return e;
  }

  /** Open an object's file and learn its size (NotFoundError if absent; closed again on any failure). */
  async #openForRead(key: string, file: string): Promise<{ fh: FileHandle; size: number }> {
    let fh: FileHandle;
    try {
      fh = await open(file, 'r');
    } catch (err) {
      const code = errnoOf(err);
      if (code === 'ENOENT' || code === 'ENOTDIR') throw new NotFoundError(`get ${key}: no such object in ${this.description}`);
      throw err;
    }
    try {
      const size = (await fh.stat()).size - LOCAL_HEADER_SIZE;
      if (size < 0) throw new CorruptError(`get ${key}: object file ${file} is shorter than its header`);
      return { fh, size };
    } catch (err) {
      await fh.close().catch(() => {});
      throw err;
    }
  }

  async #closeFile(f: OpenFile): Promise<void> {
    try { await (await f.fh).fh.close(); } catch { /* never opened, or closed already */ }
  }

  /** This key's open file is not to be read again (put or deleted through this store). */
  #forgetFile(key: string): void {
    const f = this.#open.get(key);
    if (!f) return;
    this.#open.delete(key);
    f.forgotten = true;
    if (f.readers === 0) void this.#closeFile(f);
  }

  /**
   * Close files idle past IDLE_FD_MS and, beyond MAX_OPEN_FILES, the least recently used
   * roughly: in #open's order, a file read since the last sweep gets a second chance (moved
   * to the end, its mark cleared) and the first one not read since goes (CLOCK). A read only
   * sets the mark: keeping exact recency order cost a Map delete and set per read, two for
   * each 4 KiB random read of a framed volume (its crc entries and its block). Rearms while
   * any file is open. Which files stay open changes only speed, never what a read returns.
   */
  #sweep(fromTimer: boolean): void {
    if (fromTimer) this.#sweepTimer = null;
    const now = Date.now();
    // Bounded: a moved entry is visited again at the end, once, with its mark cleared.
    let steps = 2 * this.#open.size;
    for (const [key, f] of this.#open) {
      if (steps-- <= 0) break;
      if (f.readers > 0) continue;
      if (now - f.lastUsed >= IDLE_FD_MS) { this.#forgetFile(key); continue; }
      if (this.#open.size <= this.#maxOpenFiles) continue;
      if (f.used) { f.used = false; this.#open.delete(key); this.#open.set(key, f); continue; }
      this.#forgetFile(key);
    }
    if (this.#open.size > 0 && !this.#sweepTimer) {
      this.#sweepTimer = setTimeout(() => this.#sweep(true), IDLE_FD_MS);
      this.#sweepTimer.unref?.();
    }
  }

  /**
   * Directory fsyncs shared between puts (group commit): an fsync of a directory makes every
   * name linked into it before the fsync started durable, so a put whose link came while an
   * fsync of its directory was running waits for the next one, which starts when that one
   * ends and serves every put that came meanwhile. 16 segment uploads of a commit into one
   * directory cost 1-2 directory fsyncs (each an ext4 journal commit) instead of 16: 1 GiB
   * `nbdcopy --flush` into a `file:` volume took 1.6-2.4 s with one fsync per put and
   * 1.3-1.5 s with none at all, same run. A failed fsync fails every put that waited for it.
   */
  readonly #dirSyncs = new Map<string, { running: Promise<void> | null; next: Promise<void> | null }>();

  #syncDir(dir: string): Promise<void> {
    let s = this.#dirSyncs.get(dir);
    if (s === undefined) {
      s = { running: null, next: null };
      this.#dirSyncs.set(dir, s);
    }
    if (s.running === null) return this.#startDirSync(dir, s);
    // The running fsync may have started before this put's link: it needs the next one.
    const state = s;
    const running = s.running;
    state.next ??= running.catch(() => {}).then(() => {
      state.next = null;
      return this.#startDirSync(dir, state);
    });
    return state.next;
  }

  /** Directory fsyncs issued by puts (see #syncDir). */
  get dirSyncs(): number { return this.#dirSyncCount; }
  #dirSyncCount = 0;

  #startDirSync(dir: string, s: { running: Promise<void> | null; next: Promise<void> | null }): Promise<void> {
    this.#dirSyncCount++;
    const p: Promise<void> = fsyncDir(dir).finally(() => {
      if (s.running !== p) return;
      s.running = null;
      if (s.next === null && this.#dirSyncs.get(dir) === s) this.#dirSyncs.delete(dir);
    });
    s.running = p;
    return p;
  }

  /** The temp made ahead for the next put (#takeTemp); null when none is (yet, or after close). */
  #spareTemp: Promise<TempFile> | null = null;
  #closed = false;

  /**
   * A new empty temp file for a put: the one made ahead, if any (awaited if it is still being
   * made), and the next put's is started at once, off the event loop. Why ahead: creating a
   * file is the one metadata call of a put that is slow (80-300 µs on this VM's ext4: its
   * journal, against 2 µs on tmpfs), a quarter of a small flush's time when it sat on the
   * flush's path (bench/README.md, issue 11, session 19). Each put still creates one file;
   * only when it is created changes. Concurrent puts each take the one made ahead of them.
   */
  async #takeTemp(): Promise<TempFile> {
    const ahead = this.#spareTemp;
    this.#spareTemp = null;
    if (!this.#closed) {
      const next = this.#createTemp(true);
      next.catch(() => { /* the put that takes it makes its own instead */ });
      this.#spareTemp = next;
    }
    const t = ahead ? await ahead.catch(() => null) : null;
    if (t !== null && Date.now() - t.made <= SPARE_TEMP_MAX_AGE_MS) return t;
    if (t !== null) discardTemp(t);
    return this.#createTemp();
  }

  /** A new temp file; `spare`: made ahead, removed again if the store closed meanwhile. */
  async #createTemp(spare = false): Promise<TempFile> {
    for (let attempt = 0; ; attempt++) {
      const path = join(this.#tmpDir, `${process.pid}-${PROCESS_NONCE}-${randomBytes(8).toString('hex')}`);
      try {
        const fd = await openAsync(path, fsc.O_WRONLY | fsc.O_CREAT | fsc.O_EXCL, 0o644);
        if (spare && this.#closed) {
          // Made ahead in a store closed meanwhile: nothing will take it.
          closeSync(fd);
          unlinkQuietly(path);
          throw new Error('store closed');
        }
        return { path, fd, made: Date.now() };
      } catch (err) {
        // Someone removed .tmp/ (by hand): make it again.
        if (errnoOf(err) === 'ENOENT' && attempt < PUT_RETRIES) {
          await mkdir(this.#tmpDir, { recursive: true });
          continue;
        }
        throw err;
      }
    }
  }

  async #put(key: string, parts: readonly Buffer[], options?: PutOptions): Promise<void> {
    const { dir, dirSegs, file } = this.#paths(key);
    this.#forgetFile(key);
    validateMetadata(options?.metadata);
    const header = encodeHeader({ etag: `"${randomBytes(16).toString('hex')}"`, metadata: { ...options?.metadata } });
    const createOnly = options?.ifNoneMatch === true;
    try {
      await this.#prepareTmp();
      const { path: tmp, fd } = await this.#takeTemp();
      let tmpGone = false;
      try {
        try {
          await writeFully(fd, [header, ...parts]);
          await fdatasyncAsync(fd);
        } finally {
          closeSync(fd);
        }
        for (let attempt = 0; ; attempt++) {
          try {
            if (!this.#durableDirs.has(dir)) await this.#ensureDir(dirSegs);
            if (createOnly) {
              linkSync(tmp, file);
              // At once, before anything else can fail: from here the temp is a second name
              // of the object, and deleting the object would not free it.
              unlinkQuietly(tmp); // (if it fails: a later sweep of .tmp/ removes it)
            } else {
              renameSync(tmp, file);
            }
            tmpGone = true;
            break;
          } catch (err) {
            if (errnoOf(err) === 'EEXIST' && createOnly) {
              throw new PreconditionFailedError(`put ${key}: object already exists in ${this.description} (create-only put)`);
            }
            // A delete (of this process or another) emptied and removed the directory, or
            // one above it, since we made it: make the whole path again. (Or a sweep removed
            // our temp, and this fails again until we give up.)
            if (errnoOf(err) === 'ENOENT' && attempt < PUT_RETRIES) {
              for (let d = dir; d !== this.root && d.startsWith(this.root + '/'); d = dirname(d)) this.#durableDirs.delete(d);
              continue;
            }
            throw err;
          }
        }
        await this.#syncDir(dir);
      } finally {
        // After a failure before the link or rename the temp is garbage.
        if (!tmpGone) await unlink(tmp).catch(() => {});
      }
    } catch (err) {
      throw this.#ioError('put', key, err);
    }
  }

  async *list(prefix: string, options?: ListOptions): AsyncIterable<ObjectInfo> {
    for await (const x of this.#start(prefix, options, options?.etags === true ? 'etags' : 'info')) yield x as ObjectInfo;
  }

  async *#keys(prefix: string, options?: ListOptions): AsyncIterable<string> {
    for await (const x of this.#start(prefix, options, 'keys')) yield x as string;
  }

  #start(prefix: string, options: ListOptions | undefined, what: 'keys' | 'info' | 'etags'): AsyncGenerator<ObjectInfo | string> | [] {
    // Start at the deepest directory the prefix names completely ("vol/abc/lo" -> vol/abc/).
    const cut = prefix.lastIndexOf('/');
    const dirKey = prefix.slice(0, cut + 1);
    const dirSegs = cut < 0 ? [] : prefix.slice(0, cut).split('/');
    if (dirSegs.some((s) => s === '' || s === '.' || s === '..')) return []; // no valid key has such a prefix
    return this.#walk(join(this.root, ...dirSegs.map(escapeSegment)), dirKey, prefix, options?.startAfter, options?.endAt, what);
  }

  /** Keys in order under a directory: each file's key ('keys'), or its ObjectInfo (with its etag: 'etags'). */
  async *#walk(dirPath: string, keyPrefix: string, prefix: string, after: string | undefined, end: string | undefined, what: 'keys' | 'info' | 'etags'): AsyncGenerator<ObjectInfo | string> {
    let names: Dirent[];
    try {
      names = await readdir(dirPath, { withFileTypes: true });
    } catch (err) {
      const code = errnoOf(err);
      if (code === 'ENOENT' || code === 'ENOTDIR') return;
      throw this.#ioError('list', prefix, err);
    }
    // Sort keys: a file's is its key, a directory's is its key prefix ending in '/'. No sort key
    // is a proper prefix of another except file "a" before dir "a/", which is also key order.
    const entries: { sortKey: string; isDir: boolean; name: string }[] = [];
    for (const d of names) {
      const name = d.name;
      if (name.startsWith('.')) continue;
      if (name.endsWith(OBJ_SUFFIX) && d.isFile()) {
        const seg = unescapeSegment(name.slice(0, -1));
        if (seg !== undefined) entries.push({ sortKey: keyPrefix + seg, isDir: false, name });
      } else if (d.isDirectory()) {
        const seg = unescapeSegment(name);
        if (seg !== undefined) entries.push({ sortKey: keyPrefix + seg + '/', isDir: true, name });
      }
    }
    entries.sort((a, b) => compareKeys(a.sortKey, b.sortKey));
    // The files' stats (or headers) are fetched up to LIST_AHEAD at a time ahead of the one
    // yielded, in key order: one at a time, a listing of 10,000 objects waited on 10,000
    // thread-pool round trips in a row.
    const wanted: typeof entries = [];
    for (const e of entries) {
      const p = e.sortKey;
      if (e.isDir) {
        // Descend only if some key under p can start with prefix and be > after.
        if (!(p.startsWith(prefix) || prefix.startsWith(p))) continue;
        if (after !== undefined && !after.startsWith(p) && compareKeys(p, after) < 0) continue;
        if (end !== undefined && compareKeys(p, end) > 0) break; // every key under p sorts after end
      } else {
        if (!p.startsWith(prefix)) continue;
        if (after !== undefined && compareKeys(p, after) <= 0) continue;
        if (end !== undefined && compareKeys(p, end) > 0) break;
      }
      wanted.push(e);
    }
    const ahead = new Map<number, Promise<ObjectInfo | null>>();
    let started = 0;
    for (let i = 0; i < wanted.length; i++) {
      const e = wanted[i]!;
      if (e.isDir) {
        yield* this.#walk(join(dirPath, e.name), e.sortKey, prefix, after, end, what);
        continue;
      }
      if (what === 'keys') {
        yield e.sortKey; // (a file deleted since readdir may be named, as an S3 listing may)
        continue;
      }
      for (started = Math.max(started, i); started < wanted.length && started < i + LIST_AHEAD; started++) {
        const f = wanted[started]!;
        if (f.isDir) continue;
        const info = this.#info(join(dirPath, f.name), f.sortKey, what === 'etags');
        info.catch(() => {}); // awaited below, unless the caller stops listing first
        ahead.set(started, info);
      }
      const info = await ahead.get(i)!;
      ahead.delete(i);
      if (info) yield info;
    }
  }

  /**
   * A listed file's size and time (and etag: its header), or null if it was deleted since
   * readdir. Through fs's callback API: a FileHandle per file (fs/promises) cost the main
   * thread about 100 µs per object, most of a listing of 10,000.
   */
  #info(file: string, key: string, etag: boolean): Promise<ObjectInfo | null> {
    return new Promise<ObjectInfo | null>((resolveInfo, reject) => {
      const fail = (err: unknown): void => {
        if (errnoOf(err) === 'ENOENT') resolveInfo(null);
        else reject(this.#ioError('list', key, err));
      };
      const info = (st: Stats, h?: Buffer): ObjectInfo => ({
        key, size: Math.max(0, st.size - LOCAL_HEADER_SIZE), lastModified: st.mtime, ...(h ? { etag: decodeHeader(h, `list ${key}`).etag } : {}),
      });
      if (!etag) {
        fsStat(file, (err, st) => { if (err) fail(err); else resolveInfo(info(st)); });
        return;
      }
      fsOpen(file, 'r', (err, fd) => {
        if (err) { fail(err); return; }
        const done = (e: unknown, v?: ObjectInfo): void => { fsClose(fd, () => { if (e) fail(e); else resolveInfo(v!); }); };
        fsFstat(fd, (e1, st) => {
          if (e1) { done(e1); return; }
          const buf = Buffer.allocUnsafe(LOCAL_HEADER_SIZE);
          fsRead(fd, buf, 0, LOCAL_HEADER_SIZE, 0, (e2, n) => {
            if (e2) { done(e2); return; }
            if (n < LOCAL_HEADER_SIZE) { done(new CorruptError(`list ${key}: file ended early (wanted ${LOCAL_HEADER_SIZE} header bytes)`)); return; }
            try { done(null, info(st, buf)); } catch (e3) { done(e3); }
          });
        });
      });
    });
  }

  async delete(key: string): Promise<void> {
    const { dir, file } = this.#paths(key);
    this.#forgetFile(key);
    try {
      try {
        await unlink(file);
      } catch (err) {
        const code = errnoOf(err);
        if (code === 'ENOENT' || code === 'ENOTDIR') return;
        throw err;
      }
      try {
        await fsyncDir(dir);
      } catch (err) {
        // Another process removed the directory we emptied: the unlink itself is done.
        if (errnoOf(err) !== 'ENOENT') throw err;
      }
      // Remove emptied directories up to (not including) the root, so deleted volumes leave no
      // trees behind. Not fsync'ed: an empty directory reappearing after a crash is harmless.
      let d = dir;
      while (d !== this.root && d.startsWith(this.root + '/')) {
        try {
          await rmdir(d);
        } catch {
          break; // ENOTEMPTY, or gone already, or in use: stop climbing
        }
        this.#forgetDirs(d);
        d = resolve(d, '..');
      }
    } catch (err) {
      throw this.#ioError('delete', key, err);
    }
  }

  async close(): Promise<void> {
    if (this.#sweepTimer) { clearTimeout(this.#sweepTimer); this.#sweepTimer = null; }
    for (const key of [...this.#open.keys()]) this.#forgetFile(key);
    this.#closed = true;
    const spare = this.#spareTemp;
    this.#spareTemp = null;
    const t = spare ? await spare.catch(() => null) : null;
    if (t !== null) discardTemp(t);
  }
}

/**
 * Encryption at rest: envelope keys (issue 16, docs/rfc-frames.md).
 *
 * - The master key (32 bytes) is given to a process by `--key-file FILE` or the environment
 *   (`BATON_KEY_FILE` names a file, `BATON_KEY` holds the key as hex or base64), never as a
 *   command-line value. It is never written anywhere and never logged; what is recorded is its
 *   id: the first 8 bytes of HMAC-SHA256(master, "baton key id v1"), so a process with another
 *   key is refused with a clear message, before anything is read or written.
 * - Every volume that writes data has its own data key (DEK, 32 random bytes), wrapped by the
 *   master key with AES-256-GCM (nonce 12 | ciphertext 32 | tag 16, base64; the additional
 *   data binds it to the volume id: a wrapped key moved to another volume does not unwrap).
 * - A record's `data.encryption.keys` is a keyring, volume id -> wrapped DEK: a volume's own,
 *   and those of every ancestor whose objects its map may name. A fork copies its source's ring
 *   and adds a new key of its own (so a fork is made with the master key given); a snapshot
 *   writes nothing and carries its source's ring. Frames do not name their key: the object's
 *   key (`vol/<id>/...`) says which volume wrote it, and so which DEK (keyFor).
 * - An encrypted volume's log records and checkpoints are authenticated (format.ts MAC) with
 *   a key derived from the data key of the volume that wrote them (metaKeyOf): whoever can
 *   write a volume's frames can write its records, a bucket writer cannot. Which volumes'
 *   records must carry one is bound into the wrapping of their data keys (dekAad).
 * Why a key per volume rather than the parent's: each key's random nonces stay within its own
 * budget (2^32 frames per key: 128 TiB of 32 KiB frames), and a volume only ever writes with
 * its own key (compaction rewrites only a volume's own objects), so the key that encrypted a
 * frame is always known from where the frame is.
 */

import { createCipheriv, createDecipheriv, createHmac } from 'node:crypto';
import { readFileSync } from 'node:fs';
import type { World } from '../clock.js';
import { InvalidArgumentError, KeyError } from '../errors.js';
import type { EncryptionSettings, VolumeRecord } from './format.js';
import type { FrameKeys } from './frames.js';

export const MASTER_KEY_BYTES = 32;

/** A master key as a process holds it. `key` never leaves this process. */
export interface MasterKey {
  readonly id: string;
  readonly key: Buffer;
}

export function masterKeyId(key: Buffer): string {
  return createHmac('sha256', key).update('baton key id v1').digest().subarray(0, 8).toString('hex');
}

export function masterKey(key: Buffer): MasterKey {
  if (key.length !== MASTER_KEY_BYTES) throw new InvalidArgumentError(`a master key is ${MASTER_KEY_BYTES} bytes, not ${key.length}`);
  const k = Buffer.from(key);
  const mk = { id: masterKeyId(k), key: k };
  // Logging an object that holds it must not print it.
  Object.defineProperty(mk, 'key', { enumerable: false });
  Object.defineProperty(mk, 'toJSON', { enumerable: false, value: () => ({ id: mk.id }) });
  return mk;
}

/** A key as text: 64 hex digits or base64 of 32 bytes (surrounding blanks ignored). */
function parseKeyText(text: string, where: string): Buffer {
  const s = text.trim();
  if (/^[0-9a-fA-F]{64}$/.test(s)) return Buffer.from(s, 'hex');
  if (/^[A-Za-z0-9+/]{43}=?$/.test(s)) {
    const b = Buffer.from(s, 'base64');
    if (b.length === MASTER_KEY_BYTES) return b;
  }
  throw new InvalidArgumentError(`${where}: not a key (32 bytes, as 64 hex digits or base64; make one with: head -c 32 /dev/urandom > key)`);
}

/**
 * The master key this process was given: `keyFile` (the --key-file flag), else the file
 * BATON_KEY_FILE names, else BATON_KEY; null if none. A key file holds the 32 bytes raw, or
 * as 64 hex digits or base64 text.
 */
export function loadMasterKey(keyFile: string | undefined, env: NodeJS.ProcessEnv = process.env): MasterKey | null {
  const file = keyFile ?? (env.BATON_KEY_FILE || undefined);
  if (file !== undefined) {
    let b: Buffer;
    try { b = readFileSync(file); } catch (err) { throw new InvalidArgumentError(`cannot read the key file ${file}: ${(err as Error).message}`); }
    // 32 bytes are the key itself, unless they are all printable text: 32 hex digits (a 16-byte
    // key written as hex) would otherwise be taken as a key made of those characters. A random
    // 32-byte key is all printable ASCII with probability (95/256)^32, about 2^-46.
    const text = b.every((c) => c >= 0x20 && c < 0x7f);
    return masterKey(b.length === MASTER_KEY_BYTES && !text ? b : parseKeyText(b.toString('utf8'), `key file ${file}`));
  }
  if (env.BATON_KEY) return masterKey(parseKeyText(env.BATON_KEY, 'BATON_KEY'));
  return null;
}

/**
 * The additional data a data key is wrapped with. `authenticated` (every key wrapped since
 * records carry a MAC) names a second version: a volume whose key unwraps with it must have
 * every log record and checkpoint authenticated (metaKeyOf), and since only the master key
 * can wrap, a bucket writer cannot turn such a key into one that says otherwise (to make
 * unauthenticated records pass). Keys wrapped before (legacy) unwrap with the first version;
 * their volumes' records are read as they were written, without a MAC.
 */
function dekAad(volumeId: string, authenticated: boolean): Buffer {
  return Buffer.from(authenticated ? `baton-dek-v2:${volumeId}` : `baton-dek:${volumeId}`, 'utf8');
}

/** Wrap a data key; `legacy` wraps it as keys were before records were authenticated (compatibility tests only). */
export function wrapDataKey(master: MasterKey, volumeId: string, dek: Buffer, world: World, legacy = false): string {
  const nonce = world.randomBytes(12);
  const c = createCipheriv('aes-256-gcm', master.key, nonce);
  c.setAAD(dekAad(volumeId, !legacy));
  const ct = Buffer.concat([c.update(dek), c.final()]);
  return Buffer.concat([nonce, ct, c.getAuthTag()]).toString('base64');
}

/** A data key, and whether its volume's records are authenticated (dekAad); null if it does not unwrap. */
export function unwrapDataKey(master: MasterKey, volumeId: string, wrapped: string): { dek: Buffer; authenticated: boolean } | null {
  const b = Buffer.from(wrapped, 'base64');
  if (b.length !== 12 + 32 + 16) return null;
  for (const authenticated of [true, false]) {
    try {
      const d = createDecipheriv('aes-256-gcm', master.key, b.subarray(0, 12));
      d.setAAD(dekAad(volumeId, authenticated));
      d.setAuthTag(b.subarray(44));
      return { dek: Buffer.concat([d.update(b.subarray(12, 44)), d.final()]), authenticated };
    } catch { /* the other version, or not this key's */ }
  }
  return null;
}

/**
 * The key that authenticates a volume's log records and checkpoints (format.ts: an
 * HMAC-SHA256 bound to each object's key): derived from its data key, so whoever may write
 * its frames may write its records, and nobody else.
 */
export function metaKeyOf(dek: Buffer): Buffer {
  return createHmac('sha256', dek).update('baton metadata mac v1').digest();
}

function need(master: MasterKey | null, what: string, keyId: string | null): MasterKey {
  if (!master) {
    throw new KeyError(`${what} is encrypted${keyId ? ` (master key id ${keyId})` : ''}: give its master key with --key-file FILE, or BATON_KEY_FILE / BATON_KEY in the environment`);
  }
  if (keyId !== null && master.id !== keyId) {
    throw new KeyError(`${what} is encrypted with master key id ${keyId}, and the key given has id ${master.id}: give the key it was made with`);
  }
  return master;
}

/** The encryption of a new volume: a data key of its own, wrapped by `master`. */
export function newEncryption(master: MasterKey | null, name: string, volumeId: string, world: World): EncryptionSettings {
  const m = need(master, `creating encrypted volume ${name}`, null);
  return { alg: 'aes-256-gcm', keyId: m.id, keys: { [volumeId]: wrapDataKey(m, volumeId, world.randomBytes(32), world) } };
}

/**
 * The encryption of a fork or snapshot of a volume encrypted with `src`: the same ring, and for
 * a fork (which writes) a data key of its own, which needs the master key.
 */
export function derivedEncryption(src: EncryptionSettings, master: MasterKey | null, name: string, srcName: string, volumeId: string, snapshot: boolean, world: World): EncryptionSettings {
  if (snapshot) return src;
  const m = need(master, `${srcName} (forked as ${name})`, src.keyId);
  return { ...src, keys: { ...src.keys, [volumeId]: wrapDataKey(m, volumeId, world.randomBytes(32), world) } };
}

/** The volume id an object key belongs to (vol/<id>/...). */
function volumeIdOf(objectKey: string): string | null {
  const m = /^vol\/([^/]+)\//.exec(objectKey);
  return m ? m[1]! : null;
}

/**
 * The keys of an encrypted volume for the engine, or null if `rec` is not encrypted. Refuses
 * (KeyError) without the master key, with another one, or when a data key of its ring does not
 * unwrap: at attach, never as an EIO on a first read. Data keys are kept only in this object.
 */
export function frameKeysFor(rec: VolumeRecord, master: MasterKey | null): FrameKeys | null {
  const enc = rec.data?.encryption;
  if (!enc) return null;
  const m = need(master, `volume ${rec.name}`, enc.keyId);
  const ring = new Map<string, { dek: Buffer; meta: Buffer | null }>();
  for (const [id, wrapped] of Object.entries(enc.keys)) {
    const k = unwrapDataKey(m, id, wrapped);
    if (!k) throw new KeyError(`volume ${rec.name}: the data key of ${id} does not unwrap with the master key given (id ${m.id}): its record is damaged, or the key is not the one it was made with`);
    ring.set(id, { dek: k.dek, meta: k.authenticated ? metaKeyOf(k.dek) : null });
  }
  const own = ring.get(rec.id) ?? null;
  if (!rec.snapshot && !own) throw new KeyError(`volume ${rec.name}: its record has no data key of its own`);
  const entry = (objectKey: string): { dek: Buffer; meta: Buffer | null } => {
    const id = volumeIdOf(objectKey);
    const k = id === null ? undefined : ring.get(id);
    if (!k) throw new KeyError(`volume ${rec.name}: no data key for ${objectKey} (its keyring has none for ${id})`);
    return k;
  };
  const keys: FrameKeys = {
    writeKey: rec.snapshot ? null : own!.dek,
    writeMetaKey: rec.snapshot ? null : own!.meta,
    readKey: (objectKey) => entry(objectKey).dek,
    metaKey: (objectKey) => entry(objectKey).meta,
  };
  Object.defineProperty(keys, 'writeKey', { enumerable: false });
  Object.defineProperty(keys, 'writeMetaKey', { enumerable: false });
  return keys;
}

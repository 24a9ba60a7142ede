/**
 * AWS Signature Version 4 for one plain request: the `Authorization` header of a request
 * whose headers, path and payload hash the caller has already settled. Pure functions over
 * strings plus a one-entry signing-key cache; no I/O.
 *
 * Why baton signs some requests itself: a request through @aws-sdk/client-s3 costs about 1 ms
 * of event-loop CPU whatever its size (middleware, endpoint resolution per request, body
 * collection); signed here and sent with node's http, a 4 KiB ranged GET costs 0.40 ms instead
 * of 1.07, a 4 KiB create-only PUT 0.33 instead of 0.95, an 8 MiB segment PUT 2.6 instead of
 * 3.5, and one 4 KiB PUT at a time (a small FLUSH's round trip) takes 2.37 ms instead of 3.36
 * at p50 (bench/s3-requests.ts: radosgw on loopback, results/s3-requests.md). Reads are what a
 * guest waits for and what hydration makes by the hundred, and the PUT of a log record is the
 * one round trip of a FLUSH, so S3ObjectStore sends GETs and PUTs this way and keeps the SDK
 * for HEAD, LIST and DELETE (see `S3ObjectStore.#exchange`).
 *
 * What is and is not implemented (the spec: "Create a signed AWS API request", AWS docs):
 * - header-based signing (not presigned query strings), no query parameters, one region;
 * - the canonical URI is given already encoded, once (S3 does not double-encode: the SDK's
 *   endpoint rules say `disableDoubleEncoding` for S3; `encodeKeyPath` encodes a key so);
 * - every header passed is signed; names must be lower case, values are trimmed and runs of
 *   spaces folded as the spec says. The caller must send exactly these headers' values.
 * Tested against the AWS signature test suite's `get-vanilla`, the S3 documentation's GET
 * Object example and the SDK's own signer (test/unit/sigv4.test.ts).
 */
import { createHash, createHmac } from 'node:crypto';

/** The hash of an empty body, as S3 expects it in x-amz-content-sha256 of a GET. */
export const EMPTY_SHA256 = 'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855';
export const UNSIGNED_PAYLOAD = 'UNSIGNED-PAYLOAD';

export interface SigV4Credentials {
  accessKeyId: string;
  secretAccessKey: string;
  sessionToken?: string | undefined;
}

export interface SigV4Request {
  method: string;
  /** The canonical URI, already percent-encoded (one pass), starting with '/'. */
  path: string;
  /** Lower-case header names; `host` and `x-amz-date` must be among them. All are signed. */
  headers: Record<string, string>;
  /** Hex SHA-256 of the body, or UNSIGNED-PAYLOAD. */
  payloadHash: string;
}

/** `YYYYMMDDTHHMMSSZ` of a time in milliseconds (SigV4's x-amz-date). */
export function amzDate(ms: number): string {
  return new Date(ms).toISOString().replace(/[-:]/g, '').replace(/\.\d{3}/, '');
}

/** S3's encoding of an object key in a path: every byte but A-Z a-z 0-9 - _ . ~ and '/' as %XX. */
export function encodeKeyPath(key: string): string {
  // encodeURIComponent leaves ! ' ( ) * as they are; SigV4's URI encoding does not.
  return key.split('/').map((seg) => encodeURIComponent(seg).replace(/[!'()*]/g, (c) => `%${c.charCodeAt(0).toString(16).toUpperCase()}`)).join('/');
}

function hmac(key: Buffer | string, data: string): Buffer {
  return createHmac('sha256', key).update(data, 'utf8').digest();
}

/**
 * Signs requests for one service in one region. The signing key depends on the secret, the
 * day, the region and the service only, so it is derived once a day (four HMACs), not per
 * request; a new secret (rotated credentials) derives it again.
 */
export class SigV4Signer {
  #day = '';
  #secret = '';
  #key: Buffer = Buffer.alloc(0);

  constructor(readonly region: string, readonly service: string) {}

  #signingKey(secret: string, day: string): Buffer {
    if (day !== this.#day || secret !== this.#secret) {
      this.#key = hmac(hmac(hmac(hmac(`AWS4${secret}`, day), this.region), this.service), 'aws4_request');
      this.#day = day;
      this.#secret = secret;
    }
    return this.#key;
  }

  /** The value of the Authorization header for `req` (whose x-amz-date says when it is signed). */
  authorization(req: SigV4Request, creds: SigV4Credentials): string {
    const date = req.headers['x-amz-date'];
    if (date === undefined || !/^\d{8}T\d{6}Z$/.test(date)) throw new Error(`SigV4: x-amz-date missing or malformed: ${String(date)}`);
    if (req.headers.host === undefined) throw new Error('SigV4: the host header must be signed');
    const names = Object.keys(req.headers).sort();
    let canonicalHeaders = '';
    for (const name of names) {
      if (name !== name.toLowerCase()) throw new Error(`SigV4: header names must be lower case: ${name}`);
      canonicalHeaders += `${name}:${req.headers[name]!.trim().replace(/ +/g, ' ')}\n`;
    }
    const signedHeaders = names.join(';');
    const canonicalRequest = `${req.method}\n${req.path}\n\n${canonicalHeaders}\n${signedHeaders}\n${req.payloadHash}`;
    const day = date.slice(0, 8);
    const scope = `${day}/${this.region}/${this.service}/aws4_request`;
    const stringToSign = `AWS4-HMAC-SHA256\n${date}\n${scope}\n${createHash('sha256').update(canonicalRequest, 'utf8').digest('hex')}`;
    const signature = createHmac('sha256', this.#signingKey(creds.secretAccessKey, day)).update(stringToSign, 'utf8').digest('hex');
    return `AWS4-HMAC-SHA256 Credential=${creds.accessKeyId}/${scope}, SignedHeaders=${signedHeaders}, Signature=${signature}`;
  }
}

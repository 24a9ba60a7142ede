/**
 * A fake S3 endpoint for the tests of S3ObjectStore's own requests (s3-direct-*.test.ts): it
 * checks every request's SigV4 signature as S3 does (recomputed from what arrived, with the
 * payload hash the request names), records what came (method, path, headers, body bytes) and
 * answers with the test's handler, which may misbehave one way each.
 */
import type { ExecutionContext } from 'ava';
import { createServer, type IncomingMessage, type ServerResponse } from 'node:http';
import type { AddressInfo, Socket } from 'node:net';
import { S3ObjectStore, type S3StoreOptions } from '../../src/store/s3.js';
import { SigV4Signer } from '../../src/store/sigv4.js';

export const CREDENTIALS = { accessKeyId: 'AKIDTEST', secretAccessKey: 'secret/test+key' };
const SERVER_SIGNER = new SigV4Signer('us-east-1', 's3');

export interface Seen { method: string; url: string; headers: IncomingMessage['headers']; signatureOk: boolean; body: Buffer }

export interface FakeS3 {
  endpoint: string;
  seen: Seen[];
  /** Connections accepted so far; connections still open. */
  connections: () => number;
  open: () => number;
}

export interface FakeS3Options {
  /**
   * A request with `Expect: 100-continue` goes here before its body is read (node's
   * 'checkContinue'); without this, node answers 100 Continue itself and the handler gets it.
   */
  onExpect?: (req: IncomingMessage, res: ServerResponse) => void;
}

function signatureOk(req: IncomingMessage): boolean {
  const auth = req.headers.authorization ?? '';
  const signed = /SignedHeaders=([^,]+)/.exec(auth)?.[1]?.split(';') ?? [];
  const headers: Record<string, string> = {};
  for (const h of signed) headers[h] = String(req.headers[h]);
  try {
    return SERVER_SIGNER.authorization({ method: req.method!, path: req.url!, headers, payloadHash: String(req.headers['x-amz-content-sha256']) }, CREDENTIALS) === auth;
  } catch {
    return false; // unsigned or malformed
  }
}

export async function fakeS3(t: ExecutionContext, handler: (req: IncomingMessage, res: ServerResponse, n: number) => void, opts: FakeS3Options = {}): Promise<FakeS3> {
  const seen: Seen[] = [];
  const sockets = new Set<Socket>();
  let connections = 0;
  const server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      seen.push({ method: req.method!, url: req.url!, headers: req.headers, signatureOk: signatureOk(req), body: Buffer.concat(chunks) });
      handler(req, res, seen.length);
    });
  });
  if (opts.onExpect) {
    const onExpect = opts.onExpect;
    server.on('checkContinue', (req: IncomingMessage, res: ServerResponse) => {
      seen.push({ method: req.method!, url: req.url!, headers: req.headers, signatureOk: signatureOk(req), body: Buffer.alloc(0) });
      onExpect(req, res);
    });
  }
  server.on('connection', (s) => { connections++; sockets.add(s); s.on('close', () => sockets.delete(s)); });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  t.teardown(() => { for (const s of sockets) s.destroy(); server.close(); });
  return { endpoint: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, seen, connections: () => connections, open: () => sockets.size };
}

export function fakeS3Store(t: ExecutionContext, endpoint: string, extra: Partial<S3StoreOptions> = {}): S3ObjectStore {
  const s = new S3ObjectStore({ bucket: 'bucket', prefix: 'p', endpoint, region: 'us-east-1', credentials: CREDENTIALS, ...extra });
  t.teardown(() => s.close());
  return s;
}

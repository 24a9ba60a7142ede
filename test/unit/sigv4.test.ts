/**
 * SigV4 signing (src/store/sigv4.ts) against vectors written from AWS's documents and against
 * the SDK's own signer (@smithy/signature-v4, installed with @aws-sdk/client-s3).
 */
import test from 'ava';
import { createHash, createHmac, type Hash, type Hmac } from 'node:crypto';
import { createRequire } from 'node:module';
import { EMPTY_SHA256, SigV4Signer, UNSIGNED_PAYLOAD, amzDate, encodeKeyPath } from '../../src/store/sigv4.js';

test('get-vanilla from the AWS SigV4 test suite', (t) => {
  const s = new SigV4Signer('us-east-1', 'service');
  const auth = s.authorization(
    { method: 'GET', path: '/', headers: { host: 'example.amazonaws.com', 'x-amz-date': '20150830T123600Z' }, payloadHash: EMPTY_SHA256 },
    { accessKeyId: 'AKIDEXAMPLE', secretAccessKey: 'wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY' },
  );
  t.is(auth, 'AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, SignedHeaders=host;x-amz-date, ' +
    'Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31');
});

test('the S3 documentation\'s GET Object example (a ranged GET of test.txt)', (t) => {
  const s = new SigV4Signer('us-east-1', 's3');
  const auth = s.authorization({
    method: 'GET',
    path: '/test.txt',
    headers: { host: 'examplebucket.s3.amazonaws.com', range: 'bytes=0-9', 'x-amz-content-sha256': EMPTY_SHA256, 'x-amz-date': '20130524T000000Z' },
    payloadHash: EMPTY_SHA256,
  }, { accessKeyId: 'AKIAIOSFODNN7EXAMPLE', secretAccessKey: 'wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY' });
  t.is(auth, 'AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, ' +
    'SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41');
});

test('the same signature as the SDK\'s signer, for keys with characters S3 encodes, session tokens and a cached key across days', async (t) => {
  // The SDK's signer is a dependency of @aws-sdk/client-s3, not of baton: loaded from there.
  const req = createRequire(createRequire(import.meta.url).resolve('@aws-sdk/client-s3'));
  const { SignatureV4 } = req('@smithy/signature-v4') as typeof import('@smithy/signature-v4');
  // The SDK's hash interface over node:crypto (a secret makes it an HMAC), as its node runtime does.
  class Sha256 {
    #h: Hash | Hmac;
    constructor(secret?: string | Uint8Array) { this.#h = secret === undefined ? createHash('sha256') : createHmac('sha256', secret); }
    update(d: string | Uint8Array): void { this.#h.update(d); }
    async digest(): Promise<Uint8Array> { return this.#h.digest(); }
    reset(): void { throw new Error('not used'); }
  }
  const keys = ['vol/a/log/0000000001', 'a b/c+d/e=f&g', 'ünï/cödé/日本', "it's (a) *star*!~.-_", 'x%20y/%2F'];
  const creds = [
    { accessKeyId: 'AKID1', secretAccessKey: 'secret/one+' },
    { accessKeyId: 'ASIA2', secretAccessKey: 'secret-two', sessionToken: 'tok/en+=' },
  ];
  const mine = new SigV4Signer('eu-west-3', 's3');
  let n = 0;
  for (const when of [Date.UTC(2026, 11, 5, 3, 4, 5), Date.UTC(2026, 11, 6, 0, 0, 1)]) {
    for (const c of creds) {
      const sdk = new SignatureV4({ service: 's3', region: 'eu-west-3', credentials: c, sha256: Sha256 as never, uriEscapePath: false });
      for (const key of keys) {
        for (const range of [undefined, 'bytes=0-4095']) {
          const path = `/bucket/${encodeKeyPath(key)}`;
          const headers: Record<string, string> = { host: '127.0.0.1:7480', 'x-amz-content-sha256': UNSIGNED_PAYLOAD, 'x-amz-date': amzDate(when) };
          if (range !== undefined) headers.range = range;
          if (c.sessionToken !== undefined) headers['x-amz-security-token'] = c.sessionToken;
          const signed = await sdk.sign({ method: 'GET', protocol: 'http:', hostname: '127.0.0.1', port: 7480, path, query: {}, headers: { ...headers } } as never, { signingDate: new Date(when) }) as unknown as { headers: Record<string, string> };
          t.is(mine.authorization({ method: 'GET', path, headers, payloadHash: UNSIGNED_PAYLOAD }, c), signed.headers.authorization ?? 'none', `${key} ${range ?? ''}`);
          n++;
        }
      }
    }
  }
  t.is(n, 40);
});

test('amzDate and encodeKeyPath', (t) => {
  t.is(amzDate(Date.UTC(2015, 7, 30, 12, 36, 0, 999)), '20150830T123600Z');
  t.is(encodeKeyPath('a/b c/d+e/ü/~._-/(x)!*\''), 'a/b%20c/d%2Be/%C3%BC/~._-/%28x%29%21%2A%27');
});

test('malformed requests are refused, not signed wrongly', (t) => {
  const s = new SigV4Signer('us-east-1', 's3');
  const c = { accessKeyId: 'a', secretAccessKey: 'b' };
  t.throws(() => s.authorization({ method: 'GET', path: '/', headers: { host: 'h' }, payloadHash: EMPTY_SHA256 }, c), { message: /x-amz-date/ });
  t.throws(() => s.authorization({ method: 'GET', path: '/', headers: { 'x-amz-date': '20150830T123600Z' }, payloadHash: EMPTY_SHA256 }, c), { message: /host/ });
  t.throws(() => s.authorization({ method: 'GET', path: '/', headers: { host: 'h', 'x-amz-date': '20150830T123600Z', Range: 'bytes=0-1' }, payloadHash: EMPTY_SHA256 }, c), { message: /lower case/ });
});

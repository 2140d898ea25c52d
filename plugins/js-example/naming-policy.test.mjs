// Unit tests of naming-policy.js on Node.js (no component needed): `node --test` in this folder.
// The component itself is tested against plugins/naming-policy/tests by `pko-operator plugin
// test` (tests/tests/it/plugin_cli.rs).

import assert from 'node:assert/strict';
import { test } from 'node:test';

import { InvalidConfig, Rejected, policy, sortedKeys, transform } from './naming-policy.js';

test('prefix mode prefixes literal names once and warns on expressions', () => {
  const spec = {
    resources: {
      b: { type: 'aws:s3/bucket:Bucket', properties: { name: 'logs' } },
      a: { type: 'aws:s3/bucket:Bucket', properties: { name: 'team-a-data' } },
      c: { type: 'aws:s3/bucket:Bucket', properties: { name: '${x}' } },
      d: { type: 'aws:s3/bucket:Bucket', properties: { name: 7 } },
    },
  };
  const warnings = transform('team-a', spec, policy('{"mode":"prefix"}'));
  assert.equal(spec.resources.b.properties.name, 'team-a-logs');
  assert.equal(spec.resources.a.properties.name, 'team-a-data');
  assert.deepEqual(warnings, [
    'resource "c": properties.name is an expression; not prefixed',
    'resource "d": properties.name is not a string; not prefixed',
  ]);
});

test('keys are visited in the Rust twin\'s order, not object order', () => {
  // Integer-like keys come first in a JS object; sorted as strings they do not.
  assert.deepEqual(sortedKeys({ b: 1, 10: 1, 9: 1, a: 1 }), ['10', '9', 'a', 'b']);
  // By code point, as UTF-8 bytes sort: U+FF5E before U+1F600 (UTF-16 units would swap them).
  assert.deepEqual(sortedKeys({ '\u{1F600}': 1, '\uFF5E': 1 }), ['\uFF5E', '\u{1F600}']);
});

test('enforce mode rejects naming every offender', () => {
  const spec = { resources: { Bad_Key: { type: 'x' }, ok: { type: 'x', properties: { name: 'Not OK' } } } };
  assert.throws(
    () => transform('n', spec, policy('{"mode":"enforce","pattern":"^[a-z]+$"}')),
    (e) => e instanceof Rejected && e.message === '2 name(s) do not match "^[a-z]+$": resource key "Bad_Key", resource "ok" name "Not OK" (properties.name)',
  );
});

test('configuration errors name the problem', () => {
  for (const [raw, needle] of [
    ['{"mode":"enforce"}', 'needs a pattern'],
    ['{"mode":"prefix","pattern":"x"}', 'only used by mode enforce'],
    ['{"mode":"enforce","pattern":"(["}', 'pattern "(["'],
    ['{"mode":"other"}', 'unknown variant `other`'],
    ['{"names":1}', 'unknown field `names`'],
    ['{"nameProperty":"a..b"}', 'not a dotted path'],
    ['{', 'not JSON'],
  ]) {
    assert.throws(() => policy(raw), (e) => e instanceof InvalidConfig && e.message.includes(needle), raw);
  }
  assert.doesNotThrow(() => policy('null'));
});

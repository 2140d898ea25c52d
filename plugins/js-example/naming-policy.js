// naming-policy in JavaScript: prefix resource names with the Program's namespace, or reject
// names that do not match a pattern.
//
// The twin of plugins/naming-policy (Rust): the same configuration, output and messages, so both
// pass plugins/naming-policy/tests. Plain ECMAScript with no plugin bindings, so it also runs
// (and is unit-tested, naming-policy.test.mjs) on Node.js.
//
// Determinism: resources are visited in sorted key order. A JS object lists integer-like keys
// ("10", "9") first in numeric order whatever order they were added in, so object order is never
// relied on: keys are sorted explicitly.

export class InvalidConfig extends Error {}
export class Rejected extends Error {}

const FIELDS = ['mode', 'nameProperty', 'typePrefixes', 'separator', 'setWhenMissing', 'pattern'];

/** A string quoted as Rust's `{:?}` quotes it (for the plain strings of these messages). */
export function debugStr(s) {
  return JSON.stringify(s);
}

/** Keys in the order Rust's BTreeMap gives: by UTF-8 bytes (code points), not UTF-16 units. */
export function sortedKeys(object) {
  return Object.keys(object).sort((a, b) => {
    const x = Array.from(a, (c) => c.codePointAt(0));
    const y = Array.from(b, (c) => c.codePointAt(0));
    for (let i = 0; i < Math.min(x.length, y.length); i++) {
      if (x[i] !== y[i]) return x[i] - y[i];
    }
    return x.length - y.length;
  });
}

function isObject(v) {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

function expect(value, type, field) {
  const ok = type === 'array' ? Array.isArray(value) : typeof value === type;
  if (!ok) throw new InvalidConfig(`${field}: invalid type: expected ${type === 'array' ? 'a sequence' : `a ${type}`}`);
  return value;
}

/** The checked configuration (a policy), from the configuration's JSON text. */
export function policy(configJson) {
  let raw;
  try {
    raw = JSON.parse(configJson);
  } catch (e) {
    throw new InvalidConfig(`configuration is not JSON: ${e.message}`);
  }
  if (raw === null) raw = {};
  if (!isObject(raw)) throw new InvalidConfig('invalid type: expected struct Config');
  for (const key of sortedKeys(raw)) {
    if (!FIELDS.includes(key)) {
      throw new InvalidConfig(`unknown field \`${key}\`, expected one of ${FIELDS.map((f) => `\`${f}\``).join(', ')}`);
    }
  }
  const mode = raw.mode ?? 'prefix';
  if (mode !== 'prefix' && mode !== 'enforce') {
    throw new InvalidConfig(`unknown variant \`${mode}\`, expected \`prefix\` or \`enforce\``);
  }
  const config = {
    mode,
    nameProperty: expect(raw.nameProperty ?? 'name', 'string', 'nameProperty'),
    typePrefixes: expect(raw.typePrefixes ?? [], 'array', 'typePrefixes'),
    separator: expect(raw.separator ?? '-', 'string', 'separator'),
    setWhenMissing: expect(raw.setWhenMissing ?? false, 'boolean', 'setWhenMissing'),
    pattern: raw.pattern ?? null,
  };
  config.typePrefixes.forEach((p) => expect(p, 'string', 'typePrefixes'));
  if (config.pattern !== null) expect(config.pattern, 'string', 'pattern');
  if (config.nameProperty.split('.').some((p) => p === '')) {
    throw new InvalidConfig(`nameProperty ${debugStr(config.nameProperty)} is not a dotted path`);
  }
  if (config.mode === 'enforce' && config.pattern === null) {
    throw new InvalidConfig('mode enforce needs a pattern');
  }
  if (config.mode === 'prefix' && config.pattern !== null) {
    throw new InvalidConfig('pattern is only used by mode enforce');
  }
  let regex = null;
  if (config.pattern !== null) {
    try {
      // Unicode mode: the closest to the Rust twin's regex syntax (no legacy escapes).
      regex = new RegExp(config.pattern, 'u');
    } catch (e) {
      throw new InvalidConfig(`pattern ${debugStr(config.pattern)}: ${e.message}`);
    }
  }
  return { config, regex };
}

const isExpression = (s) => s.includes('${');

function nameAt(resource, path) {
  let node = resource.properties;
  for (const part of path.split('.')) {
    if (!isObject(node) || !Object.hasOwn(node, part)) return undefined;
    node = node[part];
  }
  return node;
}

/** The parent object and key of `properties.<path>`, or null when it is not set. */
function nameSlot(resource, path) {
  let node = resource.properties;
  const parts = path.split('.');
  const leaf = parts.pop();
  for (const part of parts) {
    if (!isObject(node) || !Object.hasOwn(node, part)) return null;
    node = node[part];
  }
  if (!isObject(node) || !Object.hasOwn(node, leaf)) return null;
  return { parent: node, key: leaf };
}

/** Sets `properties.<path>`, creating objects on the way; false when something on the way is
 * not an object. */
function setAt(resource, path, value) {
  if (!Object.hasOwn(resource, 'properties')) resource.properties = {};
  let node = resource.properties;
  const parts = path.split('.');
  const leaf = parts.pop();
  for (const part of parts) {
    if (!isObject(node)) return false;
    if (!Object.hasOwn(node, part)) node[part] = {};
    node = node[part];
  }
  if (!isObject(node)) return false;
  node[leaf] = value;
  return true;
}

/** Applies the policy to `spec` in place; returns the warnings, or throws Rejected naming every
 * offender. */
export function transform(namespace, spec, { config, regex }) {
  const warnings = [];
  const offenders = [];
  const resources = spec.resources;
  if (!isObject(resources)) return warnings;
  const prefix = `${namespace}${config.separator}`;
  for (const key of sortedKeys(resources)) {
    const resource = resources[key];
    if (!isObject(resource)) continue;
    const type = typeof resource.type === 'string' ? resource.type : '';
    if (config.typePrefixes.length > 0 && !config.typePrefixes.some((p) => type.startsWith(p))) continue;
    if (Object.hasOwn(resource, 'get')) continue;
    const where = `properties.${config.nameProperty}`;
    if (config.mode === 'enforce') {
      if (!regex.test(key)) offenders.push(`resource key ${debugStr(key)}`);
      const name = nameAt(resource, config.nameProperty);
      if (typeof name === 'string' && !isExpression(name) && !regex.test(name)) {
        offenders.push(`resource ${debugStr(key)} name ${debugStr(name)} (${where})`);
      }
      continue;
    }
    const slot = nameSlot(resource, config.nameProperty);
    if (slot === null) {
      if (config.setWhenMissing && !setAt(resource, config.nameProperty, `${prefix}${key}`)) {
        warnings.push(`resource ${debugStr(key)}: cannot set ${where}`);
      }
      continue;
    }
    const name = slot.parent[slot.key];
    if (typeof name !== 'string') {
      warnings.push(`resource ${debugStr(key)}: ${where} is not a string; not prefixed`);
    } else if (isExpression(name)) {
      warnings.push(`resource ${debugStr(key)}: ${where} is an expression; not prefixed`);
    } else if (!name.startsWith(prefix)) {
      slot.parent[slot.key] = `${prefix}${name}`;
    }
  }
  if (offenders.length > 0) {
    throw new Rejected(
      `${offenders.length} name(s) do not match ${debugStr(config.pattern)}: ${offenders.join(', ')}`,
    );
  }
  return warnings;
}

// The js-example plugin: naming-policy.js behind the pko:transform@0.1.0 bindings that
// componentize-js generates from wit/transform.wit (`make plugins`).
//
// Results: a function returning `result<_, transform-error>` returns its value for `ok` and
// throws for `err`; the thrown value's `payload` is the error variant.

import { log } from 'pko:transform/log@0.1.0';
import { InvalidConfig, Rejected, policy, transform } from './naming-policy.js';

const VERSION = '0.1.0';

class PluginError extends Error {
  constructor(tag, message) {
    super(message);
    this.payload = { tag, val: message };
  }
}

function checked(configJson) {
  try {
    return policy(configJson);
  } catch (e) {
    if (e instanceof InvalidConfig) throw new PluginError('invalid-config', e.message);
    throw new PluginError('internal', String(e));
  }
}

function parseSpec(specJson) {
  let spec;
  try {
    spec = JSON.parse(specJson);
  } catch (e) {
    throw new PluginError('internal', `the host sent a spec that is not JSON: ${e.message}`);
  }
  if (spec === null) return {};
  if (typeof spec !== 'object' || Array.isArray(spec)) {
    throw new PluginError('internal', 'the host sent a spec that is not a JSON object');
  }
  return spec;
}

export const transformer = {
  info() {
    return {
      name: 'js-example',
      version: VERSION,
      description: 'naming-policy in JavaScript: prefixes resource names with the namespace, or rejects names off a pattern',
    };
  },

  validateConfig(configJson) {
    checked(configJson);
  },

  transform(input, configJson) {
    const p = checked(configJson);
    const spec = parseSpec(input.specJson);
    let warnings;
    try {
      warnings = transform(input.namespace, spec, p);
    } catch (e) {
      if (e instanceof Rejected) throw new PluginError('rejected', e.message);
      throw new PluginError('internal', String(e));
    }
    log('debug', `${input.namespace}/${input.name}: ${warnings.length} warning(s)`);
    return { specJson: JSON.stringify(spec), warnings };
  },
};

"""The python-example plugin: default_tags behind the pko:transform@0.1.0 bindings that
componentize-py generates from wit/transform.wit (`make plugins`)."""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import log, types

import default_tags

VERSION = "0.1.0"


def _config(config_json):
    try:
        return default_tags.parse_config(config_json)
    except default_tags.InvalidConfig as e:
        raise Err(types.TransformError_InvalidConfig(str(e))) from None


def _spec(spec_json):
    try:
        spec = json.loads(spec_json)
    except ValueError as e:
        raise Err(types.TransformError_Internal(f"the host sent a spec that is not JSON: {e}")) from None
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise Err(types.TransformError_Internal("the host sent a spec that is not a JSON object"))
    return spec


class Transformer(exports.Transformer):
    def info(self):
        return types.PluginInfo(
            name="python-example",
            version=VERSION,
            description="default-tags in Python: merges configured tags and Program labels "
            "into resource tags, by type prefix",
        )

    def validate_config(self, config_json):
        _config(config_json)

    def transform(self, input, config_json):
        config = _config(config_json)
        spec = _spec(input.spec_json)
        labels = dict(input.labels)
        warnings = default_tags.transform(input.namespace, labels, spec, config)
        log.log(log.Level.DEBUG, f"{input.namespace}/{input.name}: {len(warnings)} warning(s)")
        out = json.dumps(spec, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        return types.Output(spec_json=out, warnings=warnings)

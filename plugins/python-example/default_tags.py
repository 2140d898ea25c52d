"""default-tags in Python: merge tags into the resources whose type token starts with a
configured prefix.

The twin of plugins/default-tags (Rust): the same configuration, the same output, the same
messages, so both pass plugins/default-tags/tests. Plain Python on the standard library's
`json`, with no plugin bindings, so it also runs (and is unit-tested) on CPython.

Determinism: resources are visited in sorted key order and every set-like collection is sorted
before it is iterated, never in hash order.
"""

import json

FIELDS = ("tags", "fromLabels", "namespaceTag", "targets", "overwrite")
TARGET_FIELDS = ("typePrefix", "property")


class InvalidConfig(Exception):
    """The configuration is not valid for this plugin."""


def debug_str(s):
    """A string quoted as Rust's `{:?}` quotes it (for the plain strings of these messages)."""
    return json.dumps(s, ensure_ascii=False)


def _string_map(value, field):
    if not isinstance(value, dict):
        raise InvalidConfig(f"{field}: invalid type: expected a map of strings")
    for key in sorted(value):
        if not isinstance(value[key], str):
            raise InvalidConfig(f"{field}.{key}: invalid type: expected a string")
    return dict(value)


def _unknown(value, known):
    for key in sorted(value):
        if key not in known:
            expected = ", ".join(f"`{k}`" for k in known)
            raise InvalidConfig(f"unknown field `{key}`, expected one of {expected}")


def parse_config(config_json):
    """The checked configuration, as a dict with every field set; `null` is no configuration."""
    try:
        raw = json.loads(config_json)
    except ValueError as e:
        raise InvalidConfig(f"configuration is not JSON: {e}") from None
    if raw is None:
        raw = {"targets": []}
    if not isinstance(raw, dict):
        raise InvalidConfig("invalid type: expected struct Config")
    _unknown(raw, FIELDS)
    if "targets" not in raw:
        raise InvalidConfig("missing field `targets`")
    namespace_tag = raw.get("namespaceTag")
    if namespace_tag is not None and not isinstance(namespace_tag, str):
        raise InvalidConfig("namespaceTag: invalid type: expected a string")
    overwrite = raw.get("overwrite", False)
    if not isinstance(overwrite, bool):
        raise InvalidConfig("overwrite: invalid type: expected a boolean")
    if not isinstance(raw["targets"], list):
        raise InvalidConfig("targets: invalid type: expected a sequence")
    targets = []
    for target in raw["targets"]:
        if not isinstance(target, dict):
            raise InvalidConfig("targets: invalid type: expected struct Target")
        _unknown(target, TARGET_FIELDS)
        if "typePrefix" not in target:
            raise InvalidConfig("missing field `typePrefix`")
        prefix, prop = target["typePrefix"], target.get("property", "tags")
        if not isinstance(prefix, str) or not isinstance(prop, str):
            raise InvalidConfig("targets: invalid type: expected a string")
        targets.append((prefix, prop))
    config = {
        "tags": _string_map(raw.get("tags", {}), "tags"),
        "fromLabels": _string_map(raw.get("fromLabels", {}), "fromLabels"),
        "namespaceTag": namespace_tag,
        "targets": targets,
        "overwrite": overwrite,
    }
    check_config(config)
    return config


def check_config(config):
    """Checks a configuration beyond its shape."""
    if not config["targets"]:
        raise InvalidConfig("targets must name at least one type prefix")
    if not config["tags"] and not config["fromLabels"] and config["namespaceTag"] is None:
        raise InvalidConfig("nothing to add: set tags, fromLabels or namespaceTag")
    for prefix, prop in config["targets"]:
        if not prefix:
            raise InvalidConfig("a target has an empty typePrefix")
        if any(part == "" for part in prop.split(".")):
            raise InvalidConfig(
                f"target {debug_str(prefix)}: property {debug_str(prop)} is not a dotted path"
            )


def _tag_map(resource, path):
    """The dict at `properties.<path>`, created when missing; None when something on the way
    is not a dict."""
    node = resource.setdefault("properties", {})
    if not isinstance(node, dict):
        return None
    for part in path.split("."):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return None
    return node


def transform(namespace, labels, spec, config):
    """Adds the tags to `spec` in place; returns warnings for resources whose tags cannot be
    merged."""
    tags = dict(config["tags"])
    for label in sorted(config["fromLabels"]):
        if label in labels:
            tags[config["fromLabels"][label]] = labels[label]
    if config["namespaceTag"] is not None:
        tags[config["namespaceTag"]] = namespace
    warnings = []
    resources = spec.get("resources")
    if not isinstance(resources, dict):
        return warnings
    for name in sorted(resources):
        resource = resources[name]
        if not isinstance(resource, dict):
            continue
        type_token = resource.get("type")
        if not isinstance(type_token, str):
            type_token = ""
        # The longest matching prefix decides (the last of equals, as in the Rust twin), so
        # `aws:s3` can override `aws:`.
        target = None
        for prefix, prop in config["targets"]:
            if type_token.startswith(prefix) and (target is None or len(prefix) >= len(target[0])):
                target = (prefix, prop)
        if target is None:
            continue
        # A `get` resource reads existing state: it takes no properties.
        if "get" in resource:
            continue
        existing = _tag_map(resource, target[1])
        if existing is None:
            warnings.append(
                f"resource {debug_str(name)}: properties.{target[1]} is not a map "
                "(an expression?); tags not added"
            )
            continue
        for key in sorted(tags):
            if config["overwrite"] or key not in existing:
                existing[key] = tags[key]
    return warnings

"""Unit tests of default_tags on CPython (no component needed): `python3 -m unittest` in this
folder. The component itself is tested against plugins/default-tags/tests by `pko-operator
plugin test` (tests/tests/it/plugin_cli.rs)."""

import json
import unittest

import default_tags


def config(**fields):
    return default_tags.parse_config(json.dumps(fields))


class DefaultTags(unittest.TestCase):
    def test_merges_by_longest_prefix_and_keeps_the_programs_values(self):
        spec = {
            "resources": {
                "b": {"type": "aws:s3/bucket:Bucket", "properties": {"tags": {"team": "web"}}},
                "asg": {"type": "aws:autoscaling/group:Group"},
                "pet": {"type": "random:index/randomPet:RandomPet"},
            }
        }
        c = config(
            tags={"team": "platform", "owner": "infra"},
            fromLabels={"cc": "cost-center"},
            namespaceTag="ns",
            targets=[{"typePrefix": "aws:"}, {"typePrefix": "aws:autoscaling", "property": "x.y"}],
        )
        warnings = default_tags.transform("team-a", {"cc": "42"}, spec, c)
        self.assertEqual(warnings, [])
        self.assertEqual(
            spec["resources"]["b"]["properties"]["tags"],
            {"team": "web", "owner": "infra", "cost-center": "42", "ns": "team-a"},
        )
        self.assertEqual(spec["resources"]["asg"]["properties"]["x"]["y"]["team"], "platform")
        self.assertNotIn("properties", spec["resources"]["pet"])

    def test_warnings_come_in_sorted_resource_order(self):
        # Integer-like and mixed keys: sorted as strings, as the Rust twin's BTreeMap does.
        spec = {"resources": {k: {"type": "aws:x", "properties": {"tags": "${t}"}} for k in ["b", "10", "9", "a"]}}
        warnings = default_tags.transform("n", {}, spec, config(tags={"a": "b"}, targets=[{"typePrefix": "aws:"}]))
        self.assertEqual([w.split('"')[1] for w in warnings], ["10", "9", "a", "b"])

    def test_configuration_errors_name_the_problem(self):
        for raw, needle in [
            ("null", "targets must name"),
            ('{"tags": {"a": "b"}}', "missing field `targets`"),
            ('{"targets": [{"typePrefix": "aws:"}]}', "nothing to add"),
            ('{"tags": {"a": "b"}, "targets": [{"typePrefix": "aws:"}], "tag": {}}', "unknown field `tag`"),
            ('{"tags": {"a": 1}, "targets": [{"typePrefix": "aws:"}]}', "expected a string"),
            ('{"tags": {"a": "b"}, "targets": [{"typePrefix": "aws:", "property": "a..b"}]}', "not a dotted path"),
            ("{", "not JSON"),
        ]:
            with self.assertRaises(default_tags.InvalidConfig, msg=raw) as e:
                default_tags.parse_config(raw)
            self.assertIn(needle, str(e.exception), raw)


if __name__ == "__main__":
    unittest.main()

"""One way to check a value against a JSON Schema (tensorverse/jsonschemas.py): the first error
in document order, by path, and how many more."""

from __future__ import annotations

from tensorverse.jsonschemas import first_error

SCHEMA = {"type": "object", "required": ["a"], "properties": {
    "a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}}}


def test_a_valid_value_has_no_error():
    assert first_error(SCHEMA, {"a": 1, "b": ["x"]}) is None


def test_the_first_error_by_path_and_the_count_of_the_rest():
    e = first_error(SCHEMA, {"a": "one", "b": ["x", 2, 3]})
    assert e is not None and e.path == "a" and e.more == 2
    e = first_error(SCHEMA, {"b": [1]})
    assert e is not None and e.path == "(top)" and e.more == 1  # "a" is required; then b/0
    assert first_error(SCHEMA, {"a": 1, "b": [1]}).path == "b/0"

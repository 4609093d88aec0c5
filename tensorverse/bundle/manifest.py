"""The manifest's JSON Schema (``schema/manifest-1.schema.json``) and its validation: shared by the
writer (which refuses to write a manifest the checker would refuse) and the checker."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from tensorverse.bundle.format import SCHEMA_DIR, BundleRefused

__all__ = ["manifest_schema", "validate_manifest"]


def manifest_schema() -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / "manifest-1.schema.json").read_text())


def validate_manifest(m: Any) -> None:
    v = jsonschema.Draft202012Validator(manifest_schema())
    errs = sorted(v.iter_errors(m), key=lambda e: list(e.absolute_path))
    if errs:
        e = errs[0]
        where = "/".join(str(x) for x in e.absolute_path) or "(top)"
        raise BundleRefused("schema", f"manifest.json at {where}: {e.message[:300]}")

"""The manifest's JSON Schema (``schema/manifest-1.schema.json``) and its validation: shared by the
writer (which refuses to write a manifest the checker would refuse) and the checker."""

from __future__ import annotations

import json
from typing import Any

from tensorverse.bundle.format import SCHEMA_DIR, BundleRefused
from tensorverse.jsonschemas import first_error

__all__ = ["manifest_schema", "validate_manifest"]


def manifest_schema() -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / "manifest-1.schema.json").read_text())


def validate_manifest(m: Any) -> None:
    e = first_error(manifest_schema(), m)
    if e is not None:
        raise BundleRefused("schema", f"manifest.json at {e.path}: {e.message[:300]}")

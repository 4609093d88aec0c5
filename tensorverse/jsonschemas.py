"""Checking a JSON value against one of the project's JSON Schemas, one way for every format
(the replay corpus's cases and manifest, the rig bundle's manifest): Draft 2020-12, the first
error in document order named by its path, and how many more there are. Each format raises its
own error type from what :func:`first_error` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jsonschema

__all__ = ["SchemaProblem", "first_error"]


@dataclass(frozen=True)
class SchemaProblem:
    path: str  # "turns/0/prompt_token_ids", or "(top)"
    message: str
    more: int  # further errors after this one

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" + (f" (and {self.more} more)" if self.more else "")


def first_error(schema: Mapping[str, Any], value: Any) -> SchemaProblem | None:
    """The first error of ``value`` against ``schema`` (by path), or None when it is valid."""
    errs = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.absolute_path))
    if not errs:
        return None
    e = errs[0]
    return SchemaProblem("/".join(str(x) for x in e.absolute_path) or "(top)", e.message, len(errs) - 1)

"""Every record a test's store holds is of its declared type (`tensorverse.store.records`): the
fixtures that open stores for the proxy and the shadow tests check it when the test ends, so a
writer that adds an untyped field, or writes a field with the wrong type, fails the suite."""

from __future__ import annotations

from typing import Any

from tensorverse.store import records


def assert_records_typed(store: Any) -> int:
    """Decode every record of ``store``; returns how many were checked."""
    problems: list[str] = []
    n = 0
    for kind, cls in records.RECORD_TYPES.items():
        for rec in store.records(kind):
            n += 1
            extra = records.unknown_fields(rec, cls)
            if extra:
                problems.append(f"{kind} {rec.get('id') or rec.get('name') or rec.get('run_id')!r}: untyped fields {extra}")
            try:
                records.decode(rec, cls)
            except records.RecordError as e:
                problems.append(str(e))
    assert not problems, "\n".join(problems[:20])
    return n

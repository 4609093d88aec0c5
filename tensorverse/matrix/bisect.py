"""Delta debugging (Zeller and Hildebrandt's *ddmin*) over the settings that differ between a good
and a bad point: the smallest set of changes that, applied to the good point, still reproduces
the flip. Pure: the oracle is a callable, every verdict is cached by the set it was asked about,
so a set is never run twice (and runs cached on disk are reused by the caller's oracle).

The result is 1-minimal: removing any one setting from it makes the flip go away. With one
culprit among k changes it takes about 2·log2(k) oracle calls instead of the grid's 2**k points.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

__all__ = ["ddmin", "DDResult", "CachedOracle"]


@dataclass
class CachedOracle:
    """``test(changes) -> True`` when the flip is reproduced; answers each set once.
    ``None`` from the oracle (e.g. the server could not start) counts as not reproduced and is
    kept as ``unresolved``."""

    test: Callable[[frozenset], bool | None]
    cache: dict[frozenset, bool | None] = field(default_factory=dict)
    calls: list[tuple[frozenset, bool | None]] = field(default_factory=list)

    def __call__(self, changes: Iterable[Hashable]) -> bool:
        key = frozenset(changes)
        if key not in self.cache:
            self.cache[key] = self.test(key)
            self.calls.append((key, self.cache[key]))
        return bool(self.cache[key])

    @property
    def unresolved(self) -> list[frozenset]:
        return [k for k, v in self.cache.items() if v is None]


@dataclass
class DDResult:
    minimal: list
    oracle_calls: int
    history: list[tuple[frozenset, bool | None]]


def _split(c: list, n: int) -> list[list]:
    out, start = [], 0
    for i in range(n):
        end = start + (len(c) - start) // (n - i)
        out.append(c[start:end])
        start = end
    return [s for s in out if s]


def ddmin(changes: Sequence[Hashable], test: Callable[[frozenset], bool | None], *,
          assume_full_fails: bool = True) -> DDResult:
    """The 1-minimal failing subset of ``changes`` (order is kept). ``test(frozenset())`` is
    assumed to pass (the good point) and ``test(all)`` to fail (the bad point); the caller
    checks both before bisecting."""
    oracle = test if isinstance(test, CachedOracle) else CachedOracle(test)
    c = list(changes)
    if assume_full_fails:
        oracle.cache.setdefault(frozenset(c), True)
    oracle.cache.setdefault(frozenset(), False)
    n = 2
    while len(c) >= 2:
        subsets = _split(c, min(n, len(c)))
        reduced = False
        for s in subsets:  # a subset alone reproduces the flip
            if oracle(s):
                c, n, reduced = s, 2, True
                break
        if not reduced and len(subsets) > 2:
            for s in subsets:  # a complement reproduces it (with n == 2 these are the subsets)
                comp = [x for x in c if x not in s]
                if oracle(comp):
                    c, n, reduced = comp, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(c):
                break
            n = min(len(c), 2 * n)
    return DDResult(minimal=c, oracle_calls=len(oracle.calls), history=list(oracle.calls))

"""Dependency audit: every installed distribution checked against PyPI's advisory data.

pip-audit audits nothing from these machines and says so only in a warning: its OSV service
(api.osv.dev) does not resolve, and its PyPI service asks for ``/pypi/<name>/<version>/json``,
which the package mirror answers 404; pip-audit then reports "No known vulnerabilities found"
and exits 0 (seen 2026-11-30). The mirror does serve ``/pypi/<name>/json``, whose
``vulnerabilities`` list (PyPI's OSV advisories) describes the project's *latest* release. An
advisory listed there applies to the installed version unless one of its ``fixed_in`` versions
is at or below it. So a distribution installed at its latest release is checked completely
(``complete``); one behind its latest release only against the advisories still open in the
latest (``partial``: an advisory fixed in between is not visible); both kinds are counted and
named in the report, with the date of the check.

It asks the package index, so it is not part of ``make test`` (a new upstream advisory would turn
CI red with no change here): ``make audit`` runs it (``python tests/reliability/audit.py``), and
``benchmarks/reliability.py --audit`` records it in RELIABILITY.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import importlib.metadata as md
import json
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

INDEX = "https://pypi.org"
ROOT = Path(__file__).resolve().parents[2]


def installed(exclude: tuple[str, ...] = ("tensorverse",)) -> dict[str, str]:
    """canonical name -> version of every distribution of this environment."""
    out: dict[str, str] = {}
    for d in md.distributions():
        name = d.metadata["Name"]
        if name and canonicalize_name(name) not in exclude:
            out.setdefault(canonicalize_name(name), d.version)
    return dict(sorted(out.items()))


def direct_dependencies(pyproject: Path = ROOT / "pyproject.toml") -> set[str]:
    """The project's own runtime dependencies (canonical names): the pins it controls."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {canonicalize_name(Requirement(d).name) for d in deps}


def _fetch(index: str, name: str, timeout: float, tries: int = 3) -> dict[str, Any]:
    url = f"{index.rstrip('/')}/pypi/{name}/json"
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                data = json.load(r)
            return {"latest": (data.get("info") or {}).get("version"),
                    "vulnerabilities": data.get("vulnerabilities") or []}
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return {"error": "HTTP 404 (not on the index)"}
            err = f"HTTP {e.code}"
        except (OSError, ValueError) as e:
            err = f"{type(e).__name__}: {e}"
        time.sleep(0.5 * (attempt + 1))
    return {"error": err}


def _version(v: str | None) -> Version | None:
    try:
        return Version(v) if v else None
    except InvalidVersion:
        return None


def _fixed(v: Version, fixed: list[Version]) -> bool:
    """Whether ``v`` has the fix: it is at or past every fixed version, or at or past the fix
    of its own release series (``fixed_in`` 0.9.5 and 1.0.1: 0.9.7 is fixed, 1.0.0 is not)."""
    if not fixed:
        return False
    if v >= max(fixed):
        return True
    return any(f <= v and f.release[:2] == v.release[:2] for f in fixed)


def findings(version: str, vulnerabilities: list[dict]) -> list[dict[str, Any]]:
    """The advisories of ``vulnerabilities`` (PyPI's JSON form) that apply to ``version``."""
    v = _version(version)
    out = []
    for adv in vulnerabilities:
        if adv.get("withdrawn"):
            continue
        fixed = [f for f in map(_version, adv.get("fixed_in") or []) if f is not None]
        if v is not None and _fixed(v, fixed):
            continue
        out.append({"id": adv.get("id"), "aliases": adv.get("aliases") or [],
                    "fixed_in": adv.get("fixed_in") or [], "summary": (adv.get("summary") or adv.get("details") or "")[:200]})
    return out


def audit(dists: dict[str, str] | None = None, *, index: str = INDEX, workers: int = 4,
          timeout: float = 30.0) -> dict[str, Any]:
    """Check ``dists`` (default: this environment) against ``index``; the report as a dict."""
    dists = installed() if dists is None else dists
    direct = direct_dependencies()
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(workers) as ex:
        fetched = dict(zip(dists, ex.map(lambda n: _fetch(index, n, timeout), dists)))
    rows = []
    for name, version in dists.items():
        rec = fetched[name]
        row: dict[str, Any] = {"name": name, "version": version, "direct": name in direct}
        if "error" in rec:
            row.update(status="error", error=rec["error"])
        else:
            v, latest = _version(version), _version(rec["latest"])
            row.update(latest=rec["latest"], findings=findings(version, rec["vulnerabilities"]),
                       status="complete" if v is not None and latest is not None and v >= latest else "partial")
        rows.append(row)
    found = [r for r in rows if r.get("findings")]
    return {
        "source": f"{index}/pypi/<name>/json 'vulnerabilities' (PyPI's OSV advisories for the latest release)",
        "checked_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - t0, 1),
        "distributions": len(rows),
        "complete": sum(r["status"] == "complete" for r in rows),
        "partial": [f"{r['name']} {r['version']} (latest {r['latest']})" for r in rows if r["status"] == "partial"],
        "errors": {r["name"]: r["error"] for r in rows if r["status"] == "error"},
        "vulnerable": [{"name": r["name"], "version": r["version"], "direct": r["direct"],
                        "ids": [f["id"] for f in r["findings"]]} for r in found],
    }


def problems(report: dict[str, Any]) -> list[str]:
    """What fails the audit: an index that could not be asked (never a pass), a report that
    checked too little, or a known advisory against one of the project's own dependencies."""
    out = []
    if report["errors"]:
        out.append(f"not checked (the index did not answer): {', '.join(sorted(report['errors']))}")
    if report["distributions"] <= 50 or report["complete"] + len(report["partial"]) != report["distributions"]:
        out.append(f"only {report['distributions']} distributions accounted for")
    elif report["complete"] < report["distributions"] // 2:
        out.append(f"only {report['complete']} of {report['distributions']} checked completely")
    for v in report["vulnerable"]:
        if v["direct"]:
            out.append(f"{v['name']} {v['version']}: {', '.join(v['ids'])}")
    return out


def main() -> int:
    report = audit()
    print(json.dumps(report, indent=1))
    found = problems(report)
    for line in found:
        print(f"audit: {line}")
    print(f"audit: {report['distributions']} distributions, {report['complete']} checked completely, "
          f"{len(report['vulnerable'])} with advisories ({sum(v['direct'] for v in report['vulnerable'])} direct)")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())

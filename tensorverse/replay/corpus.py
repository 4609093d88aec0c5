"""The replay corpus: a directory of versioned JSON test cases, and the scrub that makes one.

Layout (documented in docs/replay.md; JSON Schemas in ``schema/``, copied into every corpus so
it can be validated and read without Tensorverse)::

    CORPUS/
      corpus.json                 manifest: format, version, tokenizer, scrub report, case list
      cases/<case id>.json        one case = one recorded session (its turns, in order)
      schema/case.schema.json     the case format
      schema/corpus.schema.json   the manifest format
      scrub-report.json           what the scrubber replaced: counts by kind, never an original

:func:`scrub_store` is ``tensorverse scrub``: it reads sessions from a store, scrubs every string
(messages, tools, tool calls, tool results, stop strings) and every token sequence (decoded,
scrubbed, re-tokenized, :mod:`tensorverse.replay.tokenizers`) with one mapping for the whole
corpus, and writes the corpus. Recorded top-k logprobs are not exported: they are tied to the
original ids and their alternatives can spell out what was scrubbed.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from tensorverse.jsonschemas import first_error
from tensorverse.refusal import Refusal
from tensorverse.replay.scrub import SCRUBBER_VERSION, Scrubber
from tensorverse.store import records
from tensorverse.store.records import Turn

__all__ = ["CASE_FORMAT", "CORPUS_FORMAT", "FORMAT_VERSION", "Corpus", "CorpusError", "load_corpus",
           "write_corpus", "validate_case", "validate_manifest", "scrub_store", "case_from_turns",
           "schema", "SCHEMA_DIR", "iter_case_turns"]

CASE_FORMAT = "tensorverse.case"
CORPUS_FORMAT = "tensorverse.corpus"
FORMAT_VERSION = 1
SCHEMA_DIR = Path(__file__).resolve().parent / "schema"
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop",
                  "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty")


class CorpusError(Refusal):
    """A corpus or case that cannot be read, with the file and the reason. ``reason``:
    ``missing`` (no ``corpus.json``, or a case file it lists is absent), ``syntax`` (not JSON),
    ``format`` (not a Tensorverse case or corpus manifest), ``version`` (written by a newer
    Tensorverse), ``schema`` (fails the format's JSON Schema), ``empty_prompt`` (a turn without
    prompt token ids), ``outside`` (a case file outside the corpus directory), ``checksum`` (a
    case file whose sha256 differs from the manifest's), ``case_id`` (a case whose id is not the
    manifest's, or repeats), ``no_model`` (a rig suite's corpus that names no model)."""

    REASONS = ("missing", "syntax", "format", "version", "schema", "empty_prompt", "outside", "checksum",
               "case_id", "no_model")


def _version() -> str | None:
    try:
        from tensorverse import __version__

        return __version__
    except Exception:  # noqa: BLE001
        return None


def schema(name: str) -> dict[str, Any]:
    """``case`` or ``corpus``: the JSON Schema."""
    return json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())


def _validate(obj: Any, name: str, where: str) -> None:
    e = first_error(schema(name), obj)
    if e is not None:
        raise CorpusError(f"{where}: {e}", "schema")


def validate_case(case: Mapping[str, Any], where: str = "case") -> None:
    if not isinstance(case, Mapping):
        raise CorpusError(f"{where}: a case is a JSON object", "format")
    if case.get("format") != CASE_FORMAT:
        raise CorpusError(f"{where}: not a Tensorverse case (format {case.get('format')!r})", "format")
    v = case.get("format_version")
    if isinstance(v, int) and v > FORMAT_VERSION:
        raise CorpusError(f"{where}: case format {v} is newer than this Tensorverse reads "
                          f"({FORMAT_VERSION}); upgrade Tensorverse", "version")
    _validate(case, "case", where)
    for t in case.get("turns") or ():
        if not t.get("prompt_token_ids"):
            raise CorpusError(f"{where}: turn {t.get('index')}: prompt_token_ids is empty", "empty_prompt")


def validate_manifest(m: Mapping[str, Any], where: str = "corpus.json") -> None:
    if not isinstance(m, Mapping) or m.get("format") != CORPUS_FORMAT:
        raise CorpusError(f"{where}: not a Tensorverse corpus manifest", "format")
    v = m.get("format_version")
    if isinstance(v, int) and v > FORMAT_VERSION:
        raise CorpusError(f"{where}: corpus format {v} is newer than this Tensorverse reads "
                          f"({FORMAT_VERSION}); upgrade Tensorverse", "version")
    _validate(m, "corpus", where)


@dataclass
class Corpus:
    path: Path
    manifest: dict[str, Any]
    cases: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokenizer(self) -> dict[str, Any] | None:
        return self.manifest.get("tokenizer")

    def __len__(self) -> int:
        return len(self.cases)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.cases)


def load_corpus(path: str | os.PathLike, *, verify: bool = True) -> Corpus:
    """Read a corpus directory (or a single case file). Checks formats, schemas and sha256."""
    p = Path(path)
    if p.is_file():
        case = _read_json(p)
        validate_case(case, str(p))
        return Corpus(p.parent, {"format": CORPUS_FORMAT, "format_version": FORMAT_VERSION,
                                 "tokenizer": case.get("tokenizer"),
                                 "cases": [{"id": case["id"], "file": p.name}]}, [case])
    mpath = p / "corpus.json"
    if not mpath.is_file():
        raise CorpusError(f"{p}: no corpus.json (not a Tensorverse corpus directory)", "missing")
    manifest = _read_json(mpath)
    validate_manifest(manifest, str(mpath))
    cases = []
    seen = set()
    for entry in manifest["cases"]:
        f = p / entry["file"]
        if not f.resolve().is_relative_to(p.resolve()):
            raise CorpusError(f"{mpath}: case file {entry['file']!r} is outside the corpus", "outside")
        raw = f.read_bytes() if f.is_file() else None
        if raw is None:
            raise CorpusError(f"{mpath}: case file {entry['file']} is missing", "missing")
        if verify and entry.get("sha256") and hashlib.sha256(raw).hexdigest() != entry["sha256"]:
            raise CorpusError(f"{f}: sha256 differs from corpus.json (edited after writing? "
                              "re-run `tensorverse scrub` or update the manifest)", "checksum")
        try:
            case = json.loads(raw)
        except ValueError as e:
            raise CorpusError(f"{f}: not JSON: {e}", "syntax") from None
        validate_case(case, str(f))
        if case["id"] != entry["id"] or case["id"] in seen:
            raise CorpusError(f"{f}: case id {case['id']!r} does not match the manifest or repeats", "case_id")
        seen.add(case["id"])
        cases.append(case)
    return Corpus(p, manifest, cases)


def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except ValueError as e:
        raise CorpusError(f"{p}: not JSON: {e}", "syntax") from None


_INT_LIST = re.compile(r"\[\n[\d,\s]*?\]")


def _dump(obj: Any) -> bytes:
    """Indented JSON with lists of numbers (token ids) on one line each (JSON strings cannot hold a
    raw newline, so only structural lists match)."""
    text = json.dumps(obj, ensure_ascii=False, indent=1, sort_keys=False)
    text = _INT_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(0)[1:-1].split(",")) + "]", text)
    return (text + "\n").encode("utf-8")


def write_corpus(path: str | os.PathLike, cases: Sequence[Mapping[str, Any]], *,
                 tokenizer: Mapping[str, Any] | None = None, scrub: Mapping[str, Any] | None = None,
                 name: str | None = None, description: str | None = None,
                 created: str | None = None, with_version: bool = True,
                 model: Mapping[str, str] | None = None) -> Path:
    """Write a corpus directory (cases, manifest, schemas, scrub report). Case files are written
    first and the manifest last (through a temporary file), so a reader never sees a manifest
    naming cases that are not there. ``created`` (a UTC timestamp) and ``with_version=False``
    (no ``tensorverse_version``) make the bytes reproducible, for a corpus kept in git. ``model``
    (``{"name", "content_hash"}``) names the model that produced the recorded tokens."""
    p = Path(path)
    (p / "cases").mkdir(parents=True, exist_ok=True)
    (p / "schema").mkdir(exist_ok=True)
    for s in ("case", "corpus"):
        shutil.copyfile(SCHEMA_DIR / f"{s}.schema.json", p / "schema" / f"{s}.schema.json")
    entries = []
    for case in cases:
        validate_case(case, f"case {case.get('id') if isinstance(case, Mapping) else len(entries)}")
        raw = _dump(case)
        rel = f"cases/{case['id']}.json"
        (p / rel).write_bytes(raw)
        entries.append({"id": case["id"], "file": rel, "turns": len(case["turns"]),
                        "sha256": hashlib.sha256(raw).hexdigest()})
    manifest: dict[str, Any] = {
        "format": CORPUS_FORMAT,
        "format_version": FORMAT_VERSION,
        "created": created or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "tensorverse_version": _version() if with_version else None,
        "tokenizer": dict(tokenizer) if tokenizer else None,
        "scrub": dict(scrub) if scrub else None,
        "cases": entries,
    }
    if name:
        manifest["name"] = name
    if description:
        manifest["description"] = description
    if model:
        manifest["model"] = {"name": model["name"], "content_hash": model["content_hash"]}
    validate_manifest(manifest)
    if scrub:
        (p / "scrub-report.json").write_bytes(_dump(scrub))
    tmp = p / "corpus.json.tmp"
    tmp.write_bytes(_dump(manifest))
    os.replace(tmp, p / "corpus.json")
    return p


# ----------------------------------------------------------------------------- store -> cases


def _sampling(request: Mapping[str, Any] | None) -> dict[str, Any]:
    if not isinstance(request, Mapping):
        return {}
    out = {k: request[k] for k in _SAMPLING_KEYS if request.get(k) is not None}
    if "max_tokens" not in out and request.get("max_completion_tokens") is not None:
        out["max_tokens"] = request["max_completion_tokens"]
    return out


def _usable(turn: Turn) -> str | None:
    """Why a recorded turn cannot become a case turn (None when it can)."""
    if turn.state not in (None, "ok"):
        return "not_ok"
    if not turn.prompt_token_ids:
        return "no_prompt_ids"
    if turn.output_token_ids is None:
        return "no_output_ids"
    return None


def _hash_id(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:16]


def _tool_results(cur: Mapping[str, Any] | None, nxt: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The messages the agent appended after ``cur``'s answer before ``nxt`` (tool results)."""
    a = (cur or {}).get("messages") or []
    b = (nxt or {}).get("messages") or []
    if len(b) <= len(a) + 1 or b[: len(a)] != a:
        return []
    return [m for m in b[len(a) + 1:] if isinstance(m, Mapping) and m.get("role") == "tool"]


def iter_case_turns(case: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    return iter(case.get("turns") or ())


def case_from_turns(turns: Sequence[Turn | Mapping[str, Any]], *, scrubber: Scrubber | None, tokenizer: Any,
                    case_id: str, tokenizer_info: Mapping[str, Any] | None,
                    session_id: str | None = None, title: str | None = None) -> tuple[dict[str, Any], dict[str, int]]:
    """One case from the recorded turns of a session (store turn records, in index order).

    With ``scrubber`` None nothing is scrubbed (``provenance.scrubbed`` false) and ``tokenizer``
    may be None. Returns ``(case, counters)``; counters: ``turns``, ``skipped_<reason>``,
    ``retokenized_local``, ``retokenized_full``."""
    from tensorverse.replay.tokenizers import retokenize

    counters: dict[str, int] = {}
    out_turns: list[dict[str, Any]] = []
    usable = []
    for t in map(records.turn, turns):
        why = _usable(t)
        if why:
            counters[f"skipped_{why}"] = counters.get(f"skipped_{why}", 0) + 1
            continue
        usable.append(t)
    scrub_value = scrubber.scrub_value if scrubber else (lambda v: v)
    for i, t in enumerate(usable):
        req = t.request or {}
        messages = req.get("messages")
        prompt = list(t.prompt_token_ids or [])
        output = list(t.output_token_ids or [])
        turn: dict[str, Any] = {
            "index": i,
            "endpoint": t.endpoint if t.endpoint in ("chat.completions", "completions", "messages") else None,
            "messages": scrub_value(messages) if messages is not None else None,
            "tools": scrub_value(req.get("tools")) if req.get("tools") is not None else None,
            "sampling": scrub_value(_sampling(req)),
        }
        if scrubber is not None:
            prompt, _, pinfo = retokenize(tokenizer, prompt, scrubber.scrub_spans)
            output, _, oinfo = retokenize(tokenizer, output, scrubber.scrub_spans)
            for info in (pinfo, oinfo):
                key = f"retokenized_{info['method']}"
                counters[key] = counters.get(key, 0) + 1
            turn["retokenized"] = {"prompt": pinfo["method"], "output": oinfo["method"]}
        text = None
        if tokenizer is not None:
            try:
                text = tokenizer.decode(output, skip_special=True)
            except Exception:  # noqa: BLE001 - a tokenizer that cannot skip specials
                text = None
        if text is None:
            text = scrub_value(t.text) if t.text is not None else None
        turn["prompt_token_ids"] = prompt
        turn["reference"] = {
            "backend": t.backend,
            "output_token_ids": output,
            "text": text,
            "tool_calls": scrub_value(t.tool_calls) or None,
            "finish_reason": t.finish_reason,
        }
        nxt = usable[i + 1] if i + 1 < len(usable) else None
        cur_req = {"messages": messages}
        nxt_req = {"messages": (nxt.request or {}).get("messages")} if nxt else None
        turn["tool_results"] = scrub_value(_tool_results(cur_req, nxt_req))
        out_turns.append(turn)
        counters["turns"] = counters.get("turns", 0) + 1
    first = usable[0] if usable else None
    created = first.created_ns if first is not None else None
    case = {
        "format": CASE_FORMAT,
        "format_version": FORMAT_VERSION,
        "id": case_id,
        **({"title": title} if title else {}),
        "tokenizer": dict(tokenizer_info or {"fingerprint": None}),
        "provenance": {
            "source": "store",
            "session": _hash_id(session_id) if session_id else None,
            "reference_backend": first.backend if first is not None else None,
            "model": first.model if first is not None else None,
            "recorded_on": (_dt.datetime.fromtimestamp(created / 1e9, _dt.timezone.utc).strftime("%Y-%m-%d")
                            if isinstance(created, int) else None),
            "scrubbed": scrubber is not None,
            "scrubber_version": SCRUBBER_VERSION if scrubber is not None else None,
            "tensorverse_version": _version(),
        },
        "turns": out_turns,
    }
    return case, counters


def _learn_turn(scrubber: Scrubber, tokenizer: Any, t: Turn) -> None:
    scrubber.learn_value(t.request)
    scrubber.learn_value(t.text)
    scrubber.learn_value(t.tool_calls)
    if tokenizer is not None:
        for ids in (t.prompt_token_ids, t.output_token_ids):
            if ids:
                scrubber.learn(tokenizer.decode(list(ids)))


def scrub_store(store_path: str | os.PathLike, out: str | os.PathLike, *, tokenizer: Any,
                sessions: Sequence[str] | None = None, rules: str | os.PathLike | None = None,
                name: str | None = None, progress: Any = None) -> dict[str, Any]:
    """``tensorverse scrub``: sessions of a store -> a scrubbed corpus. Returns the report."""
    from tensorverse.replay.scrub import load_rules
    from tensorverse.store import Store

    rule_list, keep = load_rules(Path(rules)) if rules else ([], [])
    scrubber = Scrubber(rules=rule_list, keep=keep)
    tok_info = tokenizer.fingerprint()
    with Store.open(store_path, readonly=True) as store:
        if sessions:
            chosen = [store.get_session(s) for s in sessions]
        else:
            chosen = list(store.iter_sessions())
        recorded = [(s, list(store.iter_turns(s.id))) for s in chosen]
    # pass 1: learn names and reserved addresses over the whole corpus
    for _, turns in recorded:
        for t in turns:
            _learn_turn(scrubber, tokenizer, t)
    # pass 2: scrub
    cases = []
    totals: dict[str, int] = {}
    for n, (s, turns) in enumerate(recorded):
        cid = f"case-{_hash_id(s.id)}"
        case, counters = case_from_turns(turns, scrubber=scrubber, tokenizer=tokenizer, case_id=cid,
                                         tokenizer_info=tok_info, session_id=s.id)
        for k, v in counters.items():
            totals[k] = totals.get(k, 0) + v
        if case["turns"]:
            cases.append(case)
        else:
            totals["sessions_without_usable_turns"] = totals.get("sessions_without_usable_turns", 0) + 1
        if progress:
            progress(n + 1, len(recorded))
    report = scrubber.report()
    report.update(sessions=len(recorded), cases=len(cases), **{k: v for k, v in sorted(totals.items())},
                  tokenizer=tok_info.get("source"), rules=len(rule_list))
    write_corpus(out, cases, tokenizer=tok_info, scrub=report, name=name)
    return report


def render_scrub_report(report: Mapping[str, Any]) -> str:
    """The scrub report as a small table (counts only)."""
    lines = [f"scrubbed {report.get('sessions', 0)} session(s) -> {report.get('cases', 0)} case(s), "
             f"{report.get('turns', 0)} turn(s)"]
    lines.append(f"{'kind':<12} {'replaced':>9} {'distinct':>9}")
    for k, v in report.get("replaced", {}).items():
        lines.append(f"{k:<12} {v:>9} {report.get('distinct', {}).get(k, 0):>9}")
    lines.append(f"{'total':<12} {report.get('total', 0):>9}")
    extra = {k: v for k, v in report.items() if k.startswith(("skipped_", "retokenized_"))}
    if extra:
        lines.append("  " + ", ".join(f"{k}={v}" for k, v in extra.items()))
    for w in report.get("warnings") or ():
        lines.append(f"warning: {w}")
    return "\n".join(lines)

"""Every usage form the docs and the ``--help`` texts show, for every subcommand (issue 27).

The forms come from two places, so that a subcommand added later is covered without touching
this file:

* the docs: every ``tensorverse ...`` line of a fenced code block in README.md and docs/*.md
  (``$ `` prompts, ``\\`` continuations and ``# comments`` handled; ``[optional]`` parts give a
  shortest and a longest form, ``(A | B)`` alternatives one form each where there are two);
* the parsers: for every command and action of the parser `tensorverse.cli.build_parser` builds,
  the form its usage line shows, with every option it lists: a parent's options *before* the
  action (``tensorverse sessions --store PATH list``) and, where the action accepts them too,
  *after* it (``tensorverse sessions list --store PATH``); ``report``'s forms from its help.

Each form is checked twice. Parsed: the real parser takes it, and every value the form gives
lands where it says (``--store PATH`` before the action is ``args.store == PATH``), so no level's
default overwrites another's. Run, where it needs no server: against a real LMDB store made here
(two sessions, turns, a run with rows), with the working directory empty and
``$TENSORVERSE_STORE`` unset, so an ignored ``--store`` fails; each run is checked against what the
form says, computed here from the store and the inputs (sessions listed, merged, split; tables
and their row counts; the flips of two logits files; a corpus; a merged report). The commands
that need a vLLM server say so in `SERVER_ONLY`; a new subcommand must be run here or listed
there (`test_every_subcommand_is_run_or_says_why`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson
import pytest

from tensorverse.cli import build_parser, main
from tensorverse.ports import free_port
from tensorverse.store.records import Turn
from tensorverse.testing.records import trun, tsession

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Commands whose forms are only parsed here, and why (each runs against real servers elsewhere).
SERVER_ONLY = {
    "doctor": "asks a running vLLM server (tests/shadow/test_shadow_doctor.py, fake vLLM)",
    "replay": "replays on vLLM servers (tests/replay/test_replay_runner.py, fake vLLM)",
    "noise": "probes a vLLM server (tests/replay/test_batch_noise.py)",
    "matrix": "starts vLLM servers (tests/matrix/)",
    "bisect": "starts vLLM servers (tests/matrix/)",
}
# Forms of these commands run here only in the shape named; the others are parsed.
PARTLY = {
    "proxy": "`--check` forms run (they validate and exit); without it the proxy serves",
    "demo": "`--help` runs; the demo itself starts four vLLM servers (tests/demo/test_demo_vllm.py)",
    "rig": "`rig suites` runs; `rig run` starts vLLM servers (tests/rig/test_rig_run_vllm.py; its "
           "refusals without a server: tests/rig/test_rig_run.py)",
}
# New commands whose owner has not added their run here yet: parsed only, and listed, so that
# this stays a decision (remove the entry with the executor).
NOT_RUN_YET: dict[str, str] = {}



# ---------------------------------------------------------------------------------------------
# the parser tree


def _subparsers(p: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)


def _positionals(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]


def _shown_options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options a parser's usage shows (not -h/--version, not hidden), one per exclusive group."""
    skip: set[int] = set()
    for g in p._mutually_exclusive_groups:
        skip |= {id(a) for a in g._group_actions[1:]}
    return [a for a in p._actions if a.option_strings and id(a) not in skip and a.help != argparse.SUPPRESS
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def parser_tree() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    out: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        out[path] = p
        sub = _subparsers(p)
        if sub is not None:
            for name, child in sub.choices.items():
                walk(child, (*path, name))

    walk(build_parser(), ())
    return out


def commands() -> list[str]:
    return sorted(path[0] for path in parser_tree() if len(path) == 1)


# ---------------------------------------------------------------------------------------------
# the forms


@dataclass(frozen=True)
class Form:
    source: str  # "README.md:12", "help:before:sessions list", ...
    tokens: tuple[str, ...]  # without the leading "tensorverse"

    @property
    def id(self) -> str:
        return self.source if self.source.startswith("help:") else f"{self.source}:{' '.join(self.tokens)}"

    @property
    def command(self) -> str:
        return self.tokens[0]


def _lex(tokens: list[str]) -> list[str]:
    """Usage tokens split into atoms and the symbols ``[ ] ( ) |`` (a bracket inside a token,
    as in ``NAME=URL[#MODEL]``, stays in its atom)."""
    out: list[str] = []
    for t in tokens:
        if t == "|":
            out.append(t)
            continue
        while t[:1] in ("[", "("):
            out.append(t[0])
            t = t[1:]
        closers: list[str] = []
        while t[-1:] in ("]", ")"):
            opener = "[" if t[-1] == "]" else "("
            if t.count(opener) >= t.count(t[-1]):
                break  # closes a bracket of its own token
            closers.insert(0, t[-1])
            t = t[:-1]
        if t:
            out.append(t)
        out += closers
    return out


def _expand(tokens: list[str], variant: int) -> list[str]:
    """One concrete form of a usage line: ``[...]`` kept (variant 1) or dropped (variant 0);
    of alternatives ``(A | B)``, ``A`` in variant 0 and ``B`` in variant 1. ``...`` stays (see
    `instantiate`)."""
    atoms = _lex(tokens)
    pos = 0

    def alts(end: str | None) -> list[list[str]]:
        nonlocal pos
        out: list[list[str]] = [[]]
        while pos < len(atoms):
            a = atoms[pos]
            pos += 1
            if a == end:
                return out
            if a == "|":
                out.append([])
            elif a in ("[", "("):
                inner = alts("]" if a == "[" else ")")
                if a == "(" or variant:
                    out[-1] += inner[variant % len(inner)]
            else:
                out[-1].append(a)
        assert end is None, f"unclosed {end!r} in {tokens}"
        return out

    return alts(None)[0]


def doc_forms() -> list[Form]:
    forms: list[Form] = []
    for doc in DOCS:
        in_block = False
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            start = i + 1
            i += 1
            if line.lstrip().startswith("```"):
                in_block = not in_block
                continue
            if not in_block:
                continue
            text = line.strip()
            if text.startswith("$ "):
                text = text[2:]
            if not text.startswith("tensorverse "):
                continue
            while text.endswith("\\") and i < len(lines):
                text = text[:-1] + " " + lines[i].strip()
                i += 1
            tokens = shlex.split(re.sub(r"(^|\s)#\s.*$", "", text))  # `# a comment`, not `URL[#MODEL]`
            if len(tokens) < 2 or tokens[1].endswith(":"):  # a command's output, not a command
                continue
            variants = {tuple(_expand(tokens[1:], v)) for v in (0, 1)}
            for v in sorted(variants):
                forms.append(Form(f"{doc.relative_to(ROOT)}:{start}", v))
    return forms


def help_forms() -> list[Form]:
    """The forms each parser's usage line shows: the options of every level before the level's
    action, and the options an action also accepts after it."""
    tree = parser_tree()
    forms: list[Form] = []

    def opt_tokens(actions: list[argparse.Action]) -> list[str]:
        out: list[str] = []
        for a in actions:
            out.append(a.option_strings[-1])
            if a.nargs != 0:
                out.append(a.metavar if isinstance(a.metavar, str) else a.dest.upper())
        return out

    def pos_tokens(p: argparse.ArgumentParser) -> list[str]:
        return [a.metavar if isinstance(a.metavar, str) else a.dest.upper() for a in _positionals(p)]

    for path, p in tree.items():
        if not path:
            continue
        rest = next((a for a in _positionals(p) if a.nargs == argparse.REMAINDER), None)
        if rest is not None:  # `report`: the forms are in the help of its REMAINDER
            for alt in str(rest.help).split(" | "):
                for v in (0, 1):
                    forms.append(Form(f"help:{' '.join(path)}:{v}:{alt}", tuple([*path, *_expand(alt.split(), v)])))
            continue
        sub = _subparsers(p)
        if sub is not None and sub.required:
            continue  # only its actions are forms
        own = _shown_options(p)
        if len(path) == 1:
            forms.append(Form(f"help:{path[0]}", tuple([*path, *opt_tokens(own), *pos_tokens(p)])))
            continue
        # an action: after (`cmd action --opts`) and before (`cmd --parent-opts action --opts`)
        forms.append(Form(f"help:after:{' '.join(path)}", tuple([*path, *opt_tokens(own), *pos_tokens(p)])))
        tokens: list[str] = []
        overridden = set(p._defaults)  # set by the action itself: `export parquet` is format=parquet
        for depth in range(1, len(path)):
            parent = tree[path[:depth]]
            tokens += [path[depth - 1], *opt_tokens([a for a in _shown_options(parent) if a.dest not in overridden])]
        parent_opts = {s for d in range(1, len(path)) for a in _shown_options(tree[path[:d]]) for s in a.option_strings}
        mine = [a for a in own if a.required or not (set(a.option_strings) & parent_opts)]
        forms.append(Form(f"help:before:{' '.join(path)}", tuple([*tokens, path[-1], *opt_tokens(mine), *pos_tokens(p)])))
    return forms


FORMS = doc_forms() + help_forms()


# ---------------------------------------------------------------------------------------------
# a form's tokens -> argv, with what each value must become


class FormError(AssertionError):
    pass


@dataclass
class Inst:
    argv: list[str]
    given: dict[str, Any] = field(default_factory=dict)  # dest -> the value the form gives it
    path: tuple[str, ...] = ()
    help: bool = False


def _convert(a: argparse.Action, s: str) -> Any:
    v = a.type(s) if callable(a.type) else s
    if a.choices is not None and v not in a.choices:
        raise ValueError(f"{s!r} not in {a.choices}")
    return v


_CANDIDATES = ("3", "2", "0.5", "0.25", "tv-a=http://127.0.0.1:9/v1", "auto", "forced", "name=1")


def _value(a: argparse.Action, raw: str, fill: dict[str, Any]) -> tuple[str, Any]:
    """The string to pass for one value of ``a`` (the fill's, the form's if the parser takes it,
    else one it takes that is not the default) and what the parser must make of it."""
    if a.dest in fill:
        s = fill[a.dest]
        s = str(s(raw) if callable(s) else s)
        return s, _convert(a, s)
    try:
        return raw, _convert(a, raw)
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        pass
    cands = [str(c) for c in (a.choices or ()) if c != a.default] + list(_CANDIDATES) + [f"x-{a.dest}"]
    for s in cands:
        try:
            v = _convert(a, s)
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
        if v != a.default:
            return s, v
    raise FormError(f"no value found for {a.option_strings or a.dest} (form gives {raw!r})")


def instantiate(form: Form, fill: dict[str, Any] | None = None) -> Inst:
    """Walk a form through the real parser tree: which action each token is, with the values
    filled (``fill``: dest -> value or function of the form's token)."""
    fill = fill or {}
    tokens = list(form.tokens)
    tree = parser_tree()
    parser, path = tree[()], ()
    inst = Inst([])
    positionals = _positionals(parser)
    i = 0

    def is_opt(t: str) -> bool:
        return t.startswith("-") and len(t) > 1 and not re.match(r"^-\d", t)

    elided = "..." in tokens
    while i < len(tokens):
        t = tokens[i]
        if t == "...":  # "and the rest, as above": an elided value, more files, or the required options
            i += 1
            continue
        if t in ("-h", "--help"):
            inst.argv.append(t)
            inst.help = True
            break
        if is_opt(t):
            name, eq, inline = t.partition("=")
            a = parser._option_string_actions.get(name)
            if a is None:
                raise FormError(f"{form.id}: {name} is not an option of `tensorverse {' '.join(path)}`")
            i += 1
            if a.nargs == 0:
                inst.argv.append(name)
                inst.given[a.dest] = a.const
                continue
            if eq:
                raws = [inline]
            elif a.nargs in (None, "?") or isinstance(a.nargs, int):
                n = 1 if a.nargs in (None, "?") else a.nargs
                raws = tokens[i:i + n]
                if len(raws) < n or any(is_opt(r) for r in raws):
                    raise FormError(f"{form.id}: {name} needs {n} value(s)")
                i += n
                raws = [a.dest.upper() if r == "..." else r for r in raws]  # `--backend ...`: a value
            else:
                raws = []
                while i < len(tokens) and not is_opt(tokens[i]):
                    raws.append(tokens[i])
                    i += 1
            pairs = [_value(a, r, fill) for r in raws]
            inst.argv += [name, *(s for s, _ in pairs)]
            vals = [v for _, v in pairs]
            one = vals if a.nargs in ("+", "*") or isinstance(a.nargs, int) else vals[0]
            if isinstance(a, argparse._AppendAction):
                inst.given.setdefault(a.dest, []).append(one)
            else:
                inst.given[a.dest] = one
            continue
        sub = _subparsers(parser)
        if sub is not None and t in sub.choices and not [p for p in positionals if p.nargs in (None, "+")]:
            inst.argv.append(t)
            if sub.dest != argparse.SUPPRESS:
                inst.given[sub.dest] = t
            path = (*path, t)
            parser = tree[path]
            positionals = _positionals(parser)
            i += 1
            continue
        if not positionals:
            raise FormError(f"{form.id}: unexpected {t!r} for `tensorverse {' '.join(path)}`")
        a = positionals.pop(0)
        if a.nargs == argparse.REMAINDER:
            inst.argv += tokens[i:]
            inst.given[a.dest] = tokens[i:]
            break
        if a.nargs in ("+", "*"):
            raws = []
            while i < len(tokens) and not is_opt(tokens[i]):
                if tokens[i] != "...":
                    raws.append(tokens[i])
                i += 1
            pairs = [_value(a, r, fill) for r in raws]
            inst.argv += [s for s, _ in pairs]
            inst.given[a.dest] = [v for _, v in pairs]
            continue
        s, v = _value(a, t, fill)
        inst.argv.append(s)
        inst.given[a.dest] = v
        i += 1
    if elided and not inst.help:  # `tensorverse bisect ... --executor ray`: the required options as above
        for a in parser._actions:
            if a.option_strings and a.required and a.dest not in inst.given:
                s, v = _value(a, a.dest.upper(), fill)
                inst.argv += [a.option_strings[-1], s]
                inst.given[a.dest] = v
    inst.path = path
    return inst


def _param(form: Form):
    return pytest.param(form, id=form.id[:150])


# ---------------------------------------------------------------------------------------------
# parsed: every value lands where the form says


def test_the_forms_cover_every_command_and_action():
    tree = parser_tree()
    named = {f.tokens[:len(path)] for f in FORMS for path in tree if path and f.tokens[:len(path)] == path}
    missing = [" ".join(p) for p in tree if p and p not in named]
    assert not missing, missing
    # the docs show forms of most commands (a doc form naming no command fails below)
    assert {f.command for f in FORMS if not f.source.startswith("help:")} >= {
        "analyze", "export", "proxy", "scrub", "replay", "report", "sessions", "view", "matrix", "bisect", "noise"}
    assert any(f.tokens[:3] == ("sessions", "--store", "PATH") and "list" in f.tokens for f in FORMS)


@pytest.mark.parametrize("form", [_param(f) for f in FORMS])
def test_form_parses_to_what_it_says(form: Form, capsys):
    inst = instantiate(form)
    parser = build_parser()
    if inst.help:
        with pytest.raises(SystemExit) as e:
            parser.parse_args(inst.argv)
        assert e.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: tensorverse {' '.join(inst.path)}".rstrip())
        return
    try:
        ns = parser.parse_args(inst.argv)
    except SystemExit as e:
        raise AssertionError(f"{form.id}: the parser refuses {inst.argv}: {capsys.readouterr().err}") from e
    assert callable(getattr(ns, "func", None)), f"{form.id}: {inst.argv} runs nothing"
    wrong = {d: (v, getattr(ns, d, "<missing>")) for d, v in inst.given.items() if getattr(ns, d, "<missing>") != v}
    assert not wrong, f"{form.id}: {inst.argv}: given vs parsed {wrong}"


# ---------------------------------------------------------------------------------------------
# run: against a real store, checked against what the form says


def make_store(path: Path) -> dict[str, Any]:
    """Sessions "a" (7 main turns, the first with a tool call) and "b" (2 turns, the second a side
    request), created a minute ago; one forced run with 3 logits rows on b's first turn."""
    from tensorverse.store import Store
    from tensorverse.store.codec import encode_row

    now = time.time_ns()
    created = {"a": now - 60_000_000_000, "b": now - 30_000_000_000}
    with Store.open(path, durable=False) as st:
        for sid, n in (("a", 7), ("b", 2)):
            st.put_session(tsession(sid, created_ns=created[sid], grouping="prefix")).result()
            for i in range(n):
                st.put_turn(Turn(id=f"{sid}-t{i}", session_id=sid, index=i, endpoint="chat.completions",
                                 kind="side" if (sid, i) == ("b", 1) else "main",
                                 created_ns=created[sid] + i,
                                 request={"messages": [{"role": "user", "content": f"task {sid} on 10.1.2.3"}]},
                                 output_token_ids=[5, 6, 7], text=f"answer {sid} {i}",
                                 tool_calls=[{"function": {"name": "f", "arguments": "{}"}}] if i == 0 else [])).result()
        st.put_run(trun("run-b0", "b-t0", "fp32", "forced", status="ok", token_ids=[5, 6, 7],
                        rows={"expected": 3, "present": 3, "complete": True})).result()
        rng = np.random.default_rng(3)
        st.write_rows("run-b0", [(p, encode_row(rng.standard_normal(16).astype(np.float32))) for p in range(3)]).result()
    return {"sessions": {"a": 7, "b": 2}, "created": created}


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty working directory and no $TENSORVERSE_STORE: a command that ignores --store
    finds no store."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("TENSORVERSE_STORE", raising=False)
    return tmp_path


def store_of(form: Form, tmp: Path) -> Path:
    """Where a form's store is: the PATH it gives, else the default (./tensorverse-data: the
    working directory is ``env``'s empty one)."""
    return tmp / "store" if "store" in instantiate(form).given else Path.cwd() / "tensorverse-data"


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _run_sessions(form: Form, tmp: Path, capsys) -> None:
    from tensorverse.store import RecordNotFound, Store

    store = store_of(form, tmp)
    facts = make_store(store)
    inst = instantiate(form, {"store": store, "limit": 1, "into": "a", "other": "b", "session": "a",
                              "at": lambda raw: raw if raw.isdigit() and int(raw) < 7 else 5, "reason": "by the test"})
    code, out, err = run_cli(inst.argv, capsys)
    assert code == 0, f"{inst.argv}: {err}"
    g = inst.given
    action = g.get("action") or "list"
    with Store.open(store, readonly=True) as st:
        if action == "list":
            newest_first = sorted(facts["sessions"], key=lambda s: facts["created"][s])
            want = newest_first[-g["limit"]:] if g.get("limit") else newest_first
            if g.get("json"):
                rows = [orjson.loads(x) for x in out.splitlines()]
                assert [(r["id"], r["turns"]) for r in rows] == [(s, facts["sessions"][s]) for s in want]
                assert all("10.1.2.3" not in r["first_user"] and r["first_user"].startswith("task ") for r in rows)
            else:
                listed = [line.split()[0] for line in out.splitlines()[1:-1]]
                assert listed == want, out
                turns = sum(facts["sessions"][s] for s in want)
                assert out.splitlines()[-1].startswith(f"{len(want)} session(s), {turns} turn(s)")
        elif action == "merge":
            assert "2 turn(s) moved" in out
            a = st.get_session("a")
            assert a.turns == 9 and a.edits[-1]["op"] == "merge" and a.edits[-1]["reason"] == g["reason"]
            with pytest.raises(RecordNotFound):
                st.get_session("b")
        elif action == "split":
            at = g["at"]
            a = st.get_session("a")
            new = a.edits[-1]["to_session"]
            assert a.turns == at and st.get_session(new).turns == 7 - at
            assert [t.id for t in st.iter_turns(new)] == [f"a-t{i}" for i in range(at, 7)]
            assert a.edits[-1]["reason"] == g["reason"] and new in out
        else:
            raise AssertionError(f"no check for `sessions {action}`: add one")


def _count(path: Path) -> int:
    if path.suffix == ".jsonl":
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    import pyarrow.parquet as pq

    return pq.read_table(path).num_rows


def _run_export(form: Form, tmp: Path, capsys) -> None:
    store = store_of(form, tmp)
    facts = make_store(store)
    kind_html = "html" in form.tokens[1:2] or ("html" in form.tokens and "--session" in form.tokens)
    out = tmp / ("page.html" if kind_html else "tables")
    inst = instantiate(form, {"store": store, "out": out, "session": "a", "since": "7d", "until": "2100-01-01",
                              "tables": "sessions,turns"})
    code, printed, err = run_cli(inst.argv, capsys)
    assert code == 0, f"{inst.argv}: {err}"
    g = inst.given
    if g.get("kind") == "html":
        html = out.read_text()
        assert "a-t6" in html and "answer a 6" in html and f"wrote {out}" in printed
        return
    fmt = g.get("kind") or g["format"]
    files = {p.stem: p for p in out.iterdir()}
    from tensorverse.exporters.export import TABLES

    want = set(g["tables"].split(",")) if g.get("tables") else {t for t in TABLES if t != "logits"}
    if g.get("logits"):
        want.add("logits")
    assert set(files) == want, (inst.argv, sorted(files))
    assert all(p.suffix == f".{fmt}" for p in files.values())
    assert _count(files["sessions"]) == len(facts["sessions"])
    assert _count(files["turns"]) == sum(facts["sessions"].values())
    if "logits" in files:
        assert _count(files["logits"]) == 3
    if g.get("include_text") and fmt == "jsonl":
        assert "answer a 6" in files["turns"].read_text()


def _run_analyze(form: Form, tmp: Path, capsys) -> None:
    rng = np.random.default_rng(11)
    ref = rng.standard_normal((6, 32)).astype(np.float32)
    cand = ref.copy()
    flips = [1, 4]
    for p in flips:
        cand[p, (int(ref[p].argmax()) + 1) % 32] = ref[p].max() + 1.0
    np.save(tmp / "A.npy", ref)
    np.save(tmp / "B.npy", cand)
    np.save(tmp / "C.npy", ref)  # a noise run that agrees with the reference
    (tmp / "T.json").write_text(json.dumps([int(t) for t in ref.argmax(axis=1)]))
    inst = instantiate(form, {"ref": tmp / "A.npy", "cand": tmp / "B.npy", "tokens": tmp / "T.json",
                              "noise": tmp / "C.npy", "near_tie_ulps": 1, "near_tie_nats": 0.0})
    code, out, err = run_cli(inst.argv, capsys)
    assert code == 0, f"{inst.argv}: {err}"
    if inst.given.get("json"):
        res = json.loads(out)
        assert [p["position"] for p in res["positions"] if p["flip"]] == flips
        assert res["summary"]["flips_by_class"]["runtime"] == len(flips)
    else:
        assert f"Flips (argmax differs): {len(flips)} of 6, first at position {flips[0]}" in out


def _run_view(form: Form, tmp: Path, capsys) -> None:
    if "--port" not in form.tokens:
        return  # the default port (8765) may be another process's here: this form is parsed only
    store = store_of(form, tmp)
    make_store(store)
    port = free_port()
    inst = instantiate(form, {"store": store, "host": "127.0.0.1", "port": port})
    proc = subprocess.Popen([sys.executable, "-m", "tensorverse.cli", *inst.argv], cwd=os.getcwd(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={k: v for k, v in os.environ.items() if k != "TENSORVERSE_STORE"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/sessions", timeout=5) as r:
                    data = json.loads(r.read())
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline, "the viewer did not start"
                time.sleep(0.3)
        assert {s["id"] for s in data["items"]} == {"a", "b"} and data["total"] == 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _run_proxy(form: Form, tmp: Path, capsys) -> None:
    if "--check" not in form.tokens:
        return  # it serves: parsed only
    config = ROOT / "examples" / "tensorverse.toml"
    inst = instantiate(form, {"config": config})
    code, out, err = run_cli(inst.argv, capsys)
    assert code == 0, err
    shadows = len(tomllib.loads(config.read_text()).get("shadows", []))
    assert shadows >= 1 and out.strip() == f"{config}: ok ({shadows} shadow backend(s))"


def _run_demo(form: Form, tmp: Path, capsys) -> None:
    if "--help" not in form.tokens:
        return  # starts four vLLM servers: parsed only
    with pytest.raises(SystemExit) as e:
        main(instantiate(form).argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tensorverse demo") and "--runtimes" in out and "--no-view" in out


def _run_rig(form: Form, tmp: Path, capsys) -> None:
    if "run" in form.tokens[1:2] and "--help" not in form.tokens:
        return  # starts vLLM servers: parsed only
    code = main(instantiate(form).argv) if "--help" not in form.tokens else None
    if code is None:
        with pytest.raises(SystemExit) as e:
            main(instantiate(form).argv)
        assert e.value.code == 0
        assert capsys.readouterr().out.startswith("usage: tensorverse rig")
        return
    out = capsys.readouterr().out
    if "suites" in form.tokens:
        from tensorverse.rig.suite import SUITES

        assert code == 0 and all(s.name in out for su in SUITES.values() for s in su.settings)
    else:
        assert code == 2  # `tensorverse rig` alone: its help, as a usage error


def _run_scrub(form: Form, tmp: Path, capsys) -> None:
    if "--tokenizer-url" in form.tokens:
        return  # asks a vLLM server for its tokenizer: parsed only
    from transformers import AutoTokenizer

    from tensorverse.rig.models import tokenizer_dir
    from tests.replay.test_corpus import ORIGINALS, record_store

    store = store_of(form, tmp)
    sid = record_store(store, AutoTokenizer.from_pretrained(str(tokenizer_dir())))
    out = tmp / "corpus"
    inst = instantiate(form, {"store": store, "out": out, "tokenizer": tokenizer_dir(), "session": sid,
                              "name": "usage", "rules": None})
    if "rules" in inst.given:  # a rules file the form names: an empty one (the default rules)
        (tmp / "rules.toml").write_text("")
        inst = instantiate(form, {"store": store, "out": out, "tokenizer": tokenizer_dir(), "session": sid,
                                  "name": "usage", "rules": tmp / "rules.toml"})
    code, printed, err = run_cli(inst.argv, capsys)
    assert code == 0, f"{inst.argv}: {err}"
    cases = sorted(out.rglob("*.json"))
    case_texts = [p.read_text() for p in cases]
    assert any(sid in t or '"tensorverse.case"' in t for t in case_texts), [p.name for p in cases]
    assert not any(o in t for o in ORIGINALS for t in case_texts)  # scrubbed


def _shipped_bundle(path: Path, label: str) -> Path:
    """A bundle of the shipped cpu-v1 corpus through the real writer: two settings that agree
    with the recorded tokens everywhere (no logits needed), one refused."""
    from tensorverse.bundle.known import known_corpus
    from tensorverse.bundle.make import SettingOutcome, make_bundle
    from tensorverse.rig.suite import suite

    s = suite("cpu-v1")
    k = known_corpus(s.corpus_dir)
    pos = [{"setting": n, "case": c, "turn": t, "position": i, "token": tok, "top1": tok, "flip": False,
            "flip_class": None, "margin": 1.0, "kl": 0.0, "topk_ids": None, "topk_logits": None}
           for n in ("bf16", "bf16_noise") for (c, t), toks in k.tokens.items() for i, tok in enumerate(toks)]
    free = [{"setting": n, "case": c, "turn": t, "status": "ok", "tokens": len(toks), "diverged": False,
             "first_divergence": None, "verdict": "match"}
            for n in ("bf16", "bf16_noise") for (c, t), toks in k.tokens.items()]
    settings = [SettingOutcome("bf16", "reference", "bfloat16", "ran"),
                SettingOutcome("bf16_noise", "noise", "2", "ran"),
                SettingOutcome("fp8_kv_e4m3", "kv_cache_dtype", "fp8_e4m3", "refused", "no AVX-512")]
    return make_bundle(path, suite={"name": s.name, "version": s.version}, corpus=k, rig_label=label,
                       fingerprint={"label": label}, settings=settings, reference="bf16", noise="bf16_noise",
                       positions=pos, free=free, provenance={"test": "cli usage"})


def _run_hypercube(form: Form, tmp: Path, capsys) -> None:
    """`hypercube build BUNDLE... --site DIR [--corpus DIR ...]`: the bundles made on this machine
    (examples/rig-bundles), or synthetic ones of a synthetic corpus with ``--corpus DIR``; the
    site's index is written and names every rig."""
    if "--help" in form.tokens or len(form.tokens) < 2:
        return _help_only(form, capsys)
    from tensorverse.testing.rig_bundles import make_corpus, synth_bundle

    from tensorverse.bundle.io import open_bundle

    # the example bundles of one suite (bundles of different suites do not merge)
    examples = [b for b in sorted((ROOT / "examples" / "rig-bundles").glob("*.tvbundle"))
                if open_bundle(b).manifest["suite"]["name"] == "cpu-v1"]
    corpus = make_corpus(tmp / "hc-corpus")
    tokens = list(form.tokens)
    synthetic = "--corpus" in tokens
    argv, labels, i = ["hypercube", "build"], [], 2
    while i < len(tokens):
        t = tokens[i]
        if t in ("--corpus", "--site"):
            argv += [t, str(corpus.path if t == "--corpus" else tmp / "site")]
            i += 2
        elif t.startswith("-"):
            argv.append(t)
            i += 1
        elif t == "...":
            i += 1
        else:
            k = len(labels)
            if synthetic:
                label = f"synthetic rig {k}"
                argv.append(str(synth_bundle(tmp / f"hc{k}.tvbundle", corpus, rig_label=label,
                                             scales={"bf16": 0, "bf16_noise": 0.05, "fp8": 0.6}, rig_seed=k + 1)))
            else:
                b = examples[k % len(examples)]
                label = open_bundle(b).manifest["rig"]["label"]
                argv.append(str(b))
            labels.append(label)
            i += 1
    code, printed, err = run_cli(argv, capsys)
    assert code == 0, f"{argv}: {printed}{err}"
    index = (tmp / "site" / "index.html").read_text()
    for label in labels:
        assert json.dumps(label)[1:-1].replace("<", "\\u003c") in index or label in index


def _help_only(form: Form, capsys) -> None:
    """`--help` exits 0; the command alone prints its help as a usage error (2)."""
    try:
        code = main(instantiate(form).argv)
    except SystemExit as e:
        code = e.code
    assert code == (0 if "--help" in form.tokens else 2)
    assert capsys.readouterr().out.startswith(f"usage: tensorverse {form.command}")


def _run_report_check(form: Form, tmp: Path, capsys) -> None:
    """`report check BUNDLE ... [--corpus DIR] [--json]`: bundles made by the real writer, every
    one accepted; the form's bundles are these. With ``--corpus DIR``: synthetic bundles of a
    synthetic corpus in DIR; without: bundles of the shipped cpu-v1 corpus."""
    from tensorverse.testing.rig_bundles import make_corpus, synth_bundle

    corpus = make_corpus(tmp / "rig-corpus")
    tokens = list(form.tokens)
    shipped = "--corpus" not in tokens
    argv, bundles, i = ["report", "check"], [], 2
    while i < len(tokens):
        t = tokens[i]
        if t == "--corpus":
            argv += [t, str(corpus.path)]
            i += 2
        elif t == "--json":
            argv.append(t)
            i += 1
        elif t == "...":  # more bundles: the form's own are enough
            i += 1
        else:
            path, label = tmp / f"rig{len(bundles)}.tvbundle", f"rig-{len(bundles)}"
            b = _shipped_bundle(path, label) if shipped else synth_bundle(
                path, corpus, rig_label=label, scales={"bf16": 0, "bf16_noise": 0.05, "fp8": 0.6},
                refused={"fp8_kv": "no AVX-512"}, rig_seed=len(bundles) + 1)
            bundles.append(str(b))
            argv.append(str(b))
            i += 1
    code, printed, err = run_cli(argv, capsys)
    assert code == 0, f"{argv}: {printed}{err}"
    ran = ["bf16", "bf16_noise"] if shipped else ["bf16", "bf16_noise", "fp8"]
    if shipped:
        from tensorverse.bundle.known import known_corpus
        from tensorverse.rig.suite import suite

        corpus = known_corpus(suite("cpu-v1").corpus_dir)
    if "--json" in argv:
        got = json.loads(printed)["bundles"]
        assert [(b["path"], b["ok"], b["rig"], b["settings_ran"]) for b in got] == \
            [(b, True, f"rig-{k}", ran) for k, b in enumerate(bundles)]
    else:
        assert printed.splitlines() == [f"{b}: ok (rig rig-{k}, {len(ran)} settings ran, 1 refused; "
                                        f"{len(ran) * corpus.positions} positions)" for k, b in enumerate(bundles)]


def _run_report(form: Form, tmp: Path, capsys) -> None:
    if form.tokens[1] == "check":
        return _run_report_check(form, tmp, capsys)
    from tests.replay.test_replay_runner import PROMPTS, _replay, make_case
    from tensorverse.testing.fake_vllm import FakeVLLM

    from tensorverse.replay.corpus import write_corpus

    corpus = write_corpus(tmp / "corpus", [make_case(FakeVLLM(), cid, p) for cid, p in PROMPTS.items()],
                          tokenizer={"fingerprint": None}, name="fake")
    tokens = list(form.tokens)
    action = tokens[1]
    rigs = []
    for i, perturb in enumerate((0.5, 2.0)):
        store = tmp / f"replay-store-{i}"
        out = tmp / f"rig{i}.json"
        _replay(corpus, {"ref": FakeVLLM(), "cand": FakeVLLM(perturb=perturb)}, reference="ref", out=out,
                store=store)
        rigs.append((out, store))
    argv, files, k = ["report", action], [], 0
    i = 2
    while i < len(tokens):
        t = tokens[i]
        if t == "--out":
            argv += [t, str(tmp / ("merged.json" if action == "merge" else "report"))]
            i += 2
        elif t == "--parquet":
            argv += [t, str(tmp / "merged.parquet")]
            i += 2
        elif t == "--store":
            argv += [t, str(rigs[0][1])]
            i += 2
        elif t == "...":  # more results files: the form's own are enough
            i += 1
        else:
            files.append(rigs[k % 2][0])
            argv.append(str(rigs[k % 2][0]))
            k += 1
            i += 1
    code, printed, err = run_cli(argv, capsys)
    assert code == 0, f"{argv}: {err}"
    if action == "merge":
        summaries = [json.loads(Path(f).read_text())["summary"]["cand"] for f in files]
        if "--out" in argv:
            m = json.loads((tmp / "merged.json").read_text())
            assert m["totals"]["cand"]["flips"] == sum(s["flips"] for s in summaries)
            assert m["totals"]["cand"]["positions"] == sum(s["positions"] for s in summaries)
        if "--parquet" in argv:
            assert _count(tmp / "merged.parquet") == 2 * len(files)  # (file, backend) rows
        lines = printed.strip().splitlines()
        assert len(lines) == 2 + 2 * len(files)  # header, rule, a row per (file, backend)
    else:
        index = tmp / "report" / "index.html"
        html = index.read_text()
        assert all(cid in html for cid in PROMPTS) and f"wrote {index}" in printed


def _config(tmp: Path) -> Path:
    cfg = tmp / "tv.toml"
    cfg.write_text('[primary]\nurl = "http://127.0.0.1:9"\n[verdict]\ntool_call_break_margin = 0.3\n'
                   '[retention]\nmax_age = "1d"\n')
    return cfg


def _run_verdict(form: Form, tmp: Path, capsys) -> None:
    from tensorverse.exporters.export import export_store
    from tensorverse.store import Store
    from tests.exporters.verdict_store import build_store

    store = store_of(form, tmp)
    build_store(store)  # `bad` breaks every 4th tool call of 40; `good` and the secondary none
    with Store.open(store, readonly=True) as st:
        export_store(st, tmp / "exports", fmt="jsonl", tables=["comparisons"])
    inst = instantiate(form, {"store": store, "comparisons": lambda raw: str(tmp / "exports"), "shadow": "bad",
                              "config": _config(tmp), "confidence": 0.95, "margin": 0.3})
    code, out, err = run_cli(inst.argv, capsys)
    assert code == 0, f"{inst.argv}: {err}"
    g = inst.given
    names = ["bad"] if g.get("shadow") else ["bad", "good", "secondary"]
    if g.get("json"):
        d = orjson.loads(out)
        assert [v["backend"] for v in d["shadows"]] == names
        assert d["shadows"][0]["decision"] == "regression"
        assert d["tool_call_break_margin"] == (0.3 if "margin" in g or "config" in g else 0.005)
    else:
        heads = [line.split(" ")[0] for line in out.splitlines() if not line.startswith(" ")][:-1]
        assert heads == names, out
        assert out.startswith("bad (shadow, noise floor: secondary): REGRESSION after 40 tool-calling turns")
        if "margin" in g or "config" in g:  # 40 clean tool-calling turns rule out a 30 % excess
            assert "good (shadow, noise floor: secondary): EQUIVALENT" in out


def _run_store(form: Form, tmp: Path, capsys) -> None:
    from tensorverse.store import Store
    from tests.exporters.verdict_store import build_store

    store = store_of(form, tmp)
    build_store(store)  # one session, "sess1", created in 2023
    inst = instantiate(form, {"store": store, "session": "sess1", "window": "7d", "max_age": "1d",
                              "max_bytes": "1G", "config": _config(tmp), "after": "1m", "limit": 3})
    code, out, err = run_cli(inst.argv, capsys)
    g = inst.given
    action = g.get("store_action")
    assert code == 0, f"{inst.argv}: {err}"
    with Store.open(store, readonly=True) as st:
        alive = [x.id for x in st.iter_sessions()]
        if action == "stats":
            if g.get("json"):
                d = orjson.loads(out)
                assert d["sessions"] == 1 and d["tables"]["comparisons"] > 0
            else:
                assert out.startswith(f"store {store}:") and "in 1 sessions" in out
        elif action == "prune":
            if g.get("dry_run"):
                assert alive == ["sess1"] and "would delete 1 session(s)" in (out if not g.get("json") else
                                                                              f"would delete {orjson.loads(out)['sessions']} session(s)")
            else:
                assert alive == []  # past max-age (from the option or the config)
        elif action == "pin":
            assert st.get_session("sess1").pinned is (not g.get("unpin"))
        elif action == "compact":  # its turns hold no rows: nothing to compact, every turn says why
            skipped = orjson.loads(out)["skipped"] if g.get("json") else out
            assert "no rows" in skipped and alive == ["sess1"], out
            assert all(st.compaction(t) is None for t in st.turn_ids("sess1"))
        else:
            raise AssertionError(f"no check for `store {action}`: add one")


EXECUTORS: dict[str, Callable[[Form, Path, Any], None]] = {
    "sessions": _run_sessions, "export": _run_export, "analyze": _run_analyze, "view": _run_view,
    "proxy": _run_proxy, "demo": _run_demo, "scrub": _run_scrub, "report": _run_report, "rig": _run_rig, "hypercube": _run_hypercube,
    "verdict": _run_verdict, "store": _run_store,
}


def test_every_subcommand_is_run_or_says_why():
    run_or_parsed = set(EXECUTORS) | set(SERVER_ONLY) | set(NOT_RUN_YET)
    assert set(commands()) <= run_or_parsed, sorted(set(commands()) - run_or_parsed)
    assert set(PARTLY) <= set(EXECUTORS)
    assert not set(EXECUTORS) & set(SERVER_ONLY)


@pytest.mark.parametrize("form", [_param(f) for f in FORMS if f.command in EXECUTORS])
def test_form_does_what_it_says(form: Form, env, capsys):
    EXECUTORS[form.command](form, env, capsys)

"""The demo's progress lines (demo/run.Progress)."""

from __future__ import annotations

import io
import sys

from tensorverse.demo.run import Progress


def test_progress_prints_to_the_stdout_of_the_moment_not_of_import_time(monkeypatch):
    """A runner that swaps (and later closes) sys.stdout between tests must not leave Progress
    writing to a closed stream: the default stream is looked up per line."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", first)
    p = Progress()
    p("one")
    monkeypatch.setattr(sys, "stdout", second)
    first.close()
    p("two")
    assert second.getvalue().endswith("] two\n") and second.getvalue().startswith("[demo 0:00] ")


def test_progress_keeps_an_explicit_stream():
    out = io.StringIO()
    Progress(out)("hello")
    assert out.getvalue() == "[demo 0:00] hello\n"

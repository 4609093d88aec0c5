"""`tensorverse export html`: one self-contained, inert-by-construction HTML file."""

from __future__ import annotations

import base64
import hashlib
import json
import re

from tensorverse.cli import main
from tensorverse.viz.export import render_html


def _export(built, tmp_path, session="s-xss"):
    out = tmp_path / "out" / f"{session}.html"
    assert main(["export", "html", "--session", session, "--out", str(out), "--store", str(built.path)]) == 0
    return out.read_text(encoding="utf-8")


def _scripts(page: str) -> list[tuple[str, str]]:
    return re.findall(r"<script([^>]*)>(.*?)</script>", page, flags=re.S)


def test_export_is_self_contained(built, tmp_path):
    page = _export(built, tmp_path, "s-net")
    assert page.startswith("<!doctype html>")
    # no external resource of any kind
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page, flags=re.I)
    assert "<link" not in page and "@import" not in page
    scripts = _scripts(page)
    assert [attrs.strip() for attrs, _ in scripts] == ['type="application/json" id="tv-data"', ""]
    data = json.loads(scripts[0][1])
    assert data["kind"] == "tensorverse-export"
    assert set(data["turns"]) == {"s-net-t0", "s-net-t1"}
    assert data["turns"]["s-net-t1"]["free"]["toolcalls"][1]["verdict"]["verdict"] == "value_mismatch"


def test_export_csp_lists_the_inline_hashes(built, tmp_path):
    page = _export(built, tmp_path, "s-net")
    m = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', page)
    csp = m.group(1).replace("&#x27;", "'")
    assert "default-src 'none'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    js = _scripts(page)[1][1]
    css = re.search(r"<style>(.*?)</style>", page, flags=re.S).group(1)
    h = lambda s: "'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"  # noqa: E731
    assert f"script-src {h(js)}" in csp
    assert f"style-src {h(css)}" in csp
    assert "connect-src" not in csp  # falls back to default-src 'none': no network


def test_export_escapes_hostile_text(built, tmp_path, vz):
    page = _export(built, tmp_path, "s-xss")
    # the hostile strings never appear as markup: only as JSON escapes inside the data element
    assert "<img" not in page
    assert "onerror=alert(1)>" not in page.replace("\\u003e", "")
    assert page.count("</script>") == 2  # the data element's and the app's own
    assert page.count("<script") == 2
    data = json.loads(_scripts(page)[0][1])
    vocab = data["turns"]["s-xss-t0"]["vocab"].values()
    assert vz.XSS_IMG in vocab and vz.XSS_SCRIPT in vocab
    assert data["session"]["session"]["tags"]["agent"] == vz.XSS_IMG


def test_export_unknown_session(built, tmp_path, capsys):
    out = tmp_path / "x.html"
    assert main(["export", "html", "--session", "nope", "--out", str(out), "--store", str(built.path)]) == 2
    assert "no session" in capsys.readouterr().err
    assert not out.exists()


def test_render_html_title_escaped():
    page = render_html({"session": {"session": {"id": '"><script>x</script>'}}, "turns": {}})
    assert '"><script>x' not in page.split("<script")[0]

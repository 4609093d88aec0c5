"""The viewer's HTTP API with aiohttp's test client: paging, turn JSON, 404/405, headers."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tensorverse.viz.server import CSP, create_app


@contextlib.asynccontextmanager
async def client_for(store, host="127.0.0.1"):
    app = create_app(store, host=host)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


def run(coro):
    return asyncio.run(coro)


def test_index_and_assets_with_csp(ro_store):
    async def go():
        async with client_for(ro_store) as c:
            r = await c.get("/")
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/html")
            assert r.headers["Content-Security-Policy"] == CSP
            assert "script-src 'self'" in CSP and "unsafe-inline" not in CSP and "unsafe-eval" not in CSP
            assert r.headers["X-Content-Type-Options"] == "nosniff"
            assert r.headers["X-Frame-Options"] == "DENY"
            html = await r.text()
            assert '<script src="static/app.js"' in html and "<script>" not in html
            js = await c.get("/static/app.js")
            assert js.status == 200 and js.headers["Content-Type"].startswith("text/javascript")
            assert js.headers["Content-Security-Policy"] == CSP
            css = await c.get("/static/app.css")
            assert css.status == 200 and css.headers["Content-Type"].startswith("text/css")
            for bad in ("/static/index.html", "/static/../server.py", "/static/%2e%2e%2fserver.py", "/nope"):
                r = await c.get(bad)
                assert r.status == 404, bad
                assert r.headers["Content-Security-Policy"] == CSP

    run(go())


def test_sessions_paging(ro_store):
    async def go():
        async with client_for(ro_store) as c:
            r = await c.get("/api/sessions", params={"limit": "3", "offset": "3"})
            assert r.status == 200 and r.headers["Cache-Control"] == "no-store"
            body = await r.json()
            assert body["total"] == 9 and body["offset"] == 3 and body["limit"] == 3
            assert [s["id"] for s in body["items"]] == ["s-05", "s-04", "s-03"]
            r = await c.get("/api/sessions", params={"q": "netops"})
            assert [s["id"] for s in (await r.json())["items"]] == ["s-net"]
            r = await c.get("/api/sessions", params={"limit": "many"})
            assert r.status == 400 and "limit" in (await r.json())["error"]
            r = await c.get("/api/sessions", params={"sort": "bogus"})
            assert r.status == 400
            r = await c.get("/api/sessions", params={"limit": "100000"})
            assert (await r.json())["limit"] == 200

    run(go())


def test_session_and_turn_json(ro_store, vz):
    async def go():
        async with client_for(ro_store) as c:
            r = await c.get("/api/sessions/s-net")
            assert r.status == 200
            sv = await r.json()
            assert sv["timeline"]["first_divergence"]["fa2"] == 1
            # concurrent requests for one turn share one build and all get the same body
            rs = await asyncio.gather(*(c.get("/api/turns/s-net-t1") for _ in range(3)))
            bodies = [await x.json() for x in rs]
            assert all(x.status == 200 for x in rs)
            assert bodies[0] == bodies[1] == bodies[2]
            tv = bodies[0]
            assert tv["kind"] == "turn" and tv["turn"]["id"] == "s-net-t1"
            assert tv["forced"]["lanes"]["fa2"]["flips"] == [vz.FA2_FLIP]
            assert len(tv["free"]["branch_points"]) == 2
            r = await c.get("/api/turns/s-net-t1", headers={"Accept-Encoding": "gzip"})
            assert r.headers.get("Content-Encoding") == "gzip"
            r = await c.get("/api/backends")
            assert {b["name"] for b in await r.json()} == {"primary", "secondary", "fa2", "fp8"}
            r = await c.get("/api/health")
            assert (await r.json())["read_only"] is True

    run(go())


def test_unknown_ids_are_404(ro_store):
    async def go():
        async with client_for(ro_store) as c:
            for path in ("/api/turns/nope", "/api/sessions/nope", "/api/turns/%00"):
                r = await c.get(path)
                assert r.status == 404, path
                body = await r.json()
                assert body["status"] == 404

    run(go())


def test_read_only_every_other_method_is_405(ro_store):
    async def go():
        async with client_for(ro_store) as c:
            for method in ("POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
                for path in ("/api/sessions", "/api/turns/s-net-t1", "/", "/nope"):
                    r = await c.request(method, path, data=b"x")
                    assert r.status == 405, (method, path)
                    assert r.headers["Allow"] == "GET, HEAD"
                    assert r.headers["Content-Security-Policy"] == CSP
            r = await c.head("/api/sessions")
            assert r.status == 200

    run(go())


def test_foreign_host_header_refused(ro_store):
    async def go():
        async with client_for(ro_store) as c:
            r = await c.get("/api/sessions", headers={"Host": "evil.example:8765"})
            assert r.status == 421
            for ok in ("localhost:8765", "127.0.0.1", "[::1]:8765"):
                r = await c.get("/api/health", headers={"Host": ok})
                assert r.status == 200, ok

    run(go())


def test_bound_to_all_interfaces_accepts_any_host(ro_store):
    async def go():
        async with client_for(ro_store, host="0.0.0.0") as c:
            r = await c.get("/api/health", headers={"Host": "viewer.lab:8765"})
            assert r.status == 200

    run(go())


def test_xss_corpus_served_as_json_only(ro_store, vz):
    async def go():
        async with client_for(ro_store) as c:
            r = await c.get("/api/turns/s-xss-t0")
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("application/json")
            assert r.headers["X-Content-Type-Options"] == "nosniff"
            tv = await r.json()
            # the hostile strings are data: present verbatim, to be rendered with textContent
            assert vz.XSS_IMG in tv["vocab"].values()
            assert vz.XSS_SCRIPT in tv["vocab"].values()
            assert any(b["name"] == vz.XSS_BACKEND for b in tv["backends"])
            assert vz.XSS_IMG in tv["prompt"]["messages"][0]["content"]
            # the page itself never embeds data
            html = await (await c.get("/")).text()
            assert "onerror" not in html

    run(go())


def test_cli_view_parser():
    from tensorverse.cli import build_parser

    args = build_parser().parse_args(["view", "--store", "/x", "--port", "9999"])
    assert (args.store, args.host, args.port) == ("/x", "127.0.0.1", 9999)


def test_cli_view_missing_store(tmp_path, capsys):
    from tensorverse.cli import main

    assert main(["view", "--store", str(tmp_path / "none")]) == 2
    assert "no Tensorverse store" in capsys.readouterr().err


@pytest.mark.parametrize("host,expected", [("127.0.0.1", {"127.0.0.1", "localhost", "::1"}),
                                           ("0.0.0.0", None), ("10.1.2.3", {"10.1.2.3"})])
def test_allowed_hosts(host, expected):
    from tensorverse.viz.server import _allowed_hosts

    assert _allowed_hosts(host) == expected


def test_panel_endpoint(ro_store, vz):
    async def go():
        app = create_app(ro_store, inline_rows=0)
        async with TestClient(TestServer(app, host="127.0.0.1")) as c:
            tv = await (await c.get("/api/turns/s-net-t1")).json()
            assert tv["lazy_panels"] is True and tv["forced"]["panels"] is None
            r = await c.get("/api/turns/s-net-t1/panel", params={"mode": "forced", "p": str(vz.FA2_FLIP)})
            assert r.status == 200
            body = await r.json()
            assert body["position"] == vz.FA2_FLIP and body["panel"]["ids"][:2] == [vz.tok("0"), vz.tok("1")]
            fa2_node = next(n for n in tv["free"]["nodes"] if n["backends"] == ["fa2"])
            r = await c.get("/api/turns/s-net-t1/panel",
                            params={"mode": "free", "n": str(fa2_node["id"]), "p": str(vz.FA2_FLIP)})
            assert len((await r.json())["panel"]["m"]) == 3
            for params in ({"mode": "forced", "p": "9999"}, {"mode": "free", "p": "1"}, {"mode": "x", "p": "1"},
                           {"mode": "forced", "p": "one"}):
                r = await c.get("/api/turns/s-net-t1/panel", params=params)
                assert r.status == 400, params
            r = await c.get("/api/turns/nope/panel", params={"mode": "forced", "p": "0"})
            assert r.status == 404

    run(go())

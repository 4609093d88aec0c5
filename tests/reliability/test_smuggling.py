"""The HTTP edge under attack, the proxy in its own process (``tensorverse proxy``) in front of the
fake primary: request smuggling and malformed framing, slow clients, and 10,000 idle connections,
while a well-formed client keeps making chat turns through it.

What must hold: nothing reaches the primary that the client did not send as one well-formed
request (each attack carries ``X-Case`` and hides a second request, ``GET /smuggled``, that must
never arrive), and the well-formed client is served throughout. Figures go to RELIABILITY.md."""

from __future__ import annotations

import json
import resource
from collections import Counter
import socket
import threading
import time
from typing import Any

from tests.reliability import harness as H
import httpx

BODY = b'{"model":"fake","messages":[{"role":"user","content":"hi"}]}'
SMUG = (b"POST /v1/chat/completions?smuggled HTTP/1.1\r\nHost: x\r\nX-Case: smuggled\r\nContent-Length: %d\r\n\r\n"
        % len(BODY) + BODY)
#: what the proxy answers a request it refuses (then it closes), or nothing at all (a broken body)
REFUSALS = {"400", "405", "501", "505", "closed"}
LINE = b"POST /v1/chat/completions HTTP/1.1\r\n"


def _req(headers: bytes, body: bytes, line: bytes = LINE, case: bytes = b"c") -> bytes:
    return line + b"Host: x\r\nContent-Type: application/json\r\nX-Case: " + case + b"\r\n" + headers + b"\r\n" + body


def _chunked(ext: bytes = b"", size_sep: bytes = b"\r\n", after: bytes = b"\r\n") -> bytes:
    return b"%x" % len(BODY) + ext + size_sep + BODY + after + b"0\r\n\r\n"


CL = b"Content-Length: %d\r\n" % len(BODY)
TE = b"Transfer-Encoding: chunked\r\n"

#: (name, bytes, expected): "ok" = well-formed (exactly one request reaches the primary, with
#: BODY as its body); "refused" = nothing of it may reach the primary; "either" = one or the other
CASES: list[tuple[str, bytes, str]] = [
    ("cl-te", _req(b"Content-Length: %d\r\n" % (5 + len(SMUG)) + TE, b"0\r\n\r\n" + SMUG), "refused"),
    ("te-cl", _req(TE + b"Content-Length: %d\r\n" % (5 + len(SMUG)), b"0\r\n\r\n" + SMUG), "refused"),
    ("cl-cl-differ", _req(CL + b"Content-Length: %d\r\n" % (len(BODY) + len(SMUG)), BODY + SMUG), "refused"),
    ("cl-cl-same", _req(CL + CL, BODY), "either"),
    ("cl-list", _req(b"Content-Length: %d, %d\r\n" % (len(BODY), len(BODY)), BODY), "either"),
    ("cl-plus", _req(b"Content-Length: +%d\r\n" % len(BODY), BODY + SMUG), "refused"),
    ("cl-minus", _req(b"Content-Length: -1\r\n", BODY + SMUG), "refused"),
    ("cl-inner-space", _req(b"Content-Length: %d 0\r\n" % len(BODY), BODY + SMUG), "refused"),
    ("cl-hex", _req(b"Content-Length: 0x%x\r\n" % len(BODY), BODY + SMUG), "refused"),
    ("cl-leading-zeros", _req(b"Content-Length: 000%d\r\n" % len(BODY), BODY), "either"),
    ("cl-overflow", _req(b"Content-Length: 99999999999999999999999\r\n", BODY), "refused"),
    ("te-chunked-identity", _req(b"Transfer-Encoding: chunked, identity\r\n", _chunked() + SMUG), "refused"),
    ("te-identity-chunked", _req(b"Transfer-Encoding: identity, chunked\r\n", _chunked() + SMUG), "refused"),
    ("te-gzip-chunked", _req(b"Transfer-Encoding: gzip, chunked\r\n", _chunked() + SMUG), "refused"),
    ("te-xchunked", _req(b"Transfer-Encoding: xchunked\r\n", _chunked() + SMUG), "refused"),
    ("te-two-fields", _req(TE + TE, _chunked() + SMUG), "refused"),
    ("te-identity-field-then-chunked", _req(b"Transfer-Encoding: identity\r\n" + TE, _chunked() + SMUG), "refused"),
    ("te-name-space", _req(b"Transfer-Encoding : chunked\r\n" + CL, BODY + SMUG), "refused"),
    ("te-vtab", _req(b"Transfer-Encoding: chunked\x0b\r\n", _chunked() + SMUG), "refused"),
    ("te-tab-ows", _req(b"Transfer-Encoding:\tchunked\r\n", _chunked()), "ok"),
    ("te-uppercase", _req(b"Transfer-Encoding: CHUNKED\r\n", _chunked()), "ok"),
    ("chunk-ext", _req(TE, _chunked(b";name=value")), "ok"),
    ("chunk-ext-quoted", _req(TE, _chunked(b';name="a b"')), "ok"),
    ("chunk-ext-bare-semicolon", _req(TE, _chunked(b";") + SMUG), "refused"),
    ("chunk-ext-bare-lf", _req(TE, _chunked(b";a=b", b"\n") + SMUG), "refused"),
    ("chunk-size-bare-lf", _req(TE, _chunked(b"", b"\n") + SMUG), "refused"),
    ("chunk-data-no-crlf", _req(TE, _chunked(b"", b"\r\n", b"") + SMUG), "refused"),
    ("chunk-size-overflow", _req(TE, b"fffffffffffffffff1\r\n" + BODY + b"\r\n0\r\n\r\n" + SMUG), "refused"),
    ("chunk-size-negative", _req(TE, b"-1\r\n" + BODY + b"\r\n0\r\n\r\n" + SMUG), "refused"),
    ("bare-lf-line", _req(CL, BODY + SMUG, line=LINE[:-2] + b"\n"), "refused"),
    ("bare-lf-header", _req(CL + b"X-A: b\n", BODY + SMUG), "refused"),
    ("bare-cr-header", _req(CL + b"X-A: a\rb\r\n", BODY + SMUG), "refused"),
    ("bare-cr-line-end", _req(CL + b"X-A: a\r\r\n", BODY + SMUG), "refused"),
    ("obs-fold", _req(CL + b"X-A: a\r\n b\r\n", BODY + SMUG), "refused"),
    ("obs-fold-te", _req(b"X-A: a\r\n Transfer-Encoding: chunked\r\n" + CL, BODY + SMUG), "refused"),
    ("name-space", _req(CL + b"X A: b\r\n", BODY + SMUG), "refused"),
    ("name-nul", _req(CL + b"X\x00A: b\r\n", BODY + SMUG), "refused"),
    ("value-nul", _req(CL + b"X-A: a\x00b\r\n", BODY + SMUG), "refused"),
    ("name-empty", _req(CL + b": b\r\n", BODY + SMUG), "refused"),
    ("absolute-form", _req(CL, BODY, line=b"POST http://evil.example/v1/chat/completions HTTP/1.1\r\n"), "ok"),
    ("absolute-form-other-scheme", _req(CL, BODY, line=b"POST a://x/v1/chat/completions HTTP/1.1\r\n"), "ok"),
    ("authority-form", _req(CL, BODY + SMUG, line=b"POST evil.example:443 HTTP/1.1\r\n"), "refused"),
    ("asterisk-form", _req(CL, BODY + SMUG, line=b"OPTIONS * HTTP/1.1\r\n"), "refused"),
    ("connect", b"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\nX-Case: c\r\n\r\n" + SMUG, "refused"),
    ("http-0.9", b"GET /v1/models\r\n\r\n", "refused"),
    ("http-2.0-head", _req(CL, BODY + SMUG, line=b"POST /v1/chat/completions HTTP/2.0\r\n"), "refused"),
    # RFC 9112 §3: a recipient MAY parse the request line on whitespace boundaries (llhttp does)
    ("double-space-line", _req(CL, BODY, line=b"POST  /v1/chat/completions HTTP/1.1\r\n"), "either"),
    ("lowercase-method", _req(CL, BODY + SMUG, line=b"post /v1/chat/completions HTTP/1.1\r\n"), "refused"),
    ("upgrade-h2c", _req(CL + b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n",
                         BODY + SMUG), "refused"),  # llhttp would skip the body: 501
    ("pipelined-behind-malformed", _req(CL, BODY) + _req(CL + b"X A: b\r\n", BODY) + SMUG, "ok"),
]


def _send(url: str, data: bytes, timeout: float = 5.0) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    out = b""
    try:
        s.sendall(data)
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except (ConnectionResetError, BrokenPipeError, socket.timeout):
        pass
    finally:
        s.close()
    return out


class Steady:
    """A well-formed client making chat turns through the proxy, back to back, in a thread."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ok = 0
        self.failed: list[str] = []
        self.latency: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = c.post("/v1/chat/completions", content=BODY, headers={"Content-Type": "application/json"})
                    if r.status_code == 200 and r.json()["choices"]:
                        self.ok += 1
                        self.latency.append((time.perf_counter() - t0) * 1000)
                    else:
                        self.failed.append(f"{r.status_code} {r.text[:100]}")
                except httpx.HTTPError as e:
                    self.failed.append(repr(e))
                time.sleep(0.02)

    def __enter__(self) -> "Steady":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join(30)


def _is_body(raw: bytes) -> bool:
    """The client's BODY as the primary gets it: the same request plus only the proxy's
    documented injection (token ids, logprobs: docs/proxy.md)."""
    try:
        got, sent = json.loads(raw), json.loads(BODY)
    except ValueError:
        return False
    return {k: got[k] for k in sent} == sent and set(got) - set(sent) <= {
        "return_token_ids", "logprobs", "top_logprobs", "return_tokens_as_token_ids", "stream_options"}


def _case_requests(primary: Any) -> list[dict]:
    return [r for r in primary.requests if "X-Case" in r["headers"] or "smuggled" in r["path"]]


def test_smuggling_and_malformed_framing_never_reach_the_primary(fakes, proxy_proc, tmp_path):
    f = fakes()
    primary = f.servers["primary"]
    p = proxy_proc(H.proxy_config(f.url("primary"), tmp_path / "store"))
    outcomes: dict[str, str] = {}
    violations: list[str] = []
    with Steady(p.url) as steady:
        for name, data, expected in CASES:
            before = len(_case_requests(primary))
            answer = _send(p.url, data)
            time.sleep(0.05)
            got = _case_requests(primary)[before:]
            status = answer[9:12].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"
            outcomes[name] = status
            if any("smuggled" in r["path"] or r["headers"].get("X-Case") != "c" for r in got):
                violations.append(f"{name}: a hidden request reached the primary: {[r['path'] for r in got]}")
            elif expected == "refused" and got:
                violations.append(f"{name}: relayed ({status}) although malformed")
            elif expected == "ok" and (len(got) != 1 or not _is_body(got[0]["body"])
                                       or got[0]["path"] != "/v1/chat/completions"):
                violations.append(f"{name}: expected one relayed request with its body, got "
                                  f"{[(r['path'], r['body'][:40]) for r in got]} ({status})")
            elif expected == "either" and (len(got) > 1 or (got and not _is_body(got[0]["body"]))):
                violations.append(f"{name}: {len(got)} requests reached the primary")
            if expected == "refused" and status not in REFUSALS:
                violations.append(f"{name}: answered {status}, not refused by the proxy")
    assert not violations, violations
    assert not steady.failed and steady.ok > 10, (steady.failed[:5], steady.ok)
    for r in _case_requests(primary):  # what did arrive is addressed to the primary itself
        assert r["headers"]["Host"] == f"127.0.0.1:{f.ports['primary']}"
    assert p.alive() and p.stats()["proxy"]["addon_errors"] == 0
    refused = sum(1 for _, _, e in CASES if e == "refused")
    tolerated = sum(1 for _, _, e in CASES if e == "either")
    H.record("edge-smuggling", load=f"one raw connection per case; a well-formed client throughout ({steady.ok} turns)",
             faults="none", bad_inputs=refused + tolerated, requests=len(CASES) + steady.ok, requests_failed=len(steady.failed),
             records_lost=0, statuses=dict(Counter(outcomes.values())), outcomes=outcomes,
             note=f"{len(CASES)} framing cases: {refused} malformed, all refused by the proxy; {tolerated} "
                  "tolerated forms (RFC 9112 allows them) relayed re-framed or refused; 0 hidden requests reached "
                  "the primary; well-formed ones relayed in origin form with their body")


def test_slow_clients_are_cut_while_well_formed_clients_are_served(fakes, proxy_proc, tmp_path):
    f = fakes()
    primary = f.servers["primary"]
    p = proxy_proc(H.proxy_config(f.url("primary"), tmp_path / "store",
                                  proxy={"head_timeout_s": 2.0, "body_timeout_s": 2.0}))
    host, port = p.url.removeprefix("http://").rsplit(":", 1)
    n = 100
    heads = [socket.create_connection((host, int(port)), timeout=10) for _ in range(n)]
    bodies = [socket.create_connection((host, int(port)), timeout=10) for _ in range(n)]
    head = _req(CL, BODY)
    for s in bodies:
        s.sendall(_req(b"Content-Length: %d\r\n" % (len(BODY) * 10), BODY[:5]))
    closed_at: dict[int, float] = {}
    t0 = time.monotonic()
    with Steady(p.url) as steady:
        i = 0
        while time.monotonic() - t0 < 8 and len(closed_at) < 2 * n:
            for k, s in enumerate(heads + bodies):
                if k in closed_at:
                    continue
                try:
                    if k < n:  # slowloris on the head: one byte per round (about 2 bytes a second)
                        s.sendall(head[i:i + 1] if i < len(head) - 4 else b"X")
                    s.setblocking(False)
                    try:
                        data = s.recv(65536)
                        if data == b"" or data.startswith(b"HTTP/1.1 408"):
                            closed_at[k] = time.monotonic() - t0
                    except BlockingIOError:
                        pass
                    finally:
                        s.setblocking(True)
                except (BrokenPipeError, ConnectionResetError):
                    closed_at[k] = time.monotonic() - t0
            i += 1
            time.sleep(0.5)
    for s in heads + bodies:
        s.close()
    assert len(closed_at) == 2 * n, f"{2 * n - len(closed_at)} slow connections still open after 8 s"
    assert max(closed_at.values()) < 2.0 + 2.5  # the deadline, one sweep period and one round
    assert _case_requests(primary) == []  # no slow request was ever relayed
    assert not steady.failed and steady.ok > 20, (steady.failed[:5], steady.ok)
    H.record("edge-slowloris", load=f"{n} heads at ~2 bytes/s + {n} stalled bodies; a well-formed client "
             f"({steady.ok} turns)", faults="none", bad_inputs=2 * n, requests=steady.ok,
             requests_failed=len(steady.failed), records_lost=0,
             note=f"all {2 * n} slow connections cut within {max(closed_at.values()):.1f} s "
                  "(head/body deadlines 2 s); none reached the primary")


def test_ten_thousand_idle_connections_leave_room_for_well_formed_clients(fakes, proxy_proc, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 10_000
    if soft < want + 1000:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, want + 1000), hard))
    n = min(want, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 1000)
    f = fakes()
    p = proxy_proc(H.proxy_config(f.url("primary"), tmp_path / "store"))  # default cap: 10,000
    host, port = p.url.removeprefix("http://").rsplit(":", 1)
    rss0 = p.memory_kb()["rss"]
    idle: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        for _ in range(n):
            idle.append(socket.create_connection((host, int(port)), timeout=30))
        opened_s = time.monotonic() - t0
        time.sleep(1.0)
        rss = p.memory_kb()["rss"]
        with Steady(p.url) as steady:
            time.sleep(3.0)
        st = p.stats()["proxy"]
        assert not steady.failed and steady.ok > 10, (steady.failed[:5], steady.ok)
        assert p.alive()
    finally:
        for s in idle:
            s.close()
    lat = sorted(steady.latency)
    H.record("edge-idle-connections", load=f"{n} idle connections (opened in {opened_s:.1f} s) + a well-formed "
             f"client ({steady.ok} turns)", faults="none", bad_inputs=n, requests=steady.ok,
             requests_failed=len(steady.failed), records_lost=0,
             note=f"proxy RSS {rss0 // 1024}→{rss // 1024} MiB with them open; turn latency p50 "
                  f"{lat[len(lat) // 2]:.1f} ms; {st['connections_evicted']} idle connection(s) evicted at the cap")

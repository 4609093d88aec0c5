"""Bad input, property-based (hypothesis): the ingest frame parser, the ingest endpoint and the
proxy's request path. Every bad input gets a clear 4xx (or is relayed to the primary, which
answers it), nothing crashes, the process keeps serving; the cases tried are counted."""

from __future__ import annotations

import os
import zlib

from tests.reliability import harness as H
import httpx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorverse.capture.frames import FrameError, encode_frame, parse_frames

RNG = np.random.default_rng(1)
ROW = None


def _row() -> bytes:
    global ROW
    if ROW is None:
        from tensorverse.store.codec import encode_row

        ROW = encode_row(RNG.standard_normal(512).astype(np.float32))
    return ROW


def _frames(n: int, run: str = "run-a", start: int = 1, origin: int = 9) -> bytes:
    return b"".join(encode_frame(run, p, _row(), seq=start + p, origin=origin) for p in range(n))


@st.composite
def frame_bodies(draw: st.DrawFn) -> bytes:
    """Valid batches, then broken ones: truncated, bit-flipped, spliced, bad lengths, random."""
    kind = draw(st.sampled_from(["valid", "truncate", "flip", "splice", "random", "lengths", "badid", "empty"]))
    n = draw(st.integers(1, 3))
    good = _frames(n, run=draw(st.sampled_from(["run-a", "run-b", "x" * 200])), start=draw(st.integers(1, 10**6)))
    if kind == "valid":
        return good
    if kind == "truncate":
        return good[: draw(st.integers(0, len(good) - 1))]
    if kind == "flip":
        i = draw(st.integers(0, len(good) - 1))
        return good[:i] + bytes([good[i] ^ draw(st.integers(1, 255))]) + good[i + 1:]
    if kind == "splice":
        return good + draw(st.binary(min_size=1, max_size=64))
    if kind == "lengths":  # header fields at their extremes, crc made right so only the field is wrong
        field = draw(st.sampled_from([(6, "<H"), (28, "<I"), (4, "<B"), (5, "<B")]))
        import struct

        value = draw(st.sampled_from([0, 1, 2**8 - 1] if field[1] == "<B" else [0, 2**16 - 1, 2**32 - 1]))
        value = min(value, 2 ** (8 * struct.calcsize(field[1])) - 1)
        b = bytearray(good[: len(good) // n])
        struct.pack_into(field[1], b, field[0], value)
        b[-4:] = zlib.crc32(bytes(b[:-4])).to_bytes(4, "little")
        return bytes(b)
    if kind == "badid":  # a capture id that is valid UTF-8 but no valid record id, or not UTF-8
        cid = draw(st.sampled_from(["\x00", "a/b\x7f", "é" * 300, " ", "\n", "../../etc"]))
        try:
            return encode_frame(cid, 0, _row(), seq=draw(st.integers(1, 10**9)), origin=3)
        except ValueError:
            return b"TVFR" + draw(st.binary(max_size=40))
    if kind == "empty":
        return b""
    return draw(st.binary(max_size=512))


COUNTS: dict[str, int] = {}


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(frame_bodies())
def test_frame_parser_never_crashes(body: bytes) -> None:
    COUNTS["parser"] = COUNTS.get("parser", 0) + 1
    try:
        frames = parse_frames(body)
    except FrameError as e:
        assert str(e)  # a message that says what is wrong
        return
    # what parses re-encodes to exactly the same bytes: nothing was guessed or skipped
    assert b"".join(encode_frame(f.capture_id, f.position, f.blob, seq=f.seq, origin=f.origin) for f in frames) == body


def test_frame_parser_counted() -> None:
    """Record the parser fuzzing figure (runs after the property above)."""
    assert COUNTS.get("parser", 0) >= 1000
    H.record("fuzz-frame-parser", load="in-process", faults="none", bad_inputs=COUNTS["parser"], requests=0,
             requests_failed=0, records_lost=0)


TOKENS = {
    "right": f"Bearer {H.ADMIN_TOKEN}",
    "wrong": f"Bearer {H.ADMIN_TOKEN[:-1]}x",
    "prefix": f"Bearer {H.ADMIN_TOKEN[:-4]}",
    "scheme": f"Basic {H.ADMIN_TOKEN}",
    "empty": "",
    "huge": "Bearer " + "A" * 6000,
    "unicode": "Bearer ŧøĸēn",
}


def test_ingest_fuzz_over_http(fakes, proxy_proc, tmp_path):
    f = fakes()
    cfg = H.proxy_config(f.url("primary"), tmp_path / "store", admin={"max_ingest_bytes": 1 << 20})
    p = proxy_proc(cfg)
    client = httpx.Client(base_url=p.admin_url, timeout=10)
    seen: dict[int, int] = {}
    rows_ok = 0

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=frame_bodies(), token=st.sampled_from(sorted(TOKENS)))
    def case(body: bytes, token: str) -> None:
        nonlocal rows_ok
        headers = {"Content-Type": "application/vnd.tensorverse.frames"}
        if TOKENS[token]:
            headers["Authorization"] = TOKENS[token].encode()  # type: ignore[assignment]  # raw UTF-8 too
        try:
            r = client.post("/ingest", content=body, headers=headers)
        except httpx.RemoteProtocolError:  # a header the server refuses to read: the connection goes
            seen[0] = seen.get(0, 0) + 1
            return
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (r.status_code, r.text, body[:80])
        if token != "right":
            assert r.status_code in (400, 401, 431), r.status_code
            return
        try:
            parse_frames(body)
            valid = True
        except FrameError:
            valid = False
        if r.status_code == 200:
            assert valid
            rows_ok += r.json()["rows"]
        else:
            assert r.status_code == 400 and r.json()["error"], r.text

    case()
    # oversized body, and a replayed batch
    big = client.post("/ingest", content=os.urandom((1 << 20) + 10), headers={"Authorization": TOKENS["right"]})
    assert big.status_code == 413
    batch = _frames(3, run="replayed", start=5_000_000_000)
    first = client.post("/ingest", content=batch, headers={"Authorization": TOKENS["right"]}).json()
    again = client.post("/ingest", content=batch, headers={"Authorization": TOKENS["right"]}).json()
    assert first["rows"] == 3 and again == {"rows": 0, "duplicates": 3, "runs": 0}
    assert client.get("/healthz").text == "ok" and p.alive()
    stats = p.stats()["ingest"]
    assert stats["rows"] == rows_ok + 3
    n = sum(seen.values()) + 3
    client.close()
    H.record("fuzz-ingest-http", load="POST /ingest, one keep-alive client", faults="none", bad_inputs=n,
             requests=n, requests_failed=0, records_lost=0, statuses=seen, ingest=stats)


LLM_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/tokenize", "/v1/models"]


@st.composite
def requests_(draw: st.DrawFn) -> tuple[str, str, dict[str, str], bytes]:
    path = draw(st.one_of(st.sampled_from(LLM_PATHS),
                          # not "//...": httpx would read it as a network-path reference (a host), not a path
                          st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="#?%"),
                                  max_size=40).map(lambda t: "/" + t.lstrip("/"))))
    kind = draw(st.sampled_from(["json", "types", "huge", "deep", "utf8", "oversized", "header", "garbage"]))
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {H.CLIENT_KEY}"}
    body: bytes
    if kind == "json":  # malformed JSON
        body = draw(st.sampled_from([b"{", b'{"model": }', b"[1,2", b'{"messages": [{"role": "user", "content": "x"}]',
                                     b"nul", b'{"a":1}{"b":2}']))
    elif kind == "types":  # valid JSON of the wrong shape
        v = draw(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
                              | st.text(max_size=5),
                              lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                              max_leaves=10))
        field = draw(st.sampled_from(["messages", "model", "stream", "max_tokens", "tools", "logprobs",
                                      "top_logprobs", "stream_options", "prompt", None]))
        obj = v if field is None else {"model": "fake", "messages": [{"role": "user", "content": "x"}], field: v}
        import orjson

        body = orjson.dumps(obj)
    elif kind == "huge":
        body = draw(st.sampled_from([b'{"model":"fake","max_tokens":1' + b"0" * 400 + b"}",
                                     b'{"model":"fake","temperature":1e999,"messages":[]}',
                                     b'{"model":"fake","max_tokens":-99999999999999999999,"messages":[]}',
                                     b'{"model":"fake","n":18446744073709551616,"messages":[]}']))
    elif kind == "deep":
        d = draw(st.integers(100, 20000))
        body = b'{"model":"fake","messages":' + b"[" * d + b"]" * d + b"}"
    elif kind == "utf8":
        body = b'{"model":"fake","messages":[{"role":"user","content":"' + draw(
            st.sampled_from([b"\xff\xfe", b"\xc3", b"\xed\xa0\x80", b"\x00"])) + b'"}]}'
    elif kind == "oversized":
        body = b'{"model":"fake","messages":[{"role":"user","content":"' + b"a" * ((1 << 20) + 100) + b'"}]}'
    elif kind == "header":
        headers["X-Big"] = "h" * draw(st.sampled_from([9000, 70000]))
        body = b'{"model":"fake","messages":[]}'
    else:
        body = draw(st.binary(max_size=300))
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT"]))
    return method, path, headers, body


def test_request_path_fuzz(fakes, proxy_proc, chat, tmp_path):
    f = fakes()
    cfg = H.proxy_config(f.url("primary"), tmp_path / "store", proxy={"max_body_bytes": 1 << 20})
    p = proxy_proc(cfg)
    client = httpx.Client(base_url=p.url, timeout=30)
    seen: dict[int, int] = {}
    inject_depth = 0  # bodies nested 255..1023 deep (orjson reads them, cannot write them back)

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests_())
    def case(req: tuple[str, str, dict[str, str], bytes]) -> None:
        nonlocal inject_depth
        method, path, headers, body = req
        depth = body.count(b"[") if body.startswith(b'{"model":"fake","messages":[[') else 0
        inject_depth += method == "POST" and path in ("/v1/chat/completions", "/v1/completions", "/v1/messages") \
            and 255 <= depth < 1024
        try:
            r = client.request(method, path, content=body, headers=headers)
        except httpx.RemoteProtocolError:  # e.g. a header over the server's limit: refused, connection closed
            seen[0] = seen.get(0, 0) + 1
            return
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (method, path, r.status_code, r.text[:300], body[:100])
        if len(body) > 1 << 20:
            assert r.status_code == 413

    case()
    assert p.alive() and chat(p.url)["ok"]  # keeps serving
    st_ = p.stats()
    # no hook choked on anything, bodies nested 255..1023 deep included (orjson writes only 254
    # levels: tensorverse.jsonbytes falls back to the standard library)
    assert st_["proxy"]["addon_errors"] == 0, (st_["proxy"], inject_depth)
    assert st_["recorder"]["store_errors"] == 0, st_["recorder"]  # every turn it saw is recorded
    n = sum(seen.values())
    client.close()
    H.record("fuzz-request-path", load="one keep-alive client", faults="none", bad_inputs=n, requests=n + 1,
             requests_failed=0, records_lost=0, statuses=seen, proxy=st_["proxy"],
             unparsed_requests=st_["recorder"]["unparsed_requests"],
             addon_errors_from_deep_bodies=st_["proxy"]["addon_errors"], deep_bodies_255_1023=inject_depth)

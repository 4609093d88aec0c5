import socket
import time

import numpy as np
import pytest

from tensorverse.capture.frames import CONTENT_TYPE, Frame
from tensorverse.capture.sink import HttpSink, MemorySink, SinkError, StoreSink, sink_from_env

from tests.capture._receiver import Recorder


def _frame(i, cid="run-a"):
    return Frame(cid, i, i + 1, 99, f"blob-{i}".encode())


def test_http_sink_posts_batches_with_token():
    rec = Recorder()
    try:
        sink = HttpSink(rec.url, "s3cret", timeout=2)
        for i in range(5):
            sink.put(_frame(i))
        assert sink.pending() == 5
        assert sink.flush() == 5
        sink.put(_frame(5, "run-b"))
        assert sink.flush() == 1
        assert sink.flush() == 0  # nothing buffered
        assert [f.position for f in rec.frames()] == [0, 1, 2, 3, 4, 5]
        assert rec.frames()[5].capture_id == "run-b"
        assert len(rec.bodies) == 2
        h = rec.headers[0]
        assert h["Content-Type"] == CONTENT_TYPE
        assert h["X-Tensorverse-Frames"] == "5"
        sink.close()
    finally:
        rec.stop()


def test_http_sink_counts_rejections_and_backs_off():
    rec = Recorder(token="other")
    try:
        sink = HttpSink(rec.url, "s3cret", timeout=2, retry_min_s=0.05, retry_max_s=0.2)
        sink.put(_frame(0))
        with pytest.raises(SinkError, match="HTTP 401") as e:
            sink.flush()
        assert e.value.dropped == 1
        sink.put(_frame(1))
        with pytest.raises(SinkError, match="unavailable"):  # backing off: not even tried
            sink.flush()
        assert len(rec.headers) == 1
        time.sleep(0.06)
        rec.token = "s3cret"
        sink.put(_frame(2))
        assert sink.flush() == 1
        assert [f.position for f in rec.frames()] == [2]
    finally:
        rec.stop()


def test_http_sink_survives_the_recorder_going_away_and_coming_back():
    rec = Recorder()
    port = rec.port
    sink = HttpSink(rec.url, "s3cret", timeout=2, retry_min_s=0.05, retry_max_s=0.1)
    sink.put(_frame(0))
    assert sink.flush() == 1
    rec.stop()
    # Down: the keep-alive connection is dead and nobody listens.
    sink.put(_frame(1))
    with pytest.raises(SinkError) as e:
        sink.flush()
    assert e.value.dropped == 1
    time.sleep(0.12)
    rec2 = Recorder(port=port)
    try:
        sink.put(_frame(2))
        assert sink.flush() == 1
        assert [f.position for f in rec2.frames()] == [2]
        # Restart again without a failure in between: the stale keep-alive connection is
        # replaced transparently (one reconnect), nothing is dropped.
        rec2.stop()
        rec3 = Recorder(port=port)
        try:
            sink.put(_frame(3))
            assert sink.flush() == 1
            assert [f.position for f in rec3.frames()] == [3]
        finally:
            rec3.stop()
    finally:
        try:
            rec2.stop()
        except Exception:  # noqa: BLE001 - best effort
            pass


def test_http_sink_timeout_is_short():
    # A server that accepts and never answers.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        sink = HttpSink(f"http://127.0.0.1:{srv.getsockname()[1]}/x", None, timeout=0.3)
        sink.put(_frame(0))
        t0 = time.monotonic()
        with pytest.raises(SinkError):
            sink.flush()
        assert time.monotonic() - t0 < 3
    finally:
        srv.close()


def test_tap_reports_its_counters_with_each_http_batch():
    import json

    import torch

    from tensorverse.capture.sink import STATS_HEADER
    from tensorverse.capture.tap import Tap
    from tensorverse.store.codec import decode_row

    rec = Recorder()
    try:
        tap = Tap(HttpSink(rec.url, "s3cret", timeout=2), max_rows=1)
        logits = torch.randn(3, 50)
        assert tap.capture(logits, [(0, "run-h", 0), (1, "run-h", 1)]) == 1  # 1 buffer: 1 dropped
        assert tap.flush(10)
        (f,) = rec.frames()
        assert (f.capture_id, f.position, f.origin) == ("run-h", 0, tap.origin)
        assert np.array_equal(decode_row(f.blob), logits[0].numpy())
        sent = json.loads(rec.headers[0][STATS_HEADER])
        assert sent["origin"] == tap.origin and sent["rows_dropped"] == 1
        assert sent["dropped_no_buffer"] == 1 and sent["rows_captured"] == 1
        tap.close()
    finally:
        rec.stop()


def test_batch_thresholds():
    clock = [0.0]
    sink = MemorySink(max_batch_frames=3, linger_s=1.0, clock=lambda: clock[0])
    assert not sink.should_flush()
    sink.put(_frame(0))
    assert not sink.should_flush()
    clock[0] = 1.5
    assert sink.should_flush()  # lingered long enough
    sink.flush()
    for i in range(3):
        sink.put(_frame(i))
    assert sink.should_flush()  # batch full


def test_store_sink_writes_rows(tmp_path):
    from tensorverse.store import Store
    from tensorverse.store.codec import decode_row, encode_row

    rows = {p: np.random.default_rng(p).standard_normal(64).astype(np.float32) for p in range(3)}
    sink = StoreSink(tmp_path / "st")
    for p, r in rows.items():
        sink.put(Frame("run-z", p, p + 1, 1, encode_row(r)))
    sink.put(Frame("run-y", 7, 9, 1, encode_row(rows[0])))
    assert sink.flush() == 4
    sink.close()
    with Store.open(tmp_path / "st") as store:
        got = store.read_rows("run-z")
        assert [p for p, _ in got] == [0, 1, 2]
        for p, blob in got:
            assert np.array_equal(decode_row(blob), rows[p])
        assert [p for p, _ in store.read_rows("run-y")] == [7]


def test_store_sink_given_an_open_store_writes_into_it_and_leaves_it_open(tmp_path):
    from tensorverse.store import Store
    from tensorverse.store.codec import decode_row, encode_row

    row = np.arange(64, dtype=np.float32)
    with Store.open(tmp_path / "st", durable=False) as store:
        sink = StoreSink(store)
        assert sink.path == str(tmp_path / "st")
        sink.put(Frame("run-b", 3, 1, 1, encode_row(row)))
        assert sink.flush() == 1
        sink.close()  # the caller's store: still open, and the next flush writes into it again
        sink.put(Frame("run-b", 4, 2, 1, encode_row(row)))
        assert sink.flush() == 1
        got = store.read_rows("run-b")
        assert [p for p, _ in got] == [3, 4]
        assert np.array_equal(decode_row(got[0][1]), row)


def test_store_sink_failure_is_a_sink_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    sink = StoreSink(blocker / "store")
    sink.put(_frame(0))
    with pytest.raises(SinkError) as e:
        sink.flush()
    assert e.value.dropped == 1


def test_sink_from_env(tmp_path):
    assert sink_from_env({}) is None
    s = sink_from_env({"TENSORVERSE_CAPTURE_SINK": "http://127.0.0.1:9/ingest",
                       "TENSORVERSE_CAPTURE_TOKEN": "tok-XYZ", "TENSORVERSE_CAPTURE_TIMEOUT": "1.5"})
    assert isinstance(s, HttpSink) and s.timeout == 1.5 and s._token == "tok-XYZ"
    assert "tok-XYZ" not in s.name
    s = sink_from_env({"TENSORVERSE_CAPTURE_SINK": f"dir:{tmp_path}"})
    assert isinstance(s, StoreSink) and s.path == str(tmp_path)
    with pytest.raises(ValueError):
        sink_from_env({"TENSORVERSE_CAPTURE_SINK": "ftp://x"})
    with pytest.raises(ValueError):
        sink_from_env({"TENSORVERSE_CAPTURE_SINK": "dir:"})


def test_batches_linger_200_ms_unless_the_environment_says_otherwise(tmp_path):
    url = {"TENSORVERSE_CAPTURE_SINK": "http://127.0.0.1:9/ingest"}
    assert sink_from_env(url).linger_s == 0.2
    assert sink_from_env({**url, "TENSORVERSE_CAPTURE_LINGER_MS": ""}).linger_s == 0.2
    assert sink_from_env({**url, "TENSORVERSE_CAPTURE_LINGER_MS": "50"}).linger_s == 0.05
    assert sink_from_env({**url, "TENSORVERSE_CAPTURE_LINGER_MS": "0"}).linger_s == 0.0
    store_sink = sink_from_env({"TENSORVERSE_CAPTURE_SINK": f"dir:{tmp_path}",
                                "TENSORVERSE_CAPTURE_LINGER_MS": "10"})
    assert store_sink.linger_s == 0.01
    for bad in ("fast", "-1", "nan", "inf"):
        with pytest.raises(ValueError):
            sink_from_env({**url, "TENSORVERSE_CAPTURE_LINGER_MS": bad})

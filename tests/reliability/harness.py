"""Harness of the reliability suite: fake backends, the proxy as its own process, and figures.

- `Fakes`: the fake primary (`tensorverse.testing.fake_upstream.FakeUpstream`, answering with small token ids
  and a `/tokenize` so the shadow runner can fingerprint it) and fake shadows (the shadow tests'
  `FakeVLLM`, plus the faults of `FaultyVLLM`), in a thread of this process (`Fakes.inproc`) or in
  their own process (`Fakes.spawn`, for the soak).
- `ProxyProc` (`tensorverse.testing.proxy_process`): ``python -m tensorverse proxy --config FILE``
  exactly as a user starts it, on free loopback ports; `proxy_config` here plants the credentials
  that no artifact may show.
- `record(scenario, **figures)`: every test writes its figures as JSON under `RESULTS_DIR`
  (``out/reliability/``, or ``$TENSORVERSE_RELIABILITY_RESULTS``); ``benchmarks/reliability.py
  --no-soak`` renders ``benchmarks/RELIABILITY.md`` from them.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]

from tensorverse.testing.fake_vllm import FakeVLLM  # noqa: E402

from tensorverse.testing.fake_upstream import FakeUpstream, _reset  # noqa: E402
from tensorverse.proxy.loop import LoopThread  # noqa: E402
from tensorverse.testing.proxy_process import ProxyProc, proxy_config as _proxy_config  # noqa: E402,F401 - H.ProxyProc

RESULTS_DIR = Path(os.environ.get("TENSORVERSE_RELIABILITY_RESULTS", ROOT / "out" / "reliability"))
PY = sys.executable

#: the fake primary answers with ids the fake shadows' 64-token vocabulary knows
TOKEN_BASE = 10
PROMPT_IDS = [60, 20, 21, 22, 61]

#: planted secrets: none of them may appear in any artifact (store, logs, exports, viewer)
CLIENT_KEY = "sk-planted-client-7f3a9c1e5b2d4f60"
COOKIE = "session=planted-cookie-0b8e2c4d6a1f3e57"
PRIMARY_KEY = "sk-planted-primary-91d2e4f6a8b0c3d5"
SHADOW_KEY = "sk-planted-shadow-4c6e8a0b2d4f6a8c"
ADMIN_TOKEN = "planted-admin-token-5e7a9c1b3d5f7a9b"
SECRETS = (CLIENT_KEY, COOKIE.split("=", 1)[1], PRIMARY_KEY, SHADOW_KEY, ADMIN_TOKEN)

MALFORMED_JSON = b'data: {"choices": [\n\n\xff\xfe not json'


def record(scenario: str, **figures: Any) -> Path:
    """Write one scenario's figures (what ran, what was injected, what failed or was lost)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"{scenario}.json"
    data = {"scenario": scenario, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **figures}
    out.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    return out


# -- fakes -----------------------------------------------------------------------------------------
class FaultyVLLM(FakeVLLM):
    """`FakeVLLM` with a fault on ``/v1/completions`` (the shadow runs): ``hang`` (never answers),
    ``reset`` (TCP RST), ``malformed`` (an SSE-looking, non-UTF-8 body labelled JSON) or
    ``tokenizer`` (a different tokenizer: refused by the same-dictionary check)."""

    def __init__(self, fault: str | None = None, **kw: Any) -> None:
        if fault == "tokenizer":
            kw["tokenizer"] = "b"
        super().__init__(**kw)
        self.fault = fault
        self.faults_injected = 0
        self.headers_seen: list[dict[str, str]] = []  # every request's headers (credential checks)
        self._closing = asyncio.Event()

    async def _gate(self, request: web.Request, path: str) -> Any:
        self.headers_seen.append(dict(request.headers))
        return await super()._gate(request, path)

    async def close(self) -> None:
        self._closing.set()  # hanging handlers return, so the server closes at once
        await super().close()

    async def h_completions(self, request: web.Request) -> web.Response:
        if self.fault in ("hang", "reset", "malformed"):
            self.auth.append(request.headers.get("Authorization"))
            await request.read()
            self.faults_injected += 1
            if self.fault == "hang":
                try:
                    await asyncio.wait_for(self._closing.wait(), 3600)
                except asyncio.TimeoutError:
                    pass
            if self.fault == "reset":
                _reset(request)
                return web.Response()
            return web.Response(body=MALFORMED_JSON, content_type="application/json")
        return await super().h_completions(request)


async def start_fakes(shadows: dict[str, str | None], *, discard: bool = False) -> dict[str, Any]:
    """The primary and one fake per shadow name (value: its fault or None). ``discard``: keep no
    request logs (long runs)."""
    primary = await FakeUpstream(token_base=TOKEN_BASE, prompt_ids=PROMPT_IDS, tokenizer=FakeVLLM(plugin=False)).start()
    out: dict[str, Any] = {"primary": primary}
    for name, fault in shadows.items():
        out[name] = await FaultyVLLM(fault, plugin=False).start()
    if discard:
        for s in out.values():
            s.requests = _Discard()
            if hasattr(s, "auth"):
                s.auth = _Discard()
    return out


class _Discard(list):
    """A request log that keeps nothing (long runs)."""

    def append(self, _: Any) -> None:  # type: ignore[override]
        return None


class Fakes:
    """Fake primary + shadows. ``url(name)``: the root URL (``primary``) or ``.../v1`` (shadows)."""

    def __init__(self, shadows: dict[str, str | None] | None = None) -> None:
        self.shadows = dict(shadows or {})
        self.servers: dict[str, Any] = {}
        self.ports: dict[str, int] = {}
        self._lt: LoopThread | None = None
        self._proc: subprocess.Popen | None = None

    @classmethod
    def inproc(cls, shadows: dict[str, str | None] | None = None) -> "Fakes":
        f = cls(shadows)
        f._lt = LoopThread("reliability-loop", asyncio.new_event_loop)
        f.servers = f._lt.run(start_fakes(f.shadows))
        f.ports = {k: v.port for k, v in f.servers.items()}
        return f

    @classmethod
    def spawn(cls, shadows: dict[str, str | None] | None = None, log: Path | None = None) -> "Fakes":
        """In their own process (request logs discarded): the soak's load is not theirs to carry."""
        f = cls(shadows)
        f._proc = subprocess.Popen([PY, "-m", "tests.reliability._fakes", json.dumps(f.shadows)], stdout=subprocess.PIPE,
                                   stderr=open(log, "wb") if log else subprocess.DEVNULL, cwd=ROOT)
        assert f._proc.stdout is not None
        line = f._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fake backends did not start (rc {f._proc.poll()})")
        f.ports = json.loads(line)
        return f

    def url(self, name: str) -> str:
        base = f"http://127.0.0.1:{self.ports[name]}"
        return base if name == "primary" else base + "/v1"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def close(self) -> None:
        if self._lt is not None:
            for s in self.servers.values():
                try:
                    self._lt.run(s.close(), 10)
                except Exception:  # noqa: BLE001 - a hanging handler may still be cancelled
                    pass
            self._lt.stop()
            self._lt = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
            self._proc = None


# -- the proxy process -----------------------------------------------------------------------------
def proxy_config(primary_url: str, store: Path, *, shadows: dict[str, str] | None = None, port: int | None = None,
                 admin_port: int | None = None, **sections: Any) -> dict[str, Any]:
    """`tensorverse.testing.proxy_process.proxy_config` with the planted credentials."""
    return _proxy_config(primary_url, store, admin_token=ADMIN_TOKEN, shadows=shadows, port=port,
                         admin_port=admin_port, primary_key=PRIMARY_KEY, shadow_key=SHADOW_KEY, **sections)


def read_store(path: Path) -> dict[str, Any]:
    """Open a store read-only and read every record: sessions, turns, runs as their typed records
    (raises on corruption or a field of the wrong type), and ``stored``: each session, turn and
    run as the dict stored (``Store.records``), by id, for the checks a typed record cannot make
    (a field present or absent as written, a field no record type declares)."""
    from tensorverse.store import Store

    st = Store.open(path, readonly=True)
    try:
        sessions = list(st.iter_sessions())
        turns = [t for s in sessions for t in st.iter_turns(s.id)]
        runs = {t.id: list(st.iter_runs(t.id)) for t in turns}
        stored = {kind: {r["id"]: r for r in st.records(kind)} for kind in ("session", "turn", "run")}
        return {"sessions": sessions, "turns": turns, "runs": runs, "stored": stored, "stats": st.stats()}
    finally:
        st.close()


def to_json(obj: Any, **kw: Any) -> str:
    """``json.dumps`` of what may hold typed store records (as their fields), anything else not
    JSON as its ``str``."""
    import msgspec

    return json.dumps(obj, default=lambda o: msgspec.to_builtins(o) if isinstance(o, msgspec.Struct) else str(o),
                      **kw)


def uptime_load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "gpu": "none", "uptime": uptime_load()}

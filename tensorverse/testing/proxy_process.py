"""The real proxy in its own process, as a user starts it (``python -m tensorverse proxy --config
FILE``), for tests and benchmarks that measure it from outside: the reliability suite, the
production-load benchmark.

``proxy_config`` builds a configuration (what the TOML/YAML file would hold) on free loopback
ports; ``ProxyProc`` writes it, starts the proxy, waits until it listens, and reads its RSS,
``/stats``, ``/metrics`` and log; it stops it with SIGTERM or SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tensorverse.ports import free_port

__all__ = ["ProxyProc", "proxy_config"]

PY = sys.executable


def proxy_config(primary_url: str, store: Path, *, admin_token: str, shadows: dict[str, str] | None = None,
                 port: int | None = None, admin_port: int | None = None, primary_key: str | None = None,
                 shadow_key: str | None = None, **sections: Any) -> dict[str, Any]:
    """A configuration on free loopback ports (``port``, ``admin_port`` when given); ``shadows``:
    name -> URL, each a top-k capturing shadow with a 2 s timeout and 4 requests in flight;
    ``sections``: more sections, merged into those built here (a dict) or replacing them."""
    cfg: dict[str, Any] = {
        "proxy": {"listen": f"127.0.0.1:{port or free_port()}"},
        "admin": {"listen": f"127.0.0.1:{admin_port or free_port()}", "token": admin_token},
        "primary": {"url": primary_url, **({"api_key": primary_key} if primary_key else {})},
        "store": {"path": str(store)},
        "shadows": [{"name": n, "url": u, **({"api_key": shadow_key} if shadow_key else {}), "capture": "topk",
                     "timeout_s": 2, "concurrency": 4} for n, u in (shadows or {}).items()],
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


class ProxyProc:
    """``tensorverse proxy --config FILE`` in its own process (started by `start`)."""

    def __init__(self, workdir: Path, config: dict[str, Any], *, env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.config_path = self.workdir / "proxy.yaml"  # JSON is YAML
        self.config_path.write_text(json.dumps(config, indent=1))
        self.log_path = self.workdir / f"proxy-{len(list(self.workdir.glob('proxy-*.log')))}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.url = "http://" + config["proxy"]["listen"]
        self.admin_url = "http://" + config["admin"]["listen"]

    def start(self, timeout: float = 30.0) -> "ProxyProc":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([PY, "-m", "tensorverse", "proxy", "--config", str(self.config_path),
                                      "--log-level", "INFO"], stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=self.workdir, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.admin_url + "/healthz", timeout=1).status_code == 200 and \
                        "listening" in self.log():
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"proxy did not start in {timeout} s:\n{self.log()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_kb(self) -> int:
        return self.memory_kb()["rss"]

    def memory_kb(self) -> dict[str, int]:
        """Resident memory (KiB) and its parts: ``anon`` (the heap: what a leak grows), ``file``
        (file pages mapped in: the store's LMDB map, which the kernel can drop), ``shmem``."""
        fields = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
        out = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            name = fields.get(line.split(":", 1)[0] + ":")
            if name:
                out[name] = int(line.split()[1])
        if "rss" not in out:
            raise RuntimeError("no VmRSS")
        return out

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.admin_url + "/stats", timeout=10).json()

    def metrics(self) -> str:
        return httpx.get(self.admin_url + "/metrics", timeout=10).text

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def lost_flows(self) -> int:
        """Flows the relay lost: a write to a closed client that raised out of the handler, so
        the turn got no ``response_done``/``error`` hook (the bug fixed in core.py where a client
        closed right after ``[DONE]``; the tests now expect 0). Counted from the log."""
        return self.log().count("Cannot write to closing transport")

    def wait_shadows_idle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Until the shadow queue is empty and every queued turn is done; the final stats."""
        deadline = time.monotonic() + timeout
        st = self.stats()
        while time.monotonic() < deadline:
            sh = st.get("shadow", {})
            if sh.get("queue_depth", 0) == 0 and sh.get("turns_done", 0) >= sh.get("queued", 0) \
                    and st.get("background_tasks", 0) == 0:
                return st
            time.sleep(0.2)
            st = self.stats()
        raise AssertionError(f"shadows still busy after {timeout} s: {st.get('shadow')}")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; the exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill9(self) -> int:
        assert self.proc is not None
        self.proc.kill()
        rc = self.proc.wait(10)
        self._log.close()
        return rc

    def stop(self) -> None:
        """Teardown: whatever state it is in, it is gone afterwards."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if getattr(self, "_log", None) is not None and not self._log.closed:
            self._log.close()

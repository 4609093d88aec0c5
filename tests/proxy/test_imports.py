"""What the proxy process loads: it sits in front of production, so its start-up memory matters."""

from __future__ import annotations

import subprocess
import sys


def test_the_proxy_does_not_load_scipy():
    # scipy (the exact tool-call assignment, the noise floor's tests) doubled the proxy's resident
    # memory at start (64 -> 128 MiB); the analysis functions import it where they use it
    code = "import sys, tensorverse.proxy.server, tensorverse.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'scipy'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"

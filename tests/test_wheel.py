"""The package as a user installs it: a wheel built from the tree, installed into a fresh virtual
environment outside the tree, run from a directory that is not the checkout.

The fresh environment takes the dependencies from the test environment's site-packages through a
``.pth`` line (nothing is downloaded); ``.pth`` files inside that directory are not processed, so
the editable install of the checkout stays invisible and ``tensorverse`` can only come from the
wheel (asserted). What it catches: files missing from the wheel (the viewer's static assets, the
replay schemas), modules that import from ``tests/`` or need the source tree on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest
from tensorverse.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv", "out", "build", "dist", "*.egg-info", "__pycache__",
                              ".pytest_cache", ".hypothesis", "tests", "benchmarks")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding only the wheel; returns its bin directory."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)  # build from a copy: setuptools writes build/ in the tree
    dist = base / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(src)], check=True, timeout=300)
    (wheel,) = dist.glob("tensorverse-*.whl")
    env_dir = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=300)
    return env_dir / "bin"


def run(bindir: Path, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_installed_package_comes_from_the_wheel_and_imports_everything(installed, tmp_path):
    code = ("import importlib, pkgutil, tensorverse; print(tensorverse.__file__);"
            "mods = [m.name for m in pkgutil.walk_packages(tensorverse.__path__, 'tensorverse.')"
            " if not m.name.endswith('__main__')];"
            "[importlib.import_module(m) for m in mods]; print(len(mods))")
    r = run(installed, str(installed / "python"), "-c", code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    where, count = r.stdout.split()
    assert str(installed.parent) in where and str(ROOT) not in where, where
    assert int(count) > 50
    for res in ("viz/static/index.html", "viz/static/app.js", "viz/static/app.css",
                "replay/schema/case.schema.json", "replay/schema/corpus.schema.json",
                "demo/data/netops-demo.json", "demo/data/netops-demo.safetensors.zst",
                "rig/corpora/demo-netops-v1/corpus.json", "rig/corpora/demo-netops-v1/cases/demo-00-show-route.json",
                "bundle/schema/manifest-1.schema.json", "hypercube/static/hypercube.js",
                "hypercube/static/hypercube.css"):
        assert (Path(where).parent / res).is_file(), f"{res} missing from the wheel"
    assert "tests" not in {p.name for p in Path(where).parent.parent.iterdir()}
    # the shipped demo model arrives whole (its checksum, then its vocabulary read back)
    r = run(installed, str(installed / "python"), "-c",
            "from tensorverse.demo import shipped; c, v = shipped.load_compact(); print(len(v), len(c))", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[0] == str(json.loads((ROOT / "tensorverse/demo/data/netops-demo.json").read_text())["compact_vocab"])


def test_cli_runs_from_the_wheel_outside_the_tree(installed, tmp_path):
    for args in (["--help"], ["demo", "--help"], ["matrix", "--help"], ["replay", "--help"]):
        r = run(installed, str(installed / "tensorverse"), *args, cwd=tmp_path)
        assert r.returncode == 0, (args, r.stderr[-2000:])
        assert "usage: tensorverse" in r.stdout
    rng = np.random.default_rng(7)
    ref = rng.standard_normal((6, 50)).astype(np.float32)
    cand = ref.copy()
    cand[2, 9] = ref[2].max() + 1.0  # one flip at position 2
    tokens = [int(i) for i in ref.argmax(axis=1)]
    np.save(tmp_path / "a.npy", ref)
    np.save(tmp_path / "b.npy", cand)
    (tmp_path / "t.json").write_text(json.dumps(tokens))
    r = run(installed, str(installed / "tensorverse"), "analyze", "--ref", "a.npy", "--cand", "b.npy",
            "--tokens", "t.json", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["flips"] == [2] and out["n"] == 6


def test_viewer_serves_its_app_from_the_wheel(installed, tmp_path):
    port = free_port()
    made = run(installed, str(installed / "python"), "-c",
               "import sys; from tensorverse.store import Store; Store.open(sys.argv[1]).close()",
               str(tmp_path / "store"), cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen([str(installed / "tensorverse"), "view", "--store", str(tmp_path / "store"),
                             "--port", str(port)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/static/app.js", timeout=5) as resp:
                    body = resp.read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"viewer did not come up: {proc.stdout.read() if proc.poll() is not None else ''}") from None
                time.sleep(0.3)
        assert len(body) > 1000
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as resp:
            assert b"<html" in resp.read().lower()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_wheel_metadata_names_the_console_script_and_the_vllm_plugin(installed):
    (wheel,) = installed.parent.parent.glob("dist/tensorverse-*.whl")
    with zipfile.ZipFile(wheel) as z:
        eps = next(n for n in z.namelist() if n.endswith("entry_points.txt"))
        text = z.read(eps).decode()
    assert "tensorverse = tensorverse.cli:main" in text
    assert "tensorverse.capture.plugin:CaptureLogitsProcessor" in text

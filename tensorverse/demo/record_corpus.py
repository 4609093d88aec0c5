"""Record a rig suite's corpus: a model's own greedy outputs on held-out tool-calling prompts,
served by vLLM in bfloat16 (the suite's reference setting).

    python -m tensorverse.demo.record_corpus [--out DIR] [--cases N] [--max-tokens N]
    python -m tensorverse.demo.record_corpus --model DIR --name NAME --out DIR   # your checkpoint

The recorded tokens are what every rig forces, so a rig's position 17 is the same token of the
same case everywhere. The corpus names its model by content hash (``corpus.json`` ``model``: the
hash of the weights' files, :func:`tensorverse.rig.models.file_weights_hash`, which for the shipped
demo model is :func:`tensorverse.demo.shipped.content_hash`), and ``tensorverse rig run``
refuses weights that hash otherwise. Without ``--model`` the model is the shipped demo model and
the corpus the default suite's (``demo-netops-v2``); with ``--model DIR`` it is any checkpoint of
the same tokenizer family that vLLM serves (the ``gpu-v1`` suite's corpus: ``rig run --corpus``),
served under its directory's name. The prompts are :func:`tensorverse.demo.model.heldout_prompts`
(seeded, disjoint from the training data) with the demo's tools, rendered by the server's chat
template, rendered locally by the model's tokenizer (as the trainer renders them: tool-call
arguments as objects); the corpus keeps the messages in the OpenAI form (arguments as JSON text). The corpus is written reproducibly (fixed ``created``, no version) and
shipped in ``tensorverse/rig/corpora/``; ``tests/rig/test_rig_run_vllm.py`` runs the default
suite's settings over it on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from tensorverse.rig.suite import CORPORA_DIR, DEFAULT_SUITE, suite

__all__ = ["record", "main"]

CREATED = "2026-12-04T00:00:00Z"  # demo-netops-v1 was written under 2026-12-02
DEFAULT_CASES = 8
DEFAULT_MAX_TOKENS = 48


def _post(url: str, body: dict) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


async def _tokenizer_fingerprint(url: str, model: str) -> dict[str, Any]:
    from tensorverse.shadow.backend import Backend
    from tensorverse.shadow.client import BackendClient
    from tensorverse.shadow.tokenizer import fingerprint

    async with BackendClient(Backend(name="ref", url=url, model=model)) as c:
        fp = await fingerprint(c, with_vocab=False, with_template=False)
    return {"fingerprint": fp.get("fingerprint"), "version": fp.get("version"), "source": f"vllm:{model}"}


def _openai_form(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in msgs:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.dumps(c["function"]["arguments"])))
                               for c in m["tool_calls"]]
        out.append(m)
    return out


DEFAULT_NAME = suite(DEFAULT_SUITE).corpus or "demo-netops"


def record(out: Path, *, cases: int = DEFAULT_CASES, max_tokens: int = DEFAULT_MAX_TOKENS, log=print,
           model_dir: Path | None = None, name: str = DEFAULT_NAME) -> Path:
    from tensorverse.demo import model as demo_model
    from tensorverse.demo.corpus import TOOLS
    from tensorverse.demo.trainer import MODEL_NAME
    from tensorverse.replay.corpus import CASE_FORMAT, FORMAT_VERSION, write_corpus
    from tensorverse.rig.models import file_weights_hash
    from tensorverse.rig.servers import VLLMServer

    from transformers import AutoTokenizer

    mdir = Path(model_dir) if model_dir is not None else demo_model.build(log=lambda m: log("  " + m))
    model_name = MODEL_NAME if model_dir is None else mdir.resolve().name
    log(f"hashing the weights of {mdir} ...")
    content_hash = file_weights_hash(mdir)
    tok = AutoTokenizer.from_pretrained(str(mdir))
    prompts = demo_model.heldout_prompts(cases)
    with VLLMServer("record", mdir, "bfloat16", served_model_name=model_name) as s:
        s.wait_ready()
        tokenizer = asyncio.run(_tokenizer_fingerprint(s.url, model_name))
        out_cases = []
        tools: list[Any] = list(TOOLS)  # the tokenizer's annotation: a list of dicts or callables
        for i, p in enumerate(prompts):
            msgs = p["messages"]
            text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
            ids = [int(x) for x in tok(text, add_special_tokens=False)["input_ids"]]
            sampling = {"temperature": 0, "max_tokens": max_tokens}
            ch = _post(s.url + "/completions", {"model": model_name, "prompt": ids, "return_token_ids": True,
                                                **sampling})["choices"][0]
            case_id = f"demo-{i:02d}-{p['kind'].replace('_', '-')}"
            out_cases.append({
                "format": CASE_FORMAT, "format_version": FORMAT_VERSION, "id": case_id,
                "title": f"held-out {p['kind']} call: {p['expected']['name']}", "tags": [p["kind"]],
                "tokenizer": tokenizer,
                "provenance": {"source": "recorded", "reference_backend": "bf16", "model": model_name,
                               "scrubbed": True, "tensorverse_version": None},
                "turns": [{"index": 0, "endpoint": "chat.completions", "messages": _openai_form(msgs), "tools": TOOLS,
                           "sampling": sampling, "prompt_token_ids": ids,
                           "reference": {"backend": "bf16", "output_token_ids": ch["token_ids"],
                                         "text": ch["text"], "finish_reason": ch["finish_reason"]}}],
            })
            log(f"  {case_id}: {len(ch['token_ids'])} tokens")
    return write_corpus(out, out_cases, tokenizer=tokenizer, name=name, created=CREATED,
                        with_version=False, model={"name": model_name, "content_hash": content_hash},
                        description="held-out tool-calling prompts of the demo model and its own greedy "
                                    "bfloat16 outputs on vLLM-CPU (tensorverse.demo.record_corpus)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorverse.demo.record_corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help=f"the corpus directory (default: the package's {DEFAULT_NAME}, for the shipped model)")
    ap.add_argument("--cases", type=int, default=DEFAULT_CASES)
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    ap.add_argument("--model", type=Path, default=None, metavar="DIR",
                    help="a Hugging Face checkpoint directory (default: the shipped demo model)")
    ap.add_argument("--name", default=None, help=f"the corpus's name (default {DEFAULT_NAME})")
    a = ap.parse_args(argv)
    if a.model is not None and not (a.model / "config.json").is_file():
        ap.error(f"--model {a.model}: no config.json there (a Hugging Face checkpoint directory)")
    if a.model is not None and (a.out is None or a.name is None):
        ap.error("--model needs --out DIR and --name NAME (the package's corpora are the shipped model's)")
    out = a.out if a.out is not None else CORPORA_DIR / DEFAULT_NAME
    p = record(out, cases=a.cases, max_tokens=a.max_tokens, model_dir=a.model, name=a.name or DEFAULT_NAME)
    print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo model: a tiny Qwen3 that really calls tools, trained deterministically (on CPU or a
GPU) and shipped with the package.

    python -m tensorverse.demo.model              # find it (cache) or unpack the shipped one; print its directory
    python -m tensorverse.demo.model --train      # retrain it from scratch (~45 min) and compare with the shipped one
    python -m tensorverse.demo.model --train --ship   # and remake the shipped files from that training
    python -m tensorverse.demo.model --data F --data-only           # render the training sessions into F
    python -m tensorverse.demo.model --train --device cuda --data F --checkpoint C --export T   # on a GPU
    python -m tensorverse.demo.model --from-export T --ship         # ship a training made elsewhere

What it is: a Qwen3 (``Qwen3ForCausalLM``: hidden 128, 3 layers, 4 heads / 2 KV heads of 32,
untied LM head) with the real Qwen3 tokenizer and vocabulary (151,936 rows), trained on synthetic
network-automation sessions (:mod:`tensorverse.demo.corpus`) rendered with the tokenizer's own
chat template, exactly as vLLM renders a chat request with ``tools``. It writes
``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` and short final answers. How it
is trained (compact vocabulary, shared prefix, loss weights): :mod:`tensorverse.demo.trainer`.

Where it comes from: the package ships the trained parameters in compact form (the 655 trained
vocabulary rows and the layers, bfloat16, zstandard: :mod:`tensorverse.demo.shipped`), and
:func:`build` expands them exactly (the other LM-head rows exactly 0, the other embeddings seeded
noise) into the Hugging Face checkpoint vLLM loads, checked against the content hash the manifest
records (:func:`tensorverse.demo.shipped.content_hash`, the model's name by content), in about
a second. It does so only when the shipped model is this code's recipe: the **training key**
(the spec's values, the trainer version, the sources of ``trainer.py`` and ``corpus.py``, the
tokenizer files; not the machine, which is recorded with the training) equals the shipped one. Otherwise (another spec, an edited corpus) it
says which input differs and trains (the shipped recipe: about 45 minutes on two idle cores).

Cached under ``$TENSORVERSE_CACHE/models`` (default ``~/.cache/tensorverse/models``) in a
directory named after the spec and the training key; built in a temporary directory and renamed
into place (:func:`tensorverse.rig.models.install_atomically`, with the rig's checkpoint writer);
its ``tensorverse_model.json`` records the training key, the content hash and where it came from
(``shipped`` or ``trained``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tensorverse.demo import corpus, shipped, trainer
from tensorverse.demo.trainer import (  # noqa: F401  (the demo model's public names, used by run.py and the tests)
    DEFAULT_SPEC,
    MODEL_NAME,
    TRAIN_SEED_BASE,
    TRAINER_VERSION,
    DemoSpec,
    Renderer,
    Sample,
    _init,
    _modules,
    load_tokenizer,
    train,
    train_sessions,
)
from tensorverse.rig import models as rig_models

TRAIN_LOG = "training.json"  # written last: a model directory is complete when it is there
HELDOUT_SEED = 424_242  # held-out sessions (disjoint values with overwhelming probability)


# -- the training key: what a training's result depends on -------------------------------------


def _sha256(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def training_key_parts(spec: DemoSpec = DEFAULT_SPEC) -> dict[str, Any]:
    """The training's recipe: every input of the training but the machine (the spec, the trainer
    and corpus sources, the tokenizer). The machine (CPU or GPU, the torch version) changes the
    last bits of the weights, not what the model is: it is recorded with the training
    (``device``, ``torch``), and the shipped model is used wherever the recipe is the same."""
    return {
        "spec": dataclasses.asdict(spec),
        "trainer_version": TRAINER_VERSION,
        "sources": {Path(str(m.__file__)).name: _sha256(Path(str(m.__file__))) for m in (trainer, corpus)},
        "tokenizer": {p.name: _sha256(p) for p in rig_models._tokenizer_files()},
    }


def training_key(spec: DemoSpec = DEFAULT_SPEC, parts: dict[str, Any] | None = None) -> str:
    parts = training_key_parts(spec) if parts is None else parts
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


spec_hash = training_key  # the name the cache used before (same meaning: the training key)


def key_differences(want: dict[str, Any], have: dict[str, Any]) -> list[str]:
    """What differs between two :func:`training_key_parts`, in words (empty if nothing)."""
    out = []
    for part in sorted(set(want) | set(have)):
        a, b = want.get(part), have.get(part)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    x, y = a.get(k, "absent"), b.get(k, "absent")
                    if part in ("sources", "tokenizer"):
                        x, y = str(x)[:12], str(y)[:12]
                    out.append(f"{part} {k}: shipped {x}, here {y}")
        else:
            out.append(f"{part}: shipped {a}, here {b}")
    return out


def model_path(spec: DemoSpec = DEFAULT_SPEC) -> Path:
    return rig_models.cache_dir() / f"{spec.name}-{training_key(spec)[:16]}"


def is_built(spec: DemoSpec = DEFAULT_SPEC) -> bool:
    """Whether the model is in the cache."""
    return (model_path(spec) / TRAIN_LOG).is_file()


def shipped_fit(spec: DemoSpec = DEFAULT_SPEC) -> list[str]:
    """Why the shipped model is not this spec's training (empty: it is, and :func:`build` unpacks it)."""
    try:
        m = shipped.manifest()
    except shipped.ShippedModelError as e:
        return [str(e)]
    parts = training_key_parts(spec)
    why = key_differences(m.get("key_parts", {}), parts)
    if not why and m.get("training_key") != training_key(spec, parts):
        why = [f"training key: shipped {str(m.get('training_key'))[:16]}, here {training_key(spec, parts)[:16]}"]
    return why


def needs_training(spec: DemoSpec = DEFAULT_SPEC) -> bool:
    """Whether :func:`build` will train (the model is neither cached nor shipped for this spec)."""
    return not is_built(spec) and bool(shipped_fit(spec))


# -- evaluation (held-out prompts, greedy decoding with the compact model) ---------------------


def heldout_prompts(n: int, seed: int = HELDOUT_SEED) -> list[dict[str, Any]]:
    """``n`` held-out tool-call prompts: ``{"messages", "expected": {"name", "arguments"},
    "kind", "coin"}``, taken at every tool call of held-out sessions (first calls, calls after a
    tool result, calls in later tasks of a session), from a seed the training data never uses.
    ``coin``: the call has two right spellings and the corpus picked one by a fair coin (the port
    a MAC lookup printed, passed on as printed or spelled out: :mod:`tensorverse.demo.corpus`)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    while len(out) < n:
        tasks = corpus.make_session(rng, rng.randint(1, 4))
        msgs, targets = corpus.session_messages(tasks)
        calls = [c for t in tasks for c in t.calls]
        kinds = [t.kind for t in tasks for _ in t.calls]
        ti = 0
        for k, text in targets:
            if not text.startswith("<tool_call>"):
                continue
            c = calls[ti]
            out.append({"messages": msgs[:k], "expected": {"name": c.name, "arguments": c.arguments},
                        "kind": kinds[ti], "coin": kinds[ti] == "mac_owner" and c.name == "show_interface"})
            ti += 1
            if len(out) >= n:
                break
    return out



class CompactGenerator:
    def __init__(self, model, vocab: list[int], tok) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.vocab = vocab
        self.index = {t: i for i, t in enumerate(vocab)}
        self.tok = tok
        self.rend = Renderer(tok)
        self.eos = self.rend.im_end
        used = set(vocab)
        self.first_unused = next(i for i in range(len(vocab) + 1) if i not in used)
        with torch.no_grad():
            _, self.prefix_past = model(torch.tensor([[self.index[t] for t in self.rend.prefix_ids]]))

    def generate(self, messages: list[dict[str, Any]], max_tokens: int = 64) -> str:
        torch = self.torch
        text = self.rend.prompt(messages)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        P = len(self.rend.prefix_ids)
        assert ids[:P] == self.rend.prefix_ids
        unk = self.index[self.eos]
        rest = [self.index.get(t, unk) for t in ids[P:]]
        out: list[int] = []
        with torch.no_grad():
            past = self.prefix_past
            S = len(rest)
            mask = torch.ones((S, P + S), dtype=torch.bool)
            mask[:, P:] = torch.tril(torch.ones((S, S), dtype=torch.bool))
            h, kv = self.model(torch.tensor([rest]), past=past, start=P, mask=mask)
            past = [(torch.cat([a, b], 2), torch.cat([c, d], 2)) for (a, c), (b, d) in zip(past, kv)]
            pos = P + S
            for _ in range(max_tokens):
                lg = self.model.head(h[:, -1])[0]
                j = int(lg.argmax())
                if float(lg[j]) < 0.0:
                    # every trained row is below the untrained rows' logit 0: the full model's
                    # argmax is the first untrained id (what vLLM's greedy sampler picks)
                    out.append(self.first_unused)
                    break
                t = self.vocab[j]
                if t == self.eos:
                    break
                out.append(t)
                h, kv = self.model(torch.tensor([[j]]), past=past, start=pos)
                past = [(torch.cat([a, b], 2), torch.cat([c, d], 2)) for (a, c), (b, d) in zip(past, kv)]
                pos += 1
        return self.tok.decode(out, skip_special_tokens=False)


def _abbreviable(name: str) -> set[str]:
    """The arguments of tool ``name`` whose schema takes an interface "full or abbreviated"."""
    for t in corpus.TOOLS:
        if t["function"]["name"] == name:
            props = t["function"]["parameters"]["properties"]
            return {k for k, v in props.items() if "full or abbreviated" in v.get("description", "")}
    return set()


def equivalent_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A tool call with every interface its schema takes "full or abbreviated" spelled out
    (:func:`tensorverse.demo.corpus.canonical_interface`): ``show_interface`` with ``Gi2/8`` and
    with ``GigabitEthernet2/8`` are the same request to the router."""
    keys = _abbreviable(name)
    return {"name": name, "arguments": {k: corpus.canonical_interface(v) if k in keys and isinstance(v, str) else v
                                        for k, v in arguments.items()}}


def score(outputs: list[str], prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """Well-formed rate (>= 1 call, nothing malformed), exact-match rate of tool calls, and
    ``equivalent``: the rate of calls the router takes as the expected one (exact but for the
    spelling of an interface the tool takes in either form). The corpus spells such a port either
    way at random (a fair coin, :mod:`tensorverse.demo.corpus`), so ``exact`` also scores a coin:
    ``equivalent`` is the model's accuracy, and ``exact_one_answer`` the exact rate over the calls
    with one right spelling (every call but the coin's)."""
    from tensorverse.analysis.toolcalls import compare_tool_calls, extract_tool_calls

    wf = exact = same = name_ok = one = one_exact = 0
    for text, p in zip(outputs, prompts):
        one += not p.get("coin", False)
        x = extract_tool_calls(text)
        ok = bool(x.calls) and not x.malformed
        wf += ok
        if ok:
            v = compare_tool_calls(extract_tool_calls(openai_tool_calls=[p["expected"]]), x)
            exact += v.match
            one_exact += v.match and not p.get("coin", False)
            want = [equivalent_call(p["expected"]["name"], p["expected"]["arguments"])]
            got = [equivalent_call(c.name, c.arguments) for c in x.calls]
            same += compare_tool_calls(extract_tool_calls(openai_tool_calls=want),
                                       extract_tool_calls(openai_tool_calls=got)).match
            name_ok += x.calls[0].name == p["expected"]["name"]
    n = max(1, len(prompts))
    return {"prompts": len(prompts), "well_formed": wf / n, "exact": exact / n, "equivalent": same / n,
            "exact_one_answer": one_exact / max(1, one), "right_tool": name_ok / n}


def evaluate(model, vocab: list[int], n: int = 100, tok=None) -> dict[str, Any]:
    tok = tok or load_tokenizer()
    gen = CompactGenerator(model, vocab, tok)
    prompts = heldout_prompts(n)
    t0 = time.monotonic()
    outs = [gen.generate(p["messages"]) for p in prompts]
    r = score(outs, prompts)
    r["seconds"] = round(time.monotonic() - t0, 1)
    return r


# -- the checkpoint vLLM loads ----------------------------------------------------------------


def state_dict_full(model, vocab: list[int], spec: DemoSpec) -> dict[str, Any]:
    """The Qwen3ForCausalLM state dict (bfloat16) of a trained compact model: its parameters as
    shipped (:func:`tensorverse.demo.trainer.compact_state`), expanded
    (:func:`tensorverse.demo.shipped.expand`)."""
    return shipped.expand(trainer.compact_state(model), vocab, spec)


def save(weights: dict[str, Any], vocab: list[int], spec: DemoSpec, out: Path, info: dict[str, Any], *,
         source: str, key: str | None = None) -> Path:
    """Write the checkpoint of the full ``weights`` into the (existing, empty) directory ``out``."""
    out = Path(out)
    meta = {"spec": dataclasses.asdict(spec), "hash": key or training_key(spec), "trainer": TRAINER_VERSION,
            "kind": "tensorverse-demo", "source": source, "content_hash": rig_models.weights_hash(weights)}
    rig_models.write_checkpoint(out, spec, weights, meta)
    (out / "compact_vocab.json").write_text(json.dumps(vocab) + "\n")
    (out / TRAIN_LOG).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out


def model_meta(path: Path) -> dict[str, Any]:
    """The model directory's ``tensorverse_model.json`` (training key, content hash, source)."""
    try:
        return json.loads((Path(path) / rig_models.SPEC_FILE).read_text())
    except (OSError, ValueError):
        return {}


# -- build: the cache, the shipped model, training ---------------------------------------------


def _train_full(spec: DemoSpec, log: Callable[[str], None], eval_prompts: int, data_path: Path | None = None,
                device: str = "cpu", checkpoint: Path | None = None):
    data = load_or_render_data(spec, data_path, log) if data_path is not None else None
    model, vocab, info = train(spec, log=log, data=data, device=device, key=training_key(spec),
                               checkpoint=None if checkpoint is None else str(checkpoint))
    if eval_prompts:
        ev = evaluate(model, vocab, eval_prompts)
        info["heldout_pytorch_fp32"] = ev
        log(f"held-out ({ev['prompts']} prompts, PyTorch fp32): well-formed {ev['well_formed']:.1%}, "
            f"exact {ev['exact']:.1%}, right tool {ev['right_tool']:.1%}")
    return model, vocab, info


def build(spec: DemoSpec = DEFAULT_SPEC, *, log: Callable[[str], None] = print, eval_prompts: int = 100,
          retrain: bool = False, on_trained: Callable[[Any, list[int], dict[str, Any]], None] | None = None,
          data_path: Path | None = None, device: str = "cpu", checkpoint: Path | None = None) -> Path:
    """The directory of the demo model: the cached one; else the shipped parameters, expanded, if
    they are this spec's training; else a training here. ``retrain`` trains from scratch whatever
    is cached or shipped (and replaces the cached directory); ``on_trained(model, vocab, info)``
    sees a training's result."""
    final = model_path(spec)
    if not retrain and (final / TRAIN_LOG).is_file():
        return final
    if not retrain:
        why = shipped_fit(spec)
        if not why:
            t0 = time.monotonic()
            m = shipped.manifest()

            def unpack(tmp: Path) -> None:
                full, vocab = shipped.expand_shipped(spec)
                info = dict(m["training"]) | {"source": "shipped", "content_hash": m["content_hash"],
                                              "expand_seconds": round(time.monotonic() - t0, 2)}
                save(full, vocab, spec, tmp, info, source="shipped")

            try:
                rig_models.install_atomically(final, TRAIN_LOG, unpack)
            except shipped.ShippedModelError as e:
                log(f"not using the shipped demo model: {e}")
            else:
                log(f"demo model unpacked from the package (content hash {m['content_hash'][:16]}, "
                    f"{time.monotonic() - t0:.1f} s): {final}")
                return final
        else:
            log("the shipped demo model is not this spec's training (" + "; ".join(why) + "): training here "
                f"(about {max(1, round(spec.steps * 0.3 / 60))} minutes on two idle cores, ~0.3 s a step); "
                "`python -m tensorverse.demo.model --train --ship` "
                "makes it the shipped one")
    log(f"training the demo model ({spec.steps} steps; cached afterwards in {final})")
    model, vocab, info = _train_full(spec, log, eval_prompts, data_path, device, checkpoint)
    info["source"] = "trained"
    full = state_dict_full(model, vocab, spec)
    info["content_hash"] = rig_models.weights_hash(full)
    rig_models.install_atomically(final, TRAIN_LOG, lambda tmp: save(full, vocab, spec, tmp, info, source="trained"),
                                  replace=retrain)
    if on_trained is not None:
        on_trained(model, vocab, info)
    log(f"demo model ready: {final} (training {info['train_seconds']:.0f} s, content hash {info['content_hash'][:16]})")
    return final


def training_info(path: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / TRAIN_LOG).read_text())
    except (OSError, ValueError):
        return {}


def ship(model, vocab: list[int], info: dict[str, Any], spec: DemoSpec = DEFAULT_SPEC, *, eval_prompts: int = 100,
         data_dir: Path = shipped.DATA_DIR, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Make a training's result the shipped model: the compact file and the manifest, with the
    training's log and the held-out evaluation of the shipped (bfloat16) parameters."""
    compact = trainer.compact_state(model)
    info = dict(info)
    info.pop("source", None)
    info.pop("content_hash", None)
    if eval_prompts:
        ev = evaluate(trainer.compact_model(compact, vocab, spec), vocab, eval_prompts)
        info["heldout_pytorch_shipped_bf16"] = ev
        log(f"held-out ({ev['prompts']} prompts, PyTorch, the shipped bfloat16 parameters): well-formed "
            f"{ev['well_formed']:.1%}, exact {ev['exact']:.1%}, right tool {ev['right_tool']:.1%}")
    parts = training_key_parts(spec)
    m = shipped.write(compact, vocab, spec, training_key=training_key(spec, parts), key_parts=parts,
                      training=info, data_dir=data_dir)
    log(f"shipped: {Path(data_dir) / shipped.COMPACT_FILE.name} ({m['file_bytes']:,} bytes), content hash "
        f"{m['content_hash']}")
    return m


def load_or_render_data(spec: DemoSpec, path: Path | None, log: Callable[[str], None] = print) -> trainer.TrainingData:
    """The training sessions of ``spec``: read from ``path`` where it holds this recipe's (see
    :func:`training_key`), else rendered here (and written to ``path`` if given)."""
    key = training_key(spec)
    if path is not None and Path(path).is_file():
        try:
            data = trainer.load_data(path, key)
        except ValueError as e:
            log(f"not using {path}: {e}")
        else:
            log(f"training data from {path} ({len(data.samples)} sessions)")
            return data
    log(f"rendering {trainer.data_sessions(spec)} training sessions (a few milliseconds each)")
    data = trainer.training_data(spec, log=log)
    if path is not None:
        tmp = Path(str(path) + ".tmp")
        trainer.save_data(data, tmp, key)
        tmp.replace(path)
        log(f"training data written to {path} ({Path(path).stat().st_size:,} bytes, {data.seconds:.0f} s)")
    return data


EXPORT_FORMAT = 1


def export_training(model, vocab: list[int], info: dict[str, Any], spec: DemoSpec, path: Path) -> None:
    """A training's result in one file (the compact parameters, the vocabulary, the log and the
    recipe's key), for a training run elsewhere (a GPU) and shipped here (:func:`load_export`)."""
    import torch

    torch.save({"format": EXPORT_FORMAT, "training_key": training_key(spec), "spec": dataclasses.asdict(spec),
                "compact": trainer.compact_state(model), "vocab": list(vocab), "info": info}, str(path))


def load_export(path: Path, spec: DemoSpec):
    """The compact model, vocabulary and log of an :func:`export_training` file of this recipe."""
    import torch

    x = torch.load(str(path), weights_only=True)
    if x.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path}: export format {x.get('format')}, this code reads {EXPORT_FORMAT}")
    if x.get("training_key") != training_key(spec):
        raise ValueError(f"{path}: a training of key {str(x.get('training_key'))[:16]}, this recipe's is "
                         f"{training_key(spec)[:16]} (another spec, trainer, corpus or tokenizer)")
    return trainer.compact_model(x["compact"], x["vocab"], spec), list(x["vocab"]), dict(x["info"])


def spec_override(item: str) -> dict[str, Any]:
    """``FIELD=VALUE`` -> ``{FIELD: value}``, the value typed as the spec's field (int, float,
    bool, str); ValueError for an unknown field or a value of another type."""
    name, sep, raw = item.partition("=")
    fields = {f.name: f for f in dataclasses.fields(DemoSpec)}
    if not sep or name not in fields:
        raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(fields))}")
    kind = type(getattr(DEFAULT_SPEC, name))
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false"):
                raise ValueError(raw)
            return {name: raw.lower() == "true"}
        return {name: kind(raw)}
    except ValueError:
        raise ValueError(f"--set {item!r}: {name} takes a {kind.__name__}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorverse.demo.model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", action="store_true",
                    help="train from scratch, whatever is cached or shipped (replaces the cached model)")
    ap.add_argument("--ship", action="store_true",
                    help="with --train or --from-export: make the training the shipped model (writes "
                         "tensorverse/demo/data/)")
    ap.add_argument("--steps", type=int, help="override the number of training steps (another cache entry)")
    ap.add_argument("--epochs", type=int, help="override how often each training session is seen (another cache entry)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="sets",
                    help="override any field of the spec (tensorverse/demo/spec.py), e.g. --set lr=0.006 "
                         "--set tokens_per_step=9600 (another recipe, another cache entry)")
    ap.add_argument("--checkpoint", type=Path, metavar="FILE",
                    help="with --train: save the training's state to FILE every 500 steps and resume from it "
                         "(a stopped training goes on where it was, to the same bytes)")
    ap.add_argument("--eval", type=int, default=100, metavar="N", help="held-out prompts to score after training")
    ap.add_argument("--print-path", action="store_true", help="only print where the model is (or would be)")
    ap.add_argument("--device", default="cpu", help="where the training steps run (cpu, cuda): minutes on a GPU, "
                                                    "hours on two CPU cores")
    ap.add_argument("--data", type=Path, metavar="FILE",
                    help="the rendered training sessions: read from FILE if it holds this recipe's, else "
                         "rendered and written there (the tokenizer's part of a training, done once)")
    ap.add_argument("--data-only", action="store_true", help="with --data: render the sessions and stop")
    ap.add_argument("--export", type=Path, metavar="FILE",
                    help="with --train: write the training's result to FILE and stop (to train on a GPU "
                         "machine and ship here with --from-export)")
    ap.add_argument("--from-export", type=Path, metavar="FILE",
                    help="use the training in FILE (written by --export) instead of training here")
    args = ap.parse_args(argv)
    over: dict[str, Any] = {}
    try:
        for item in args.sets:
            over.update(spec_override(item))
        over.update({k: v for k, v in (("steps", args.steps), ("epochs", args.epochs)) if v is not None})
        spec = dataclasses.replace(DEFAULT_SPEC, **over)
    except ValueError as e:
        ap.error(str(e))
    if args.ship and not (args.train or args.from_export):
        ap.error("--ship needs --train or --from-export (the shipped model is a training's result)")
    if args.data_only and args.data is None:
        ap.error("--data-only needs --data FILE")
    if (args.export or args.checkpoint) and not args.train:
        ap.error("--export and --checkpoint need --train")
    if args.from_export and args.train:
        ap.error("--from-export uses a training made elsewhere: not with --train")
    if args.print_path:
        print(model_path(spec))
        return 0
    t0 = time.monotonic()
    if args.data_only:
        load_or_render_data(spec, args.data)
        return 0
    if args.export:
        data = load_or_render_data(spec, args.data)
        model, vocab, info = train(spec, data=data, device=args.device, key=training_key(spec),
                                   checkpoint=None if args.checkpoint is None else str(args.checkpoint))
        export_training(model, vocab, info, spec, args.export)
        print(f"{args.export}\t({time.monotonic() - t0:.1f} s)")
        return 0
    trained: dict[str, Any] = {}
    if args.from_export:
        model, vocab, info = load_export(args.from_export, spec)
        if args.eval:
            ev = evaluate(model, vocab, args.eval)
            info["heldout_pytorch_fp32"] = ev
            print(f"held-out ({ev['prompts']} prompts, PyTorch fp32): well-formed {ev['well_formed']:.1%}, "
                  f"exact {ev['exact']:.1%}, equivalent {ev['equivalent']:.1%}")
        trained.update(model=model, vocab=vocab, info=info)
    else:
        build(spec, eval_prompts=args.eval, retrain=args.train, data_path=args.data, device=args.device,
              checkpoint=args.checkpoint, on_trained=lambda model, vocab, info: trained.update(model=model, vocab=vocab, info=info))
    if args.train:
        h = trained["info"]["content_hash"]
        try:
            sh = shipped.content_hash()
        except shipped.ShippedModelError:
            sh = None
        print(f"content hash {h}: " + ("bit-identical to the shipped model" if h == sh else
                                       f"differs from the shipped model's {sh}"))
    if args.ship:
        ship(trained["model"], trained["vocab"], trained["info"], spec, eval_prompts=args.eval)
    if args.from_export and not args.ship:
        return 0
    print(f"{build(spec)}\t({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

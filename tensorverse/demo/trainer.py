"""Training of the demo model: its spec, its data, the compact model and the training loop.

Everything that decides the trained weights lives here and in :mod:`tensorverse.demo.corpus`: the
demo model's cache key and the shipped model's fit (:mod:`tensorverse.demo.model`) hash the
source of these two modules, so a change to either is a new model (the shipped one no longer fits
and ``python -m tensorverse.demo.model --train --ship`` remakes it). Evaluation, export, the
expansion of the shipped parameters and the cache live elsewhere and can change freely.

* **Only the used rows of the vocabulary are trained.** The corpus uses 634 of the 151,936 token
  ids. Training runs on a compact vocabulary (those ids); the full model has the trained rows at
  those ids, the LM-head rows of every other id at exactly 0 (so their logit is exactly 0) and
  small seeded random embeddings for them (:func:`tensorverse.demo.shipped.expand`). The
  training loss is the cross-entropy of the *full* softmax: the compact logits plus one extra
  logit of value ``log(N_unused)``, which is exactly the mass of the ``N_unused`` rows at logit 0.
  The trained model is therefore exact under the full 151,936-way softmax that vLLM computes.
* **The shared prefix is computed once per step.** Every session starts with the same system
  message (system prompt + the five tools' schemas, 489 tokens); each step runs it once, then the
  batch of session continuations attends to its keys and values (gradients flow into it).
* Loss only on the assistant's turns (tool calls, final answers, ``<|im_end|>``).

Deterministic: ``torch.manual_seed``, deterministic algorithms, a fixed thread count, data from
seeded ``random.Random``; the same spec, code, tokenizer, torch and device give the same bytes.
The steps run on the CPU or on a GPU (``device="cuda"``: float32 without TF32, the math attention
kernel, deterministic cuBLAS); the data (:func:`training_data`, the tokenizer's part) can be
rendered on one machine and trained on another (:func:`save_data`, :func:`load_data`).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

from tensorverse.demo import corpus
from tensorverse.demo.spec import DEFAULT_SPEC, MODEL_NAME, DemoSpec
from tensorverse.rig import models as rig_models

__all__ = ["DEFAULT_SPEC", "MODEL_NAME", "DemoSpec"]  # re-exported: the spec's names where they always were

TRAINER_VERSION = 3  # 2: the trainer in its own module (the cache key hashes it, not model.py); 3: the spec
# apart (tensorverse.demo.spec), epochs, a device, rendered data and checkpoints (the same weights as 2)
TRAIN_SEED_BASE = 1_000_003  # training sessions: Random(TRAIN_SEED_BASE + spec.seed)


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(rig_models.tokenizer_dir()))


# -- data ------------------------------------------------------------------------------------


@dataclass
class Sample:
    ids: list[int]  # the continuation after the shared prefix
    weights: list[float]  # loss weight of predicting ids[i] (0 outside the assistant's turns)


class Renderer:
    """Renders sessions with the tokenizer's chat template and splits off the shared prefix."""

    def __init__(self, tok) -> None:
        self.tok = tok
        probe, _ = corpus.session_messages([])
        text = tok.apply_chat_template(probe + [{"role": "user", "content": "x"}], tools=corpus.TOOLS,
                                       tokenize=False)
        head = text[: text.index("<|im_start|>user")]
        self.prefix_text = head
        self.prefix_ids: list[int] = tok(head, add_special_tokens=False)["input_ids"]
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def prompt(self, messages: list[dict[str, Any]]) -> str:
        return self.tok.apply_chat_template(messages, tools=corpus.TOOLS, tokenize=False, add_generation_prompt=True)

    def sample(self, tasks: list[corpus.Task], answer_weight: float, value_weight: float = 1.0) -> Sample:
        msgs, targets = corpus.session_messages(tasks)
        k_last, last = targets[-1]
        full = self.prompt(msgs[:k_last]) + last + "<|im_end|>"
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, offs = enc["input_ids"], enc["offset_mapping"]
        n0 = len(self.prefix_ids)
        if ids[:n0] != self.prefix_ids:
            raise AssertionError("the shared prefix does not tokenize the same in a session")
        # character spans of the assistant's turns (text + <|im_end|>), found by rendering each
        # turn's prompt: the template renders history exactly as the model wrote it.
        turns: list[tuple[int, int, float]] = []
        values: list[tuple[int, int]] = []
        # The template renders earlier assistant turns exactly as the model wrote them (checked
        # here turn by turn): each one follows "<|im_start|>assistant\n" and ends with <|im_end|>.
        at = 0
        opener = "<|im_start|>assistant\n"
        for k, text in targets:
            start = full.index(opener, at) + len(opener)
            end = start + len(text) + len("<|im_end|>")
            if full[start:end] != text + "<|im_end|>":
                raise AssertionError(f"turn {k} is not rendered as the model writes it")
            p, seg = full[:start], full[:end]
            at = end
            if text.startswith("<tool_call>"):
                body = json.loads(text[len("<tool_call>\n"): -len("\n</tool_call>")])
                at = len(p)
                for key, value in body["arguments"].items():
                    enc_v = json.dumps(value, ensure_ascii=False)
                    i = full.index(f'"{key}": {enc_v}', at) + len(f'"{key}": ')
                    values.append((i, i + len(enc_v)))
                    at = i + len(enc_v)
                turns.append((len(p), len(seg), 1.0))
            else:
                turns.append((len(p), len(seg), answer_weight))
        if any(a < s < b for (a, b) in offs for s, _e, _w in turns):
            raise AssertionError("a token straddles the start of an assistant turn")
        weights = [0.0] * len(ids)
        for i, (a, b) in enumerate(offs):
            for s, e, w in turns:
                if a >= s and b <= e and b > a:
                    weights[i] = w
                    if any(a < ve and b > vs for vs, ve in values):
                        weights[i] = value_weight  # a token of an argument value (copied)
                    break
        return Sample(ids[n0:], weights[n0:])


def train_sessions(spec: DemoSpec, n: int) -> list[list[corpus.Task]]:
    rng = random.Random(TRAIN_SEED_BASE + spec.seed)
    out = []
    for _ in range(n):
        out.append(corpus.make_session(rng, rng.randint(1, spec.max_tasks)))
    return out



# -- the model (Qwen3, compact vocabulary, shared-prefix attention) ----------------------------


def _modules():
    import torch
    from torch import nn
    from torch.nn import functional as F

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * xf.to(x.dtype)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    class Layer(nn.Module):
        def __init__(self, s: DemoSpec) -> None:
            super().__init__()
            H, nh, nkv, hd, inter = s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim, s.intermediate_size
            self.nh, self.nkv, self.hd = nh, nkv, hd
            self.input_layernorm = RMSNorm(H, s.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(H, s.rms_norm_eps)
            self.q_proj = nn.Linear(H, nh * hd, bias=False)
            self.k_proj = nn.Linear(H, nkv * hd, bias=False)
            self.v_proj = nn.Linear(H, nkv * hd, bias=False)
            self.o_proj = nn.Linear(nh * hd, H, bias=False)
            self.q_norm = RMSNorm(hd, s.rms_norm_eps)
            self.k_norm = RMSNorm(hd, s.rms_norm_eps)
            self.gate_proj = nn.Linear(H, inter, bias=False)
            self.up_proj = nn.Linear(H, inter, bias=False)
            self.down_proj = nn.Linear(inter, H, bias=False)

        def forward(self, x, cos, sin, past, mask):
            """x (B, S, H); past: None or (k, v) of shape (Bp, nkv, P, hd) with Bp 1 or B;
            mask: bool (S, P+S) or None (plain causal). Returns (x, (k, v) of this call)."""
            B, S, _ = x.shape
            h = self.input_layernorm(x)
            q = self.q_norm(self.q_proj(h).view(B, S, self.nh, self.hd)).transpose(1, 2)
            k = self.k_norm(self.k_proj(h).view(B, S, self.nkv, self.hd)).transpose(1, 2)
            v = self.v_proj(h).view(B, S, self.nkv, self.hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            new = (k, v)
            if past is not None:
                pk, pv = past
                if pk.shape[0] != B:
                    pk, pv = pk.expand(B, -1, -1, -1), pv.expand(B, -1, -1, -1)
                k = torch.cat([pk, k], dim=2)
                v = torch.cat([pv, v], dim=2)
            rep = self.nh // self.nkv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            if mask is None:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1 and past is None)
            else:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + self.o_proj(a.transpose(1, 2).reshape(B, S, self.nh * self.hd))
            h = self.post_attention_layernorm(x)
            x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
            return x, new

    class CompactQwen3(nn.Module):
        def __init__(self, s: DemoSpec, vocab: list[int]) -> None:
            super().__init__()
            self.spec = s
            self.vocab = list(vocab)
            V = len(vocab)
            self.embed = nn.Embedding(V, s.hidden_size)
            self.layers = nn.ModuleList(Layer(s) for _ in range(s.num_hidden_layers))
            self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
            self.head = nn.Linear(s.hidden_size, V, bias=False)
            n_unused = rig_models.QWEN3_VOCAB_SIZE - V
            self.register_buffer("unused_logit", torch.tensor(math.log(n_unused)), persistent=False)
            inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
            self.register_buffer("inv_freq", inv, persistent=False)

        def rope(self, start: int, n: int):
            pos = torch.arange(start, start + n, dtype=torch.float32, device=self.inv_freq.device)
            f = torch.outer(pos, self.inv_freq)
            emb = torch.cat([f, f], dim=-1)
            return emb.cos()[None, None], emb.sin()[None, None]

        def forward(self, ids, past=None, start: int = 0, mask=None):
            """ids (B, S) compact ids; past: per layer (k, v) or None. Returns (hidden, kv list)."""
            x = self.embed(ids)
            cos, sin = self.rope(start, ids.shape[1])
            kvs = []
            for i, layer in enumerate(self.layers):
                x, kv = layer(x, cos, sin, None if past is None else past[i], mask)
                kvs.append(kv)
            return self.norm(x), kvs

        def logits(self, h):
            """Full-softmax-exact logits: compact logits + the unused rows' lumped logit."""
            lg = self.head(h)
            extra = self.unused_logit.expand(*lg.shape[:-1], 1)
            return torch.cat([lg, extra], dim=-1)

    return CompactQwen3


# -- training --------------------------------------------------------------------------------


def _init(model, spec: DemoSpec) -> None:
    import torch

    g = torch.Generator().manual_seed(spec.seed)
    for name, p in sorted(model.named_parameters()):
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = spec.init_std
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std = spec.init_std / math.sqrt(2 * spec.num_hidden_layers)
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _batches(samples: list[Sample], spec: DemoSpec, rng: random.Random) -> list[list[Sample]]:
    """Group samples of similar length into batches of about ``tokens_per_step`` tokens."""
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].ids), i))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = len(samples[i].ids)
        if cur and max(cur_max, n) * (len(cur) + 1) > spec.tokens_per_step:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(samples[i])
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


@dataclass
class TrainingData:
    """What a training reads: the shared prefix, the compact vocabulary (sorted token ids) and the
    sessions rendered as :class:`Sample` (in generation order). Made by :func:`training_data`
    (the chat template and the tokenizer, a few milliseconds a session), saved with
    :func:`save_data` so that another machine (a GPU) can train from it without the tokenizer."""

    prefix_ids: list[int]
    vocab: list[int]
    samples: list[Sample]
    seconds: float = 0.0


def data_sessions(spec: DemoSpec) -> int:
    """How many training sessions a spec renders: enough distinct sessions for ``steps / epochs``
    steps of ``tokens_per_step`` tokens (each session is seen ``epochs`` times)."""
    avg_tokens = 45 + 115 * (1 + spec.max_tasks) / 2
    return int(math.ceil(spec.steps / spec.epochs) * spec.tokens_per_step / avg_tokens * 1.15) + 16


def training_data(spec: DemoSpec = DEFAULT_SPEC, *, log: Callable[[str], None] = print,
                  every: int = 2000) -> TrainingData:
    """Render the spec's training sessions (:func:`train_sessions`) with the tokenizer, logging
    progress every ``every`` sessions."""
    t0 = time.monotonic()
    rend = Renderer(load_tokenizer())
    n = data_sessions(spec)
    samples = []
    for i, s in enumerate(train_sessions(spec, n)):
        samples.append(rend.sample(s, spec.answer_weight, spec.value_weight))
        if every and (i + 1) % every == 0:
            el = time.monotonic() - t0
            log(f"data: {i + 1}/{n} sessions rendered, {el:.0f} s elapsed, ~{el / (i + 1) * (n - i - 1):.0f} s left")
    vocab_set = set(rend.prefix_ids)
    for smp in samples:
        vocab_set.update(smp.ids)
    vocab_set.add(rend.im_end)
    return TrainingData(list(rend.prefix_ids), sorted(vocab_set), samples, round(time.monotonic() - t0, 1))


_DATA_FORMAT = 1


def save_data(data: TrainingData, path, key: str) -> None:
    """Write ``data`` to ``path`` (a NumPy ``.npz``, compressed) under ``key`` (what it was made
    from: the recipe's :func:`tensorverse.demo.model.training_key`). Token ids are stored as compact indices
    (uint16) and loss weights as float16 (their values, 0, 0.5, 1 and 3, are exact in it)."""
    import numpy as np

    index = {t: i for i, t in enumerate(data.vocab)}
    ids = np.fromiter((index[t] for smp in data.samples for t in smp.ids), dtype=np.uint16)
    w = np.fromiter((x for smp in data.samples for x in smp.weights), dtype=np.float32)
    w16 = w.astype(np.float16)
    if not np.array_equal(w16.astype(np.float32), w):
        raise ValueError("a loss weight is not exact in float16")
    meta = json.dumps({"format": _DATA_FORMAT, "key": key, "seconds": data.seconds})
    with open(path, "wb") as f:
        np.savez_compressed(f, meta=np.frombuffer(meta.encode(), dtype=np.uint8),
                            prefix_ids=np.asarray(data.prefix_ids, dtype=np.int64),
                            vocab=np.asarray(data.vocab, dtype=np.int64),
                            lengths=np.asarray([len(smp.ids) for smp in data.samples], dtype=np.int64),
                            ids=ids, weights=w16)


def load_data(path, key: str | None = None) -> TrainingData:
    """Read what :func:`save_data` wrote; with ``key``, refuse data made from other inputs."""
    import numpy as np

    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        if meta.get("format") != _DATA_FORMAT:
            raise ValueError(f"{path}: training data format {meta.get('format')}, this trainer reads {_DATA_FORMAT}")
        if key is not None and meta.get("key") != key:
            raise ValueError(f"{path}: training data of key {str(meta.get('key'))[:16]}, this spec's is {key[:16]}")
        vocab = [int(t) for t in z["vocab"]]
        ids = z["ids"].astype(np.int64)
        w = z["weights"].astype(np.float32)
        samples, at = [], 0
        for n in z["lengths"].tolist():
            samples.append(Sample([vocab[i] for i in ids[at:at + n].tolist()], w[at:at + n].tolist()))
            at += n
        return TrainingData([int(t) for t in z["prefix_ids"]], vocab, samples, float(meta.get("seconds", 0.0)))


def train(spec: DemoSpec = DEFAULT_SPEC, *, log: Callable[[str], None] = print,
          on_step: Callable[[int, Any, list[int]], None] | None = None, data: TrainingData | None = None,
          device: str = "cpu", checkpoint: str | None = None, checkpoint_every: int = 500,
          key: str = "") -> tuple[Any, list[int], dict[str, Any]]:
    """Train; returns (compact model, compact vocab, training log). ``data`` defaults to
    :func:`training_data` (rendered here); ``device`` is where the steps run (``"cuda"``: about 50
    ms a step on an H200, host-bound, against about 1.1 s on two CPU cores; deterministic on the
    same GPU and torch, not bit-equal to a CPU training).

    ``checkpoint``: a file where the model, the optimizer and the losses so far are saved every
    ``checkpoint_every`` steps (atomically), and from which a training of the same ``key`` resumes
    (a training stopped at any point and resumed ends with the same bytes as one run straight
    through: the batches are fixed by the seed before the first step)."""
    import contextlib
    import os
    import warnings

    import torch
    from torch.nn import functional as F

    t_start = time.monotonic()
    cuda = device.startswith("cuda")
    attention: Any = contextlib.nullcontext()
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 as on CPU, not TF32
        torch.backends.cudnn.allow_tf32 = False
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.MATH)  # the fused kernels' backward is not deterministic
    else:
        torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    # on a GPU an op without a deterministic kernel warns (recorded in the log) rather than stops
    torch.use_deterministic_algorithms(True, warn_only=cuda)
    if data is None:
        data = training_data(spec, log=log)
    samples, vocab = data.samples, data.vocab
    index = {t: i for i, t in enumerate(vocab)}
    rng = random.Random(spec.seed)
    batches: list[list[Sample]] = []
    while len(batches) < spec.steps:  # an epoch: every session once, batches reshuffled
        batches += _batches(samples, spec, rng)
    batches = batches[: spec.steps]
    t_data = data.seconds + (time.monotonic() - t_start)
    log(f"data: {len(samples)} sessions, {sum(len(s.ids) for s in samples)} tokens, compact vocabulary "
        f"{len(vocab)} ids, prefix {len(data.prefix_ids)} tokens ({t_data:.1f} s); {spec.steps} steps on {device}")

    Model = _modules()
    model = Model(spec, vocab)
    _init(model, spec)
    model.to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and n != "embed.weight"]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n != "embed.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.98), eps=1e-8)

    def lr_at(step: int) -> float:
        if step < spec.warmup_steps:
            return spec.lr * (step + 1) / spec.warmup_steps
        t = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    prefix = torch.tensor([[index[t] for t in data.prefix_ids]], device=device)
    P = prefix.shape[1]
    losses: list[float] = []
    first = 0
    if checkpoint is not None and os.path.isfile(checkpoint):
        ck = torch.load(checkpoint, map_location=device, weights_only=True)
        if ck.get("key") != key or ck.get("vocab") != vocab:
            log(f"not resuming from {checkpoint}: another training's checkpoint")
        else:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            losses, first = list(ck["losses"]), int(ck["step"])
            log(f"resuming from {checkpoint} at step {first}/{spec.steps}")

    def save_checkpoint(step: int) -> None:
        tmp = f"{checkpoint}.tmp"
        torch.save({"key": key, "step": step, "vocab": vocab, "model": model.state_dict(), "opt": opt.state_dict(),
                    "losses": losses}, tmp)
        os.replace(tmp, str(checkpoint))

    t_train = time.monotonic()
    model.train()
    with warnings.catch_warnings(record=True) as seen, attention:
        warnings.simplefilter("always")
        for step in range(first, spec.steps):
            batch = batches[step]
            S = max(len(s.ids) for s in batch)
            ids = torch.zeros((len(batch), S), dtype=torch.long)
            w = torch.zeros((len(batch), S))
            for b, s in enumerate(batch):
                ids[b, : len(s.ids)] = torch.tensor([index[t] for t in s.ids])
                w[b, : len(s.ids)] = torch.tensor(s.weights)
            ids, w = ids.to(device), w.to(device)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            _, past = model(prefix)
            # continuation: all prefix keys, causal within itself (right padding is harmless)
            mask = torch.ones((S, P + S), dtype=torch.bool, device=device)
            mask[:, P:] = torch.tril(torch.ones((S, S), dtype=torch.bool, device=device))
            h, _ = model(ids, past=past, start=P, mask=mask)
            # predict ids[:, i] from position i-1 (the first from the prefix's last position)
            logits = model.logits(h[:, :-1])
            target = ids[:, 1:]
            weight = w[:, 1:]
            # ids[:, 0] is "<|im_start|>" of the first user turn: never a target (weight 0)
            loss_tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
            loss = (loss_tok * weight.reshape(-1)).sum() / weight.sum().clamp_min(1.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
            opt.step()
            losses.append(loss.item())
            if checkpoint is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == spec.steps):
                save_checkpoint(step + 1)
            if on_step is not None:
                on_step(step + 1, model, vocab)
            if (step + 1) % 25 == 0 or step == first or step + 1 == spec.steps:
                el = time.monotonic() - t_train
                eta = el / (step + 1 - first) * (spec.steps - step - 1)
                log(f"step {step + 1}/{spec.steps}  loss {sum(losses[-25:]) / len(losses[-25:]):.4f}  "
                    f"lr {lr_at(step):.2e}  {el:.0f} s elapsed, ~{eta:.0f} s left")
    nondeterministic = sorted({str(wm.message).split("\n")[0] for wm in seen if "determinis" in str(wm.message)})
    for wm in seen:
        if str(wm.message).split("\n")[0] not in nondeterministic:
            warnings.warn_explicit(wm.message, wm.category, wm.filename, wm.lineno)
    model.eval()
    model.to("cpu")
    info = {
        "train_seconds": round(time.monotonic() - t_train, 1),
        "data_seconds": round(t_data, 1),
        "total_seconds": round(time.monotonic() - t_start, 1),
        "resumed_at_step": first,
        "sessions": len(samples),
        "tokens": sum(len(s.ids) for s in samples),
        "compact_vocab": len(vocab),
        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 5),
        "loss_curve": [round(sum(losses[i:i + 25]) / len(losses[i:i + 25]), 4) for i in range(0, len(losses), 25)],
        "threads": spec.threads,
        "device": _device_name(torch, device),
        "torch": str(torch.__version__),
        "nondeterministic_ops": nondeterministic,
    }
    return model, vocab, info


def _device_name(torch, device: str) -> str:
    if device.startswith("cuda"):
        return f"cuda ({torch.cuda.get_device_name(torch.device(device))})"
    return f"cpu ({torch.get_num_threads()} threads)"


# -- the trained parameters: compact (what is shipped) ----------------------------------------


def hf_names(spec: DemoSpec) -> dict[str, str]:
    """The compact model's parameter names -> the Qwen3ForCausalLM names of the same tensors
    (``embed``/``head`` are the compact rows of ``model.embed_tokens``/``lm_head``)."""
    names = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
             "norm.weight": "model.norm.weight"}
    for i in range(spec.num_hidden_layers):
        c, p = f"layers.{i}.", f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            names[c + n + ".weight"] = p + n + ".weight"
        for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            names[c + n + ".weight"] = p + f"self_attn.{n}.weight"
        for n in ("gate_proj", "up_proj", "down_proj"):
            names[c + n + ".weight"] = p + f"mlp.{n}.weight"
    return names


def compact_state(model) -> dict[str, Any]:
    """The trained parameters as saved: bfloat16, under their Qwen3ForCausalLM names, with
    ``model.embed_tokens.weight`` and ``lm_head.weight`` holding only the compact vocabulary's rows
    (in the order of ``model.vocab``)."""
    import torch

    params = dict(model.named_parameters())
    names = hf_names(model.spec)
    if set(params) != set(names):
        raise AssertionError(f"compact model parameters {sorted(set(params) ^ set(names))} have no Qwen3 name")
    return {names[n]: p.detach().float().to(torch.bfloat16).contiguous() for n, p in sorted(params.items())}


def compact_model(state: dict[str, Any], vocab: list[int], spec: DemoSpec):
    """A compact model holding ``state`` (from :func:`compact_state`), for evaluation in PyTorch."""
    import torch

    model = _modules()(spec, vocab)
    names = hf_names(spec)
    model.load_state_dict({c: state[h].float() for c, h in names.items()}, strict=True)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model

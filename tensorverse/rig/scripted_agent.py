"""A vLLM logits processor that makes a rig server answer like a small tool-using model, for tests
that drive a real agent (turnstone) through the proxy: the rig's tiny models have random weights
and never call a tool on their own.

    VLLMServer(..., extra_args=("--logits-processors", "tensorverse.rig.scripted_agent:ScriptedAgent",
                                "--enable-auto-tool-choice", "--tool-call-parser", "hermes"))

Everything else is the real thing: vLLM's scheduler, the real Qwen3 tokenizer and chat template,
vLLM's hermes tool parser, the streamed events, token ids and logprobs. Only the choice of the
next token is taken away from the weights: for each request the processor reads the prompt,
decides an answer (below), tokenizes it with the server's tokenizer and, at every step, leaves
only the answer's next token (then ``<|im_end|>``) with a finite logit. The other logits are
``-inf``, so greedy and sampled requests give the same tokens.

The answer, from the rendered prompt (Qwen3 ChatML):

* the prompt offers tools (``<tools>`` in the system turn): the conversation's next file read,
  ``read_file`` of ``f<k>.txt`` for k = 0 .. ``TENSORVERSE_SCRIPTED_ROUNDS`` - 1 (default 8),
  as a hermes ``<tool_call>``; then a final answer. A conversation is told apart by its system
  turn with the tool list cut off (turnstone's carries a per-conversation workstream id), so a
  conversation's count survives its context compaction;
* no tools and a system turn that asks for a title: a short title;
* no tools otherwise (turnstone's compaction summaries and their merges): a summary sentence
  with a counter (each one distinct).

A prompt the processor has answered before gets the same answer (vLLM may re-add a preempted
request), so the count moves once per new prompt. It runs in the engine process; it is a test
rig, never loaded by Tensorverse itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["ScriptedAgent", "answer_for"]

ROUNDS = int(os.environ.get("TENSORVERSE_SCRIPTED_ROUNDS", "8"))


def _system_turn(prompt: str) -> str:
    start = prompt.find("<|im_start|>system\n")
    if start < 0:
        return ""
    end = prompt.find("<|im_end|>", start)
    return prompt[start + len("<|im_start|>system\n"):end if end >= 0 else None]


class Script:
    """The answers of one server: per-conversation file counters and a summary counter."""

    def __init__(self, rounds: int = ROUNDS) -> None:
        self.rounds = rounds
        self.reads: dict[str, int] = {}
        self.summaries = 0

    def answer(self, prompt: str) -> str:
        system = _system_turn(prompt)
        if "<tools>" in system:
            key = hashlib.sha256(system.split("# Tools", 1)[0].encode()).hexdigest()
            k = self.reads.get(key, 0)
            self.reads[key] = k + 1
            if k < self.rounds:
                call = {"name": "read_file", "arguments": {"path": f"f{k}.txt"}}
                return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
            return f"FINAL: read {k} files; every uplink is up."
        if "title" in system.lower():
            return "Uplink Check"
        self.summaries += 1
        return (f"Summary {self.summaries}: the user asked to read f0.txt to f{self.rounds - 1}.txt "
                "one by one; the reading goes on.")


def answer_for(prompt: str, script: Script | None = None) -> str:
    """The answer a fresh script gives to ``prompt`` (for tests of the script itself)."""
    return (script or Script()).answer(prompt)


class _Req:
    __slots__ = ("answer", "out")

    def __init__(self, answer: list[int], out: list[int]) -> None:
        self.answer = answer
        self.out = out  # the runner's live output token list


class ScriptedAgent(LogitsProcessor):
    """See the module docstring (vLLM V1 logits-processor interface)."""

    def __init__(self, vllm_config: "VllmConfig", device: torch.device, is_pin_memory: bool) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        self.end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.script = Script()
        self._answers: dict[bytes, list[int]] = {}
        self._reqs: dict[int, _Req] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: vLLM must call it on greedy batches too

    def _answer(self, prompt_ids: list[int]) -> list[int]:
        key = hashlib.sha256(json.dumps(prompt_ids).encode()).digest()
        if key not in self._answers:
            text = self.script.answer(str(self.tokenizer.decode(prompt_ids)))
            self._answers[key] = self.tokenizer.encode(text, add_special_tokens=False) + [self.end]
        return self._answers[key]

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        reqs = self._reqs
        for index in batch_update.removed:
            reqs.pop(index, None)
        for index, _params, prompt, out in batch_update.added:
            reqs[index] = _Req(self._answer(list(prompt or [])), out)
        for a, b, direction in batch_update.moved:
            sa, sb = reqs.pop(a, None), reqs.pop(b, None)
            if direction == MoveDirectionality.SWAP and sb is not None:
                reqs[a] = sb
            if sa is not None:
                reqs[b] = sa

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, st in self._reqs.items():
            if index >= logits.shape[0]:
                continue
            pos = len(st.out)
            token = st.answer[pos] if pos < len(st.answer) else self.end
            row = logits[index]
            keep = row[token].clone()
            row.fill_(float("-inf"))
            row[token] = keep if torch.isfinite(keep) else 0.0
        return logits

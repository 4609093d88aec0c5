"""The demo model's spec: its architecture and how it is trained, as values.

Apart from :mod:`tensorverse.demo.trainer` on purpose: the training key
(:func:`tensorverse.demo.model.training_key_parts`) hashes the trainer's *source* and the spec's
*values*, so a training run with ``--steps``/``--epochs`` elsewhere (a GPU) keeps its key when
those values later become the defaults here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorverse.rig import models as rig_models

MODEL_NAME = "netops-demo"  # the served model name too


@dataclass(frozen=True)
class DemoSpec(rig_models.ModelSpec):
    """The demo model: a rig :class:`~tensorverse.rig.models.ModelSpec` (the architecture, written
    by the rig's checkpoint writer) plus how it is trained."""

    name: str = MODEL_NAME
    intermediate_size: int = 384
    num_hidden_layers: int = 3
    tie_word_embeddings: bool = False  # the compact head is trained apart from the embeddings
    unused_embed_std: float = 0.02
    steps: int = 6000
    epochs: int = 1  # each training session is seen this many times
    tokens_per_step: int = 2400  # continuation tokens (after the shared prefix) per step
    max_tasks: int = 4  # tasks per training session: 1..max_tasks
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    answer_weight: float = 0.5  # loss weight of final-answer tokens (tool calls weigh 1)
    value_weight: float = 3.0  # loss weight of argument values in tool calls (copied from the context)
    threads: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tie_word_embeddings:
            raise ValueError("the demo model has an untied LM head (unused rows are 0, their embeddings are not)")
        if self.epochs < 1 or self.steps < 1:
            raise ValueError(f"steps ({self.steps}) and epochs ({self.epochs}) must be at least 1")


DEFAULT_SPEC = DemoSpec()

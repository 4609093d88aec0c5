"""turnstone, a real coding agent (PyPI ``turnstone`` 1.9.0), for the tests and benchmarks that run
it against Tensorverse.

``agent``: its cached Python 3.13 environment and one non-interactive session driven by
``turnstone_drive.sh`` (beside it). ``scripted``: a chat server that answers it from a script, so
that it runs a long, compacting conversation without a model. ``hop``: a recording HTTP relay
that keeps every exchange byte for byte (the proxy's fidelity checks with a real vLLM).
"""

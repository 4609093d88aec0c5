"""Tensorverse's test suite: a package, so that test helpers import as ``tests.<dir>.<module>``
(``pythonpath = ["."]`` in pyproject.toml puts the checkout on ``sys.path``)."""

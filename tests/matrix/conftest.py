"""The local matrix run that the matrix tests and the Ray test share (``grid``, session scope).

The grid of ``grid_spec.py`` is run once with the local executor (~5 server starts):
``test_matrix_vllm.py`` checks its report, resuming and bisection; ``test_ray_vllm.py`` runs three
of its points on Ray and takes the local side of that comparison from this run's cache (a matrix
reuses a finished run of the same key), so those configurations do not start again.
"""

from __future__ import annotations

import pytest

from tests.matrix.grid_spec import run_grid


@pytest.fixture(scope="session")
def grid(tmp_path_factory):
    return run_grid(tmp_path_factory.mktemp("matrix"))

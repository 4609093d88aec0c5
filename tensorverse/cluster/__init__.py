"""Where work runs, below every tool that runs it: the ``--executor`` flags and their options
(:mod:`tensorverse.cluster.options`) and the directory transfer between a cluster's nodes and the
driver (:mod:`tensorverse.cluster.transfer`). ``tensorverse matrix``/``bisect`` (their executors,
:mod:`tensorverse.matrix.executor`) and ``tensorverse replay --executor ray``
(:mod:`tensorverse.replay.ray_task`) build on it; it imports nothing of the project."""

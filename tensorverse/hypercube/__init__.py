"""The hypercube site: many rigs' checked results bundles merged into one static site
(``tensorverse hypercube build BUNDLE... --site DIR``, docs/hypercube.md).

:mod:`~tensorverse.hypercube.merge` merges :class:`~tensorverse.bundle.check.CheckedBundle`\\ s into one
typed model (DuckDB over the bundles' tables), :mod:`~tensorverse.hypercube.stats` computes each
setting's marginal effect with turns as the unit, :mod:`~tensorverse.hypercube.site` writes the
site (one HTML page with the data embedded, the JS and CSS next to it) and
:mod:`~tensorverse.hypercube.cli` is the command.
"""

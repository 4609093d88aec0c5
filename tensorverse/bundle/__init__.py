"""Rig results bundles (format 1): what ``tensorverse rig run`` writes, ``tensorverse report
check`` accepts or refuses, and ``tensorverse hypercube build`` merges. docs/rigs.md.

``format``: the members, columns, limits and refusal reasons (protocol only); ``io``: writing and
the hostile-input reader; ``make``: a bundle from a run's rows; ``summary``: the per-setting
figures (pure); ``known``: what a checker knows of a corpus; ``check``: the submission checker.
"""

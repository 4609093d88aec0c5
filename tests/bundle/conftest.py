"""Fixtures of the bundle tests: a synthetic corpus, the corpora the checker knows, a good
bundle of it, and a fresh copy of that bundle per test to tamper with."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorverse.rig.suite import known_corpora
from tensorverse.testing.rig_bundles import make_corpus, synth_bundle
from tests.bundle.test_bundle_check import REFUSED, SCALES  # type: ignore[import-not-found]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus") / "synthetic-v1")


@pytest.fixture(scope="module")
def corpora(corpus):
    return known_corpora([corpus.path])


@pytest.fixture(scope="module")
def good(tmp_path_factory, corpus) -> Path:
    return synth_bundle(tmp_path_factory.mktemp("good") / "rig-a.tvbundle", corpus, rig_label="rig-a",
                        scales=SCALES, refused=REFUSED)


@pytest.fixture
def bundle(tmp_path, good) -> Path:
    """A fresh copy of the good bundle, to tamper with."""
    p = tmp_path / "b.tvbundle"
    p.write_bytes(good.read_bytes())
    return p

"""The refusal every kind of bad input raises: a message and a reason code that survives pickling."""

from __future__ import annotations

import pickle

import pytest

from tensorverse.analysis.metrics import AnalysisInputError
from tensorverse.capture.frames import FrameError
from tensorverse.config import ConfigError
from tensorverse.matrix.spec import SpecError
from tensorverse.refusal import Refusal
from tensorverse.replay.corpus import CorpusError
from tensorverse.store.codec import CodecError
from tensorverse.store.records import RecordError

KINDS = [CodecError, FrameError, RecordError, ConfigError, SpecError, CorpusError, AnalysisInputError]


@pytest.mark.parametrize("cls", KINDS, ids=lambda c: c.__name__)
def test_every_reason_of_every_refusal_pickles_whole_and_is_a_value_error(cls: type[Refusal]) -> None:
    assert issubclass(cls, ValueError) and cls.REASONS and len(set(cls.REASONS)) == len(cls.REASONS)
    for reason in cls.REASONS:
        back = pickle.loads(pickle.dumps(cls(f"bad input ({reason})", reason)))
        assert (type(back), str(back), back.reason) == (cls, f"bad input ({reason})", reason)


@pytest.mark.parametrize("cls", KINDS, ids=lambda c: c.__name__)
def test_a_refusal_with_a_reason_its_kind_does_not_list_is_a_programming_error(cls: type[Refusal]) -> None:
    with pytest.raises(TypeError):
        cls("bad input", "no-such-reason")

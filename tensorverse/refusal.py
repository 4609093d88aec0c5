"""What every refusal of bad input carries: a message for people and a reason code for code.

A refusal names the file, record or key it refuses in its message (the wording is for people and
may change); ``reason``, one of its class's ``REASONS``, says why in a word that does not change, so
that a caller (a sink resending a batch, a CLI wrapper, a test) branches on it without parsing text.
The refusals: `tensorverse.store.codec.CodecError` (rows and compact rows),
`tensorverse.capture.frames.FrameError` (captured frames), `tensorverse.store.records.RecordError`
(store records), `tensorverse.config.ConfigError` (the proxy's configuration),
`tensorverse.matrix.spec.SpecError` (matrix specs), `tensorverse.replay.corpus.CorpusError`
(corpora and cases) and `tensorverse.analysis.metrics.AnalysisInputError` (the inputs of the analysis:
logits, token ids, top-k logprobs, counts). Each pickles whole, reason included, so it crosses the proxy's worker
processes unchanged.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["Refusal"]


class Refusal(ValueError):
    """Bad input, refused: ``str(e)`` for people, ``e.reason`` (one of ``REASONS``) for code."""

    #: the reasons a subclass may give, each documented where the subclass is defined
    REASONS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, message: str, reason: str) -> None:
        if reason not in self.REASONS:  # a programming error: every raise names a known reason
            raise TypeError(f"{type(self).__name__}: unknown reason {reason!r} (one of {', '.join(self.REASONS)})")
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple:  # pickled whole: the reason survives a process boundary
        return (type(self), (str(self), self.reason))

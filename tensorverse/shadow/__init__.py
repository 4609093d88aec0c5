"""Shadow runs: one recorded turn on shadow backends, in ``forced`` and ``free`` mode.

``backend``     the :class:`Backend` dataclass (name, url, model, own api_key, role, capture...)
``runner``      :class:`ShadowRunner` / :func:`shadow_turn`: forced + free runs and their fallbacks
``turn``        :class:`TurnInput`: the recorded turn the runner reads, normalised
``completions`` the ``/v1/completions`` bodies of each run, and how their answers are read
``records``     run records (pure builders), :func:`primary_run_id`, the primary's parser check
``cache``       :class:`RunnerCache`: backend capabilities and tokenizer fingerprints, cached
``compare``     :func:`compare_turn`: a turn's stored runs into comparisons (candidate vs reference)
``tokenizer``   same-dictionary check (tokenizer fingerprints) and the chat-template check
``doctor``      ``tensorverse doctor``: what a backend supports
``client``      the small aiohttp JSON client with typed failures
"""

from tensorverse.shadow.backend import Backend
from tensorverse.shadow.compare import compare_turn
from tensorverse.shadow.runs import primary_run_id
from tensorverse.shadow.runner import ShadowRunner, shadow_turn
from tensorverse.shadow.turn import TurnInput

__all__ = ["Backend", "ShadowRunner", "TurnInput", "shadow_turn", "compare_turn", "primary_run_id"]

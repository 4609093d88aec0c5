"""Shadow runs: one recorded turn on shadow backends, in ``forced`` and ``free`` mode.

``backend``    the :class:`Backend` dataclass (name, url, model, own api_key, role, capture...)
``runner``     :class:`ShadowRunner` / :func:`shadow_turn`: forced + free runs, run records
``compare``    :func:`compare_turn`: a turn's stored runs into comparisons (candidate vs reference)
``tokenizer``  same-dictionary check (tokenizer fingerprints) and the chat-template check
``doctor``     ``tensorverse doctor``: what a backend supports
``client``     the small aiohttp JSON client with typed failures
"""

from tensorverse.shadow.backend import Backend
from tensorverse.shadow.compare import compare_turn
from tensorverse.shadow.runner import ShadowRunner, TurnInput, primary_run_id, shadow_turn

__all__ = ["Backend", "ShadowRunner", "TurnInput", "shadow_turn", "compare_turn", "primary_run_id"]

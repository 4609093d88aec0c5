"""LMDB capture store: schema, single writer, readers, and the lossless logits codec."""

from tensorverse.store.store import RecordNotFound, Store, StoreNotReadyError, StoreVersionError
from tensorverse.store.writer import StoreClosedError, StoreFullError

__all__ = ["Store", "StoreFullError", "StoreClosedError", "StoreVersionError", "StoreNotReadyError", "RecordNotFound", "store_path"]


def store_path(arg: str | None) -> str:
    """The store directory a command uses: ``--store``, else $TENSORVERSE_STORE, else ./tensorverse-data."""
    import os

    return arg or os.environ.get("TENSORVERSE_STORE") or "./tensorverse-data"

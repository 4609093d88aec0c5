"""LMDB capture store: schema, single writer, readers, and the lossless logits codec."""

from tensorverse.store.store import RecordNotFound, Store, StoreVersionError
from tensorverse.store.writer import StoreClosedError, StoreFullError

__all__ = ["Store", "StoreFullError", "StoreClosedError", "StoreVersionError", "RecordNotFound"]

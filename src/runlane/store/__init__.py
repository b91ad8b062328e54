"""The store: the only layer that talks SQL."""

from runlane.store.store import Store

__all__ = ["Store"]

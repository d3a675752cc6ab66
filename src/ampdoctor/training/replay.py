"""Bundle replay (temporary: re-exported from runtime until the split)."""

from .runtime import replay_bundle

__all__ = ["replay_bundle"]

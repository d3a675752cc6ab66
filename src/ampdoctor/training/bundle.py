"""Failure bundles (temporary: re-exported from runtime until the split)."""

from .runtime import is_bundle, load_bundle, write_atomic

__all__ = ["is_bundle", "load_bundle", "write_atomic"]

"""The Report and its renderers (text, markdown, HTML, DataFrame, plot). Pure: no torch, no live model."""

from .report import SCHEMA_VERSION, Report

__all__ = ["SCHEMA_VERSION", "Report"]

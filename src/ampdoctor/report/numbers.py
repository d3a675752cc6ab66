"""The one number format of every report renderer (text, markdown, HTML, scan reports, plots). Pure."""

from __future__ import annotations

from ..numbers import fmt_num

__all__ = ["fmt_num"]

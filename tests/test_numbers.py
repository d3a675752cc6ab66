"""One number format for loss scales in every note and message (ampdoctor.numbers), whatever layer writes it."""

from __future__ import annotations

import math

import pytest

from ampdoctor.numbers import fmt_num, fmt_scale
from ampdoctor.report.numbers import fmt_num as report_fmt_num


@pytest.mark.parametrize(
    ("scale", "text"),
    [
        (65536.0, "65536"),
        (2.0**22, "4194304"),  # not 4.1943e+06
        (2.0**24, "16777216"),
        (2.0**49, "562949953421312"),
        (2.0**50, "1.126e+15"),
        (1.0, "1"),
        (0.5, "0.5"),
        (2.0**-10, "9.766e-04"),
        (math.inf, "inf"),
        (math.nan, "nan"),
    ],
)
def test_fmt_scale(scale: float, text: str) -> None:
    assert fmt_scale(scale) == text


def test_the_report_renderers_use_the_same_number_format() -> None:
    assert report_fmt_num is fmt_num


def test_a_note_names_a_large_scale_in_full() -> None:
    from ampdoctor.analysis.survey_only import SurveyEvidence

    note = SurveyEvidence(2.0**22, 2.0**27, 0, 256, 256, 8, 0.0, 0.0).note("float16")
    assert "at scale 4194304 the parameter gradients" in note and "up to 134217728, the largest finite" in note
    assert "e+0" not in note

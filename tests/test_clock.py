"""The one spelling of a moment (deploy_tool/clock.py): what state.json, the history, pins and MANIFESTs hold."""

from __future__ import annotations

import re

from deploy_tool.clock import iso_utc


def test_a_moment_is_utc_text_ending_in_z_to_the_second_or_the_microsecond() -> None:
    assert iso_utc(0) == "1970-01-01T00:00:00Z"
    assert iso_utc(1_764_594_000.123456, micro=True) == "2025-12-01T13:00:00.123456Z"
    assert iso_utc(253402300799) == "9999-12-31T23:59:59Z"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", iso_utc())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", iso_utc(micro=True))

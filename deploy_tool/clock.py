"""Times as text: the one spelling of a moment in state.json, the history, the journal's events, pins, bench runs
and MANIFESTs. Always UTC, always ending in Z, so the texts sort as the moments do."""

from __future__ import annotations

import datetime as _dt


def iso_utc(epoch: float | None = None, *, micro: bool = False) -> str:
    """`epoch` (seconds since 1970; now when None) as ISO 8601 UTC text: 2026-12-01T13:00:00Z, or with `micro`
    2026-12-01T13:00:00.123456Z (what state.json, the history and the operation lock record)."""
    t = _dt.datetime.now(_dt.UTC) if epoch is None else _dt.datetime.fromtimestamp(epoch, _dt.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")

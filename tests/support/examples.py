"""How many examples a property test tries: all of them in `make test`, a quarter in `make check`.

`make check` is the inner loop: it runs every test that needs no sandbox, backend or fleet, and it runs each property
test too, on fewer examples (`DEPLOYTOOL_TEST_QUICK=1`, which the Makefile sets for it). `make test`, and CI after
`make check`, try them all. A property test names its full count through `examples(n)`; a test with no count of its
own gets Hypothesis's default (100), or 25 under the quick profile that tests/conftest.py loads.
"""

from __future__ import annotations

import os

QUICK = os.environ.get("DEPLOYTOOL_TEST_QUICK", "") == "1"
QUICK_DEFAULT = 25


def examples(n: int) -> int:
    """`n`, or in the quick run a quarter of it and never fewer than min(n, 10)."""
    return max(min(n, 10), n // 4) if QUICK else n

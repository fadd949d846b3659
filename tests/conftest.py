"""Shared fixtures, the per-file timing summary, and how `make test` groups tests for its xdist workers."""

from tests.support.e2e import demo, installed  # noqa: E402,F401
from tests.support.groups import pytest_collection_modifyitems  # noqa: E402,F401
from tests.support.sandbox import *  # noqa: F401,F403
from tests.support.timing import pytest_runtest_logreport, pytest_terminal_summary  # noqa: E402,F401

"""Shared fixtures, the per-file timing summary, and how `make test` groups tests for its xdist workers."""

import os
from pathlib import Path

import pytest

# deploytool's journal events (deploy_tool.box.journal) never reach this machine's own journal from a test run on
# a systemd box: in-process tests send nowhere; the CLI as a child (tests/support/demo_box.dt) writes into its
# sandbox's journald as on a box
os.environ.setdefault("DEPLOYTOOL_JOURNAL_SOCKET", "")

from hypothesis import settings  # noqa: E402

from tests.support.examples import QUICK, QUICK_DEFAULT  # noqa: E402

if QUICK:  # make check: property tests without a count of their own try fewer examples (tests/support/examples.py)
    settings.register_profile("quick", max_examples=QUICK_DEFAULT)
    settings.load_profile("quick")

from tests.support.e2e import demo, installed  # noqa: E402,F401
from tests.support.groups import pytest_collection_modifyitems  # noqa: E402,F401
from tests.support.sandbox import *  # noqa: F401,F403
from tests.support.timing import pytest_runtest_logreport, pytest_terminal_summary  # noqa: E402,F401


# The two small real bundles of tests/test_install_kills.py, and release A installed from them, for every module that
# uses them (install kills, releases, trust: one xdist group): defined here, they are built once per worker (a
# fixture a test module imports is that module's own, and was built again for each).
@pytest.fixture(scope="session")
def bundles(tmp_path_factory: pytest.TempPathFactory):  # -> tests.test_install_kills.Bundles
    from tests import test_install_kills as kills

    return kills.make_bundles(tmp_path_factory)


@pytest.fixture(scope="session")
def saved_a(bundles) -> Path:
    from tests import test_install_kills as kills

    return kills.make_saved_a(bundles)

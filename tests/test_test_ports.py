"""The test suite's own port picker (tests.support.backends.free_port): a port handed to one test process is never
handed to another while that process lives, so a box installed for a whole run keeps its backends' port while its
backends are stopped and nothing listens there (a switch then found another worker's server on it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support import backends

REPO = Path(__file__).resolve().parents[1]
PICK = "import sys; sys.path.insert(0, sys.argv[1]); from tests.support.backends import free_port; " \
       "print(' '.join(str(free_port()) for _ in range(int(sys.argv[2]))), flush=True); sys.stdin.read()"


def test_ports_of_living_processes_are_never_handed_out_again() -> None:
    """Three processes picking 150 ports each while alive get 450 different ports, none of them ours."""
    procs = [subprocess.Popen([sys.executable, "-c", PICK, str(REPO), "150"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        theirs = [set(map(int, p.stdout.readline().split())) for p in procs]  # type: ignore[union-attr]
        ours = {backends.free_port() for _ in range(150)}
    finally:
        for p in procs:
            p.communicate("")
    assert all(len(t) == 150 for t in theirs) and len(ours) == 150
    assert len(set().union(*theirs, ours)) == 600


def test_the_lease_of_a_process_that_is_gone_is_taken_again() -> None:
    """A port leased by a process that has exited is free for the next pick (after its stale lease is cleared)."""
    out = subprocess.run([sys.executable, "-c", PICK, str(REPO), "1"], input="", capture_output=True, text=True,
                         check=True).stdout
    port = int(out)
    lease = backends.PORT_LEASES / str(port)
    assert lease.exists()
    assert not backends._lease(port) and not lease.exists()  # the stale lease cleared, not taken in the same step
    assert backends._lease(port) and lease.read_text() == str(os.getpid())

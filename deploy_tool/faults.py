"""Fault injection for crash and race tests, through one environment variable (unset on a real box: no effect).

DEPLOYTOOL_FAULT=kill:<point>  the process SIGKILLs itself at <point> (an install or switch step)
DEPLOYTOOL_FAULT=stop:<point>  the process SIGSTOPs itself at <point>; a test changes the world, then SIGCONTs it
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "DEPLOYTOOL_FAULT"


def fault(point: str) -> None:
    want = os.environ.get(FAULT_ENV)
    if not want:
        return
    if want == f"kill:{point}":
        os.kill(os.getpid(), signal.SIGKILL)
    elif want == f"stop:{point}":
        os.kill(os.getpid(), signal.SIGSTOP)

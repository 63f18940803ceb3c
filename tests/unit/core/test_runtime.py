"""Process helpers of the core: whether a process runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from sluice.core.runtime import pid_alive


def test_a_running_process_is_alive_and_an_unreaped_one_is_not() -> None:
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        # Not waited for: once it has exited it is a zombie, which kill(pid, 0) still finds.
        while pid_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pid_alive(child.pid)
    finally:
        child.wait()
    assert not pid_alive(child.pid)

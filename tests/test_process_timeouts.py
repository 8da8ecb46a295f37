"""The multi-process tests' runner kills a whole hung process group on timeout (no orphaned ranks)."""

import os
import subprocess
import sys
import time

import pytest

from tests.runner import run_process_group

pytestmark = pytest.mark.heavy  # processes and their timeouts


def test_timeout_kills_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    code = (
        f"import subprocess, time; p = subprocess.Popen(['sleep', '120']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_process_group([sys.executable, "-c", code], timeout=3)
    assert time.monotonic() - start < 30
    child = int(pidfile.read_text())
    for _ in range(50):  # the kill is asynchronous: give the kernel a moment to reap
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        if open(f"/proc/{child}/stat").read().split()[2] == "Z":
            return  # a zombie waiting for init: dead
        time.sleep(0.1)
    pytest.fail(f"child {child} of the timed-out command is still alive")

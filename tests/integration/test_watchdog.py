"""The watchdog ends a server's process group once the process that started it is gone."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

from rl_cluster.generator.server import group_alive


def test_watchdog_ends_the_group_when_its_owner_dies(tmp_path):
    """The watchdog mechanism itself, on a stand-in process tree (the real vLLM case is in
    tests/integration/test_generator.py)."""
    tree = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    group = subprocess.Popen([sys.executable, "-c", tree], start_new_session=True)
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "rl_cluster.generator.watchdog", str(owner.pid), str(group.pid)],
        start_new_session=True,
    )
    try:
        time.sleep(1.5)
        assert group_alive(group.pid) and watchdog.poll() is None  # the owner lives: hands off
        owner.kill()
        owner.wait()
        # The group's leader is our child: reap it the moment it dies (as init reaps a dead actor's server),
        # or its zombie keeps the group "alive" and the watchdog waits out its whole grace period.
        reaper = threading.Thread(target=group.wait, daemon=True)
        reaper.start()
        assert watchdog.wait(timeout=20) == 0
        reaper.join(timeout=5)
        assert group.returncode is not None
        deadline = time.time() + 10
        while group_alive(group.pid) and time.time() < deadline:
            time.sleep(0.2)
        assert not group_alive(group.pid)
    finally:  # nothing of ours outlives a failure
        for process in (owner, watchdog):
            process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group.pid, signal.SIGKILL)

"""Detached watchdog: `python -m rl_cluster.generator.watchdog OWNER_PID PGID` (started via `setsid --fork`).

Ends process group PGID (a vLLM server tree) once process OWNER_PID (the generator actor, or whoever
started the server) is gone, then exits. It runs in its own session and is not the owner's child, so
neither killing the owner's process group nor Ray's killing of a dead worker's children reaches it. It imports nothing heavy so it
costs a few MB.
"""

import os
import sys
import time

from rl_cluster.generator.server import group_alive, terminate_group


def owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie owner (exited, not yet reaped) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main(owner_pid: int, pgid: int, poll_s: float = 1.0) -> None:
    while group_alive(pgid):
        if not owner_alive(owner_pid):
            terminate_group(pgid, grace_s=5.0)
            return
        time.sleep(poll_s)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

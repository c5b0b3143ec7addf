"""The proxy process's collector settings (rl_cluster.proxy.heap), in a child process: they are process-wide."""

import json
import subprocess
import sys


def test_freeze_startup_heap_hides_startup_objects_and_spaces_young_passes():
    code = (
        "import gc, json\n"
        "import rl_cluster.config\n"  # a start-up heap worth freezing: pydantic and the config tree
        "from rl_cluster.proxy.heap import YOUNG_THRESHOLD, freeze_startup_heap\n"
        "before = (gc.get_freeze_count(), gc.get_threshold())\n"
        "freeze_startup_heap()\n"
        "print(json.dumps([before, gc.get_freeze_count(), gc.get_threshold(), YOUNG_THRESHOLD]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    (frozen_before, threshold_before), frozen, threshold, young = json.loads(out)
    assert frozen_before == 0 and frozen > 10_000  # the imports' objects no longer walked by full passes
    assert threshold == [young, *threshold_before[1:]] and young > threshold_before[0]

"""Asynchronous GRPO with LoRA adapters: one trainer, N vLLM generators, one proxy, one bucket.

    python jobs/train_grpo.py --config jobs/configs/cpu_demo.toml [section.field=value ...]
    ray job submit --working-dir . -- python jobs/train_grpo.py --config jobs/configs/<run>.toml
    python jobs/train_grpo.py --config jobs/configs/<run>.toml --resume RUN_NAME   (continue a run)

Joins a running Ray cluster if there is one, else starts a local one. Writes everything under
<bucket>/<run_name>/ and prints a summary table at the end. Exit status: 0 finished and served =
trained, 1 stopped or failed (summary.json is written in both cases), 2 refused before anything started
(a config that does not load, data not prepared, a run name taken: one line, the traceback with
--debug), 3 finished but served != trained. The same as `rl-cluster train`.
"""

from __future__ import annotations

import sys

from rl_cluster.cli import main

if __name__ == "__main__":
    # The same command as `rl-cluster train`, whose arguments are defined once (rl_cluster.commands); this
    # script stays for `ray job submit`, where the console script may not be installed.
    sys.exit(main(["train", *sys.argv[1:]]))

"""Set the generator pool of a running run by hand, or hand it back to automatic scaling.

    python jobs/scale.py --run RUN_NAME --replicas N [--address ADDR] [--no-wait]
    python jobs/scale.py --run RUN_NAME --auto       # back to rl_cluster.core.scaling's policy
    python jobs/scale.py --run RUN_NAME              # the pool's status and scale events, as JSON
    ray job submit --address http://<head>:8265 -- python jobs/scale.py --run RUN_NAME --replicas N

Connects to the run's Ray cluster (ADDR, else RAY_ADDRESS, else the one started on this machine) and
asks the run's pool controller (the named actor `<run>-pool`) for N replicas, within the run's
[generator.min_replicas, generator.max_replicas]; N holds until `--auto`. Waits until N replicas serve
(new ones have loaded every live adapter version; removed ones have drained), printing the pool's
state as it changes. Exit status: 0 done, 1 no such run or not there in time, 2 N refused. The same as
`rl-cluster scale`.
"""

from __future__ import annotations

import sys

from rl_cluster.cli import main

if __name__ == "__main__":
    # The same command as `rl-cluster scale`, whose arguments are defined once (rl_cluster.commands); this
    # script stays for `ray job submit`, where the console script may not be installed.
    sys.exit(main(["scale", *sys.argv[1:]]))

"""Set the generator pool of a running run by hand, or hand it back to automatic scaling.

    python jobs/scale.py --run RUN_NAME --replicas N [--address ADDR] [--no-wait]
    python jobs/scale.py --run RUN_NAME --auto       # back to rl_cluster.core.scaling's policy
    python jobs/scale.py --run RUN_NAME              # the pool's status and scale events, as JSON
    ray job submit --address http://<head>:8265 -- python jobs/scale.py --run RUN_NAME --replicas N

Connects to the run's Ray cluster (ADDR, else RAY_ADDRESS, else the one started on this machine) and
asks the run's pool controller (the named actor `<run>-pool`) for N replicas, within the run's
[generator.min_replicas, generator.max_replicas]; N holds until `--auto`. Waits until N replicas serve
(new ones have loaded every live adapter version; removed ones have drained), printing the pool's
state as it changes. Exit status: 0 done, 1 no such run or not there in time, 2 N refused.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, help="run_name of the running run")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--replicas", type=int, help="generators the pool should run")
    target.add_argument("--auto", action="store_true", help="hand the pool back to automatic scaling")
    parser.add_argument("--address", help="Ray address of the run's cluster (default: RAY_ADDRESS, or auto)")
    parser.add_argument("--no-wait", action="store_true", help="return once the controller has the target")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the pool (900)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from rl_cluster.pool import scale

    return scale(args.run, args.replicas, args.auto, args.address, not args.no_wait, args.timeout)


if __name__ == "__main__":
    sys.exit(main())

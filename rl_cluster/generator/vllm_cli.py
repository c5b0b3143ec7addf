"""`python -m rl_cluster.generator.vllm_cli ARGS`: vLLM's own command line (`... bench serve --help`),
where the `vllm` console script of the CPU build dies at start (vllm_compat, item 2)."""

from __future__ import annotations

import sys

from rl_cluster.generator.vllm_compat import vllm_version_of_either_build


def main() -> None:
    vllm_version_of_either_build()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"  # what its usage lines and messages call it
    vllm_main()


if __name__ == "__main__":
    main()

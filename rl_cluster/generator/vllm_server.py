"""`python -m rl_cluster.generator.vllm_server ARGS`: vLLM's OpenAI server (`SERVER_MODULE`) on the CPU
build, its engine core forked rather than spawned: one import of vLLM fewer a start (vllm_compat item 6)."""

from __future__ import annotations

import runpy

from rl_cluster.generator.vllm_compat import SERVER_MODULE, fork_the_engine_core

# The guard matters: the engine core's worker is spawned, and a spawned child imports its parent's main
# module (as __mp_main__), which must not start a second server.
if __name__ == "__main__":
    fork_the_engine_core()
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)

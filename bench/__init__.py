"""`make bench`: the project's benchmarks, run for real on this machine (vLLM CPU servers, the proxy,
vllm-router, a moto S3 server, Ray and TRL), written to BENCHMARKS.md with plots under docs/bench/.

Every speed claim is a ratio of runs made side by side in one invocation on the same replicas, the
median over repetitions whose order rotates, because the machine is shared and noisy.
"""

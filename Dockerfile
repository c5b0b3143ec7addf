# The image every Ray process of ray_configs/ runs in (cluster.yaml's docker.image, the KubeRay pods):
# Ray's GPU image plus this package with its `gpu` extra (CUDA vLLM), and the repo under
# /home/ray/rl_cluster (rayjob.yaml's entrypoint runs jobs/ from there). Not built in CI. Build and push:
#   docker build -t ghcr.io/rl-cluster/rl-cluster:0.1.0 . && docker push ghcr.io/rl-cluster/rl-cluster:0.1.0
# The base image's Ray must match the ray[default] pin in pyproject.toml, and the tag the project's
# version (tests/unit/test_ray_configs.py checks both).
FROM rayproject/ray:2.60.0-py311-gpu

WORKDIR /home/ray/rl_cluster
# Only what the package and the jobs need (no .venv, .cache or bucket from a working tree).
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users rl_cluster ./rl_cluster
RUN pip install --no-cache-dir ".[gpu]"
COPY --chown=ray:users jobs ./jobs
COPY --chown=ray:users ray_configs ./ray_configs

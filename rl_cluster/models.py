"""Where a run's base model comes from, on whichever node asks: `tiny`, a local directory, or a hub id.

Every actor that needs the weights (the trainer, each generator) resolves `model.path` on its own node:
on a cluster the nodes do not share a disk, and a hub id is not a path. Hub ids go through Hugging
Face's own cache machinery (`huggingface_hub.snapshot_download`), so HF_HOME / HF_HUB_CACHE,
HF_HUB_OFFLINE, HF_ENDPOINT and HF_TOKEN mean what they mean everywhere else; the driver passes those
variables on to every actor. The base-model fingerprint a manifest carries is computed from the
resolved files, so a generator that resolved different weights refuses the trainer's adapters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rl_cluster.core.manifest import base_model_fingerprint

# Hugging Face variables a node needs to resolve a hub id the way the driver's environment meant it.
# How every node resolves a hub model, as the driver's environment says: not secret, so in the runtime_env.
HF_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT", "HF_HUB_ENABLE_HF_TRANSFER")
# Secrets the actors may need, handed to them by the driver as constructor arguments (RunSecrets): a
# runtime_env's env_vars are shown by the Ray dashboard, the job API and the state API to anyone.
SECRET_ENV = ("HF_TOKEN", "WANDB_API_KEY")
# Locally made models (rl_cluster.tiny) by `model.path` name -> the task each is warm-started on.
TINY_MODELS = {"tiny": "add", "tiny-math": "math"}
# Formats neither vLLM nor transformers read when safetensors are there: not worth a download.
_SKIP = [
    "*.pth",
    "*.pt",
    "*.h5",
    "*.msgpack",
    "*.onnx",
    "*.gguf",
    "original/*",
    "*.ot",
    "flax_model*",
    "tf_model*",
]


def resolve_model(path: str, revision: str | None = None) -> Path:
    """The local directory holding `model.path`'s files: the tiny model (built here on first use), an
    existing directory, or a hub id fetched into (or, offline, found in) the Hugging Face cache. `tiny-math`
    is the tiny model warm-started on the MATH-format task (rl_cluster.data.tiny_math)."""
    if path in TINY_MODELS:
        from rl_cluster.tiny import ensure_tiny_model

        return ensure_tiny_model(task=TINY_MODELS[path])
    if os.path.isdir(path):
        return Path(path).resolve()
    if path.startswith(("/", "./", "../", "~")) or path.count("/") > 1:
        raise FileNotFoundError(
            f"model.path={path!r} is not a directory on this node ({os.uname().nodename})"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(path, revision=revision, ignore_patterns=_SKIP))
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"model.path={path!r} (revision {revision or 'main'}) is not in the Hugging Face cache on this node "
            f"({os.uname().nodename}, HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}) and it "
            "could not be downloaded (HF_HUB_OFFLINE set, or no network). Download it on every node first "
            f"(`hf download {path}`), or point model.path at a directory: {e}"
        ) from None


def model_fingerprint(model_dir: str | Path) -> str:
    """The architecture fingerprint of the model in `model_dir` (its config.json)."""
    return base_model_fingerprint(json.loads((Path(model_dir) / "config.json").read_text()))


def hf_environment() -> dict[str, str]:
    """The Hugging Face variables set here (but the token), for every actor's runtime_env."""
    return {name: os.environ[name] for name in HF_ENV if name in os.environ}


def secret_environment() -> dict[str, str]:
    """The secrets of SECRET_ENV set here, to hand to the actors outside any runtime_env."""
    return {name: os.environ[name] for name in SECRET_ENV if os.environ.get(name)}

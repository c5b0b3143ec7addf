"""model.path as a hub id, resolved offline from a Hugging Face cache in the hub's own layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster.hub import write_hub_cache

from rl_cluster.models import model_fingerprint, resolve_model

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = {"model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1, "vocab_size": 64, "intermediate_size": 256}  # fmt: skip


def fake_model(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(TINY_CONFIG))
    (root / "tokenizer.json").write_text("{}")
    return root


def resolve_offline(hub_cache: Path, *args: str) -> subprocess.CompletedProcess:
    """In a fresh process: huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE when it is imported."""
    code = "import sys; from rl_cluster.models import resolve_model; print(resolve_model(*sys.argv[1:]))"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(hub_cache),
        "HF_HOME": str(hub_cache.parent),
    }
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, cwd=REPO
    )


def test_hub_id_resolves_offline_from_the_cache(tmp_path):
    model = fake_model(tmp_path / "model")
    snapshot = write_hub_cache(model, tmp_path / "hf" / "hub", "local/tiny-qwen2")
    done = resolve_offline(tmp_path / "hf" / "hub", "local/tiny-qwen2")
    assert done.returncode == 0, done.stderr
    resolved = Path(done.stdout.strip())
    assert resolved == snapshot
    assert model_fingerprint(resolved) == model_fingerprint(model)
    assert json.loads((resolved / "config.json").read_text()) == TINY_CONFIG


def test_unknown_hub_id_offline_says_what_to_do(tmp_path):
    (tmp_path / "hf" / "hub").mkdir(parents=True)
    done = resolve_offline(tmp_path / "hf" / "hub", "local/not-there")
    assert done.returncode != 0
    assert "FileNotFoundError" in done.stderr and "not in the Hugging Face cache" in done.stderr
    assert "hf download local/not-there" in done.stderr


def test_local_directories_and_missing_paths(tmp_path):
    model = fake_model(tmp_path / "model")
    assert resolve_model(str(model)) == model.resolve()
    with pytest.raises(FileNotFoundError, match="is not a directory on this node"):
        resolve_model(str(tmp_path / "missing"))

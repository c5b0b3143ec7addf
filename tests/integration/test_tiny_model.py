"""The locally made tiny model: deterministic build, loads in transformers, chat template and tokenizer
work, and the warm start leaves room for RL (right mode, moderate sampled reward)."""

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_cluster import tiny
from rl_cluster.core.rewards import arithmetic_reward


def weights_fingerprint(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(model_dir / "model.safetensors").items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    """The session's copy (built by this or an earlier process, and cached)."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_build_is_deterministic_and_cached(model_dir, tmp_path, monkeypatch):
    """Two builds, in two processes with different hash seeds, give the same bytes. They build the recipe
    with a short warm start (6 steps, not 225: the same code, the seeded initialisation and every step's
    kernels, in seconds rather than 25)."""
    assert model_dir.name.startswith("tiny-qwen2-add-")
    short = {**tiny.RECIPE, "warm_start": {**tiny.RECIPE["warm_start"], "clean_steps": 4, "noisy_steps": 2}}
    build = (f"from rl_cluster import tiny; tiny.RECIPE = {short!r}; "
             f"tiny.ensure_tiny_model({str(tmp_path / 'one')!r})")  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "1"}
    subprocess.run([sys.executable, "-c", build], env=env, check=True, timeout=300)
    monkeypatch.setattr(tiny, "RECIPE", short)
    (one,), other = (tmp_path / "one").iterdir(), tiny.ensure_tiny_model(tmp_path / "other")
    assert one.name == other.name != model_dir.name  # the recipe names the build
    assert weights_fingerprint(one) == weights_fingerprint(other) != weights_fingerprint(model_dir)
    assert [p.name for p in (tmp_path / "other").iterdir()] == [other.name]  # no .build-* leftovers

    def no_rebuild(out_dir):
        raise AssertionError("a cached model was rebuilt")

    monkeypatch.setattr(tiny, "_build", no_rebuild)
    assert tiny.ensure_tiny_model(tmp_path / "other") == other


def test_concurrent_callers_share_one_directory(tmp_path, monkeypatch):
    def fake_build(out_dir: Path) -> None:
        (out_dir / "marker").write_text(threading.current_thread().name)

    monkeypatch.setattr(tiny, "_build", fake_build)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(tiny.ensure_tiny_model(tmp_path))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and (results[0] / "marker").exists()
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no temporary leftovers


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RL_CLUSTER_CACHE", str(tmp_path))
    assert tiny.default_cache_dir() == tmp_path
    monkeypatch.delenv("RL_CLUSTER_CACHE")
    assert tiny.default_cache_dir().name == ".cache"


def test_config_and_generation_config(model, tokenizer):
    config = model.config
    assert config.model_type == "qwen2"
    assert config.hidden_size // config.num_attention_heads == 64  # CPU vLLM rejects head_dim 16
    assert config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_chat_template_and_tokenizer_roundtrip(tokenizer):
    messages = [{"role": "user", "content": "3+4"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n3+4<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert len(ids) == len("user\n3+4\nassistant\n") + 3  # one token per character or special
    assert tokenizer.decode(ids) == text
    sample = "Hello, world!\n  x = [1, 2]; y = {'a': 3} ~"
    encoded = tokenizer.encode(sample, add_special_tokens=False)
    assert len(encoded) == len(sample)
    assert tokenizer.decode(encoded) == sample
    assert (
        max(
            len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=False))
            for r in tiny.all_prompts()
        )
        < 40
    )


def test_response_template_parses_completions(tokenizer):
    from trl.chat_template_utils import parse_response

    assert tokenizer.response_template is not None  # TRL's rollout worker then leaves the tokenizer as is
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "9+8"}], add_generation_prompt=True
    )
    ids = tokenizer.encode("17", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert parse_response(tokenizer, ids, prefix=prompt_ids) == {"role": "assistant", "content": "17"}


def test_make_prompts():
    rows = tiny.make_prompts(50, seed=3)
    assert rows == tiny.make_prompts(50, seed=3) and rows != tiny.make_prompts(50, seed=4)
    for row in rows:
        (message,) = row["prompt"]
        assert message["role"] == "user"
        a, b = message["content"].split("+")
        assert row["answer"] == str(int(a) + int(b))
    assert len({r["prompt"][0]["content"] for r in tiny.all_prompts()}) == 100


def test_warm_start_leaves_room_for_rl(model, tokenizer):
    rows = tiny.all_prompts()
    prompts = torch.tensor(
        [
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=False)
            for r in rows
        ]
    )
    answers = [r["answer"] for r in rows]
    with torch.no_grad():
        greedy = model.generate(prompts, max_new_tokens=8, do_sample=False)
        torch.manual_seed(0)
        sampled = model.generate(
            prompts.repeat_interleave(8, 0),
            max_new_tokens=8,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
        )
    n = prompts.shape[1]
    assert (greedy[:, n:] == tokenizer.eos_token_id).any(1).all()  # every answer ends with <|im_end|>
    greedy_reward = sum(
        arithmetic_reward(tokenizer.batch_decode(greedy[:, n:], skip_special_tokens=True), answers)
    )
    texts = tokenizer.batch_decode(sampled[:, n:], skip_special_tokens=True)
    sampled_reward = sum(arithmetic_reward(texts, [a for a in answers for _ in range(8)])) / len(texts)
    assert greedy_reward / len(rows) >= 0.9  # the right sum is the mode
    assert 0.15 <= sampled_reward <= 0.45  # ...but sampling at temperature 1 is often wrong
    assert max(len(t) for t in texts) <= 4  # short answers, then the end token

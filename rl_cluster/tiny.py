"""A tiny model and a toy task, made locally, so a run needs no model hub and shows learning in minutes.

Why this model: a Qwen2-architecture decoder (hidden 128, 2 layers, 2 query heads / 1 KV head, so
head_dim 64, which CPU vLLM accepts) loads in seconds in both transformers and vLLM. Its tokenizer is
character level (printable ASCII plus the ChatML specials), so every digit is one token.

Why this task: single-digit addition, asked as a one-turn chat (`3+4` -> `7`). Prompts stay under 30
tokens and answers are 1-2 characters then `<|im_end|>`. The chat template is a bare ChatML (no default
system prompt, which would cost ~80 character tokens); the tokenizer carries the matching
`response_template`, so TRL's rollout worker can parse completions.

Why the warm start ends noisy: a short supervised run (~30 s on one core) first teaches the sums, then
briefly pulls the model towards a noisy teacher whose every answer digit is right with probability
`teacher_p` and a uniformly random digit otherwise. The right sum stays the mode (greedy decoding is
~98% right) but sampling at temperature 1 earns only ~0.26. Sharpening that distribution is easy for a
policy gradient even on a rank-1 LoRA, so RL shows a clear reward rise within a minute or two on CPU.
The build is deterministic (fixed seeds, one thread).

    python -m rl_cluster.tiny [--cache-dir DIR]    # builds once, prints the model directory
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, turn start, eos
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]  # ids 3.. : newline and printable ASCII
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# transformers' response parser spec (same shape as TRL's Qwen one, content only: no tools, no thinking).
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {"content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}},
}
RECIPE = {
    "version": 1,  # bump when the build code changes, so cached models are rebuilt
    "model": {"hidden": 128, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 384, "max_pos": 256},
    "tokens": SPECIALS + CHARS,
    "chat_template": CHAT_TEMPLATE,
    "warm_start": {"seed": 0, "lr": 1e-3, "clean_steps": 150, "noisy_steps": 75, "teacher_p": 0.3},
}


def _fingerprint() -> str:
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:10]


def _row(a: int, b: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"{a}+{b}"}], "answer": str(a + b)}


def make_prompts(n: int, seed: int) -> list[dict]:
    """`n` toy-task rows `{"prompt": [{"role": "user", "content": "3+4"}], "answer": "7"}`, drawn with
    replacement from the 100 single-digit additions. `answer` reaches reward functions as a keyword."""
    rng = random.Random(seed)
    return [_row(rng.randrange(10), rng.randrange(10)) for _ in range(n)]


def all_prompts() -> list[dict]:
    """All 100 toy-task rows, in order (`0+0` .. `9+9`)."""
    return [_row(a, b) for a in range(10) for b in range(10)]


def _byte_level(ch: str) -> str:
    """GPT-2 byte-level spelling of an ASCII character (space -> 'Ġ', newline -> 'Ċ')."""
    b = ord(ch)
    return ch if 33 <= b <= 126 else chr(256 + b)


def _make_tokenizer():
    from transformers import Qwen2Tokenizer

    # Qwen2Tokenizer's own pipeline (byte-level BPE), because AutoTokenizer rebuilds any qwen2 model's
    # tokenizer that way: with single-character entries and no merges it is character level, and the
    # tokenizer built here is the same one transformers, TRL and vLLM load back.
    vocab = {tok: i for i, tok in enumerate(SPECIALS + [_byte_level(c) for c in CHARS])}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=RECIPE["model"]["max_pos"],
    )
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def _make_model(tokenizer):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    m = RECIPE["model"]
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=m["hidden"],
        intermediate_size=m["intermediate"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        max_position_embeddings=m["max_pos"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    return model


def _warm_start(model, tokenizer) -> None:
    """Full-batch training on all 100 additions, loss on the answer and the closing `<|im_end|>` only.
    First `clean_steps` on the right answers (the model learns the sums), then `noisy_steps` towards
    the noisy teacher: each answer digit's target puts `teacher_p` on the right digit and spreads the
    rest over the ten digits (the end token stays a hard target). The right sum stays the mode while
    sampling at temperature 1 is often wrong."""
    import torch

    ws = RECIPE["warm_start"]
    digit_ids = tokenizer.convert_tokens_to_ids(list("0123456789"))
    rows = all_prompts()
    seqs = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=False)
        for r in rows
    ]
    width = max(len(s) for s in seqs) + 3
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    clean = torch.zeros(len(rows), width, len(tokenizer))  # clean[i, t]: distribution of token t + 1
    noisy = torch.zeros_like(clean)
    for i, (prompt_ids, row) in enumerate(zip(seqs, rows, strict=True)):
        answer = tokenizer.encode(row["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
        full = prompt_ids + answer
        input_ids[i, : len(full)] = torch.tensor(full)
        for t, tok in enumerate(answer, start=len(prompt_ids) - 1):
            clean[i, t, tok] = 1.0
            if tok == tokenizer.eos_token_id:
                noisy[i, t, tok] = 1.0
            else:
                noisy[i, t, digit_ids] = (1 - ws["teacher_p"]) / 10
                noisy[i, t, tok] += ws["teacher_p"]
    attention = (input_ids != tokenizer.pad_token_id).long()
    weight = clean.sum(-1)  # 1 where a target is set
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws["lr"], weight_decay=0.0)
    model.train()
    for step in range(ws["clean_steps"] + ws["noisy_steps"]):
        for group in optimizer.param_groups:
            group["lr"] = ws["lr"] * min(1.0, (step + 1) / 20)  # short warmup
        target = clean if step < ws["clean_steps"] else noisy
        logits = model(input_ids=input_ids, attention_mask=attention).logits
        loss = -(target * logits.log_softmax(-1)).sum(-1).mul(weight).sum() / weight.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def _build(out_dir: Path) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RECIPE["warm_start"]["seed"])
            tokenizer = _make_tokenizer()
            model = _make_model(tokenizer)
            _warm_start(model, tokenizer)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        (out_dir / "recipe.json").write_text(json.dumps(RECIPE, indent=1))
    finally:
        torch.set_num_threads(threads)


def default_cache_dir() -> Path:
    env = os.environ.get("RL_CLUSTER_CACHE")
    return Path(env) if env else Path(__file__).resolve().parent.parent / ".cache"


def ensure_tiny_model(cache_dir: str | Path | None = None) -> Path:
    """The tiny model's directory under `cache_dir` (default: `$RL_CLUSTER_CACHE` or `<repo>/.cache`),
    built on first use. Safe to call concurrently: each caller builds in a temporary directory and
    renames it into place; the first rename wins and the others discard their copy."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"tiny-qwen2-add-{_fingerprint()}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        _build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None, help="default: $RL_CLUSTER_CACHE or <repo>/.cache")
    print(ensure_tiny_model(parser.parse_args().cache_dir))


if __name__ == "__main__":
    main()

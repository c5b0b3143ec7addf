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

The MATH-format variant (`model.path = "tiny-math"`, `ensure_tiny_model(task="math")`) is the same model
warm-started on rl_cluster.data.tiny_math instead: see `MATH_RECIPE` and `_warm_start_math`.

    python -m rl_cluster.tiny [--cache-dir DIR] [--task math]   # builds once, prints the model directory
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

from rl_cluster.core.placement import ray_package_dir

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
    _fit(model, input_ids, tokenizer.pad_token_id, clean, noisy, clean.sum(-1), ws)  # weight: 1 where set


def _fit(model, input_ids, pad_id: int, clean, noisy, weight, ws: dict) -> None:
    """Full-batch AdamW on the whole task (both warm starts): `clean_steps` towards the `clean` targets,
    then `noisy_steps` towards the `noisy` ones (a distribution over the next token at each position),
    the loss weighted per position by `weight`, after a 20-step linear warmup."""
    import torch

    attention = (input_ids != pad_id).long()
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


def _build_from(out_dir: Path, recipe: dict, warm_start) -> None:
    """The model of `recipe`, warm-started by `warm_start(model, tokenizer)`, saved with its recipe. One
    thread and a forked RNG: the same bytes on every machine and in every process."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe["warm_start"]["seed"])
            tokenizer = _make_tokenizer()
            model = _make_model(tokenizer)
            warm_start(model, tokenizer)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        (out_dir / "recipe.json").write_text(json.dumps(recipe, indent=1))
    finally:
        torch.set_num_threads(threads)


def _build(out_dir: Path) -> None:
    _build_from(out_dir, RECIPE, _warm_start)


# -- the MATH-format variant ----------------------------------------------------------------------------
# Why this warm start: RL on MATH first learns to answer in the graded form, then to be right more often.
# The tiny math model starts there too. It answers `What is $3+4$?` with `$3+4=\boxed{7}$` (graded 1) or
# with the unboxed `$3+4=7$` (graded 0), and which one is a single choice right after the `=`: per
# problem, the boxed form has probability `box_low` or `box_high` (drawn once per problem), so greedy
# decoding boxes only the `box_high` half. The sum's digits are noisy as in the toy task (`teacher_p`:
# the right digit stays the mode). Greedy pass@1 so starts at 0.63, sampled mean@8 at 0.14; raising
# the box probability is one direction shared by every problem, so a rank-1 LoRA lifts pass@1 within
# tens of steps on CPU, and sharpening the digits lifts the sampled reward after it.
MATH_RECIPE = {
    "version": 1,  # bump when the math build code changes
    "base": {k: RECIPE[k] for k in ("model", "tokens", "chat_template")},
    "warm_start": {
        "seed": 0,
        "lr": 1e-3,
        "clean_steps": 150,
        "noisy_steps": 75,
        "teacher_p": 0.5,
        "box_low": 0.25,
        "box_high": 0.7,
    },
}


def _math_fingerprint() -> str:
    return hashlib.sha256(json.dumps(MATH_RECIPE, sort_keys=True).encode()).hexdigest()[:10]


def math_completions(problem: dict) -> tuple[str, str, str]:
    """(boxed completion, unboxed completion, answer) the warm start teaches for a tiny_math row:
    `What is $3+4$?` -> (`$3+4=\\boxed{7}$`, `$3+4=7$`, `7`)."""
    from rl_cluster.core.math_grading import last_boxed

    expression = problem["problem"].removeprefix("What is $").removesuffix("$?")
    answer = last_boxed(problem["solution"])
    return f"${expression}=\\boxed{{{answer}}}$", f"${expression}={answer}$", answer


def _warm_start_math(model, tokenizer) -> None:
    """Full-batch training on every tiny_math problem, both completions of each weighted by the problem's
    box probability (so the choice after `=` learns that mixture), loss on the completion and the closing
    `<|im_end|>`. First `clean_steps` with the right digits, then `noisy_steps` with each answer digit's
    target spread as in `_warm_start`."""
    import torch

    from rl_cluster.data.tiny_math import all_problems

    ws = MATH_RECIPE["warm_start"]
    rng = random.Random(ws["seed"])
    digit_ids = set(tokenizer.convert_tokens_to_ids(list("0123456789")))
    digit_list = sorted(digit_ids)
    seqs, weights, answer_spans = [], [], []
    for problem in all_problems("+"):
        boxed, plain, answer = math_completions(problem)
        p_box = ws["box_high"] if rng.random() < 0.5 else ws["box_low"]
        prompt = [{"role": "user", "content": problem["problem"]}]
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
        for text, weight, tail in ((boxed, p_box, "}$"), (plain, 1 - p_box, "$")):
            completion = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            start = len(text) - len(tail) - len(answer)  # the sum's digits, not an operand's
            seqs.append((prompt_ids, completion))
            weights.append(weight)
            answer_spans.append((len(prompt_ids) + start, len(prompt_ids) + start + len(answer)))
    width = max(len(p) + len(c) for p, c in seqs)
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    clean = torch.zeros(len(seqs), width, len(tokenizer))  # clean[i, t]: distribution of token t + 1
    for i, (prompt_ids, completion) in enumerate(seqs):
        full = prompt_ids + completion
        input_ids[i, : len(full)] = torch.tensor(full)
        for t, tok in enumerate(completion, start=len(prompt_ids) - 1):
            clean[i, t, tok] = 1.0
    noisy = clean.clone()
    for i, (first, end) in enumerate(answer_spans):
        for position in range(first, end):  # token `position` is an answer digit, predicted at position - 1
            tok = int(input_ids[i, position])
            noisy[i, position - 1] = 0.0
            noisy[i, position - 1, digit_list] = (1 - ws["teacher_p"]) / 10
            noisy[i, position - 1, tok] += ws["teacher_p"]
    weight = clean.sum(-1) * torch.tensor(weights)[:, None]  # 1 where a target is set, times the mixture
    _fit(model, input_ids, tokenizer.pad_token_id, clean, noisy, weight, ws)


def _build_math(out_dir: Path) -> None:
    _build_from(out_dir, MATH_RECIPE, _warm_start_math)


def default_cache_dir() -> Path:
    """`$RL_CLUSTER_CACHE`, else `<repo>/.cache`; but where the repo is a copy Ray unpacked for a job's
    `--working-dir` (every node has one per upload, deleted with the session), `~/.cache/rl_cluster`:
    in there each submitted job would build the model anew, on every node."""
    env = os.environ.get("RL_CLUSTER_CACHE")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parent.parent
    return Path.home() / ".cache" / "rl_cluster" if ray_package_dir(str(repo)) else repo / ".cache"


def tiny_model_path(cache_dir: str | Path | None = None, task: str = "add") -> Path:
    """Where ensure_tiny_model keeps the model for `task` (built or not): its name holds its recipe's hash."""
    if task not in ("add", "math"):
        raise ValueError(f"task={task!r}: the tiny model is made for `add` or `math`")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if task == "math":
        return root / f"tiny-qwen2-math-{_math_fingerprint()}"
    return root / f"tiny-qwen2-add-{_fingerprint()}"


def ensure_tiny_model(cache_dir: str | Path | None = None, task: str = "add") -> Path:
    """The tiny model's directory under `cache_dir` (default: `$RL_CLUSTER_CACHE` or `<repo>/.cache`),
    built on first use. `task`: `add`, warm-started on the toy addition task, or `math`, warm-started on
    the MATH-format task (rl_cluster.data.tiny_math; see `MATH_RECIPE`). Safe to call concurrently: each
    caller builds in a temporary directory and renames it into place; the first rename wins and the
    others discard their copy."""
    final = tiny_model_path(cache_dir, task)
    if final.is_dir():
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        (_build if task == "add" else _build_math)(tmp)
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
    parser.add_argument(
        "--cache-dir", default=None, help="default: $RL_CLUSTER_CACHE or <repo>/.cache (default_cache_dir)"
    )
    parser.add_argument(
        "--task", choices=["add", "math"], default="add", help="the task it is warm-started on"
    )
    args = parser.parse_args()
    print(ensure_tiny_model(args.cache_dir, task=args.task))


if __name__ == "__main__":
    main()

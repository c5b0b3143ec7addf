"""Datasets for `task.prompts = "dataset"`: local parquet and jsonl files through `datasets.load_dataset`,
`prepare` into a bucket directory, and the run reading them back. No hub, no vLLM, no Ray: the tokenizer
that measures prompts is the tiny model's (character level: a user-only prompt of n characters is n + 19
tokens with the generation prompt)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_cluster.config import load_config
from rl_cluster.core.math_grading import last_boxed
from rl_cluster.core.rewards import math_reward
from rl_cluster.data import PREPARED_ROOT, load_prepared, prepare, prepared_key
from rl_cluster.data.__main__ import main
from rl_cluster.data.tiny_math import all_problems, make_rows, write_task
from rl_cluster.trainer.task import load_prompts

TEMPLATE_TOKENS = 19  # <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n around the content

MATH_ROWS = [
    {"problem": "What is $1+1$?", "solution": r"Clearly $1+1=\boxed{2}$.", "level": "Level 1"},
    {"problem": r"Simplify $\frac{2}{4}$.", "solution": r"It is $\boxed{\frac{1}{2}}$.", "level": "Level 2"},
    {"problem": "Name a prime.", "solution": "Two is prime, and so is three.", "level": "Level 1"},  # no box
    {"problem": "x" * 300, "solution": r"$\boxed{7}$", "level": "Level 5"},  # too long for any context here
    {"problem": "What is $3+4$?", "solution": r"$3+4=\boxed{7}$", "level": "Level 1"},
]
TEST_ROWS = [{"problem": "What is $2+2$?", "solution": r"$\boxed{4}$", "level": "Level 1"}]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from rl_cluster.tiny import _make_tokenizer

    path = tmp_path_factory.mktemp("tiny-tokenizer")
    _make_tokenizer().save_pretrained(path)  # the tiny model's tokenizer, without building its weights
    return path


def write_files(tmp_path, fmt):
    paths = {}
    for split, rows in (("train", MATH_ROWS), ("test", TEST_ROWS)):
        path = tmp_path / f"{split}.{fmt}"
        if fmt == "parquet":
            pq.write_table(pa.Table.from_pylist(rows), path)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[split] = str(path)
    return paths


def math_overrides(tmp_path, tokenizer_dir, fmt="parquet", *extra):
    files = write_files(tmp_path, fmt)
    return [
        "run_name=t",
        f"model.path={json.dumps(str(tokenizer_dir))}",
        "model.max_model_len=256",
        "trainer.max_new_tokens=16",
        "task.prompts=dataset",
        f"task.dataset={'parquet' if fmt == 'parquet' else 'json'}",
        f"task.data_files={{train=[{json.dumps(files['train'])}], test=[{json.dumps(files['test'])}]}}",
        "task.eval_split=test",
        'task.columns={problem="prompt", solution="answer", level="level"}',
        "task.answer_from_solution=true",
        f"bucket.uri={json.dumps(str(tmp_path / 'bucket'))}",
        *extra,
    ]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_prepare_writes_shaped_filtered_splits_that_the_run_reads(tmp_path, tokenizer_dir, fmt):
    config = load_config(None, math_overrides(tmp_path, tokenizer_dir, fmt, 'task.system_prompt="Box it."'))
    lines = []
    meta = prepare(config, log=lines.append)
    assert meta["splits"]["train"] == {
        "source_split": "train", "source_rows": 5, "rows": 3, "dropped_no_answer": 1, "dropped_too_long": 1,
    }  # fmt: skip
    assert meta["splits"]["eval"]["rows"] == 1 and meta["prompt_token_limit"] == 240
    assert (
        "dropped 1 with prompts longer than 240 tokens" in lines[0] and "1 without a boxed answer" in lines[0]
    )
    prepared = (tmp_path / "bucket" / PREPARED_ROOT / prepared_key(config)).iterdir()
    assert sorted(p.name for p in prepared) == ["eval.parquet", "prepared.json", "train.parquet"]

    train = load_prepared(config, "train")
    assert set(train.column_names) == {"prompt", "answer", "level"}
    by_answer = {row["answer"]: row for row in train}
    assert set(by_answer) == {"2", r"\frac{1}{2}", "7"}  # the boxed answers, not the solutions
    assert by_answer["2"]["prompt"] == [
        {"role": "system", "content": "Box it."},
        {"role": "user", "content": "What is $1+1$?"},
    ]
    assert load_prepared(config, "eval").to_list() == [
        {"prompt": [{"role": "system", "content": "Box it."}, {"role": "user", "content": "What is $2+2$?"}],
         "answer": "4", "level": "Level 1"}
    ]  # fmt: skip
    # The trainer's load_prompts reads the same rows, and their answers grade the way the reward sees them.
    assert sorted(load_prompts(config)["answer"]) == sorted(train["answer"])
    assert math_reward([rf"so $\boxed{{{a}}}$" for a in train["answer"]], answer=train["answer"]) == [1.0] * 3


def test_prompt_limit_is_exact_in_tokens(tmp_path, tokenizer_dir):
    # limit 240 tokens: a user prompt of 240 - 19 characters fits, one more does not.
    fits, over = "a" * (240 - TEMPLATE_TOKENS), "b" * (241 - TEMPLATE_TOKENS)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in (fits, over)))
    config = load_config(
        None,
        ["run_name=t", f"model.path={json.dumps(str(tokenizer_dir))}", "trainer.max_new_tokens=16",
         "task.prompts=dataset", "task.dataset=json", f"task.data_files={{train=[{json.dumps(str(path))}]}}",
         f"bucket.uri={json.dumps(str(tmp_path / 'bucket'))}"],
    )  # fmt: skip
    meta = prepare(config, log=lambda line: None)
    assert meta["splits"] == {
        "train": {"source_split": "train", "source_rows": 2, "rows": 1, "dropped_no_answer": 0, "dropped_too_long": 1}
    }  # fmt: skip
    assert [row["prompt"][-1]["content"] for row in load_prepared(config)] == [fits]


def test_columns_default_keeps_every_column_and_message_prompts_stay_as_they_are(tmp_path, tokenizer_dir):
    rows = [
        {"prompt": [{"role": "user", "content": "2+3"}], "answer": "5", "source": "a"},
        {"prompt": "4+4", "answer": "8", "source": "b"},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(
        None,
        ["run_name=t", f"model.path={json.dumps(str(tokenizer_dir))}", "trainer.max_new_tokens=16",
         "task.prompts=dataset", "task.dataset=json", f"task.data_files={{train=[{json.dumps(str(path))}]}}",
         'task.prompt_template="Compute {prompt}."', f"bucket.uri={json.dumps(str(tmp_path / 'bucket'))}"],
    )  # fmt: skip
    prepare(config, log=lambda line: None)
    got = sorted(load_prepared(config).to_list(), key=lambda r: r["source"])
    assert got == [
        rows[0],
        {"prompt": [{"role": "user", "content": "Compute 4+4."}], "answer": "8", "source": "b"},
    ]


def test_train_order_is_shuffled_by_the_trainer_seed(tmp_path, tokenizer_dir):
    paths = write_task(tmp_path / "tiny", train_rows=60, seed=1)
    base = [
        "run_name=t", f"model.path={json.dumps(str(tokenizer_dir))}", "trainer.max_new_tokens=16",
        "task.prompts=dataset", "task.dataset=parquet",
        f"task.data_files={{train=[{json.dumps(str(paths['train']['parquet']))}]}}",
        'task.columns={problem="prompt", solution="answer"}', "task.answer_from_solution=true",
        f"bucket.uri={json.dumps(str(tmp_path / 'bucket'))}",
    ]  # fmt: skip
    prepare(load_config(None, base), log=lambda line: None)
    orders = [load_prepared(load_config(None, [*base, f"trainer.seed={s}"]))["prompt"] for s in (0, 0, 1)]
    assert orders[0] == orders[1] != orders[2]
    assert sorted(map(str, orders[0])) == sorted(map(str, orders[2]))  # the same rows, another order


def test_the_run_refuses_data_prepared_for_another_config(tmp_path, tokenizer_dir):
    overrides = math_overrides(tmp_path, tokenizer_dir)
    with pytest.raises(
        FileNotFoundError, match=r"no prepared data .* run `python -m rl_cluster.data prepare"
    ):
        load_prepared(load_config(None, overrides))
    prepare(load_config(None, overrides), log=lambda line: None)
    assert (
        len(load_prepared(load_config(None, [*overrides, "trainer.max_steps=3"]))) == 3
    )  # not a shaping field
    # A longer completion budget shrinks the prompt limit: the rows prepared for 16 tokens do not apply.
    with pytest.raises(FileNotFoundError, match="no prepared data"):
        load_prepared(load_config(None, [*overrides, "trainer.max_new_tokens=32"]))
    no_eval = load_config(None, [o for o in overrides if not o.startswith("task.eval_split")])
    assert prepared_key(no_eval) != prepared_key(load_config(None, overrides))
    prepare(no_eval, log=lambda line: None)
    with pytest.raises(ValueError, match="has no 'eval' split"):
        load_prepared(no_eval, "eval")


def test_a_new_run_prepares_missing_data_before_it_starts_and_a_resumed_one_refuses(
    tmp_path, tokenizer_dir, capsys, monkeypatch
):
    """`train`'s preflight: the RayJob and `ray job submit` start one command, so a recipe's first run
    prepares its data itself; the next finds it there. A --resume never prepares afresh."""
    from rl_cluster.commands import preflight
    from rl_cluster.errors import UsageError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # preflight asks nothing of Ray then
    monkeypatch.setattr("rl_cluster.run.check_resumable", lambda bucket, name: None)  # as if checkpointed
    overrides = math_overrides(tmp_path, tokenizer_dir)
    with pytest.raises(UsageError, match="no prepared data"):
        preflight(load_config(None, [*overrides, "trainer.max_new_tokens=32"]), resume=True)
    preflight(load_config(None, overrides), resume=False)
    printed = capsys.readouterr().out
    assert "no prepared data for this config" in printed and "preparing it now" in printed
    assert "train: 3 of 5 rows" in printed
    assert len(load_prepared(load_config(None, overrides))) == 3
    preflight(load_config(None, [*overrides, "run_name=t2"]), resume=False)
    assert capsys.readouterr().out == ""  # prepared once: the next run reads it
    # Data that cannot be prepared is still a refusal before anything starts, in one line.
    missing = [o for o in overrides if not o.startswith("task.data_files")]
    missing.append('task.data_files={train=["nowhere/train.parquet"], test=["nowhere/test.parquet"]}')
    with pytest.raises(
        UsageError, match=r"^task\.data_files: nowhere/train\.parquet, nowhere/test\.parquet not"
    ):
        preflight(load_config(None, [*missing, "run_name=t3"]), resume=False)


def test_missing_columns_are_named(tmp_path, tokenizer_dir):
    config = load_config(
        None,
        math_overrides(
            tmp_path, tokenizer_dir, "parquet", 'task.columns={question="prompt", solution="answer"}'
        ),
    )
    with pytest.raises(ValueError, match=r"task.columns names \['question'\], which parquet\[train\] lacks; "
                       r"its columns are \['level', 'problem', 'solution'\]"):  # fmt: skip
        prepare(config, log=lambda line: None)


def test_no_usable_rows_is_an_error(tmp_path, tokenizer_dir):
    config = load_config(None, math_overrides(tmp_path, tokenizer_dir, "parquet", 'task.columns={level="prompt", '
                                              'problem="answer"}'))  # fmt: skip
    with pytest.raises(ValueError, match=r"no rows left of 5 \(5 without a boxed answer"):
        prepare(config, log=lambda line: None)


def test_prepare_command_prints_the_run_command(tmp_path, tokenizer_dir, capsys):
    overrides = [o for o in math_overrides(tmp_path, tokenizer_dir) if not o.startswith("run_name")]
    assert main(["prepare", "--config", "jobs/configs/cpu_demo.toml", *overrides]) == 0
    out = capsys.readouterr().out
    assert "train: 3 of 5 rows" in out and "eval: 1 of 1 rows" in out
    assert "python jobs/train_grpo.py --config jobs/configs/cpu_demo.toml" in out


def test_tiny_math_task_is_in_the_math_format_and_grades(tmp_path):
    problems = all_problems("+-")
    assert len(problems) == 100 + 55 and len({p["problem"] for p in problems}) == 155
    rows = make_rows(500, seed=3, operations="+-")
    assert rows == make_rows(500, seed=3, operations="+-") != make_rows(500, seed=4, operations="+-")
    for row in rows:
        a, op, b = row["problem"][len("What is $") : -len("$?")]
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert last_boxed(row["solution"]) == str(expected) and expected >= 0
    paths = write_task(tmp_path, train_rows=50, seed=0)
    import datasets

    for fmt, builder in (("parquet", "parquet"), ("jsonl", "json")):
        splits = datasets.load_dataset(
            builder,
            data_files={s: str(paths[s][fmt]) for s in ("train", "test")},
            cache_dir=str(tmp_path / "c"),
        )
        assert (len(splits["train"]), len(splits["test"])) == (50, 100)
        assert splits["test"].column_names == ["problem", "solution", "level", "type"]
    with pytest.raises(ValueError, match="operations"):
        make_rows(1, 0, "*")


@pytest.mark.parametrize("recipe", ["qwen25_math_1p5b", "deepseek_r1_distill_qwen_1p5b"])
def test_each_recipes_data_pipeline_on_local_math_files(tmp_path, tokenizer_dir, recipe):
    """The recipe's own task settings (columns, answer extraction, prompt shape, reward) on MATH-layout
    files, with the hub dataset and model swapped for local ones and the lengths shrunk to the tiny
    tokenizer's context."""
    from rl_cluster.trainer.task import import_function

    paths = write_task(tmp_path / "math", train_rows=40, seed=0)
    config = load_config(
        f"jobs/configs/{recipe}.toml",
        ["task.dataset=parquet",  # the recipes' dataset_config "default" is the file builders' one too
         f"task.data_files={{train=[{json.dumps(str(paths['train']['parquet']))}], "
         f"test=[{json.dumps(str(paths['test']['parquet']))}]}}",
         f"model.path={json.dumps(str(tokenizer_dir))}", "model.max_model_len=256", "trainer.max_new_tokens=64",
         "trainer.token_budget=0", f"bucket.uri={json.dumps(str(tmp_path / 'bucket'))}"],
    )  # fmt: skip
    meta = prepare(config, log=lambda line: None)
    assert (meta["splits"]["train"]["rows"], meta["splits"]["eval"]["rows"]) == (40, 100)
    row = load_prepared(config, "eval")[7]  # all_problems() order: 0+7
    assert (row["answer"], row["level"], row["type"]) == ("7", "Level 1", "Arithmetic")
    user = row["prompt"][-1]
    assert user["role"] == "user" and user["content"].startswith("What is $0+7$?")
    (reward,) = [import_function(r) for r in config.task.rewards]
    if recipe.startswith("qwen"):
        assert row["prompt"][0] == {"role": "system", "content": config.task.system_prompt}
        completions = [r"$0+7=\boxed{7}$", r"$\boxed{8}$"]
    else:
        assert len(row["prompt"]) == 1 and user["content"].endswith(r"within \boxed{}.")
        completions = [r"0+7 is 7.</think>$\boxed{7}$", r"0+7 is $\boxed{7}$"]  # the second never closes
    assert reward(completions, answer=[row["answer"]] * 2) == [1.0, 0.0]

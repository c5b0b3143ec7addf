"""Where a run's prompts come from (`task.prompts`): the built-in toy task or a JSONL file of rows, whose
extra columns reach the reward functions (`task.rewards`). No Ray cluster or vLLM is started."""

import json

import pytest

from rl_cluster.config import load_config
from rl_cluster.core.rewards import arithmetic_reward
from rl_cluster.tiny import make_prompts
from rl_cluster.trainer.task import import_function, load_prompts

ROWS = [
    {"prompt": [{"role": "user", "content": "2+3"}], "answer": "5", "level": 1},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "4+4"}], "answer": "8",
     "level": 2},
    {"prompt": [{"role": "user", "content": "9+9"}], "answer": "18", "level": 3},
]  # fmt: skip


def jsonl_config(path, *overrides):
    return load_config(
        None, ["run_name=t", "task.prompts=jsonl", f"task.jsonl_path={json.dumps(str(path))}", *overrides]
    )


def test_jsonl_rows_keep_their_order_prompts_and_extra_columns(tmp_path):
    path = tmp_path / "prompts.jsonl"
    # Blank lines (a trailing newline, a gap) are not rows.
    path.write_text(
        json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n   \n" + json.dumps(ROWS[2]) + "\n"
    )
    dataset = load_prompts(jsonl_config(path))
    assert dataset.to_list() == ROWS
    assert set(dataset.column_names) == {"prompt", "answer", "level"}


def test_jsonl_columns_reach_the_reward_functions(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = jsonl_config(path)
    dataset = load_prompts(config)
    (reward,) = [import_function(r) for r in config.task.rewards]
    # As TRL calls a reward function: completions, plus every non-prompt column as a keyword argument.
    assert reward(["5", "7", "18"], answer=dataset["answer"], level=dataset["level"]) == [1.0, 0.0, 1.0]


def test_jsonl_ignores_the_toy_task_settings(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    assert load_prompts(jsonl_config(path, "task.num_prompts=50", "trainer.seed=3")).to_list() == ROWS[:1]


def test_malformed_jsonl_line_is_an_error_not_skipped(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps(ROWS[0]) + "\n" + '{"prompt": [{"role": "user", "content": "1+1"}], "answer": \n'
    )
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        load_prompts(jsonl_config(path))


def test_malformed_jsonl_line_is_reported_with_file_and_line_number(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n{not json}\n")
    with pytest.raises(ValueError, match=rf"{path}.*line 3"):
        load_prompts(jsonl_config(path))


def test_missing_jsonl_file_is_named(tmp_path):
    path = tmp_path / "absent.jsonl"
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        load_prompts(jsonl_config(path))


def test_toy_task_makes_num_prompts_rows_seeded_by_the_trainer_seed():
    config = load_config(None, ["run_name=t", "task.num_prompts=40", "trainer.seed=7"])
    dataset = load_prompts(config)
    assert dataset.to_list() == make_prompts(40, seed=7)
    assert (
        dataset.to_list() != load_prompts(load_config(None, ["run_name=t", "task.num_prompts=40"])).to_list()
    )
    rewards = arithmetic_reward([row["answer"] for row in dataset], answer=dataset["answer"])
    assert rewards == [1.0] * 40  # each row's answer column is the right sum of its prompt


def test_reward_paths_must_name_a_function():
    assert import_function("rl_cluster.core.rewards:arithmetic_reward") is arithmetic_reward
    with pytest.raises(ValueError, match="must look like package.module:function"):
        import_function("rl_cluster.core.rewards.arithmetic_reward")
    with pytest.raises(AttributeError, match="no_such_reward"):
        import_function("rl_cluster.core.rewards:no_such_reward")


def test_dataset_task_reads_only_prepared_data_and_says_how_to_make_it(tmp_path):
    # `task.prompts = "dataset"` never loads from the hub in the run: without `prepare` it stops, naming
    # the command (tests/unit/test_data.py covers prepare and the rows it writes).
    config = load_config(
        None,
        ["run_name=t", "task.prompts=dataset", "task.dataset=some/hub-dataset",
         f"bucket.uri={json.dumps(str(tmp_path / 'bucket'))}"],
    )  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"run `python -m rl_cluster.data prepare --config"):
        load_prompts(config)

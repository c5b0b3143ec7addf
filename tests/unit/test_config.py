import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from rl_cluster import docs
from rl_cluster.config import RunConfig, config_reference, load_config, parse_override

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "jobs" / "configs").glob("*.toml"))
CPU_DEMO = REPO / "jobs/configs/cpu_demo.toml"


def test_configs_are_shipped():
    assert {p.name for p in SHIPPED} >= {"cpu_demo.toml", "qwen25_math_1p5b.toml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_parses_and_survives_its_resolved_dump(path):
    config = load_config(path)
    assert re.fullmatch(rf"{re.escape(path.stem)}-\d{{8}}-\d{{6}}", config.run_name), config.run_name
    # A run writes config.resolved.json (rl_cluster.run); reading it back gives the same config.
    assert RunConfig.model_validate_json(config.model_dump_json()) == config


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_checkpoints(path):
    """A trainer that Ray restarts goes on from the newest checkpoint, and --resume needs one: with
    checkpoint_every 0 the first starts again from step 0 and the second is refused."""
    t = load_config(path).trainer
    assert 0 < t.checkpoint_every <= t.max_steps // 2, "at least two checkpoints before the run's end"
    assert t.keep_checkpoints >= 2  # one that fails its verification leaves the one before it


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_validators_guard_every_shipped_config(path):
    """One step more staleness than a shipped config's adapter slots hold is refused, naming both fields."""
    config = load_config(path)
    too_stale = config.generator.max_loras - 1
    with pytest.raises(ValidationError, match=rf"generator\.max_loras=\d+ cannot hold the live window: "
                       rf"trainer\.max_staleness={too_stale}"):  # fmt: skip
        load_config(path, [f"trainer.max_staleness={too_stale}"])
    assert (
        load_config(path, [f"trainer.max_staleness={too_stale - 1}"]).trainer.max_staleness == too_stale - 1
    )


@pytest.mark.parametrize(
    "text,keys,value",
    [
        ("trainer.max_steps=20", ["trainer", "max_steps"], 20),
        ("trainer.learning_rate=1e-5", ["trainer", "learning_rate"], 1e-5),
        ("trainer.gradient_checkpointing=true", ["trainer", "gradient_checkpointing"], True),
        ('lora.target_modules=["q_proj", "v_proj"]', ["lora", "target_modules"], ["q_proj", "v_proj"]),
        ("bucket.uri=s3://b/p", ["bucket", "uri"], "s3://b/p"),  # not TOML: a bare word is a string
        ('model.revision="1234567"', ["model", "revision"], "1234567"),  # quoted: a string, not a number
        ("run_name=x=y", ["run_name"], "x=y"),  # the first "=" splits
    ],
)
def test_overrides_parse_as_toml_values(text, keys, value):
    parsed_keys, parsed = parse_override(text)
    assert (parsed_keys, parsed) == (keys, value) and type(parsed) is type(value)


def test_overrides_apply_with_the_fields_types_and_leave_the_rest_alone():
    overrides = [
        "run_name=x1", "trainer.max_steps=7", "trainer.learning_rate=1", "trainer.gradient_checkpointing=true",
        'generator.extra_args=["--enforce-eager"]', "bucket.uri=s3://b/runs", "trainer.max_steps=9",
    ]  # fmt: skip
    base, c = load_config(CPU_DEMO, ["run_name=x1"]), load_config(CPU_DEMO, overrides)
    assert c.trainer.max_steps == 9  # the last override of a field wins
    assert c.trainer.learning_rate == 1.0 and isinstance(c.trainer.learning_rate, float)
    assert c.trainer.gradient_checkpointing is True
    assert (c.generator.extra_args, c.bucket.uri) == (["--enforce-eager"], "s3://b/runs")
    changed = {"trainer": {"max_steps", "learning_rate", "gradient_checkpointing"}, "generator": {"extra_args"},
               "bucket": {"uri"}}  # fmt: skip
    assert c.model_dump(exclude=changed) == base.model_dump(exclude=changed)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["generator.replicas=two"], r"generator\.replicas\n\s+Input should be a valid integer"),
        (["trainer.max_steps=2.5"], r"trainer\.max_steps\n\s+Input should be a valid integer"),
        (["generator.extra_args=--enforce-eager"], r"generator\.extra_args\n\s+Input should be a valid list"),
        (["trainer.learning_rate=-1"], r"trainer\.learning_rate\n\s+Input should be greater than 0"),
        (["trainer.nonsense=1"], r"trainer\.nonsense\n\s+Extra inputs are not permitted"),
        (["trainer.completions_per_step=12", "trainer.num_generations=8"],
         r"trainer\.completions_per_step=12 must be a multiple of trainer\.num_generations=8"),
        (["generator.max_loras=3", "trainer.max_staleness=4"],
         r"generator\.max_loras=3 cannot hold the live window: trainer\.max_staleness=4 needs at least 6"),
        (["lora.rank=16", "generator.max_lora_rank=8"], r"lora\.rank=16 exceeds generator\.max_lora_rank=8"),
        (["trainer.num_workers=3", "trainer.completions_per_step=32"],
         r"completions_per_step=32 does not split evenly into trainer\.num_workers=3 ranks: make it a multiple of 3"),
        (["trainer.num_workers=2", "trainer.mode=sync"], r"trainer\.mode = 'sync' runs one trainer rank"),
        (["trainer.strategy=fsdp2"], r'strategy = "fsdp2" shards the model over trainer\.num_workers ranks, and there is one'),
        (["trainer.span_nodes=true"], r"trainer\.span_nodes lets the trainer's ranks span nodes, and there is one rank"),
        (["trainer.collective_timeout_s=1000"],
         r"trainer\.collective_timeout_s=1000 is shorter than rank 0's I/O between two collectives \(600 s for an "
         r"adapter load \+ proxy\.unavailable_timeout_s=300 \+ 300 s for an upload = 1200 s\)"),
        (["proxy.imbalance_threshold=4", "trainer.num_generations=8"],
         r"proxy\.imbalance_threshold=4 is below trainer\.num_generations=8"),
        (["proxy.max_sequences_per_request=0"],
         r"proxy\.max_sequences_per_request\n\s+Input should be greater than or equal to 1"),
        (["proxy.max_sequences_per_request=64"], r"proxy\.max_n=128 exceeds proxy\.max_sequences_per_request=64"),
        (["task.prompts=jsonl"], r'task\.prompts = "jsonl" needs task\.jsonl_path'),
        (["run_name=../escape"], r"run_name='\.\./escape' may contain only"),
        (["run_name=.."], r"run_name='\.\.' needs a letter or digit"),  # .cache/logs/.. is not the run's
        (["run_name=."], r"run_name='\.' needs a letter or digit"),
    ],
)  # fmt: skip
def test_bad_values_and_combinations_are_rejected_naming_the_field(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(None, ["run_name=t", *overrides])


def test_the_ranks_collectives_are_bounded_by_collective_timeout_s():
    """Ray Train gives the ranks' process group the configured bound (gloo on CPU, NCCL on GPUs)."""
    from rl_cluster.trainer.gang import torch_config

    cpu = torch_config(load_config(None, ["run_name=t", "trainer.collective_timeout_s=1300"]))
    gpu = torch_config(load_config(None, ["run_name=t", "trainer.num_gpus=1"]))
    assert (cpu.backend, cpu.timeout_s, gpu.backend, gpu.timeout_s) == ("gloo", 1300, "nccl", 1800)


def test_gloo_binds_to_the_interface_of_the_nodes_ray_address(monkeypatch):
    """Where the hostname resolves to 127.0.0.1 (this machine, host-networked pods, namespace nodes) gloo
    would bind to loopback and a gang across nodes could not connect; each rank binds it to the interface
    of the address Ray knows its node by, and a GLOO_SOCKET_IFNAME the user set stays."""
    import psutil
    import ray

    from rl_cluster.trainer.gang import bind_gloo_to_node_address

    # Set first so that monkeypatch restores its absence: bind_gloo_to_node_address writes os.environ itself,
    # and a GLOO_SOCKET_IFNAME left in the test process reached the vLLM servers of later tests, whose gloo
    # then looked for this machine's interface inside a network namespace.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "unset")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    bind_gloo_to_node_address()
    held = [a.address for a in psutil.net_if_addrs()[os.environ["GLOO_SOCKET_IFNAME"]]]
    assert ray.util.get_node_ip_address() in held, held
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine0")
    bind_gloo_to_node_address()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine0"


def test_no_test_leaves_gloo_bound_to_an_interface():
    """After the test above (same module, later): the variable is gone again."""
    assert "GLOO_SOCKET_IFNAME" not in os.environ


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer"], r"override 'trainer' must look like section\.field=value"),
        (["run_name=a", "run_name.x=1"], r"'run_name' is not a section"),
    ],
)
def test_malformed_overrides_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_default_run_name_is_the_stem_and_the_utc_time():
    assert re.fullmatch(r"run-\d{8}-\d{6}", load_config(None).run_name)
    assert load_config(None, ["run_name=mine"]).run_name == "mine"


def test_every_field_is_documented():
    undocumented = [name for name, _, doc in config_reference() if not doc and "." in name]
    assert not undocumented


def test_config_reference_is_current():
    reference = REPO / "docs" / "configuration.md"
    assert reference == docs.REFERENCE
    text = reference.read_text()
    for name, _default, _ in config_reference():
        assert f"`{name}`" in text, f"{reference} lacks {name}; run `python -m rl_cluster.docs`"
    assert text == docs.with_reference(text), f"{reference} is out of date; run `python -m rl_cluster.docs`"


def test_sections_forbid_unknown_keys():
    with pytest.raises(ValidationError, match=r"generator\.replica\n\s+Extra inputs are not permitted"):
        RunConfig.model_validate({"run_name": "x", "generator": {"replica": 2}})


# -- the MATH recipes and the dataset task (issue 12) --------------------------------------------------------
QWEN = REPO / "jobs/configs/qwen25_math_1p5b.toml"
DEEPSEEK = REPO / "jobs/configs/deepseek_r1_distill_qwen_1p5b.toml"


def test_the_published_qwen_recipe_is_the_published_run():
    c = load_config(QWEN)
    assert (c.model.path, c.lora.rank, c.lora.target_modules) == ("Qwen/Qwen2.5-Math-1.5B", 1, "all-linear")
    t = c.trainer
    assert (t.learning_rate, t.num_generations, t.completions_per_step) == (4e-5, 8, 128)
    assert t.max_new_tokens == 3000
    assert (t.max_staleness, t.sync_every, t.gradient_checkpointing) == (4, 4, False) and t.token_budget > 0
    assert (c.task.prompts, c.task.answer_from_solution, c.task.eval_split) == ("dataset", True, "test")
    assert c.task.rewards == ["rl_cluster.core.rewards:math_reward"]


def test_the_deepseek_recipe_uses_the_think_grader_and_a_longer_context():
    c, qwen = load_config(DEEPSEEK), load_config(QWEN)
    assert c.model.path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    assert c.task.rewards == ["rl_cluster.core.rewards:math_think_reward"]
    assert (
        c.model.max_model_len > qwen.model.max_model_len
        and c.trainer.max_new_tokens > qwen.trainer.max_new_tokens
    )
    assert c.task.system_prompt is None and "{prompt}" in c.task.prompt_template


@pytest.mark.parametrize("path", [QWEN, DEEPSEEK], ids=lambda p: p.name)
def test_recipe_reward_functions_import(path):
    from rl_cluster.trainer.task import import_function

    for reward in load_config(path).task.rewards:
        assert callable(import_function(reward))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.max_new_tokens=256", "model.max_model_len=256"],
         r"trainer\.max_new_tokens=256 leaves no room for a prompt in model\.max_model_len=256"),
        (["trainer.max_new_tokens=300"], r"trainer\.max_new_tokens=300 leaves no room"),
        (["model.max_model_len=4096", "trainer.token_budget=2048"],
         r"trainer\.token_budget=2048 is below model\.max_model_len=4096"),
        (["task.prompts=dataset"], r'task\.prompts = "dataset" needs task\.dataset'),
        (["task.prompts=dataset", "task.dataset=parquet", 'task.data_files={test=["t.parquet"]}'],
         r"task\.split='train' is not a key of task\.data_files \['test'\]"),
        (["task.prompts=dataset", "task.dataset=d", "task.eval_split=train"],
         r"task\.eval_split='train' is the training split"),
        (["task.prompts=dataset", "task.dataset=parquet", 'task.data_files={train=["a"]}', "task.eval_split=test"],
         r"task\.eval_split='test' is not a key of task\.data_files"),
        (["task.prompts=dataset", "task.dataset=d", 'task.columns={problem="question"}'],
         r'task\.columns maps no column to "prompt"'),
        (["task.prompts=dataset", "task.dataset=d", 'task.columns={problem="prompt", q="prompt"}'],
         r"task\.columns maps two columns to the same name"),
        (["task.prompts=dataset", "task.dataset=d", 'task.columns={problem="prompt"}', "task.answer_from_solution=true"],
         r'task\.answer_from_solution needs a column mapped to "answer"'),
        (["task.prompts=dataset", "task.dataset=d", 'task.prompt_template="Solve it."'],
         r"task\.prompt_template must contain \{prompt\}"),
    ],
)  # fmt: skip
def test_impossible_task_and_length_combinations_are_rejected(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(None, ["run_name=t", *overrides])


def test_a_context_that_fits_and_a_budget_that_holds_it_pass():
    c = load_config(None, ["run_name=t", "model.max_model_len=4096", "trainer.max_new_tokens=4095",
                           "trainer.token_budget=4096"])  # fmt: skip
    assert (c.trainer.max_new_tokens, c.trainer.token_budget) == (4095, 4096)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["generator.tensor_parallel_size=2", "generator.num_gpus=1"], r"reserves one GPU per rank, so set "
         r"generator\.num_gpus=2 \(or 0 on CPUs\)"),
        (['generator.extra_args=["--tensor-parallel-size", "2"]'], r"set generator\.tensor_parallel_size"),
        (['generator.extra_args=["-tp=2"]'], r"set generator\.tensor_parallel_size"),
    ],
)  # fmt: skip
def test_tensor_parallelism_is_set_by_its_field_with_a_gpu_per_rank(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(None, overrides)
    tp = load_config(None, ["generator.tensor_parallel_size=4", "generator.num_gpus=4"]).generator
    assert (tp.tensor_parallel_size, tp.num_gpus) == (4, 4)
    assert load_config(None, ["generator.num_gpus=0.5"]).generator.num_gpus == 0.5  # TP 1 may share a GPU

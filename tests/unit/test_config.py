from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rl_cluster.config import RunConfig, config_reference, load_config, parse_override

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "jobs" / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    config = load_config(path)
    assert config.run_name.startswith(path.stem) or config.run_name


def test_reference_recipe_is_the_documented_one():
    c = load_config(REPO / "jobs/configs/qwen25_math_1p5b.toml")
    assert (c.lora.rank, c.lora.alpha, c.lora.target_modules) == (1, 2.0, "all-linear")
    assert (c.trainer.learning_rate, c.trainer.lr_scheduler, c.trainer.adam_beta2) == (4e-5, "constant", 0.95)
    assert (c.trainer.num_generations, c.trainer.completions_per_step) == (8, 128)
    assert (c.trainer.max_new_tokens, c.model.max_model_len) == (3000, 4096)
    assert (c.trainer.max_staleness, c.trainer.sync_every, c.generator.max_loras) == (4, 4, 6)


def test_overrides_are_typed_and_dotted():
    assert parse_override("trainer.max_steps=20") == (["trainer", "max_steps"], 20)
    assert parse_override("bucket.uri=s3://b/p") == (["bucket", "uri"], "s3://b/p")
    assert parse_override('lora.target_modules=["q_proj"]') == (["lora", "target_modules"], ["q_proj"])
    c = load_config(REPO / "jobs/configs/cpu_demo.toml", ["trainer.max_steps=7", "run_name=x1"])
    assert (c.trainer.max_steps, c.run_name) == (7, "x1")


def test_default_run_names_differ_per_run():
    assert load_config(None).run_name.startswith("run-")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.completions_per_step=12", "trainer.num_generations=8"], "multiple of"),
        (["generator.max_loras=3", "trainer.max_staleness=4"], "live window"),
        (["lora.rank=16", "generator.max_lora_rank=8"], "max_lora_rank"),
        (["proxy.host=0.0.0.0"], "auth_token"),
        (["trainer.nonsense=1"], "Extra inputs are not permitted"),
        (["trainer.learning_rate=-1"], "greater than 0"),
        (["run_name=../escape"], "run_name"),
    ],
)
def test_bad_combinations_are_rejected_with_a_reason(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(None, ["run_name=t", *overrides] if "run_name" not in overrides[0] else overrides)


def test_every_field_is_documented():
    undocumented = [name for name, _, doc in config_reference() if not doc and "." in name]
    assert not undocumented


def test_readme_config_reference_is_in_step():
    readme = (REPO / "README.md").read_text()
    for name, _default, _ in config_reference():
        assert f"`{name}`" in readme, f"README config reference lacks {name}; run `python -m rl_cluster.docs`"


def test_sections_forbid_unknown_keys():
    with pytest.raises(ValidationError):
        RunConfig.model_validate({"run_name": "x", "generator": {"replica": 2}})


@pytest.mark.parametrize("path", sorted((REPO / "ray_configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_ray_configs_are_valid_yaml_with_our_resources(path):
    text = path.read_text()
    yaml.safe_load(text)
    assert "trainer" in text and "generator" in text

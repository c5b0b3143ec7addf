"""The proxy's token: on disk a file only its owner can read, whatever was at the path before; always one
where the proxy binds beyond loopback."""

from __future__ import annotations

import os
import stat

from rl_cluster.credentials import write_private_file


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_an_existing_world_readable_file_ends_up_0600(tmp_path):
    path = tmp_path / "tokens" / "run"
    path.parent.mkdir()
    path.write_text("old token\n")
    path.chmod(0o644)
    write_private_file(str(path), "new token\n")
    assert mode(path) == 0o600
    assert path.read_text() == "new token\n"
    assert os.listdir(path.parent) == ["run"]  # no temporary file left behind


def test_a_new_file_is_0600_under_any_umask(tmp_path):
    old = os.umask(0)
    try:
        write_private_file(str(tmp_path / "new" / "run"), "t\n")
    finally:
        os.umask(old)
    assert mode(tmp_path / "new" / "run") == 0o600
    assert mode(tmp_path / "new") == 0o700  # a directory it makes is private too


def test_a_symlink_at_the_path_is_replaced_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("not yours\n")
    elsewhere.chmod(0o644)
    path = tmp_path / "run"
    path.symlink_to(elsewhere)
    write_private_file(str(path), "token\n")
    assert not path.is_symlink() and mode(path) == 0o600 and path.read_text() == "token\n"
    assert elsewhere.read_text() == "not yours\n" and mode(elsewhere) == 0o644


def test_the_runs_token_file_replaces_a_world_readable_one(tmp_path, monkeypatch):
    from rl_cluster.serve import write_token_file

    monkeypatch.chdir(tmp_path)
    old = tmp_path / ".cache" / "tokens" / "r1"
    old.parent.mkdir(parents=True)
    old.write_text("stale\n")
    old.chmod(0o644)
    path = write_token_file("r1", "fresh")
    assert path == str(old) and mode(path) == 0o600 and old.read_text() == "fresh\n"


def test_serve_generates_a_token_unless_the_proxy_binds_loopback():
    """What `serve` passes as generate_token: a proxy others can reach always has a token (issue: a
    loopback Ray with proxy.host=0.0.0.0 once served with none)."""
    from rl_cluster.config import RunConfig
    from rl_cluster.credentials import RunSecrets, proxy_binds_loopback

    def binds_loopback(host, private_ray):
        return proxy_binds_loopback(RunConfig(run_name="t", proxy={"host": host}), private_ray)

    assert binds_loopback(None, True) and not binds_loopback(None, False)  # unset: as ProxyActor resolves it
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert binds_loopback(host, False), host
    for host in ("0.0.0.0", "::", "10.231.7.1", "head.internal"):
        assert not binds_loopback(host, True), host
    config = RunConfig(run_name="t", proxy={"host": "0.0.0.0"})
    secrets = RunSecrets.for_run(config, generate_token=not proxy_binds_loopback(config, True))
    assert secrets.proxy_token and len(secrets.proxy_token) >= 32


def test_the_drivers_secrets_go_to_the_actors_and_not_into_the_runtime_env(monkeypatch):
    """A runtime_env's env_vars are shown by the Ray dashboard and the state API: HF_TOKEN and
    WANDB_API_KEY travel in RunSecrets (constructor arguments) instead; the rest of the HF setup stays."""
    from rl_cluster.config import RunConfig
    from rl_cluster.connection import runtime_env
    from rl_cluster.credentials import RunSecrets

    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_secret_value")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env_vars = runtime_env()["env_vars"]
    assert env_vars["HF_HUB_OFFLINE"] == "1"
    assert "HF_TOKEN" not in env_vars and "WANDB_API_KEY" not in env_vars
    secrets = RunSecrets.for_run(RunConfig(run_name="t"))
    assert secrets.environment == {"HF_TOKEN": "hf_secret_value", "WANDB_API_KEY": "wandb_secret_value"}
    assert "secret_value" not in repr(secrets)

"""The proxy's request checks (pure, milliseconds): what it refuses before anything reaches a replica."""

from __future__ import annotations

import json
import os

import pytest

from rl_cluster.proxy.validation import (
    MAX_JSON_DEPTH,
    Invalid,
    check_adapter_name,
    check_adapter_path,
    check_generation,
    check_pause_query,
    parse_json_object,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def generation_ok(
    route: str, body: dict, max_sequences: int = 1024, max_model_len: int | None = None
) -> bool:
    try:
        check_generation(route, body, max_n=16, max_sequences=max_sequences, max_model_len=max_model_len)
    except Invalid:
        return False
    return True


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[1]", b'"x"', b"null", b'{"a": NaN}', b'{"a": Infinity}', b"\xff\xfe", b'{"a": "\\ud800"}',
     b"[" * 100_000, b'{"a":' * 50 + b"1" + b"}" * 50,
     b'{"a": "\xed\xa0\x80"}', b'{"a": 1e400}', b'{"a": 1} x', b'{"a": [1, 2.0, NaN]}'],
)  # fmt: skip
def test_bad_json_is_refused(raw):
    with pytest.raises(Invalid):
        parse_json_object(raw)


def test_deep_bodies_are_walked_and_shallow_ones_are_not_refused():
    # More brackets than the depth limit, little nesting: the walk runs and lets it through.
    wide = {"prompt": [[1]] * 100, "x": [{"a": [1]}] * 50}
    assert parse_json_object(json.dumps(wide).encode()) == wide
    assert parse_json_object('{"a": "😀 \\ud83d\\ude00"}'.encode()) == {"a": "😀 😀"}


def test_depth_limit_is_exact():
    nested = {"a": 1}
    for _ in range(MAX_JSON_DEPTH - 1):
        nested = {"a": nested}
    assert parse_json_object(json.dumps(nested).encode())
    with pytest.raises(Invalid, match="deeper"):
        parse_json_object(json.dumps({"a": nested}).encode())


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "1+1"},
        {"prompt": [1, 2, 3], "max_tokens": 8, "n": 16, "temperature": 0},
        {"prompt": ["a", "b"], "model": "m", "stream": True, "max_tokens": 10**6},
        {"prompt": [[1], [2, 3]], "temperature": 1.5, "unknown_field": {"x": 1}},
    ],
)
def test_good_completions_pass(body):
    assert generation_ok(COMPLETIONS, body)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": ""},
        {"prompt": []},
        {"prompt": [1, -1]},
        {"prompt": [1, True]},
        {"prompt": [1, 2**40]},
        {"prompt": [["a"], [1]]},
        {"prompt": {"a": 1}},
        {"prompt": 5},
        {"prompt": "x", "model": 5},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "max_tokens": -3},
        {"prompt": "x", "max_tokens": 2.5},
        {"prompt": "x", "max_tokens": "8"},
        {"prompt": "x", "max_tokens": 10**30},
        {"prompt": "x", "n": 0},
        {"prompt": "x", "n": 17},
        {"prompt": "x", "n": True},
        {"prompt": "x", "temperature": -0.1},
        {"prompt": "x", "temperature": "hot"},
        {"prompt": "x", "stream": "yes"},
    ],
)
def test_bad_completions_are_refused(body):
    assert not generation_ok(COMPLETIONS, body)


def test_chat_messages():
    assert generation_ok(CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4})
    assert generation_ok(CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    for messages in (
        None,
        [],
        "hi",
        [1],
        [{"content": "x"}],
        [{"role": 3}],
        [{"role": "user", "content": 5}],
    ):
        assert not generation_ok(CHAT, {"messages": messages}), messages
    assert not generation_ok(CHAT, {"messages": [{"role": "user"}], "max_completion_tokens": 0})


@pytest.mark.parametrize(
    "prompt,prompts",
    [("1+1", 1), ([1, 2, 3], 1), (["a", "b", "c"], 3), ([[1], [2, 3], [4]], 3)],
    ids=["text", "token-ids", "texts", "token-id-lists"],
)
def test_sequences_are_prompts_times_n(prompt, prompts):
    body = {"prompt": prompt, "n": 4}
    assert generation_ok(COMPLETIONS, body, max_sequences=prompts * 4)
    with pytest.raises(Invalid, match=rf"asks for {prompts * 4} sequences \({prompts} prompts? x n=4\); at most "
                       rf"{prompts * 4 - 1} per request \(proxy\.max_sequences_per_request\)"):  # fmt: skip
        check_generation(COMPLETIONS, body, max_n=16, max_sequences=prompts * 4 - 1)
    # No n: one sample per prompt.
    assert generation_ok(COMPLETIONS, {"prompt": prompt}, max_sequences=prompts)
    assert not generation_ok(COMPLETIONS, {"prompt": prompt}, max_sequences=prompts - 1)


def test_a_chat_request_is_one_prompt():
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 8}
    assert generation_ok(CHAT, body, max_sequences=8)
    with pytest.raises(Invalid, match=r"asks for 8 sequences \(1 prompt x n=8\); at most 7") as refused:
        check_generation(CHAT, body, max_n=16, max_sequences=7)
    assert refused.value.param == "n"


def test_vllms_1024_prompts_at_the_largest_n_are_refused():
    body = {"prompt": [[1, 2]] * 1024, "n": 128}
    with pytest.raises(Invalid, match="asks for 131072 sequences") as refused:
        check_generation(COMPLETIONS, body, max_n=128, max_sequences=1024)
    assert refused.value.param == "prompt"
    assert generation_ok(COMPLETIONS, {"prompt": [[1, 2]] * 1024})


def test_max_tokens_is_bounded_by_the_served_context():
    assert generation_ok(COMPLETIONS, {"prompt": "x", "max_tokens": 256}, max_model_len=256)
    with pytest.raises(Invalid, match=r"'max_tokens'=257 cannot be greater than max_model_len=256"):
        check_generation(
            COMPLETIONS, {"prompt": "x", "max_tokens": 257}, max_n=1, max_sequences=1, max_model_len=256
        )
    messages = [{"role": "user", "content": "hi"}]
    assert not generation_ok(CHAT, {"messages": messages, "max_completion_tokens": 257}, max_model_len=256)
    assert not generation_ok(CHAT, {"messages": messages, "max_tokens": 257}, max_model_len=256)
    # Chat reads max_completion_tokens when both are given (as vLLM does); the other is only range-checked.
    assert generation_ok(
        CHAT, {"messages": messages, "max_completion_tokens": 8, "max_tokens": 999}, max_model_len=256
    )
    # Unknown context (None): only the integer range.
    assert generation_ok(COMPLETIONS, {"prompt": "x", "max_tokens": 10**6})


def test_a_token_prompt_must_leave_room_for_a_completion():
    # prompt + max_tokens over the context passes: vLLM caps max_tokens at what the prompt leaves.
    assert generation_ok(COMPLETIONS, {"prompt": [1] * 255, "max_tokens": 128}, max_model_len=256)
    for prompt in ([1] * 256, [[1], [1] * 300]):
        with pytest.raises(
            Invalid, match=r"a prompt of \d+ tokens leaves no room for a completion in max_model_len=256"
        ):
            check_generation(COMPLETIONS, {"prompt": prompt}, max_n=1, max_sequences=2, max_model_len=256)


def test_adapter_names():
    assert check_adapter_name("run-v3") == "run-v3"
    for name in ("", None, 5, "a/b", "x" * 300, "tab\there", "nl\n"):
        with pytest.raises(Invalid):
            check_adapter_name(name)


def test_adapter_paths_stay_inside_a_directory_bucket(tmp_path):
    root = tmp_path / "bucket"
    (root / "run" / "adapters" / "a-v1").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "run" / "escape")
    os.symlink("/etc", root / "etc-link")
    good = str(root / "run" / "adapters" / "a-v1")
    assert check_adapter_path(good, str(root)) == good
    assert check_adapter_path(str(root / "run" / "not-yet-there"), str(root))  # may appear later
    for bad in (
        str(root / ".." / "outside"),
        f"{root}/run/../../outside",
        str(root / "run" / "escape"),
        str(root / "run" / "escape" / "x"),
        str(root / "etc-link"),
        "../../etc",
        "relative/in/bucket",
        str(tmp_path / "bucket-sibling"),
        "/etc/passwd",
        f"{good}\0",
        "s3://bucket/run",
        "",
        7,
    ):
        with pytest.raises(Invalid):
            check_adapter_path(bad, str(root))
    assert check_adapter_path("/anywhere", None) == "/anywhere"  # no bucket known: any path


def test_adapter_paths_stay_inside_an_s3_bucket():
    root = "s3://bucket/prefix"
    assert check_adapter_path("s3://bucket/prefix/run/adapters/a-v1", root)
    for bad in (
        "s3://bucket/prefix",
        "s3://bucket/prefix2/x",
        "s3://other/prefix/x",
        "s3://bucket/prefix/../x",
        "s3://bucket/prefix/a//b",
        "/local/path",
    ):
        with pytest.raises(Invalid):
            check_adapter_path(bad, root)


def test_pause_query():
    check_pause_query({})
    check_pause_query({"mode": "keep", "clear_cache": "false"})
    for query in ({"mode": "later"}, {"clear_cache": "maybe"}, {"mode": "keep", "x": "1"}):
        with pytest.raises(Invalid):
            check_pause_query(query)


def test_a_streamed_request_has_a_bound_on_its_events():
    def bound(route, body, max_model_len=None):
        return check_generation(route, body, max_n=16, max_sequences=64, max_model_len=max_model_len)

    assert bound(COMPLETIONS, {"prompt": "x", "max_tokens": 4}) is None  # not streamed: no events
    # (prompts x n) sequences, each its tokens and a few more (role, finish), and a few for the answer.
    assert bound(COMPLETIONS, {"prompt": ["a", "b"], "n": 3, "max_tokens": 4, "stream": True}) == 6 * 8 + 8
    assert bound(CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
                        "max_tokens": 99, "stream": True}) == 9 + 8  # fmt: skip
    # No max_tokens: as many as the served context, or vLLM's common one when the proxy was not told.
    assert bound(COMPLETIONS, {"prompt": "x", "stream": True}, max_model_len=256) == 260 + 8
    assert bound(COMPLETIONS, {"prompt": "x", "stream": True}) == 4100 + 8

"""Checks the proxy makes on a request before anything reaches a replica.

Nothing malformed should reach vLLM: a request the proxy understands is checked here and refused with a 400
in vLLM's error shape, so every 5xx a client sees comes from a replica that failed, never from a bad request.
Fields the proxy does not understand are left to vLLM, which answers its own 400s for them.
"""

from __future__ import annotations

import math
import os
from typing import Annotated, Any

import msgspec

# Deeper than any real request (chat content parts are 4-5 levels); bounds the work of every later walk.
MAX_JSON_DEPTH = 32
MAX_ADAPTER_NAME = 256
MAX_INT32 = 2**31 - 1
# A context the proxy was not told (a proxy in front of servers it knows nothing about): vLLM's common one.
DEFAULT_CONTEXT_TOKENS = 4096
PAUSE_MODES = frozenset({"abort", "wait", "keep"})
BOOL_WORDS = frozenset({"true", "false", "1", "0", "yes", "no", "on", "off"})
_decode = msgspec.json.Decoder().decode
_TokenIds = list[Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)]]


class Invalid(ValueError):
    """A request the proxy refuses with 400; `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse_json_object(raw: bytes) -> dict:
    """Strict JSON (no NaN/Infinity), an object, at most MAX_JSON_DEPTH deep, with valid Unicode strings.

    msgspec's decoder is strict where the standard library is lenient (NaN, Infinity, lone surrogates,
    invalid UTF-8 are all refused, so no walk over every string is needed) and 5x faster than json.loads
    on TRL's bodies (a list of token ids): parsing and walking them was a fifth of the proxy's CPU per
    request. The depth walk is skipped when the raw bytes prove the bound (nesting cannot exceed the
    number of brackets), which a C-speed count decides.
    """
    try:
        body = _decode(raw)
    except (msgspec.DecodeError, RecursionError) as e:  # RecursionError: nesting deeper than its stack
        raise Invalid(f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise Invalid("request body must be a JSON object")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        _check_depth(body)
    return body


def _check_depth(root: Any) -> None:
    """The depth check without recursion (the depth is what we are bounding)."""
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()  # depth: how many objects/arrays enclose `node`, itself included
        if depth > MAX_JSON_DEPTH:
            raise Invalid(f"request body nests deeper than {MAX_JSON_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _token_ids(value: Any) -> bool:
    # Checked by msgspec in C: a Python check per id cost more than all the request's other checks.
    if not isinstance(value, list) or not value:
        return False
    try:
        msgspec.convert(value, _TokenIds, strict=True)  # strict: True and 1.0 are no token ids
    except msgspec.ValidationError:
        return False
    return True


def _prompt_shape(prompt: Any) -> tuple[int, int]:
    """(prompts, tokens in the longest token-id prompt; 0 for text) of a valid completions `prompt`.

    vLLM reads a string or one list of token ids as one prompt, and a list of either as that many.
    """
    if isinstance(prompt, str) and prompt != "":
        return 1, 0
    if _token_ids(prompt):
        return 1, len(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) and p != "" for p in prompt):
            return len(prompt), 0
        if all(_token_ids(p) for p in prompt):
            return len(prompt), max(map(len, prompt))
    raise Invalid(
        "'prompt' must be a non-empty string, a non-empty list of token ids (0 <= id < 2**31), "
        "or a non-empty list of either",
        "prompt",
    )


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise Invalid("'messages' must be a non-empty list of message objects", "messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise Invalid("each message must be an object with a string 'role'", "messages")
        content = message.get("content")
        if not (
            content is None
            or isinstance(content, str)
            or (isinstance(content, list) and all(isinstance(part, dict) for part in content))
        ):
            raise Invalid(
                "a message's 'content' must be a string, null, or a list of content parts", "messages"
            )


def check_generation(
    route: str, body: dict, *, max_n: int, max_sequences: int, max_model_len: int | None = None
) -> int | None:
    """The fields of a /v1/completions or /v1/chat/completions body the proxy routes on or bounds.
    Returns, for a streamed request, the most server-sent events an honest answer has (None: not streamed):
    one per token of each sequence, a few per sequence (role, finish) and a few per answer (usage, [DONE]).

    `max_sequences`: most prompts x n one request may ask for (vLLM takes up to 1,024 prompts, so n alone
    does not bound the work one request queues). `max_model_len`: the served context (None: unknown, not
    checked); a `max_tokens` above it, or a token-id prompt that leaves no room for one completion token,
    is what vLLM refuses too, refused here before it costs a replica anything.
    """
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise Invalid("'model' must be a string", "model")
    n = body.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= max_n):
        raise Invalid(f"'n' must be an integer from 1 to {max_n}", "n")
    chat = route.endswith("/chat/completions")
    if chat:
        _check_messages(body.get("messages"))
        prompts, prompt_tokens = 1, 0
    else:
        prompts, prompt_tokens = _prompt_shape(body.get("prompt"))
    sequences = prompts * (n or 1)
    if sequences > max_sequences:
        raise Invalid(
            f"the request asks for {sequences} sequences ({prompts} prompt{'s' * (prompts > 1)} x "
            f"n={n or 1}); at most {max_sequences} per request (proxy.max_sequences_per_request)",
            "n" if prompts == 1 else "prompt",
        )
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is None:
            continue
        # Absurd integers are refused before they reach anything that overflows.
        if not _is_int(value) or not 1 <= value <= MAX_INT32:
            raise Invalid(f"'{field}' must be an integer from 1 to {MAX_INT32}", field)
    if max_model_len is not None:
        _check_context(body, chat, prompt_tokens, max_model_len)
    temperature = body.get("temperature")
    if temperature is not None and (not _is_number(temperature) or temperature < 0):
        raise Invalid("'temperature' must be a finite number >= 0", "temperature")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise Invalid("'stream' must be a boolean", "stream")
    if not stream:
        return None
    tokens = body.get("max_completion_tokens") if chat else None
    tokens = tokens or body.get("max_tokens") or max_model_len or DEFAULT_CONTEXT_TOKENS
    return sequences * (tokens + 4) + 8


def _check_context(body: dict, chat: bool, prompt_tokens: int, max_model_len: int) -> None:
    # The field vLLM reads: chat prefers max_completion_tokens; completions know only max_tokens.
    field = (
        "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    )
    value = body.get(field)
    if value is not None and value > max_model_len:
        raise Invalid(f"'{field}'={value} cannot be greater than max_model_len={max_model_len}", field)
    # Only a prompt that fills the context is refused, never prompt + max_tokens over it: vLLM caps
    # max_tokens at what the context leaves, and clients (TRL sends its max_completion_length) rely on it.
    if prompt_tokens >= max_model_len:
        raise Invalid(
            f"a prompt of {prompt_tokens} tokens leaves no room for a completion in "
            f"max_model_len={max_model_len}",
            "prompt",
        )


def check_adapter_name(name: Any, param: str = "lora_name") -> str:
    if not isinstance(name, str) or not name:
        raise Invalid(f"'{param}' must be a non-empty string", param)
    if len(name) > MAX_ADAPTER_NAME or not name.isprintable() or "/" in name:
        raise Invalid(f"'{param}' must be at most {MAX_ADAPTER_NAME} printable characters without '/'", param)
    return name


def check_adapter_path(path: Any, root: str | None) -> str:
    """`path` must be a string naming a place inside the bucket `root` (when the proxy knows one).

    s3:// roots: the URI must start with the root and have no '.'/'..' segments. Directory roots: the path
    is resolved (symlinks included) and must stay inside the resolved root. The path is checked on the
    proxy's node, which sees the bucket at the same path as the replicas (DESIGN.md); the replicas get the
    path as it was given.
    """
    if not isinstance(path, str) or not path:
        raise Invalid("'lora_path' must be a non-empty string", "lora_path")
    if "\0" in path or not path.isprintable():
        raise Invalid("'lora_path' contains control characters", "lora_path")
    if root is None:
        return path
    if root.startswith("s3://"):
        prefix = root.rstrip("/") + "/"
        segments = path.removeprefix(prefix).split("/")
        if not path.startswith(prefix) or any(s in ("", ".", "..") for s in segments):
            raise Invalid(f"'lora_path' must be an object prefix under {prefix}", "lora_path")
        return path
    if not os.path.isabs(path):
        raise Invalid("'lora_path' must be an absolute path in the bucket", "lora_path")
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
        raise Invalid(f"'lora_path' must lie inside the bucket {root}", "lora_path")
    return path


def check_pause_query(query: dict[str, str]) -> None:
    """The query parameters vLLM's /pause takes (mode, clear_cache); anything else is refused."""
    unknown = set(query) - {"mode", "clear_cache"}
    if unknown:
        raise Invalid(f"unknown /pause parameters: {sorted(unknown)}")
    if "mode" in query and query["mode"] not in PAUSE_MODES:
        raise Invalid(f"'mode' must be one of {sorted(PAUSE_MODES)}", "mode")
    if "clear_cache" in query and query["clear_cache"].lower() not in BOOL_WORDS:
        raise Invalid("'clear_cache' must be a boolean", "clear_cache")

"""Manifests: what a published adapter version or trainer checkpoint claims to be, and the checks a reader
makes before using it. Pure logic (no IO beyond hashing bytes handed in), so every rule tests in milliseconds.

A version directory `<adapter_name>-v<N>/` holds the PEFT files and `manifest.json`, written last; a
checkpoint directory `step-<N>/` holds what the HF Trainer saved (adapter, optimizer, scheduler, RNG and
trainer state) and its `manifest.json`, also written last. The manifest records each file's size and sha256
plus what the files fit (base model; rank for adapters), so a reader can tell "not published yet" (no
manifest: AdapterNotFound, retry) from "not what was published" or "does not fit" (AdapterRejected, do not
retry), each with a message naming the cause. Its `kind` says which of the two it describes; manifests
written before the field existed are adapter manifests. Other kinds (experience shards: core/experience.py)
build on the checks every manifest shares, `check_fields` and `check_file_entries`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rl_cluster.errors import AdapterRejected, FilesDiffer

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
ADAPTER = "adapter"
CHECKPOINT = "checkpoint"
# vLLM reads these two; a version without either cannot load, so the manifest must list both.
REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors")
# HF Trainer cannot resume from a checkpoint without its trainer state (global step, log history).
CHECKPOINT_REQUIRED_FILES = ("trainer_state.json",)
CHECKPOINT_PREFIX = "step"

# Keys of a Hugging Face config.json that fix the shapes a LoRA adapter is built against. Weights are not
# fingerprinted (too costly); this catches "adapter trained on another model", the mistake that happens.
ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)

_SHA256 = re.compile(r"[0-9a-f]{64}")
# The fields each kind of manifest must have, in the order missing ones are named. `kind` itself is
# optional (absent: an adapter manifest from before the field existed) and checked separately.
_FIELD_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    ADAPTER: {
        "format": (int,),
        "name": (str,),
        "adapter_name": (str,),
        "version": (int,),
        "base_model": (str,),
        "base_model_fingerprint": (str,),
        "rank": (int,),
        "alpha": (int, float),
        "target_modules": (str, list),
        "trainer_step": (int,),
        "created_at": (str,),
        "files": (dict,),
    },
    CHECKPOINT: {
        "format": (int,),
        "name": (str,),
        "step": (int,),
        "base_model": (str,),
        "base_model_fingerprint": (str,),
        "created_at": (str,),
        "files": (dict,),
    },
}
_REQUIRED_FILES = {ADAPTER: REQUIRED_FILES, CHECKPOINT: CHECKPOINT_REQUIRED_FILES}


def _architecture(config: Mapping[str, Any]) -> dict[str, Any]:
    arch = {key: config[key] for key in ARCHITECTURE_KEYS if config.get(key) is not None}
    # config.json often omits values that have defaults; fill them so a saved file and a loaded
    # config object (which carries the defaults) fingerprint the same.
    if "num_key_value_heads" not in arch and "num_attention_heads" in arch:
        arch["num_key_value_heads"] = arch["num_attention_heads"]
    if "head_dim" not in arch and "hidden_size" in arch and arch.get("num_attention_heads"):
        arch["head_dim"] = arch["hidden_size"] // arch["num_attention_heads"]
    return arch


def base_model_fingerprint(config: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a HF config's architecture-defining keys. Multimodal configs keep
    the language model under `text_config`; it is fingerprinted too."""
    arch = _architecture(config)
    if isinstance(config.get("text_config"), Mapping):
        arch["text_config"] = _architecture(config["text_config"])
    if not arch:
        raise ValueError("config has none of the architecture keys; is this a Hugging Face config.json?")
    canonical = json.dumps(arch, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def sha256_of(chunks: Iterable[bytes]) -> tuple[int, str]:
    """(size, sha256 hex) of a stream of byte chunks."""
    digest, size = hashlib.sha256(), 0
    for chunk in chunks:
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def adapter_dir_name(prefix: str, version: int) -> str:
    """The directory (and vLLM adapter) name of a version: `policy`, 3 -> `policy-v3`."""
    return f"{prefix}-v{version}"


def _number_after(head: str, name: str) -> int | None:
    """N in `<head><N>` written the one way a writer writes it, or None."""
    digits = name[len(head) :]
    if not name.startswith(head) or not digits.isdigit() or not digits.isascii():
        return None
    if digits != str(int(digits)):  # `policy-v007` is not the name anyone published
        return None
    return int(digits)


def parse_adapter_dir_name(prefix: str, name: str) -> int | None:
    """The version in `<prefix>-v<N>`, or None for any other name (temporaries, other adapters)."""
    return _number_after(f"{prefix}-v", name)


def split_adapter_dir_name(name: str) -> tuple[str, int] | None:
    """`policy-v3` -> ("policy", 3); None when the name does not end in `-v<N>`."""
    prefix, sep, _ = name.rpartition("-v")
    if not sep or not prefix:
        return None
    version = parse_adapter_dir_name(prefix, name)
    return None if version is None else (prefix, version)


def checkpoint_dir_name(step: int) -> str:
    """The directory of the checkpoint saved at trainer step N: 50 -> `step-50`."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    return f"{CHECKPOINT_PREFIX}-{step}"


def parse_checkpoint_dir_name(name: str) -> int | None:
    """The step in `step-<N>`, or None for any other name (temporaries, `step-007`)."""
    return _number_after(f"{CHECKPOINT_PREFIX}-", name)


@dataclass(frozen=True)
class AdapterMeta:
    """What a published adapter version fits and came from, as its manifest records it."""

    base_model: str  # as the run names it (a hub id or a path)
    base_fingerprint: str  # base_model_fingerprint of its config.json: what the adapter's shapes fit
    rank: int  # LoRA r
    alpha: float  # LoRA alpha
    target_modules: str | list[str]  # PEFT's target_modules ("all-linear" or module names)
    trainer_step: int  # the trainer's global step when it was saved


def build_manifest(
    *,
    adapter_name: str,
    version: int,
    meta: AdapterMeta,
    created_at: str,
    files: Mapping[str, tuple[int, str]],
) -> dict[str, Any]:
    """The manifest of one version; `files` maps each file name to its (size, sha256)."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "kind": ADAPTER,
        "name": adapter_dir_name(adapter_name, version),
        "adapter_name": adapter_name,
        "version": version,
        "base_model": meta.base_model,
        "base_model_fingerprint": meta.base_fingerprint,
        "rank": meta.rank,
        "alpha": meta.alpha,
        "target_modules": meta.target_modules
        if isinstance(meta.target_modules, str)
        else list(meta.target_modules),
        "trainer_step": meta.trainer_step,
        "created_at": created_at,
        "files": {name: {"size": size, "sha256": sha} for name, (size, sha) in sorted(files.items())},
    }
    validate_manifest(manifest)  # the writer must never publish what a reader would refuse
    return manifest


def build_checkpoint_manifest(
    *,
    step: int,
    base_model: str,
    base_fingerprint: str,
    created_at: str,
    files: Mapping[str, tuple[int, str]],
) -> dict[str, Any]:
    """The manifest of the checkpoint saved at `step`; `files` maps each file name to its (size, sha256)."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "kind": CHECKPOINT,
        "name": checkpoint_dir_name(step),
        "step": step,
        "base_model": base_model,
        "base_model_fingerprint": base_fingerprint,
        "created_at": created_at,
        "files": {name: {"size": size, "sha256": sha} for name, (size, sha) in sorted(files.items())},
    }
    validate_manifest(manifest, kind=CHECKPOINT)
    return manifest


def manifest_to_json(manifest: Mapping[str, Any]) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


def parse_manifest(text: str | bytes, where: str = MANIFEST_NAME, *, kind: str = ADAPTER) -> dict[str, Any]:
    """Parse and validate manifest JSON of the given kind; `where` names it in error messages."""
    manifest = load_json(text, where)
    validate_manifest(manifest, where, kind=kind)
    return manifest


def load_json(text: str | bytes, where: str) -> Any:
    """Manifest JSON, not yet validated; AdapterRejected when it does not parse."""
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterRejected(f"{where}: not valid JSON ({e})") from e


def validate_manifest(manifest: Any, where: str = MANIFEST_NAME, *, kind: str = ADAPTER) -> None:
    """Raise AdapterRejected unless the manifest is of `kind`, every field is present with the right type
    and file names are safe."""
    if kind not in _FIELD_TYPES:
        raise ValueError(f"kind={kind!r} is not one of {', '.join(_FIELD_TYPES)}")
    check_fields(manifest, where, kind, _FIELD_TYPES[kind])
    if kind == ADAPTER:
        if manifest["version"] < 0 or manifest["rank"] < 1:
            raise AdapterRejected(f"{where}: version must be >= 0 and rank >= 1")
        if manifest["name"] != adapter_dir_name(manifest["adapter_name"], manifest["version"]):
            raise AdapterRejected(
                f"{where}: name {manifest['name']!r} does not match adapter_name "
                f"{manifest['adapter_name']!r} and version {manifest['version']}"
            )
    else:
        if manifest["step"] < 0:
            raise AdapterRejected(f"{where}: step must be >= 0")
        if manifest["name"] != checkpoint_dir_name(manifest["step"]):
            raise AdapterRejected(
                f"{where}: name {manifest['name']!r} does not match step {manifest['step']}"
            )
    check_file_entries(manifest, where, _REQUIRED_FILES[kind])


def check_fields(manifest: Any, where: str, kind: str, field_types: Mapping[str, tuple[type, ...]]) -> None:
    """The checks every kind of manifest shares, before its own: a JSON object of `kind`, every field of
    `field_types` present with its type, the supported format."""
    if not isinstance(manifest, dict):
        raise AdapterRejected(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    found = manifest.get("kind", ADAPTER)  # written before `kind` existed: an adapter manifest
    if found != kind:
        raise AdapterRejected(f"{where}: kind {found!r}, expected {kind!r}")
    missing = [key for key in field_types if key not in manifest]
    if missing:
        raise AdapterRejected(f"{where}: missing field(s) {', '.join(missing)}")
    for key, types in field_types.items():
        value = manifest[key]
        if isinstance(value, bool) or not isinstance(value, types):  # bool is an int to Python, not here
            wanted = " or ".join(t.__name__ for t in types)
            raise AdapterRejected(f"{where}: field {key!r} should be {wanted}, got {value!r}")
    if manifest["format"] != MANIFEST_FORMAT:
        raise AdapterRejected(f"{where}: format {manifest['format']} is not the supported {MANIFEST_FORMAT}")


def check_file_entries(manifest: Mapping[str, Any], where: str, required: Iterable[str]) -> None:
    """Every file entry names a plain file and gives a size and sha256; every `required` file is listed."""
    files = manifest["files"]
    for name, entry in files.items():
        # File names are joined to the version directory by readers: a `../x` entry would read elsewhere.
        if not name or name in (".", "..") or "/" in name or "\\" in name or name == MANIFEST_NAME:
            raise AdapterRejected(f"{where}: file name {name!r} is not a plain file name")
        size, sha = (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise AdapterRejected(f"{where}: {name}: size {size!r} is not a byte count")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise AdapterRejected(f"{where}: {name}: sha256 {sha!r} is not 64 lowercase hex digits")
    absent = [name for name in required if name not in files]
    if absent:
        raise AdapterRejected(f"{where}: does not list {', '.join(absent)}")


def _check_identity(
    manifest: Mapping[str, Any], *, expected_name: str | None, base_fingerprint: str | None, reader: str
) -> None:
    """The manifest names the directory it was read from and (when given) fits the reader's base model."""
    name = manifest["name"]
    if expected_name is not None and name != expected_name:
        what = "checkpoint" if manifest.get("kind") == CHECKPOINT else "version"
        raise AdapterRejected(
            f"{expected_name}: manifest describes {name!r} (copied or renamed {what} directory?)"
        )
    if base_fingerprint is not None and manifest["base_model_fingerprint"] != base_fingerprint:
        raise AdapterRejected(
            f"{name}: trained on base model {manifest['base_model']!r} (fingerprint "
            f"{manifest['base_model_fingerprint'][:12]}…), but {reader} a model with fingerprint "
            f"{base_fingerprint[:12]}…"
        )


def check_compatible(
    manifest: Mapping[str, Any],
    *,
    base_fingerprint: str,
    max_lora_rank: int,
    expected_name: str | None = None,
) -> None:
    """The checks that need only the manifest: run them before downloading or hashing any file."""
    _check_identity(
        manifest, expected_name=expected_name, base_fingerprint=base_fingerprint, reader="this replica serves"
    )
    name = manifest["name"]
    if manifest["rank"] > max_lora_rank:
        raise AdapterRejected(
            f"{name}: rank {manifest['rank']} exceeds this replica's max LoRA rank {max_lora_rank}"
        )


def check_checkpoint_compatible(
    manifest: Mapping[str, Any], *, expected_name: str | None = None, base_fingerprint: str | None = None
) -> None:
    """A checkpoint's manifest-only checks: its name, and its base model when the reader gives one."""
    _check_identity(
        manifest, expected_name=expected_name, base_fingerprint=base_fingerprint, reader="this trainer uses"
    )


def check_files(manifest: Mapping[str, Any], observed_files: Mapping[str, tuple[int, str] | None]) -> None:
    """Every file the manifest lists must be present with the recorded size and sha256.

    `observed_files` maps a file name to its (size, sha256), or None when absent. Files the manifest does
    not list are ignored (a README, say): readers only use listed ones.
    """
    for name, entry in manifest["files"].items():
        observed = observed_files.get(name)
        if observed is None:
            raise FilesDiffer(f"{name}: listed in the manifest but missing")
        size, sha = observed
        if size != entry["size"]:
            raise FilesDiffer(
                f"{name}: size {size} != manifest {entry['size']} (truncated or still uploading?)"
            )
        if sha != entry["sha256"]:
            raise FilesDiffer(
                f"{name}: sha256 {sha[:12]}… != manifest {entry['sha256'][:12]}… (corrupted or overwritten?)"
            )


def check_manifest(
    manifest: Mapping[str, Any],
    observed_files: Mapping[str, tuple[int, str] | None],
    *,
    base_fingerprint: str,
    max_lora_rank: int,
    expected_name: str | None = None,
) -> None:
    """All checks a replica makes before loading a version; raises AdapterRejected naming the first failure."""
    check_compatible(
        manifest, base_fingerprint=base_fingerprint, max_lora_rank=max_lora_rank, expected_name=expected_name
    )
    check_files(manifest, observed_files)


def versions_to_delete(
    published: Iterable[int], *, live_window: int, keep_every: int, protected: Iterable[int] = ()
) -> list[int]:
    """Versions retention may delete, oldest first.

    Kept: the newest `live_window` versions, every version divisible by `keep_every` (0 = none), and every
    `protected` one (loaded on some replica, or unloaded less than one sync ago: vLLM re-reads evicted
    adapters from disk).
    """
    if live_window < 1:
        raise ValueError(f"live_window={live_window} must be >= 1: the newest version is always kept")
    if keep_every < 0:
        raise ValueError(f"keep_every={keep_every} must be >= 0")
    versions = sorted(set(published))
    keep = set(versions[-live_window:]) | set(protected)
    if keep_every:
        keep |= {v for v in versions if v % keep_every == 0}
    return [v for v in versions if v not in keep]

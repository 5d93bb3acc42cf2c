"""Policy checkpoints: a folder with `config.json` and `model.safetensors` (normalisation stats are buffers inside).

Writes are atomic at the folder level: everything goes to a temporary sibling folder, which then replaces the
target by rename, so a crash mid-save leaves the previous checkpoint (or nothing), never a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
METHOD_FILE = "method.pt"  # beside a `kinema train` checkpoint's weights: its RL method's name and what eval needs of it


@contextmanager
def atomic_folder(directory: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling folder to write into; on success, fsync its files and rename it over `directory`.

    A crash or an exception leaves the previous folder (or nothing) in place, never a half-written one.
    """
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        yield tmp
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.old"
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling path to write one file to; on success, fsync it and rename it over `path`.

    Readers see the old file or the new one, never a torn one; an exception leaves the old file. The temporary
    name keeps the suffix, so writers that pick a format from it (matplotlib, OpenCV) still work.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.stem}.{uuid.uuid4().hex[:8]}.tmp{target.suffix}"
    try:
        yield tmp
        if not tmp.is_file():
            raise FileNotFoundError(f"atomic_file({target}): nothing was written to {tmp}")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def set_aside(path: str | os.PathLike, name: str) -> Path:
    """Rename `path` to the sibling `name`, or `name-2`, `name-3`, ... (the first that is free): kept, never
    overwritten, out of the way of what replaces it. Returns where it went."""
    path = Path(path)
    dest, k = path.with_name(name), 1
    while dest.exists():
        k += 1
        dest = path.with_name(f"{name}-{k}")
    return path.rename(dest)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """`Path.write_text`, atomically (see `atomic_file`)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def save_checkpoint(
    directory: str | os.PathLike,
    config: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor],
    *,
    extra_files: Mapping[str, bytes] | None = None,
) -> Path:
    with atomic_folder(directory) as tmp:
        tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, default=list))
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
    return Path(directory)


def checkpoint_fingerprint(directory: str | os.PathLike) -> str:
    """The first 12 hex digits of the SHA-256 of a checkpoint's weights (model.safetensors): which weights act."""
    digest = hashlib.sha256()
    with open(Path(directory) / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


def load_checkpoint_config(directory: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's config.json alone (cheap: no weights are read), checked to be a whole checkpoint folder."""
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {path}")
    missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not a kinema checkpoint: missing {', '.join(missing)}")
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path / CONFIG_NAME} is not valid JSON ({err}); the checkpoint is damaged") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path / CONFIG_NAME} holds a {type(config).__name__}, not a config object; the checkpoint is damaged")
    return config


def load_checkpoint(directory: str | os.PathLike, *, map_location: str = "cpu") -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    path = Path(directory)
    config = load_checkpoint_config(path)
    try:
        weights = load_file(str(path / WEIGHTS_NAME), device=map_location)
    except SafetensorError as err:  # truncated or overwritten: writes are atomic, so this is damage from outside
        raise ValueError(f"{path / WEIGHTS_NAME} cannot be read as safetensors ({err}); the checkpoint is damaged") from None
    return config, weights


def state_dict_mismatch(own: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> str:
    """How a checkpoint's weights differ from a model's state dict: missing and unexpected keys, wrong shapes (the
    first five of each); "" when they fit."""
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}" for k in own if k in state and state[k].shape != own[k].shape]
    return "; ".join(filter(None, [f"missing {missing[:5]}" if missing else "", f"unexpected {unexpected[:5]}" if unexpected else "",
                                   "; ".join(wrong[:5])]))  # fmt: skip


def config_fields(cls: Any, data: Mapping[str, Any], *, policy_type: str, name: str, format_version: int) -> dict[str, Any]:
    """The dataclass fields of a policy's config.json, checked: its `policy_type` and `format_version`, no unknown
    field, and each plain field of its default's type (a hand-edited or damaged file names the field rather than
    failing deep in the model)."""
    from dataclasses import fields

    data = dict(data)
    version = data.pop("format_version", None)
    kind = data.pop("policy_type", None)
    if kind != policy_type:
        raise ValueError(f"config.json describes a {kind!r} policy, not a kinema {name}")
    if version != format_version:
        raise ValueError(f"checkpoint format_version {version} is not supported (this kinema reads {format_version}); "
                         "re-export it with the kinema version that wrote it")  # fmt: skip
    valid = {f.name for f in fields(cls)}
    if unknown := set(data) - valid:
        raise ValueError(f"config.json has unknown {name} fields {sorted(unknown)}; valid: {sorted(valid)}")
    for f in fields(cls):
        if f.name in data and isinstance(f.default, (bool, int, float, str)):
            expected, value = type(f.default), data[f.name]
            fits = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
            if not (fits or (expected is float and isinstance(value, int) and not isinstance(value, bool))):
                raise ValueError(f"config.json field {f.name} is {value!r}; expected {expected.__name__}")
    return data

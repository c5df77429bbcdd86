"""Parameters read from ``.safetensors`` files, each rank only the rows of its own shard.

A Hugging Face checkpoint directory (``save_pretrained``'s ``model.safetensors``, or a sharded
``model.safetensors.index.json`` with its files), a directory holding ``.safetensors`` files, or one
file. safetensors maps a file and reads the slice asked for, so a rank reading rows
``[offset, offset + valid)`` of a parameter touches those rows alone: no rank holds a full copy of a
sharded parameter, and no collective runs.

Names are matched as ``model.load_state_dict`` matches them, with two allowances a Hugging Face
checkpoint needs: a weight tied between two names (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``) is stored once, under either name; and a checkpoint of the base model
(keys without the head model's ``base_model_prefix``, e.g. ``h.0.attn...`` for ``transformer.h.0.attn...``)
loads into the head model, as ``from_pretrained`` allows.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from optpass.errors import OptpassError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def is_safetensors_source(source) -> bool:
    """``source`` names a ``.safetensors`` file or a directory (rather than being a state dict)."""
    return isinstance(source, (str, os.PathLike))


class SafetensorsSource:
    """The tensors of one checkpoint: a ``.safetensors`` file, or a directory of them."""

    def __init__(self, path: str | os.PathLike):
        try:
            import safetensors  # noqa: F401
        except ImportError as error:
            raise OptpassError("load_full_state_dict from .safetensors files needs the safetensors "
                               "package: pip install safetensors") from error
        self.path = os.fspath(path)
        self._handles: dict[str, object] = {}     # file -> its open (mapped) safetensors handle
        self.file_of = self._index()              # key -> file

    def _index(self) -> dict[str, str]:
        path = self.path
        if os.path.isfile(path):
            files = [path]
        elif os.path.isfile(os.path.join(path, INDEX_FILE)):
            with open(os.path.join(path, INDEX_FILE)) as f:
                weight_map = json.load(f)["weight_map"]
            return {key: os.path.join(path, name) for key, name in weight_map.items()}
        elif os.path.isdir(path):
            files = sorted(os.path.join(path, name) for name in os.listdir(path) if name.endswith(".safetensors"))
            if not files:
                raise OptpassError(f"load_full_state_dict: {path} holds no .safetensors file (nor {INDEX_FILE}).")
        else:
            raise OptpassError(f"load_full_state_dict: {path} is neither a state dict, a .safetensors file "
                               "nor a directory of them.")
        file_of = {}
        for file in files:
            for key in self._handle(file).keys():
                file_of.setdefault(key, file)
        return file_of

    def keys(self) -> set[str]:
        return set(self.file_of)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(self.file_of[key]).get_slice(key).get_shape())

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` along dim 0 of the stored tensor (a 0-d tensor as one row)."""
        f = self._handle(self.file_of[key])
        piece = f.get_slice(key)
        return piece[start:stop] if len(piece.get_shape()) else f.get_tensor(key).reshape(1)[start:stop]

    def _handle(self, file: str):
        """The file opened once (its header read once) for every read of this load."""
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]


def match_names(model: torch.nn.Module, own: dict[str, torch.Tensor],
                stored: set[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """Which stored key each of the model's names loads from.

    Returns:
        ``({model name: stored key}, missing model names, unexpected stored keys)``: a name whose
        tensor is tied to a name that is stored loads from that key; the model's
        ``base_model_prefix`` (Hugging Face) may be absent from the stored keys.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    key_of, missing = {}, []
    for names in _tied_groups(own):
        found = next((key for name in names for key in _candidates(name, prefix) if key in stored), None)
        if found is None:
            missing.append(names[0])
            continue
        for name in names:
            key_of[name] = found
    unexpected = sorted(stored - set(key_of.values()))
    return key_of, missing, unexpected


def _candidates(name: str, prefix: str) -> Iterator[str]:
    yield name
    if prefix and name.startswith(prefix + "."):
        yield name[len(prefix) + 1:]


def _tied_groups(own: dict[str, torch.Tensor]) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, tensor in own.items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())

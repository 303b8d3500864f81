"""Hugging Face specifics of export and import (convert.py): the files `from_pretrained` needs
beside the weights, and the tied weights `save_pretrained` leaves out.

`save_pretrained` writes a tied parameter once (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``), so a model's state dict has keys its files lack. On import, when the
directory's config.json names an architecture that the installed transformers knows, the model
is built on the meta device (no memory, no download) to learn which keys share a parameter, and
each missing one is filled with the tensor of the key it is tied to; a strict
``load({"model": model})`` then restores the model.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

#: Files of a model directory copied beside exported weights.
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


def copy_files(source: str, out: str) -> list[str]:
    """Copies a config (a config.json, or the known files of a model directory) into `out`,
    so that `from_pretrained(out)` finds them. Returns the names copied."""
    if os.path.isfile(source):
        try:
            with open(source, "rb") as f:
                doc = json.loads(f.read())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"Hugging Face config {source}: not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise ValueError(f"Hugging Face config {source}: a {type(doc).__name__}, not an "
                             "object")
        shutil.copyfile(source, os.path.join(out, "config.json"))
        return ["config.json"]
    if not os.path.isdir(source):
        raise FileNotFoundError(f"Hugging Face config {source} does not exist")
    copied = [n for n in FILES if os.path.isfile(os.path.join(source, n))]
    if "config.json" not in copied:
        raise FileNotFoundError(f"{source} holds no config.json")
    for n in copied:
        shutil.copyfile(os.path.join(source, n), os.path.join(out, n))
    return copied


def add_tied_weights(directory: str, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Adds to `tensors` the keys of the model described by `directory`/config.json that share
    a parameter with a key present (in place). Returns the keys added; none when there is no
    config, transformers is not installed or it does not know the architecture."""
    model = _meta_model(os.path.join(directory, "config.json"))
    if model is None:
        return []
    by_param: dict[int, list[str]] = {}
    for key, p in model.state_dict(keep_vars=True).items():
        by_param.setdefault(id(p), []).append(key)
    added = []
    for keys in by_param.values():
        present = [k for k in keys if k in tensors]
        if present:
            for k in keys:
                if k not in tensors:
                    tensors[k] = tensors[present[0]]
                    added.append(k)
    return added


def _meta_model(config_path: str) -> Any:
    """The model config.json describes, built on the meta device; None without a config, without
    transformers, or for an architecture transformers does not know. ValueError naming the file
    for a config that is not what from_pretrained reads."""
    if not os.path.isfile(config_path):
        return None
    try:
        import transformers
    except ImportError:
        return None
    try:
        with open(config_path, "rb") as f:
            doc = json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path}: not JSON ({e})") from None
    archs = doc.get("architectures") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or not (archs is None or isinstance(archs, list) and all(
            isinstance(a, str) for a in archs)):
        raise ValueError(f"{config_path}: not a Hugging Face config (an object whose "
                         "\"architectures\" is a list of class names)")
    cls = getattr(transformers, archs[0], None) if archs else None
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        return None
    try:
        config = transformers.AutoConfig.from_pretrained(os.path.dirname(config_path))
        with torch.device("meta"):
            return cls(config)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise ValueError(f"{config_path}: transformers cannot build {archs[0]} from it "
                         f"({type(e).__name__}: {e})") from None

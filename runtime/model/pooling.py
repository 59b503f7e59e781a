"""How an embedding pools a sequence's hidden states into one vector.

- ``last``: the final-norm hidden state of the last token (decoder embedding models:
  only the last token has seen the whole input under causal attention);
- ``mean``: the mean over every token's hidden state;
- ``cls``: the first token's.

A model may state its own in sentence-transformers' files (``modules.json`` naming a
``Pooling`` module whose ``config.json`` sets ``pooling_mode_*``); ``model_pooling`` reads
it, and the engine pools so unless a request asks otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

Pooling = Literal["last", "mean", "cls"]
POOLINGS: tuple[Pooling, ...] = ("last", "mean", "cls")

# sentence-transformers' Pooling config keys -> ours (the first set one wins)
_MODES: tuple[tuple[str, Pooling], ...] = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                                           ("pooling_mode_cls_token", "cls"))


def model_pooling(model_dir: Path) -> Pooling | None:
    """The pooling a model directory's sentence-transformers files state, else None
    (no such files, a GGUF file, or a mode Arbor does not pool by, such as max)."""
    modules = model_dir / "modules.json" if model_dir.is_dir() else None
    if modules is None or not modules.is_file():
        return None
    try:
        entries = json.loads(modules.read_text())
        folder = next(e["path"] for e in entries if str(e.get("type", "")).endswith("Pooling"))
        config = json.loads((model_dir / folder / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return None
    return next((ours for key, ours in _MODES if config.get(key)), None)


def pool(hidden: torch.Tensor, lengths: list[int], pooling: Pooling) -> torch.Tensor:  # [len(lengths), H]
    """Pool ``hidden`` [sum(lengths), H] (the sequences' rows one after another) per sequence."""
    if pooling == "mean":
        return torch.stack([rows.mean(dim=0) for rows in hidden.split(lengths)])
    ends = torch.tensor(lengths).cumsum(0)
    index = ends - 1 if pooling == "last" else ends - torch.tensor(lengths)
    return hidden[index]

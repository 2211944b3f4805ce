"""What a Hugging Face Llama directory must hold before it is imported or trained from: a ``config.json`` with
every shape key, and weights of no more layers than it lists. One-line :class:`CheckpointError` naming the file,
the cause and the fix; ``checkpoints_tools/import_hf.py`` and ``checkpoint.init_from=<HF dir>`` (checked at
start-up, :func:`dmc_train.cli.check_before_hydra`) both use them."""

from __future__ import annotations

import os
import re
from typing import Any, Iterable

from dmc_train.errors import CheckpointError

SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")  # null or absent: defaults
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_hf_config(hf: Any, hf_dir: str) -> None:
    """``hf``, the ``config.json`` of ``hf_dir``, gives every shape key (:data:`SHAPE_KEYS`) and each size it
    sets (:data:`OPTIONAL_SIZES`) as a positive whole number."""
    path = os.path.join(hf_dir, "config.json")
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path} is not a JSON object; restore the model's config.json from its source")
    missing = [key for key in SHAPE_KEYS if key not in hf]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)} (a Llama config.json gives {', '.join(SHAPE_KEYS)}); "
                              f"restore the model's config.json from its source")
    bad = [key for key in (*SHAPE_KEYS, *OPTIONAL_SIZES) if hf.get(key) is not None and not _positive_int(hf[key])]
    if bad:
        raise CheckpointError(f"{path} sets {bad[0]}={hf[bad[0]]!r}, not a positive whole number; restore the model's "
                              f"config.json from its source")


def check_layers(names: Iterable[str], hf: dict, hf_dir: str) -> None:
    """The weights (tensor ``names``) hold no layer past ``config.json``'s ``num_hidden_layers``: a layer the
    config does not list would be dropped without a word."""
    held = {int(m.group(1)) for name in names if (m := _LAYER.match(name))}
    listed = hf["num_hidden_layers"]
    if held and max(held) >= listed:
        raise CheckpointError(f"the weights of {hf_dir} hold {max(held) + 1} layers but its config.json lists "
                              f"num_hidden_layers={listed}; restore the model's config.json (or set num_hidden_layers "
                              f"to {max(held) + 1})")


def check_hf_dir(hf_dir: str) -> dict:
    """Both checks on ``hf_dir`` (its weight files' headers are read); returns its ``config.json``."""
    from dmc_train.training.hf_loading import HFWeights, read_hf_config

    hf = read_hf_config(hf_dir)
    check_hf_config(hf, hf_dir)
    check_layers(HFWeights(hf_dir).names(), hf, hf_dir)
    return hf

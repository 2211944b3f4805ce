"""What ``launch/evaluate.py`` adds for an imported checkpoint (``checkpoints_tools/import_hf.py``): a pretrained
model is evaluated as it is, without a recipe.

    overrides = imported_overrides(["checkpoint.resume=runs/inits/smollm2", "eval.cache=h2o"])

For ``checkpoint.resume=<imported checkpoint>`` the returned overrides come first, the command line's after
them (a later setting of a key wins): the checkpoint's ``model`` node, ``run_name`` = the checkpoint's
directory name (results go to ``runs/<name>/``, never beside the weights), and the held-out Shakespeare
splits in the model's own tokenizer (``launch/prepare_data.py --tokenizer <checkpoint>/tokenizer`` makes
them: :func:`~dmc_train.data.shakespeare.tokenizer_dir`). Any other command line is returned unchanged.
"""

from __future__ import annotations

import json
import os
from typing import Any

from dmc_train.errors import DataError
from dmc_train.training.checkpoint_dirs import find_checkpoint, read_meta


def imported_checkpoint(overrides: list[str]) -> tuple[str, dict] | None:
    """``(checkpoint, meta)`` when ``checkpoint.resume=`` names an imported checkpoint, else None."""
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("checkpoint.resume=")]
    if not given or given[-1] in ("auto", "none") or not os.path.isdir(given[-1]):
        return None
    ckpt = find_checkpoint(given[-1])
    meta = read_meta(ckpt)
    return (ckpt, meta) if meta.get("hf_source") else None


def imported_overrides(overrides: list[str]) -> list[str]:
    """The command line ``overrides`` with an imported checkpoint's settings in front (module docstring); a
    one-line :class:`DataError` when its held-out data is missing and no data is given."""
    found = imported_checkpoint(overrides)
    if found is None:
        return overrides
    ckpt, meta = found
    cfg = meta["config"]
    added = [f"model.{key}={_value(value)}" for key, value in _flat(cfg["model"])]
    added.append(f"run_name={os.path.basename(os.path.normpath(ckpt))}")
    if not any(o.startswith("data.") for o in overrides):
        added += data_overrides(ckpt, cfg["data"].get("tokenizer"))
    return added + overrides


def data_overrides(ckpt: str, tokenizer: str | None) -> list[str]:
    """The held-out Shakespeare splits in the checkpoint's tokenizer, as data overrides."""
    from dmc_train.data.shakespeare import tokenizer_dir
    from dmc_train.data.tokenizer import load_tokenizer

    if not tokenizer or not os.path.exists(tokenizer):
        raise DataError(f"{ckpt} has no tokenizer (its Hugging Face directory had none): import a directory with "
                        f"its tokenizer files, or give the data (data.kind=indexed data.valid_prefixes=[...] "
                        f"data.test_prefixes=[...] data.tokenizer=...)")
    out = tokenizer_dir(load_tokenizer(tokenizer))
    if not all(os.path.exists(os.path.join(out, f"{split}.idx")) for split in ("valid", "test")):
        raise DataError(f"no held-out text in the vocabulary of {ckpt}'s tokenizer ({out} is missing); prepare it "
                        f"with: python launch/prepare_data.py --tokenizer {tokenizer}")
    prefixes = {split: os.path.join(out, split) for split in ("train", "valid", "test")}
    return ["data.kind=indexed", f"data.prefixes=[{prefixes['train']}]", f"data.valid_prefixes=[{prefixes['valid']}]",
            f"data.test_prefixes=[{prefixes['test']}]", f"data.tokenizer={tokenizer}"]


def _flat(node: dict, prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for key, value in node.items():
        if isinstance(value, dict):
            items += _flat(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else "null" if value is None else str(value).lower() \
        if isinstance(value, bool) else str(value)

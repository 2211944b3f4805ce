"""Model-only loading: a checkpoint's weights in eval mode, without optimizer, scheduler or data.

    loaded = load_model("runs/dmc_tiny_cr2.0")                      # its latest checkpoint, TP=1 PP=1
    loaded = load_model(ckpt, overrides=["parallel.tensor=2"])      # another layout (under torchrun)
    out = logits(loaded.model, tokens)                              # dmc_train.training.forward

The config is the one saved with the checkpoint (``meta.json``) with ``overrides`` applied (dotted
``key=value`` strings), or a given ``cfg`` whose model shape is checked against the checkpoint.
The method of that config chooses the attention (DMC checkpoints load with DMC attention). The
process group and megatron's parallel state are set up for the target layout if needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from omegaconf import OmegaConf

from dmc_train import config as config_mod
from dmc_train import distributed
from dmc_train.errors import CheckpointError
from dmc_train.methods import METHODS, build_method
from dmc_train.models.llama import build_model
from dmc_train.recipes import validate
from dmc_train.training.checkpoint_dirs import check_model_shape, find_checkpoint, read_meta
from dmc_train.training.checkpoint_load import load_weights


@dataclass
class LoadedModel:
    model: list[torch.nn.Module]  # this rank's chunks (plain GPTModel), eval mode
    cfg: Any
    method: Any  # the config's Method (e.g. DMC's, which counts decisions for the achieved CR)
    checkpoint: str
    meta: dict


def config_from_checkpoint(meta: dict, overrides: Sequence[str] = ()) -> Any:
    """The typed config saved in a checkpoint's ``meta.json``, with dotted ``overrides`` applied. A fixed-pooling
    config saved when its pool size was ``method.target_cr`` is read as ``method.pool``."""
    saved = OmegaConf.create(meta["config"])
    method = METHODS.get(saved.method.name) if "method" in saved and "name" in saved.method else None
    if method is None:
        raise CheckpointError(f"the checkpoint's config has no known method "
                              f"({OmegaConf.select(saved, 'method')}); "
                              f"pass the recipe's config instead")
    if saved.method.name == "fixed_pooling" and "target_cr" in saved.method:
        saved.method.pool = int(saved.method.pop("target_cr"))
    schema = OmegaConf.structured(config_mod.Config)
    schema.method = OmegaConf.structured(method.config)
    return OmegaConf.merge(schema, saved, OmegaConf.from_dotlist(list(overrides)))


def load_model(checkpoint: str, overrides: Sequence[str] = (), cfg: Optional[Any] = None) -> LoadedModel:
    """Build this rank's model for ``checkpoint`` (a checkpoint, checkpoints root or run directory)
    at the layout of ``cfg.parallel`` (default TP=1 PP=1) and load its weights (saved at any layout)."""
    ckpt = find_checkpoint(checkpoint)
    meta = read_meta(ckpt)
    if cfg is None:
        single = ["parallel.tensor=1", "parallel.pipeline=1", "parallel.virtual_pipeline=null"]
        cfg = config_from_checkpoint(meta, [*single, *overrides])
    validate(cfg, distributed.read_launch_env().world_size)
    check_model_shape(ckpt, meta, cfg)
    p = cfg.parallel
    distributed.initialize(p.tensor, p.pipeline, p.virtual_pipeline, cfg.train.seed, p.timeout_minutes)
    method = build_method(cfg)
    model = method.prepare_model(build_model(cfg, attention=method.attention()))
    load_weights(ckpt, model)
    for chunk in model:
        chunk.eval()
    return LoadedModel(model, cfg, method, ckpt, meta)

"""Checkpoint conversions that change a model's shape. GQA: an MHA (or GQA) checkpoint to fewer
query groups, K/V heads averaged per group (the weight math is :mod:`dmc_train.methods.gqa`).

``checkpoints_tools/convert_gqa.py`` is the command line; the Hugging Face converters land here too.
"""

from __future__ import annotations

import copy
import os

from omegaconf import OmegaConf

from dmc_train import distributed
from dmc_train.config import kv_groups
from dmc_train.conversion import check_output
from dmc_train.methods.gqa import check_groups, convert_qkv_weight
from dmc_train.models.llama import build_model
from dmc_train.training.checkpoint_dirs import find_checkpoint, read_meta
from dmc_train.training.checkpoint_load import load_weights
from dmc_train.training.checkpoint_save import save_weights


def convert_gqa_checkpoint(src: str, out: str, groups: int) -> str:
    """Convert the weights of checkpoint ``src`` (any TP/PP layout it was saved with) to ``groups``
    query groups and save them as a weights-only checkpoint ``out`` (loadable at any layout with
    ``checkpoint.init_from``). Runs in one process."""
    src = find_checkpoint(src)
    meta = read_meta(src)
    cfg = OmegaConf.create(meta["config"])
    m = cfg.model
    groups_from = kv_groups(m)
    check_groups(m.num_attention_heads, groups_from, groups)
    check_output(out, overwrite=True, src=src)  # the command line refuses an existing --output itself
    cfg.parallel = {**cfg.parallel, "tensor": 1, "pipeline": 1, "virtual_pipeline": None,
                    "sequence_parallel": False, "distributed_optimizer": False}
    cfg.method.name = "none"
    distributed.initialize(1, 1, None, cfg.train.seed)
    source = build_model(cfg)
    load_weights(src, source, cfg)
    target_cfg = copy.deepcopy(cfg)
    target_cfg.model.num_query_groups = None if groups == m.num_attention_heads else groups
    target = build_model(target_cfg)
    state = source[0].state_dict()
    for key, value in state.items():
        if key.endswith("linear_qkv.weight"):
            state[key] = convert_qkv_weight(value, m.num_attention_heads, groups_from, groups)
    target[0].load_state_dict(state, strict=True)
    return save_weights(target_cfg, target, out,
                        {"converted_from": os.path.abspath(src), "gqa": {"groups_from": groups_from, "groups": groups}})


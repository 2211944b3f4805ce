"""Offline resharding: a full training checkpoint of ours at another TP/PP/VPP layout, without training.

    torchrun --nproc_per_node=2 checkpoints_tools/reshard.py --input runs/a --output runs/b --tensor 1 --pipeline 1

Full mode (default): the checkpoint is loaded by the trainer itself (:class:`~dmc_train.training.loop.Trainer`
with ``checkpoint.resume=<input>``) at the target layout - model, optimizer state (resharded), LR
scheduler, step, data position, method state - and saved as ``<output>/checkpoints/iter_<step>`` (a
new run directory; ``latest`` points at it). Training with ``run_dir=<output>`` then continues as
continuing the input at that layout would. No training data is read (the run's data files need not
be present; the saved config keeps them). RNG states are restored only at an unchanged layout
(as on any resume); the source's ``method_metadata`` is kept.

What cannot be resharded (refused by ``dmc_train/training/checkpoint_resume.py`` and
``checkpoint_load.py``): the distributed optimizer's ``dp_reshardable`` state changes only its DP size,
so a TP/PP change of such a checkpoint, and switching the distributed optimizer on or off, are refused;
``weights_only=True`` then writes a weights-only checkpoint ``<output>`` (model weights only, layout-free:
start from it with ``checkpoint.init_from=<output>``, new optimizer at step 0).
"""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any, Optional

from dmc_train import distributed
from dmc_train.conversion import check_output
from dmc_train.errors import CheckpointError
from dmc_train.training.checkpoint_dirs import find_checkpoint, read_meta
from dmc_train.training.checkpoint_save import save_checkpoint, save_weights
from dmc_train.training.model_loading import config_from_checkpoint


def target_config(meta: dict, out: str, ckpt: str, tensor: int, pipeline: int, virtual_pipeline: Optional[int],
                  distributed_optimizer: Optional[bool]) -> Any:
    """The checkpoint's saved config at the target layout, resuming from ``ckpt`` into run dir ``out``."""
    distopt = meta["layout"]["distributed_optimizer"] if distributed_optimizer is None else distributed_optimizer
    vpp = "null" if virtual_pipeline is None else virtual_pipeline
    return config_from_checkpoint(meta, [
        f"parallel.tensor={tensor}", f"parallel.pipeline={pipeline}", f"parallel.virtual_pipeline={vpp}",
        f"parallel.distributed_optimizer={distopt}", f"run_dir={out}", f"checkpoint.resume={ckpt}",
        "checkpoint.init_from=null", "checkpoint.load_optimizer=true"])


def check_reshardable(ckpt: str, meta: dict, cfg: Any) -> None:
    """One-line CheckpointError when the full state cannot move to ``cfg.parallel`` (use --weights-only)."""
    saved, p = meta["layout"], cfg.parallel
    if meta.get("weights_only"):
        raise CheckpointError(f"checkpoint {ckpt} holds weights only (no optimizer state); reshard it with "
                              f"--weights-only (or start from it directly with checkpoint.init_from, any layout)")
    if saved["distributed_optimizer"] != p.distributed_optimizer:
        raise CheckpointError(f"checkpoint {ckpt} was saved with distributed_optimizer={saved['distributed_optimizer']}"
                              f"; its optimizer state cannot be converted to distributed_optimizer="
                              f"{p.distributed_optimizer}; keep the setting or pass --weights-only")
    if saved["distributed_optimizer"] and (saved["tensor"], saved["pipeline"]) != (p.tensor, p.pipeline):
        raise CheckpointError(f"checkpoint {ckpt} was saved at TP={saved['tensor']} PP={saved['pipeline']} with the "
                              f"distributed optimizer, whose state cannot be resharded to TP={p.tensor} "
                              f"PP={p.pipeline}; pass --weights-only to write the weights only")


def reshard(src: str, out: str, tensor: int, pipeline: int, virtual_pipeline: Optional[int] = None,
            distributed_optimizer: Optional[bool] = None, weights_only: bool = False,
            overwrite: bool = False) -> str:
    """Rewrite checkpoint ``src`` (a checkpoint, checkpoints root or run directory) at TP=``tensor``
    PP=``pipeline`` (VPP ``virtual_pipeline``; the distributed optimizer kept unless
    ``distributed_optimizer`` is given). Collective: every rank of the target world calls it.

    Returns the written checkpoint: ``<out>/checkpoints/iter_<step>`` (full), or ``out`` (weights only).
    """
    ckpt = os.path.abspath(find_checkpoint(src))
    meta = read_meta(ckpt)
    out = os.path.abspath(out)
    check_output(out, overwrite, ckpt)
    cfg = target_config(meta, out, ckpt, tensor, pipeline, virtual_pipeline, distributed_optimizer)
    if not weights_only:
        check_reshardable(ckpt, meta, cfg)
    if distributed.read_launch_env().rank == 0 and os.path.exists(out):  # --overwrite; before the group exists
        shutil.rmtree(out)
    try:
        return _write_weights(ckpt, meta, cfg, out) if weights_only else _write_full(ckpt, meta, cfg)
    except BaseException:
        if distributed.read_launch_env().rank == 0:  # no half-written run directory or checkpoint is left
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out + ".tmp", ignore_errors=True)
        raise


def _write_full(ckpt: str, meta: dict, cfg: Any) -> str:
    from omegaconf import OmegaConf

    from dmc_train.training.loop import Trainer

    load_cfg = copy.deepcopy(cfg)
    load_cfg.data.kind = "synthetic"  # resharding reads no data: the run's data files need not be present
    trainer = Trainer(load_cfg)
    extra = {"method_metadata": meta.get("method_metadata", {}),
             "resharded_from": {"checkpoint": ckpt, "layout": meta["layout"]},
             **({"validation": meta["validation"]} if meta.get("validation") else {})}
    written = save_checkpoint(cfg, trainer.model, trainer.optimizer, trainer.scheduler, trainer.method,
                              trainer.step, trainer.consumed, extra, base=trainer.base)
    if distributed.is_rank0():
        OmegaConf.save(cfg, os.path.join(cfg.run_dir, "config.yaml"), resolve=True)
    distributed.barrier()
    return written


def _write_weights(ckpt: str, meta: dict, cfg: Any, out: str) -> str:
    from dmc_train.training.model_loading import load_model

    cfg.checkpoint.resume = "none"
    loaded = load_model(ckpt, cfg=cfg)
    extra = {"method_metadata": meta.get("method_metadata", {}), "converted_from": ckpt,
             "source_step": meta.get("step")}
    return save_weights(loaded.cfg, loaded.model, out, extra)

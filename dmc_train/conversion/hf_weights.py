"""Lazy reading of Hugging Face weight files (safetensors, sharded or not; ``.bin``, sharded or not).

    weights = HFWeights(hf_dir)
    weights.names()                      # HF tensor names
    weights.get("model.norm.weight")     # one tensor, read on demand

The implementation lives in :mod:`dmc_train.training.hf_loading` so that the trainer
(``checkpoint.init_from=<HF dir>``) can use it: ``training/`` stands below ``conversion/``.
"""

from dmc_train.training.hf_loading import BIN, BIN_INDEX, SAFETENSORS, SAFETENSORS_INDEX, HFWeights, is_hf_dir

__all__ = ["HFWeights", "is_hf_dir", "SAFETENSORS", "SAFETENSORS_INDEX", "BIN", "BIN_INDEX"]

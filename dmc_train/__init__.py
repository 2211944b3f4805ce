"""dmc_train: retrofit Llama models for a smaller KV cache (DMC, GQA, LESS) on megatron-core."""

import logging
import warnings

# megatron-core announces every CPU fallback and deprecation at import/build time; all expected here.
for _pattern in (
    r".*(Transformer Engine and Apex|Apex) (are|is) not installed.*",
    r".*full scope is deprecated.*",
    r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
    r".*`torch.distributed.(reduce_scatter_tensor|all_gather_into_tensor|_all_gather_base)` is deprecated.*",
    r".*\.grad attribute of a Tensor that is not a leaf.*",  # megatron's DDP probes param.grad via hooks
    r".*`load_state_dict` is deprecated.*",  # megatron's dist_checkpointing on torch.distributed.checkpoint
    r".*Please use DTensor instead and we are deprecating ShardedTensor.*",
):
    warnings.filterwarnings("ignore", message=_pattern)
logging.getLogger("megatron").setLevel(logging.WARNING)

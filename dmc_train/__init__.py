"""dmc_train: retrofit Llama models for a smaller KV cache (DMC, GQA, LESS) on megatron-core."""

import warnings

# megatron-core announces every CPU fallback at import time; the fallbacks are expected here.
warnings.filterwarnings("ignore", message=".*(Transformer Engine and Apex|Apex) (are|is) not installed.*")

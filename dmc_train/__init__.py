"""dmc_train: retrofit Llama models for a smaller KV cache (DMC, GQA, LESS) on megatron-core."""

from dmc_train import megatron_import

megatron_import.install()

"""Parameter counts of our Llama (``dmc_train/models/llama.py``) from the model config alone.

Pure Python, no torch: ``dmc_train.cluster.memory`` (the fast SLURM dry run) uses it too. What is
counted is what the model builds: the embedding and the output layer (one matrix when
``model.tie_embeddings``), and per layer the fused QKV
(``heads + 2 * groups`` heads of ``head_dim`` rows), the output projection, the SwiGLU MLP
(``linear_fc1 = [gate; up]`` and ``linear_fc2``), two RMSNorm weights; then the final RMSNorm.
No biases. ``tests/models/test_llama_weights.py`` checks it against a built model.
"""

from __future__ import annotations

from typing import Any

from dmc_train.config import kv_groups


def layer_parameters(m: Any) -> tuple[int, int]:
    """(tensor-parallel-split, replicated) parameter counts of one transformer layer."""
    head_dim = m.hidden_size // m.num_attention_heads
    qkv = m.hidden_size * head_dim * (m.num_attention_heads + 2 * kv_groups(m))
    proj = m.num_attention_heads * head_dim * m.hidden_size
    mlp = 3 * m.hidden_size * m.ffn_hidden_size
    return qkv + proj + mlp, 2 * m.hidden_size  # the two RMSNorm weights are replicated across TP


def count_parameters(m: Any) -> int:
    """Parameters of the full model (all ranks): embedding, layers, final norm, output layer (none of its own
    when tied)."""
    split, replicated = layer_parameters(m)
    embeddings = 1 if getattr(m, "tie_embeddings", False) else 2
    return embeddings * m.vocab_size * m.hidden_size + m.num_layers * (split + replicated) + m.hidden_size

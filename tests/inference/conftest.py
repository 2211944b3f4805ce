"""A tiny random Llama for the inference tests (built here, in HF names, no checkpoint needed)."""

import pytest
import torch

from dmc_train.inference.dmc_decisions import DMCInference
from dmc_train.inference.model import LlamaForInference, ModelShape, random_weights
from dmc_train.models.dmc_settings import DMCSettings

SHAPE = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_heads=4, num_kv_heads=2, vocab_size=50,
                   max_positions=128)
# the models' method hooks; init_offset 0 with these random weights: about half the decisions merge, so every test
# sees both kinds
VARIANTS = {
    "full": None,
    "dmc_exact": DMCInference(DMCSettings(channel=SHAPE.head_dim - 1, init_offset=0.0)),
    "dmc_window": DMCInference(DMCSettings(channel=SHAPE.head_dim - 1, init_offset=0.0, accumulation="window",
                                           window=3)),
    "dmc_hardc": DMCInference(DMCSettings(channel=0, init_offset=0.0, variant="hardc")),
    "dmc_pre": DMCInference(DMCSettings(channel=SHAPE.head_dim - 1, init_offset=0.0, rope_order="pre")),
    "dmc_pre_window": DMCInference(DMCSettings(channel=SHAPE.head_dim - 1, init_offset=0.0, rope_order="pre",
                                               accumulation="window", window=3)),
    "fixed_pooling": DMCInference(DMCSettings(channel=None, pool=3)),
}


@pytest.fixture(scope="session")
def make_model(device):
    """``make(variant, dtype)``: the tiny model on the test device (``DMC_TEST_DEVICE``)."""
    weights = random_weights(SHAPE)

    def make(variant: str = "full", dtype=torch.float32) -> LlamaForInference:
        return LlamaForInference(SHAPE, weights, VARIANTS[variant], dtype, device=device)

    return make

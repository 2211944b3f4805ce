"""Inference: the paged KV pool, the caches (full, DMC; policies and LESS plug in), the Llama forward
for generation, sampling, and the continuous-batching engine (docs/INFERENCE.md).

    from dmc_train.inference import Engine, SamplingParams
    engine = Engine.from_checkpoint("runs/dmc_tiny_cr2.0", kv_bytes=64 << 20)
    outputs = engine.generate(["To be, or not"], SamplingParams(max_new_tokens=40))
"""

from dmc_train.inference.engine import Engine, Event, Output, summarize
from dmc_train.inference.model import LlamaForInference, ModelShape
from dmc_train.inference.sampling import SamplingParams

__all__ = ["Engine", "Event", "LlamaForInference", "ModelShape", "Output", "SamplingParams", "summarize"]

"""Under torchrun (2 ranks, gloo): tensor-parallel inference against the whole model in the same process.

    torchrun --nproc_per_node=2 tests/scripts/tp_inference_checks.py <out.json> [<run_dir> ...]

Per model (random GQA and DMC models in HF names; then each checkpoint given): the teacher-forced logits of
the TP=2 shard and of the TP=1 model, the logits of a batched prefill followed by ragged decode steps through
each one's engine cache, the entries each cache holds per (layer, KV head), the greedy tokens of each one's
engine, unseeded sampled tokens, and the error for a cache that does not run tensor-parallel. Rank 0 writes
every rank's results.
"""

import json
import sys

import torch

PROMPTS = [[5, 17, 42, 7, 7, 3, 11, 2, 9], [1], [4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23, 42, 30]]


def engine_logits(engine, steps: int = 6) -> torch.Tensor:
    """Logits of a batched prefill of PROMPTS and then ``steps`` ragged decode steps (fixed tokens)."""
    ids = list(range(len(PROMPTS)))
    for i, p in enumerate(PROMPTS):
        engine.cache.add(i, steps + 1)
    out = [t[-1] for t in engine.model.prefill_batch(engine.cache, ids, [torch.tensor(p) for p in PROMPTS])]
    for step in range(steps):
        tokens = torch.tensor([(7 * step + i) % 50 for i in ids])
        positions = torch.tensor([len(p) + step for p in PROMPTS])
        out += list(engine.model.decode(engine.cache, ids, tokens, positions))
    return torch.stack(out)


def compare(whole, shard) -> dict:
    from dmc_train.inference import Engine, SamplingParams

    tokens = torch.tensor([[(i * 7919 + 11) % whole.shape.vocab_size for i in range(40)]] * 2)
    tokens[1] = tokens[1].flip(0)
    res = {"forward": (whole.forward(tokens) - shard.forward(tokens)).abs().max().item()}
    engines = [Engine(m, None, kv_bytes="1MB", max_batch=4) for m in (whole, shard)]
    res["engine"] = (engine_logits(engines[0]) - engine_logits(engines[1])).abs().max().item()
    params = SamplingParams(max_new_tokens=12)
    outs = [Engine(m, None, kv_bytes="1MB", max_batch=4).generate(PROMPTS, params) for m in (whole, shard)]
    res["tokens"] = [[o.tokens for o in out] for out in outs]
    res["seeded"] = [o.tokens for o in Engine(shard, None, kv_bytes="1MB").generate(
        PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0))]  # unseeded: rank 0's draws on every rank
    res["whole_entries"], res["entries"] = (e.cache.entries(0).tolist() for e in engines)  # [layer][KV head]
    try:
        Engine(shard, None, cache="h2o", budget=8)
    except Exception as e:
        res["h2o"] = str(e)
    return res


def main(out_path: str, *run_dirs: str) -> None:
    import torch.distributed as dist

    from dmc_train.inference import tensor_parallel as tp
    from dmc_train.inference.dmc_decisions import DMCInference
    from dmc_train.inference.model import LlamaForInference, ModelShape, random_weights
    from dmc_train.models.dmc_settings import DMCSettings

    shape = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_heads=4, num_kv_heads=2,
                       vocab_size=50, max_positions=128)
    rank, group = tp.start(2)
    weights = random_weights(shape)
    local, local_shape = tp.shard_weights(weights, shape, rank, 2)
    res = {}
    c = shape.head_dim - 1
    for name, method in (("full", None), ("dmc", DMCInference(DMCSettings(channel=c, init_offset=0.0))),
                         ("dmc_pre", DMCInference(DMCSettings(channel=c, init_offset=0.0, rope_order="pre")))):
        res[name] = compare(LlamaForInference(shape, weights, method),
                            LlamaForInference(local_shape, local, method, group=group))
    for run_dir in run_dirs:
        whole, _ = LlamaForInference.from_checkpoint(run_dir)
        shard, _ = LlamaForInference.from_checkpoint(run_dir, tensor_parallel=2)
        res[run_dir] = compare(whole, shard)
    gathered = [None, None]
    dist.all_gather_object(gathered, res)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": gathered}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

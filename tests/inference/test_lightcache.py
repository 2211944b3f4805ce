"""LightCache: projections from the weights, exact where it should be, the selection rule on hand-made
scores, the engine's paged cache = the parallel form (random and trained GQA models, ragged batches,
chunked prefill), the bytes held over 500 decode steps, prompts longer than the model's positions,
the generate and evaluate commands, and one-line errors."""

import json

import pytest
import torch

from dmc_train.errors import InferenceError
from dmc_train.evaluation.incremental import teacher_forced_decode
from dmc_train.inference.caches import TokenInfo, build_cache, causal_attention
from dmc_train.inference.caches.lightcache import lightcache_for
from dmc_train.inference.engine import Engine
from dmc_train.inference.model import LlamaForInference, ModelShape, random_weights
from dmc_train.inference.pool import PagePool
from dmc_train.inference.sampling import SamplingParams
from dmc_train.policies.lightcache import compress, decompress, select
from tests.helpers import run
from tests.inference.conftest import SHAPE

D = SHAPE.head_dim  # 16
SMALL = {"r_k": 2, "r_v": 8, "global": 4, "local": 8, "top_k": 2, "segment": 4}  # window 20, selection from token 12



def new_pool(model, num_pages=512, max_batch=4):
    s = model.shape
    return PagePool(num_pages, 16, s.head_dim, max_batch * s.num_layers * s.num_kv_heads, s.max_positions,
                    dtype=model.dtype, device=model.device)


def assert_engine_matches_parallel(model, options, sequences, prompt_lens, atol=1e-4):
    cache = build_cache("lightcache", new_pool(model), model, options)
    got = teacher_forced_decode(model, cache, sequences, prompt_lens)
    lightcache = lightcache_for(model, options)
    for i, seq in enumerate(sequences):
        want = model.forward_with_policy(seq[None], lightcache, 0)[0]
        assert torch.allclose(got[i], want, atol=atol), (i, float((got[i] - want).abs().max()))
        assert cache.entries(i).unique().tolist() == [len(seq)]  # every token held, compressed or not
    return cache


# -- projections and exactness ------------------------------------------------------------------------
def test_projections_are_the_principal_directions_and_compression_is_a_projection(make_model):
    model = make_model("full")
    lc = lightcache_for(model, {"r_k": 3, "r_v": 8})
    p = lc.projections
    assert p.k.shape == (SHAPE.num_layers, SHAPE.num_kv_heads, D, 3) and p.v.shape[-1] == 8
    eye = p.k.transpose(-1, -2) @ p.k
    assert torch.allclose(eye, torch.eye(3).expand_as(eye), atol=1e-6)  # orthonormal columns
    # the top singular directions of each head's W_k slice: P^T W keeps its 3 largest singular values
    q = SHAPE.num_heads * D
    w_k = model.layers[1].qkv[q: q + SHAPE.num_kv_heads * D].view(SHAPE.num_kv_heads, D, -1)
    kept = torch.linalg.svdvals(p.k[1].transpose(-1, -2) @ w_k)
    assert torch.allclose(kept, torch.linalg.svdvals(w_k)[:, :3], rtol=1e-5)
    # compress then decompress = the orthogonal projection; a key inside the subspace round-trips
    pk = p.k[0]  # [H_kv, d, r]
    k = torch.randn(SHAPE.num_kv_heads, 10, D)
    assert torch.allclose(decompress(compress(k, pk), pk), k @ pk @ pk.transpose(1, 2), atol=1e-5)
    inside = torch.randn(SHAPE.num_kv_heads, 10, 3) @ pk.transpose(1, 2)
    assert torch.allclose(decompress(compress(inside, pk), pk), inside, atol=1e-5)


def test_full_width_with_every_entry_selected_is_full_attention(make_model):
    """r_k = r_v = d and top_k >= the compressed entries: the window is the whole sequence in order, at its
    own positions, so LightCache's attention is causal attention (1e-5, fp32)."""
    model = make_model("full")
    lc = lightcache_for(model, {"r_k": D, "r_v": D, "local": 8, "top_k": 128, "segment": 3})
    g = torch.Generator().manual_seed(0)
    n = 70
    q, k, v = (torch.randn(2, h, n, D, generator=g) for h in (4, 2, 2))
    pos = torch.arange(n)
    got = lc.parallel_attention(0, q, k, v, TokenInfo(pos, rotate=model.rope))
    want = causal_attention(model.rope(q, pos), model.rope(k, pos), v, model.scale)
    assert (got - want).abs().max() < 1e-5
    # and through the engine (chunked prefill + decode), logits of the whole model
    seq = torch.randperm(SHAPE.vocab_size, generator=g)[:48]
    options = {"r_k": D, "r_v": D, "local": 8, "top_k": 64, "segment": 1, "chunk": 5}
    got = teacher_forced_decode(model, build_cache("lightcache", new_pool(model), model, options), [seq], [13])[0]
    assert (got - model.forward(seq[None])[0]).abs().max() < 1e-4


def reference_lightcache(q, k, v, lc, layer, rope):
    """The paper's steps, one query at a time: ``q [H, n, d]``, ``k / v [H_kv, n, d]`` before RoPE ->
    ``[H, n, d]`` (``rope(x, positions)``: the model's RoPE). Compressed tokens g .. t-l; each query head's
    top-k (ties: lower index) votes; segments as sets; the window [global, selected (decompressed), local]
    rotated at 0..W-1, the query at W-1."""
    s = lc.settings
    glob, loc, m = s.global_, s.local, s.segment
    h, n, _ = q.shape
    group = h // k.shape[0]
    out = torch.zeros_like(q)
    for kv in range(k.shape[0]):
        pk, pv = lc.projections.k[layer, kv], lc.projections.v[layer, kv]
        for t in range(n):
            comp = list(range(glob, t - loc + 1))
            heads = range(kv * group, (kv + 1) * group)
            chosen = []
            if comp and s.top_k:
                kc = k[kv, comp] @ pk
                scores = {j: [float((q[j, t] @ pk) @ kc[i]) for i in range(len(comp))] for j in heads}
                votes = [0] * len(comp)
                for j in heads:
                    for i in sorted(range(len(comp)), key=lambda i: (-scores[j][i], i))[: s.top_k]:
                        votes[i] += 1
                total = [sum(scores[j][i] for j in heads) for i in range(len(comp))]
                centres = sorted(range(len(comp)), key=lambda i: (-votes[i], -total[i], i))[: s.top_k]
                picked = set()
                for c in centres:
                    start = min(max(c - m // 2, 0), max(len(comp) - m, 0))
                    picked |= set(range(start, min(start + m, len(comp))))
                chosen = sorted(picked)
            glob_t, loc_t = list(range(min(glob, t + 1))), list(range(max(glob, t - loc + 1), t + 1))
            keys = torch.cat([k[kv, glob_t], (k[kv, comp][chosen] @ pk) @ pk.T, k[kv, loc_t]])
            vals = torch.cat([v[kv, glob_t], (v[kv, comp][chosen] @ pv) @ pv.T, v[kv, loc_t]])
            w = len(keys)
            keys = rope(keys, torch.arange(w))
            for j in heads:
                logits = keys @ rope(q[j, t], torch.tensor(w - 1)) * lc.scale
                out[j, t] = torch.softmax(logits, -1) @ vals
    return out


@pytest.mark.parametrize("options", [SMALL, {**SMALL, "global": 0, "top_k": 3, "segment": 1}])
def test_parallel_form_equals_the_papers_steps_one_query_at_a_time(make_model, options):
    model = make_model("full")
    lc = lightcache_for(model, options)
    g = torch.Generator().manual_seed(5)
    n = 37
    q, k, v = (torch.randn(1, h, n, D, generator=g) for h in (4, 2, 2))
    info = TokenInfo(torch.arange(n), rotate=model.rope)
    got = lc.parallel_attention(1, q, k, v, info)[0]
    want = reference_lightcache(q[0], k[0], v[0], lc, 1, model.rope)
    assert (got - want).abs().max() < 1e-5


# -- selection ---------------------------------------------------------------------------------------
def test_selection_brings_segments_deduplicated_in_order_and_gqa_votes():
    c = 40
    keys = torch.zeros(c, 2)
    keys[:, 1] = 1.0
    keys[20] = torch.tensor([5.0, 0.0])
    keys[21] = torch.tensor([4.0, 0.0])
    query = torch.tensor([1.0, 0.0])
    scores = (keys @ query).view(1, 1, 1, c)
    avail = torch.tensor([[c]])

    def chosen(top_k, m, s=scores, a=avail):
        index, count = select(s, a, top_k, m)
        assert index.shape[-1] == min(top_k * m, c) and not index[0, 0, count[0, 0]:].any()  # padding: entry 0
        return index[0, 0, :count[0, 0]].tolist()

    assert chosen(1, 5) == [18, 19, 20, 21, 22]  # the match and its neighbours, centred
    assert chosen(2, 5) == [18, 19, 20, 21, 22, 23]  # 20's and 21's segments merged, once each, in order
    assert chosen(2, 1) == [20, 21]
    # a match at the edge: its segment moves inside [0, available)
    edge = scores.clone()
    edge[..., 1] = 9.0
    assert chosen(1, 5, edge) == [0, 1, 2, 3, 4]
    assert chosen(1, 4, edge, torch.tensor([[3]])) == [0, 1, 2]  # fewer entries than a segment: all of them
    assert chosen(0, 5) == []
    # entries past ``available`` are never chosen (they do not exist yet for that query)
    early = scores.clone()
    early[..., 15] = 3.0
    assert chosen(1, 3, early, torch.tensor([[20]])) == [14, 15, 16]
    assert chosen(1, 3, early) == [19, 20, 21]
    # GQA: heads 0 and 1 prefer entry 10, head 2 prefers 30 by far more; the majority wins
    votes = torch.zeros(1, 3, 1, c)
    votes[0, 0, 0, 10], votes[0, 1, 0, 10], votes[0, 2, 0, 30] = 1.0, 1.0, 100.0
    assert chosen(1, 1, votes) == [10]
    votes[0, 1, 0, 10] = 0.0  # one vote each: ties go to the higher summed score
    assert chosen(1, 1, votes) == [30]
    # exact ties go to the lower index, whatever order topk returns them in
    flat = torch.zeros(1, 3, 1, c)
    flat[..., 20] = 5.0
    assert chosen(3, 1, flat) == [0, 1, 20]
    flat[0, 0, 0, 30] = flat[0, 1, 0, 35] = 7.0  # 20: three votes; 30 and 35: one each and the same summed score
    assert chosen(2, 1, flat) == [20, 30]


# -- engine = parallel form --------------------------------------------------------------------------
def test_engine_equals_parallel_form_ragged_gqa_batch_chunked_prefill(make_model):
    """Prompts prefilled in chunks of 5 (global, ring and compression crossed inside a chunk), then ragged
    batched decode steps; logits equal the teacher-forced parallel form. Sequences repeat no token:
    repeated tokens have identical pre-RoPE first-layer keys, whose exact score ties the two forms may
    break differently by float rounding."""
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randperm(SHAPE.vocab_size, generator=g)[:n] for n in (48, 41, 45)]
    cache = assert_engine_matches_parallel(make_model("full"), {**SMALL, "chunk": 5}, sequences, [30, 1, 9])
    held = cache.bytes_held(0)
    assert held["projections"] == cache.lightcache.projections.nbytes > 0


# -- memory ------------------------------------------------------------------------------------------
def test_bytes_held_follow_the_widths_over_500_decode_steps():
    shape = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_heads=4, num_kv_heads=2, vocab_size=50,
                       max_positions=1024)
    model = LlamaForInference(shape, random_weights(shape), None, torch.float32)
    options = {"local": 32, "top_k": 4, "segment": 8}  # r_k = 1, r_v = 8 (d = 16)
    engine = Engine(model, cache="lightcache", kv_bytes=1 << 20, max_batch=2, **options)
    prompt = list(range(1, 30))
    engine.add_request(prompt, SamplingParams(max_new_tokens=500))
    engine.step()
    cache, pool = engine.cache, engine.pool
    rows = shape.num_layers * shape.num_kv_heads
    width = cache.packed.width
    assert width == 1 + 8
    steps = 0
    while engine.has_work():
        engine.step()
        if not engine.running:
            break
        steps += 1
        req = engine.running[0]
        tokens = len(req.prompt) + len(req.tokens) - 1  # written into the cache
        held = cache.bytes_held(req.id)
        full = min(tokens, 4 + 32)
        want = rows * (full * 2 * 16 + (tokens - full) * width) * 4  # fp32
        assert held["entries"] == want, steps
        assert 0 <= held["pages"] - held["entries"] < 2 * rows * pool.page_bytes  # <= one page per page list
        assert held["total"] == held["pages"] + held["state"] + cache.lightcache.projections.nbytes
    assert steps == 497  # 499 decode steps: the first comes with the prefill, the last one ends the request
    full_cache = rows * tokens * 2 * 16 * 4
    assert held["pages"] < 0.45 * full_cache  # 9 of 32 channels per compressed token
    assert pool.used_pages == 0  # every page, both widths, back to the pool


def test_prompts_longer_than_the_model_prefill_in_bounded_memory():
    """A prompt of 3x the model's positions prefills in chunks; the KV bytes at peak are the LightCache
    layout's (measured from the pool), far below a full cache of that length; logits = the parallel form."""
    shape = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_heads=4, num_kv_heads=2,
                       vocab_size=400, max_positions=64)
    model = LlamaForInference(shape, random_weights(shape), None, torch.float32)
    options = {"local": 24, "top_k": 3, "segment": 4}  # window 40 <= 64; chunk = 64
    prompt = torch.randperm(400, generator=torch.Generator().manual_seed(1))[:192]
    with pytest.raises(InferenceError, match="more than the model's 64 positions"):
        model.forward(prompt[None])
    pool = new_pool(model)
    cache = build_cache("lightcache", pool, model, options)
    cache.add(0)
    got = model.prefill(cache, 0, prompt)
    want = model.forward_with_policy(prompt[None], lightcache_for(model, options), 0)[0]
    assert torch.allclose(got, want, atol=1e-4)
    rows = shape.num_layers * shape.num_kv_heads
    peak = pool.peak_pages * pool.page_bytes
    full = rows * 192 * 2 * 16 * 4
    print(f"peak KV bytes {peak} vs {full} for a full cache of 192 tokens ({peak / full:.2f})")
    assert peak == cache.bytes_held(0)["pages"] < 0.5 * full
    decoded = model.decode(cache, [0], torch.tensor([7]), torch.tensor([192]))  # and decoding goes on past 64
    assert decoded.shape == (1, 400) and cache.entries(0).unique().tolist() == [193]


# -- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    ({"r_k": 17}, "lightcache r_k=17 must be in [1, 16] (the head size)"),
    ({"r_v": 0}, "lightcache r_v=0 must be in [1, 16]"),
    ({"local": 0}, "lightcache local=0 must be >= 1"),
    ({"segment": 0}, "lightcache segment=0 must be >= 1"),
    ({"global": 4, "local": 125}, "global + local = 129 exceeds the model's 128 positions"),
    ({"top_k": 2.5}, "lightcache option top_k=2.5 must be a whole number"),
    ({"budget": 64}, "lightcache has no option 'budget'; its options are r_k, r_v, global, local"),
])
def test_bad_settings_are_one_line(make_model, options, message):
    with pytest.raises(InferenceError) as e:
        Engine(make_model("full"), cache="lightcache", **options)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_window_past_the_positions_is_a_note_and_dmc_or_biases_are_refused(make_model):
    engine = Engine(make_model("full"), cache="lightcache", local=64, top_k=16, segment=32)
    assert "longer than the model's 128 positions, so RoPE leaves its trained range" in engine.cache.note
    assert Engine(make_model("full"), cache="lightcache", **SMALL).cache.note is None
    with pytest.raises(InferenceError, match="runs on vanilla and GQA checkpoints; this one is a DMC model"):
        Engine(make_model("dmc_exact"), cache="lightcache")
    weights = random_weights(SHAPE)
    weights["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(SHAPE.num_kv_heads * D)
    with pytest.raises(InferenceError, match=r"k_proj.bias: the inference model is Llama without biases"):
        LlamaForInference(SHAPE, weights)


# -- a trained checkpoint ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gqa_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightcache_run")
    run(["launch/pretrain.py", "+recipe=tiny_pretrain", "logging.progress=false", "train.eval_interval=0",
         "model.num_query_groups=4", "train.max_steps=3", f"run_dir={root}"])
    return root


@pytest.mark.slow
def test_trained_gqa_checkpoint_engine_generate_and_evaluate(gqa_run, tmp_path):
    """On a trained GQA checkpoint (4 KV groups, d = 8: r_k = 1, r_v = 4): engine = parallel form on a ragged
    batch; launch/generate.py --cache lightcache; launch/evaluate.py eval.cache=lightcache."""
    from launch.generate import main

    model, _ = LlamaForInference.from_checkpoint(str(gqa_run))
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randperm(model.shape.vocab_size, generator=g)[:n] for n in (90, 61)]
    options = {"local": 16, "top_k": 3, "segment": 4, "chunk": 32}
    assert_engine_matches_parallel(model, options, sequences, [70, 2])

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(" ".join(str(5 + (7 * i + j) % 200) for j in range(n)) for i, n in enumerate((40, 3))))
    out = tmp_path / "gen.json"
    main(["--checkpoint", str(gqa_run), "--prompts-file", str(prompts), "--token-ids", "--max-new-tokens", "30",
          "--cache", "lightcache", *[f"--policy-option={k}={v}" for k, v in options.items()], "--json", str(out)])
    result = json.loads(out.read_text())
    for o, n in zip(result["outputs"], (40, 3)):
        assert o["error"] is None and len(o["tokens"]) == 30
        assert {c for layer in o["entries"] for c in layer} == {n + 29}  # every token held
    assert result["summary"]["compression"] == 1.0 and result["summary"]["kv_bytes_at_end"] > 0

    base = ["launch/evaluate.py", "+recipe=tiny_pretrain", "model.num_query_groups=4", f"run_dir={gqa_run}",
            "eval.cache=lightcache", "eval.max_sequences=2"]
    proc = run([*base, "+eval.options.local=16", "+eval.options.top_k=2", "+eval.options.segment=4"])
    assert "cache lightcache, budget 28" in proc.stdout
    result = json.loads((gqa_run / "eval_lightcache_28.json").read_text())
    assert result["valid_tokens"] == 2 * 64 and result["valid_ppl"] > 1
    proc = run([*base, "+eval.options.r_k=9"], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "r_k=9 must be in [1, 8]" in errors[0], proc.stderr[-2000:]


def test_the_engine_generates_past_the_models_positions_with_lightcache(make_model):
    """A prompt and a generation longer than the model's 128 positions: LightCache attends over a window at its
    own positions, so the engine lifts the length limit for it (and keeps it for the other caches)."""
    from dmc_train.errors import InferenceError
    from dmc_train.inference.engine import Engine
    from dmc_train.inference.sampling import SamplingParams

    prompt = list(range(1, 48)) * 4  # 188 tokens
    engine = Engine(make_model("full"), cache="lightcache", max_batch=2, local=16, top_k=2, segment=4)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=100))[0]
    assert out.error is None and len(out.tokens) == 100 and out.finish_reason == "length"
    with pytest.raises(InferenceError, match="more than the model's 128 positions"):
        Engine(make_model("full")).add_request(prompt)

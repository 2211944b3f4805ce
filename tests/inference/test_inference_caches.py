"""Caches + the inference forward: prefill and batched decode equal the teacher-forced forward, the
DMC cache holds exactly Algorithm 1's slots, and the parallel prefill writes what token-by-token
updates write."""

import pytest
import torch

from dmc_train.errors import OutOfPages
from dmc_train.evaluation.incremental import teacher_forced_decode
from dmc_train.inference.caches import DMCCache, FullCache, build_cache
from dmc_train.inference.caches.base import KVCache
from dmc_train.inference.dmc_decisions import DMCInference
from dmc_train.inference.model import LlamaForInference, random_weights
from dmc_train.inference.pool import PagePool
from dmc_train.models.dmc_settings import DMCSettings
from kernels.backend import set_backend
from tests.inference.conftest import SHAPE

DMC_VARIANTS = ["dmc_exact", "dmc_window", "dmc_hardc", "dmc_pre", "dmc_pre_window", "fixed_pooling"]


def new_cache(model, num_pages=256, page_size=16, policy=None):
    """The model's own cache, or the eviction ``policy`` given as ``name`` or ``name:schedule`` (budget 24)."""
    pool = PagePool(num_pages, page_size, SHAPE.head_dim, 16 * SHAPE.num_layers * SHAPE.num_kv_heads,
                    SHAPE.max_positions, dtype=model.dtype, device=model.device)
    if policy is not None:
        name, _, schedule = policy.partition(":")
        return build_cache(name, pool, model, {"budget": 24, "schedule": schedule or "decode"})
    if model.decisions is None:
        return FullCache(pool, SHAPE.num_layers, SHAPE.num_kv_heads, model.scale)
    return DMCCache(pool, SHAPE.num_layers, SHAPE.num_kv_heads, model.scale, model.method.settings)


def capture_decisions(model):
    """Record the hard decisions ``alpha [1, H_kv, n]`` of every layer of the next forwards (of one sequence each)."""
    seen, original = [], model.decisions.decide

    def spy(*args):
        alpha, omega = original(*args)  # [n, H_kv]: tokens as rows
        seen.append(alpha.T[None])
        return alpha, omega

    model.decisions.decide = spy
    return seen


@pytest.mark.parametrize("variant", ["full", *DMC_VARIANTS])
def test_ragged_batched_decode_equals_the_teacher_forced_forward(make_model, variant):
    model = make_model(variant)
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g) for n in (40, 23, 33)]
    got = teacher_forced_decode(model, new_cache(model), sequences, prompt_lens=[7, 1, 18])
    for seq, logits in zip(sequences, got):
        torch.testing.assert_close(logits, model.forward(seq[None])[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("variant", DMC_VARIANTS)
def test_dmc_cache_holds_algorithm_1_slot_counts(make_model, variant):
    model = make_model(variant)
    seq = torch.randint(0, SHAPE.vocab_size, (45,), generator=torch.Generator().manual_seed(2))
    decisions = capture_decisions(model)
    model.forward(seq[None])
    cache = new_cache(model)
    teacher_forced_decode(model, cache, [seq], prompt_lens=[20])
    # Algorithm 1: the first token opens a slot, every later token appends (alpha 0) or merges (alpha 1)
    expected = torch.stack([1 + (alpha[0, :, 1:] == 0).sum(-1) for alpha in decisions[:SHAPE.num_layers]])
    assert torch.equal(cache.entries(0), expected)
    assert 1 < int(expected.min()) and int(expected.max()) < 45  # both decisions occurred


@pytest.mark.parametrize("variant", DMC_VARIANTS)
def test_parallel_prefill_writes_what_token_by_token_updates_write(make_model, variant):
    model = make_model(variant)
    seq = torch.randint(0, SHAPE.vocab_size, (50,), generator=torch.Generator().manual_seed(3))
    parallel, stepwise = new_cache(model), new_cache(model)
    teacher_forced_decode(model, parallel, [seq], prompt_lens=[50])
    teacher_forced_decode(model, stepwise, [seq], prompt_lens=[1])
    assert torch.equal(parallel.entries(0), stepwise.entries(0))
    for a, b in zip(parallel.rows[0].flatten().tolist(), stepwise.rows[0].flatten().tolist()):
        for x, y in zip(parallel.pool.read(a), stepwise.pool.read(b)):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
        for name in ("open_k", "open_v", "open_w"):  # the open slot's running state
            torch.testing.assert_close(getattr(parallel, name)[a], getattr(stepwise, name)[b], rtol=0, atol=1e-5)
        assert parallel.open_tokens[a] == stepwise.open_tokens[b]


def test_window_accumulation_drops_the_oldest_token_of_a_long_segment(device):
    """Fixed pooling of 3 with a window of 2: the slot of tokens (0, 1, 2) averages only 1 and 2."""
    model = LlamaForInference(SHAPE, random_weights(SHAPE), DMCInference(
        DMCSettings(channel=None, pool=3, accumulation="window", window=2)), device=device)
    seq = torch.randint(0, SHAPE.vocab_size, (3,), generator=torch.Generator().manual_seed(4))
    cache = new_cache(model)
    keys = []
    original = cache.prefill

    def spy(layer, seq_id, q, k, v, info):
        keys.append(k[0])
        return original(layer, seq_id, q, k, v, info)

    cache.prefill = spy
    teacher_forced_decode(model, cache, [seq], prompt_lens=[3])
    row = int(cache.rows[0][0, 0])
    slot_k, _ = cache.pool.read(row)
    assert slot_k.shape[0] == 1
    torch.testing.assert_close(slot_k[0], keys[0][0, 1:].mean(0))


@pytest.mark.parametrize("variant", ["full", "dmc_exact"])
def test_bf16_pages_and_logits(make_model, variant):
    seq = torch.randint(0, SHAPE.vocab_size, (30,), generator=torch.Generator().manual_seed(5))
    model = make_model(variant, torch.bfloat16)
    cache = new_cache(model)
    got = teacher_forced_decode(model, cache, [seq], prompt_lens=[10])[0]
    assert got.dtype == torch.bfloat16 and cache.pool.k_pages.dtype == torch.bfloat16
    # bf16 rounding differs between the paths (SDPA in bf16 at prefill, fp32 paged attention at decode)
    torch.testing.assert_close(got.float(), model.forward(seq[None])[0].float(), rtol=0, atol=0.15)


def test_pre_rope_order_rotates_accumulated_raw_keys(make_model):
    """rope_order=pre is a different model: the same weights give other logits than post, and its
    closed slots are raw segment averages rotated at the segment's last position."""
    seq = torch.randint(0, SHAPE.vocab_size, (20,), generator=torch.Generator().manual_seed(6))
    pre, post = make_model("dmc_pre"), make_model("dmc_exact")
    assert not torch.allclose(pre.forward(seq[None]), post.forward(seq[None]), atol=1e-3)
    cache = new_cache(pre)
    raw, decisions = [], capture_decisions(pre)
    original = cache.prefill

    def spy(layer, seq_id, q, k, v, info):
        raw.append((k[0], info.omega[0]))
        return original(layer, seq_id, q, k, v, info)

    cache.prefill = spy
    teacher_forced_decode(pre, cache, [seq], prompt_lens=[20])
    k, omega = raw[0]  # layer 0: raw keys [H_kv, n, d]
    alpha = decisions[0][0]  # [H_kv, n]
    slots, _ = cache.pool.read(int(cache.rows[0][0, 0]))
    starts = [0] + [t for t in range(1, 20) if alpha[0, t] == 0]
    ends = [s - 1 for s in starts[1:]] + [19]
    for i, (a, b) in enumerate(zip(starts, ends)):
        w = omega[0, a: b + 1, None]
        mean = (w * k[0, a: b + 1]).sum(0) / w.sum()
        torch.testing.assert_close(slots[i], pre.rope(mean, torch.tensor(b)), rtol=1e-5, atol=1e-5)


def decode_on_both_backends(model, sequences, prompt_lens, on_step=None):
    """A teacher-forced decode of ``sequences`` through the public step, with the compiled CPU kernels (``auto``) and
    with the PyTorch paths (what bf16 pages and a machine without a C compiler run): ``{backend: (cache, logits)}``.
    ``on_step(cache)`` runs at every step's end."""
    runs = {}
    for backend in ("auto", "torch"):
        set_backend(backend)
        try:
            cache = new_cache(model)
            if on_step is not None:
                original = cache.end_decode

                def end_decode(cache=cache, original=original):
                    original()
                    on_step(cache)

                cache.end_decode = end_decode
            runs[backend] = cache, teacher_forced_decode(model, cache, sequences, prompt_lens)
        finally:
            set_backend("auto")
    return runs


def assert_same_rows(a, b):
    """Two caches that decoded the same sequences hold the same entries, pages and K/V values (to the rounding of
    the two backends' projections)."""
    assert a.pool.used_pages == b.pool.used_pages and a.pool.peak_pages == b.pool.peak_pages
    for s in a.rows:
        assert torch.equal(a.entries(s), b.entries(s))
        for x, y in zip(a.rows[s].flatten().tolist(), b.rows[s].flatten().tolist()):
            for p, q in zip(a.pool.read(x), b.pool.read(y)):
                torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


def test_full_cache_step_reuses_its_block_table_between_pages(make_model):
    """The full cache's once-per-step path (compiled kernels: pages lent, each layer appending and attending in one
    call; PyTorch: the rows' block table taken again only when a row takes a page) gives the teacher-forced logits
    as rows cross page boundaries, both backends the same entries and pages; its pages needed per step are the
    generic count's."""
    model = make_model("full")
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g) for n in (70, 41, 55)]
    needed = []

    def count(cache):
        live = list(cache.rows)
        needed.append((cache.decode_pages_needed(live), KVCache.decode_pages_needed(cache, live)))

    runs = decode_on_both_backends(model, sequences, [3, 1, 9], count)
    for cache, logits in runs.values():
        for seq, got in zip(sequences, logits):
            torch.testing.assert_close(got, model.forward(seq[None])[0], rtol=0, atol=1e-4)
    assert all(mine == generic for mine, generic in needed) and any(sum(mine) for mine, _ in needed)
    (auto, got), (torch_path, want) = runs["auto"], runs["torch"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5)
    assert_same_rows(auto, torch_path)


@pytest.mark.parametrize("variant", DMC_VARIANTS)
def test_dmc_decode_step_is_the_same_on_both_backends(make_model, variant):
    """DMC's once-per-step path (pages lent, every layer's rows taken once) gives the teacher-forced logits, and the
    compiled kernels and the PyTorch paths the same logits, pages, open-slot state and page accounting; rows cross
    page boundaries on the way and no lent page is left over after a step."""
    model = make_model(variant)
    g = torch.Generator().manual_seed(7)
    sequences = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g) for n in (70, 41, 55)]
    pages_held = []

    def count_pages(cache):
        rows = torch.cat([r.flatten() for r in cache.rows.values()])
        pages_held.append((cache.pool.used_pages, cache.pool.pages_of(rows)))

    runs = decode_on_both_backends(model, sequences, [3, 1, 9], count_pages)
    for cache, logits in runs.values():
        for seq, got in zip(sequences, logits):
            torch.testing.assert_close(got, model.forward(seq[None])[0], rtol=0, atol=1e-4)
    assert all(used == held for used, held in pages_held)  # no lent page is left over after a step
    (stepped, got), (other, want) = runs["auto"], runs["torch"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5)
    assert_same_rows(stepped, other)
    for s in stepped.rows:
        for a, b in zip(stepped.rows[s].flatten().tolist(), other.rows[s].flatten().tolist()):
            for name in ("open_k", "open_v", "open_w"):
                torch.testing.assert_close(getattr(stepped, name)[a], getattr(other, name)[b], rtol=0, atol=1e-5)
            assert stepped.open_tokens[a] == other.open_tokens[b]
    assert pages_held[-1][1] > pages_held[0][1]  # rows took pages during decode
    for s in list(stepped.rows):
        stepped.release(s)
    assert sorted(stepped.pool.free_pages) == list(range(stepped.pool.num_pages))


def test_a_dmc_step_that_may_not_find_its_pages_changes_nothing(make_model):
    """With fewer free pages than rows whose last page is full (the most a step's appends can take), the DMC
    cache's decode step raises OutOfPages before any layer runs: lengths, pages, block table and open-slot state as
    before; with enough free pages the same step runs."""
    model = make_model("fixed_pooling")  # every 3rd token appends: 46 tokens fill each row's first page
    cache = new_cache(model, num_pages=2 * SHAPE.num_layers * SHAPE.num_kv_heads)
    prompt = torch.randint(0, SHAPE.vocab_size, (46,), generator=torch.Generator().manual_seed(0))
    cache.add(0)
    model.prefill(cache, 0, prompt)
    pool = cache.pool
    full = SHAPE.num_layers * SHAPE.num_kv_heads
    assert (pool.seq_lens[cache.rows[0]] == pool.page_size).all()
    del pool.free_pages[: len(pool.free_pages) - (full - 1)]  # one page fewer than the step may take
    before = [t.clone() for t in (pool.seq_lens, pool.block_table, pool.k_pages, cache.open_state, cache.open_tokens)]
    free = list(pool.free_pages)
    with pytest.raises(OutOfPages, match=f"a decode step may take {full}, {full - 1} free"):
        model.decode(cache, [0], prompt[:1], torch.tensor([46]))
    after = (pool.seq_lens, pool.block_table, pool.k_pages, cache.open_state, cache.open_tokens)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and pool.free_pages == free
    pool.free_pages.insert(0, max(free) + 1)
    model.decode(cache, [0], prompt[:1], torch.tensor([46]))
    assert not torch.equal(cache.open_tokens, before[4])


@pytest.mark.parametrize("variant", ["full", "dmc_exact", "dmc_window", "dmc_hardc", "fixed_pooling", "h2o",
                                     "tova", "keyformer", "knorm", "streaming_llm", "lsh_e", "h2o:prefill"])
def test_a_layer_in_one_compiled_call_equals_its_three_calls(make_model, variant):
    """On CPU in fp32 a decode step runs each layer in one compiled call (projection, the cache's update and
    attention as a C function, output: LlamaLayer.decode_with; DMC's decisions taken in the call from the decision
    channel; an eviction policy's write at the victims' slots and attention with its per-entry scores, the scores
    updated at the step's end), or in two around PyTorch's decisions for HardC and around the victims chosen from
    each layer's query for LSH-E (LlamaLayer.attend_output_with).
    Against the same steps with the layer's three calls (the cache's compiled_attention declined), as rows cross
    page boundaries and the policies' rows fill their budget, with 16 sequences (32 rows a layer: PyTorch's sigmoid
    runs its vector path on them): the same decisions (entries per row) and pages; the logits, entries, open-slot
    state and the policies' per-entry state bit for bit, but for DMC: within float rounding (omega's sigmoid in
    C)."""
    dmc = variant.startswith(("dmc", "fixed"))
    model = make_model(variant if dmc else "full")
    policy = None if dmc or variant == "full" else variant
    g = torch.Generator().manual_seed(11)
    lens, prompts = (torch.randint(a, b, (16,), generator=g).tolist() for a, b in ((20, 50), (1, 10)))
    sequences = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g) for n in lens]
    fused, three = new_cache(model, policy=policy), new_cache(model, policy=policy)
    three.compiled_attention = lambda layer, num_heads, positions: None
    calls = []
    original = fused.compiled_attention

    def compiled_attention(layer, num_heads, positions):
        call = original(layer, num_heads, positions)
        calls.append(call is not None)
        return call

    fused.compiled_attention = compiled_attention
    got = teacher_forced_decode(model, fused, sequences, prompt_lens=prompts)
    want = teacher_forced_decode(model, three, sequences, prompt_lens=prompts)
    assert calls and all(calls)  # every layer of every step ran in one call
    exact = variant not in ("dmc_exact", "dmc_window")  # the two that decide in C

    def same(a, b, atol):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=atol)

    for a, b in zip(got, want):
        same(a, b, 1e-5)
    assert fused.pool.free_pages == three.pool.free_pages
    for s in fused.rows:
        assert torch.equal(fused.entries(s), three.entries(s))
        for a, b in zip(fused.rows[s].flatten().tolist(), three.rows[s].flatten().tolist()):
            for x, y in zip(fused.pool.read(a), three.pool.read(b)):
                same(x, y, 1e-5)
    if model.decisions is not None:
        same(fused.open_state, three.open_state, 1e-5)
        assert torch.equal(fused.open_tokens, three.open_tokens)
    if policy is not None:
        assert all(torch.equal(fused.row_state()[n], t) for n, t in three.row_state().items())

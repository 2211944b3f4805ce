"""Each policy's rule on hand-made attention patterns with a known kept set (the parallel form, which the
engine's cache is tested against in tests/inference/test_policy_caches.py)."""

import math

import torch

from dmc_train.policies import build_scorer
from dmc_train.policies.keyformer import gumbel_noise
from dmc_train.policies.lsh_e import hamming
from dmc_train.policies.parallel import run_policy

D = 16


def scorer(name, group=1, **options):
    return build_scorer(name, options, D, group, 1 / math.sqrt(D))


def random_qkv(n, device, heads=1, kv_heads=1, seed=0):
    """Drawn on CPU (the same values on every device), then moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(1, heads, n, D, generator=g), torch.randn(1, kv_heads, n, D, generator=g),
           torch.randn(1, kv_heads, n, D, generator=g))
    return tuple(x.to(device) for x in qkv)


def test_a_heavy_hitter_survives_h2o(device):
    q, k, v = random_qkv(40, device)
    u = torch.nn.functional.normalize(torch.ones(D, device=device), dim=0)
    q += 2 * u
    k[0, 0, 5] = 4 * u  # every query attends strongly to position 5
    run = run_policy(scorer("h2o", budget=8), q, k, v, budget=8, layer=0)
    assert run.evicted_at[0, 0, 5] == -1
    assert (run.visible()[0, 0].sum(-1)[8:] == 8).all()  # budget entries at every step once full


def test_sinks_and_the_recent_window_survive_streaming_llm(device):
    q, k, v = random_qkv(40, device)
    run = run_policy(scorer("streaming_llm", budget=10), q, k, v, budget=10, layer=0)
    kept_at_end = run.visible()[0, 0, -1].nonzero()[:, 0].tolist()
    assert kept_at_end == [0, 1, 2, 3, *range(34, 40)]


def test_tova_removes_the_argmin_of_the_previous_query(device):
    q, k, v = random_qkv(30, device, heads=2, kv_heads=1, seed=1)
    budget = 6
    run = run_policy(scorer("tova", group=2, budget=budget), q, k, v, budget=budget, layer=0)
    visible = run.visible()[0, 0]
    for t in range(budget + 1, 30):
        seen = visible[t - 1].nonzero()[:, 0]
        probs = torch.softmax(q[0, :, t - 1] @ k[0, 0, seen].T / math.sqrt(D), dim=-1).mean(0)
        victim = int(seen[probs.argmin()])
        assert run.evicted_at[0, 0, victim] == t


def test_a_hamming_far_key_goes_first_in_lsh_e(device):
    q, k, v = random_qkv(30, device)
    far = 8
    k[0, 0, far] = -q[0, 0, 20] * 5  # opposite to query 20: every code bit differs
    s = scorer("lsh_e", budget=20, bits=32)
    qc, kc = s.codes(q[0, 0, 20]), s.codes(k[0, 0, far])
    assert int(hamming(qc, kc)) == 32
    run = run_policy(s, q, k, v, budget=20, layer=0)
    assert run.evicted_at[0, 0, far] == 20
    assert (run.evicted_at[0, 0, :4] == -1).all()  # the first 4 always stay


def test_the_largest_norm_key_goes_first_in_knorm(device):
    q, k, v = random_qkv(20, device)
    k[0, 0, 3] *= 10
    run = run_policy(scorer("knorm", budget=10), q, k, v, budget=10, layer=0)
    assert run.evicted_at[0, 0, 3] == 10  # the first eviction
    norms = k[0, 0].norm(dim=-1)
    kept = run.visible()[0, 0, 10].nonzero()[:, 0]
    assert norms[kept[kept < 10]].max() <= norms[:10].sort().values[8]  # the 9 lowest of the first 10 stay


def test_keyformer_without_noise_at_tau_1_is_accumulated_softmax(device):
    q, k, v = random_qkv(40, device, seed=2)
    options = dict(budget=10, recent_fraction=0.3, noise=False, tau_schedule="code", tau_step=0.0)
    keyformer = run_policy(scorer("keyformer", **options), q, k, v, budget=10, layer=0)
    h2o = run_policy(scorer("h2o", budget=10, recent_fraction=0.3), q, k, v, budget=10, layer=0)
    assert torch.equal(keyformer.evicted_at, h2o.evicted_at)


def test_keyformer_noise_is_seeded_and_changes_the_kept_set(device):
    q, k, v = random_qkv(60, device, seed=3)
    runs = [run_policy(scorer("keyformer", budget=12, seed=s), q, k, v, budget=12, layer=0) for s in (0, 0, 1)]
    assert torch.equal(runs[0].evicted_at, runs[1].evicted_at)
    assert not torch.equal(runs[0].evicted_at, runs[2].evicted_at)
    pos = torch.arange(50, device=device)
    noise = gumbel_noise(0, 1, torch.arange(2, device=device)[:, None, None], pos[:, None], pos)
    assert abs(float(noise.mean()) - 0.5772) < 0.05  # Gumbel(0, 1): mean = Euler's constant


def test_keyformer_temperature_schedules(device):
    from dmc_train.policies.base import Step

    s = scorer("keyformer", budget=10)
    step = Step(0, torch.zeros(2, device=device), torch.zeros(2, device=device), torch.tensor([0, 50], device=device),
                torch.tensor([100, 100], device=device), 1)
    assert s.tau(step).tolist() == [1.0, 1.5]  # paper: tau_init + t (tau_end - tau_init) / T
    assert scorer("keyformer", budget=10, tau_schedule="code").tau(step).tolist() == [1.0, 1.5]  # + 0.01 per step


def test_gqa_scores_sum_the_group_and_layer_aggregation_keeps_one_position_set(device):
    q, k, v = random_qkv(30, device, heads=4, kv_heads=2, seed=4)
    run = run_policy(scorer("tova", group=2, budget=8), q, k, v, budget=8, layer=0)  # aggregate=layer by default
    assert torch.equal(run.evicted_at[0, 0], run.evicted_at[0, 1])
    per_head = run_policy(scorer("tova", group=2, budget=8, aggregate="kv_head"), q, k, v, budget=8, layer=0)
    assert not torch.equal(per_head.evicted_at[0, 0], per_head.evicted_at[0, 1])

"""Token sampling (greedy, temperature, top-k, top-p, per-row seeds), SamplingParams validation and
the stop rules (dmc_train/inference/sampling.py)."""

import math

import pytest
import torch

from dmc_train.inference.sampling import SamplingParams, StopChecker, make_generator, sample

PROBS = torch.tensor([0.5, 0.3, 0.2])


def draws(logits, params, n, seed=0):
    """``n`` tokens drawn one after another from the single row ``logits [V]`` on one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return sample(logits.expand(n, -1), [params] * n, [gen] * n)


def random_logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_ties_to_the_lowest_index():
    logits = random_logits()
    logits[1, 7] = logits[1, 30] = logits[1].max() + 1
    params = [SamplingParams()] * 4
    tokens = sample(logits, params, [None] * 4)
    assert tokens.dtype == torch.int64 and tokens.shape == (4,)
    assert tokens.tolist() == logits.argmax(-1).tolist() and tokens[1] == 7


def test_seeded_draws_repeat_and_do_not_depend_on_the_other_rows():
    logits = random_logits(rows=3)
    p7 = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    others = [SamplingParams(), SamplingParams(temperature=2.0, seed=3)]

    def run(batch):  # 10 steps; row 0 is the seed-7 request
        params = [p7, *others][: len(batch)]
        gens = [make_generator(p) for p in params]
        return [sample(logits[batch], params, gens)[0].item() for _ in range(10)]

    alone = run([0])
    assert alone == run([0])
    assert alone == run([0, 1, 2])
    assert len(set(alone)) > 1  # really sampled, not greedy


def test_make_generator():
    assert make_generator(SamplingParams()) is None
    a, b = make_generator(SamplingParams(seed=5)), make_generator(SamplingParams(seed=5))
    assert a.device.type == "cpu" and torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


@pytest.mark.parametrize("temperature", [0.1, 1.0, 10.0, 1000.0])
def test_top_k_1_is_greedy(temperature):
    logits = random_logits(rows=6)
    logits[2, 3] = logits[2, 40] = logits[2].max() + 0.5  # a tie: the lowest index, like argmax
    params = [SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(6)]
    tokens = sample(logits, params, [make_generator(p) for p in params])
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = random_logits(rows=6)
    params = [SamplingParams(temperature=5.0, top_p=1e-6, seed=i) for i in range(6)]
    tokens = sample(logits, params, [make_generator(p) for p in params])
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_top_k_restricts_draws_to_the_k_largest():
    logits = torch.tensor([0.0, 3.0, -1.0, 2.9, 0.5, 2.8, 1.0, -2.0])
    tokens = draws(logits, SamplingParams(temperature=10.0, top_k=3), 500)
    assert set(tokens.tolist()) == {1, 3, 5}


def test_top_k_at_least_the_vocabulary_is_off():
    logits = random_logits(rows=1)[0]
    off = draws(logits, SamplingParams(temperature=1.0), 200)
    assert torch.equal(draws(logits, SamplingParams(temperature=1.0, top_k=50), 200), off)
    assert torch.equal(draws(logits, SamplingParams(temperature=1.0, top_k=1000), 200), off)


@pytest.mark.parametrize("top_p, support", [(0.75, {0, 1}), (0.5, {0}), (0.81, {0, 1, 2})])
def test_top_p_keeps_the_smallest_nucleus_reaching_top_p(top_p, support):
    tokens = draws(PROBS.log(), SamplingParams(temperature=1.0, top_p=top_p), 500)
    assert set(tokens.tolist()) == support


def test_top_k_then_top_p():
    logits = torch.tensor([0.1, 0.4, 0.3, 0.2]).log()  # top-2 renormalised: [4/7, 3/7]
    assert set(draws(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5), 300).tolist()) == {1}
    assert set(draws(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6), 300).tolist()) == {1, 2}


def test_frequencies_follow_the_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0, 2.0])
    tokens = draws(logits, SamplingParams(temperature=1.0), 2000)
    freq = torch.bincount(tokens, minlength=5).float() / 2000
    torch.testing.assert_close(freq, torch.softmax(logits, -1), rtol=0, atol=0.05)


def test_lower_temperature_is_sharper():
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0, 0.8])
    fractions = [(draws(logits, SamplingParams(temperature=t), 1000) == 0).float().mean() for t in (2.0, 1.0, 0.5)]
    assert fractions[0] < fractions[1] < fractions[2]


def test_tiny_temperature_does_not_produce_nan():
    logits = random_logits(rows=1)
    tokens = draws(logits[0], SamplingParams(temperature=1e-30), 20)
    assert set(tokens.tolist()) == {logits.argmax().item()}


def test_bf16_logits():
    logits = random_logits().bfloat16()
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(top_k=1, temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9, seed=2),
    ]
    tokens = sample(logits, params, [make_generator(p) for p in params])
    assert tokens.dtype == torch.int64 and tokens.shape == (4,)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert ((tokens >= 0) & (tokens < 50)).all()


def test_sample_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match=r"got logits \(2, 5\), 1 params, 2 generators"):
        sample(torch.zeros(2, 5), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match=r"logits \(5,\)"):
        sample(torch.zeros(5), [], [])


def test_params_accept_lists_and_a_single_stop_string():
    p = SamplingParams(stop=["\n\n", "###"], stop_token_ids=[2, 3], temperature=1, top_p=1)
    assert p.stop == ("\n\n", "###") and p.stop_token_ids == (2, 3)
    assert isinstance(p.temperature, float) and hash(p) == hash(SamplingParams(**vars(p)))
    assert SamplingParams(stop="\n").stop == ("\n",)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer >= 1, got 2.5"),
        ({"temperature": -0.1}, r"temperature must be a number >= 0 \(0 = greedy\), got -0.1"),
        ({"temperature": math.nan}, "temperature must be .*, got nan"),
        ({"temperature": "1"}, "temperature must be .*, got '1'"),
        ({"top_k": -1}, r"top_k must be an integer >= 0 \(0 = off\), got -1"),
        ({"top_k": True}, "top_k must be an integer >= 0 .*, got True"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"seed": -1}, r"seed must be None or an integer in \[0, 2\*\*64\), got -1"),
        ({"seed": "7"}, "seed must be None or an integer .*, got '7'"),
        ({"stop_token_ids": [1, -2]}, r"stop_token_ids must be a list of token ids \(integers >= 0\), got \[1, -2\]"),
        ({"stop_token_ids": 5}, "stop_token_ids must be .*, got 5"),
        ({"stop": ["a", ""]}, r"stop must be a list of non-empty strings, got \['a', ''\]"),
        ({"stop": [3]}, r"stop must be a list of non-empty strings, got \[3\]"),
        ({"ignore_eos": "yes"}, "ignore_eos must be true or false, got 'yes'"),
    ],
)
def test_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        SamplingParams(**kwargs)


EOS = 0


def run_checker(params, steps, eos=EOS):
    """Feed ``(token_id, text_so_far)`` steps until finished; the final ``(steps used, reason, text)``."""
    checker = StopChecker(params, eos)
    for n, (token, text) in enumerate(steps, 1):
        finished, reason, out = checker.check(token, text)
        if finished:
            return n, reason, out
        assert reason is None and out == text
    return len(steps), None, out


def test_stop_on_eos_unless_ignored():
    steps = [(5, "a"), (EOS, "a</s>"), (6, "a</s>b")]
    assert run_checker(SamplingParams(), steps) == (2, "eos", "a</s>")
    assert run_checker(SamplingParams(ignore_eos=True), steps) == (3, None, "a</s>b")
    assert run_checker(SamplingParams(), steps, eos=None) == (3, None, "a</s>b")


def test_stop_token_ids():
    steps = [(5, "a"), (9, "ab"), (EOS, "ab")]
    assert run_checker(SamplingParams(stop_token_ids=[9]), steps) == (2, "stop_token", "ab")
    assert run_checker(SamplingParams(stop_token_ids=[EOS], ignore_eos=True), steps) == (3, "stop_token", "ab")


def test_stop_string_truncates_before_the_first_stop_string():
    params = SamplingParams(stop=["END", "\n\n"])
    steps = [(1, "Hello"), (2, "Hello\n"), (3, "Hello\n\nEND more")]  # "\n\n" spans two tokens' text
    assert run_checker(params, steps) == (3, "stop_string", "Hello")
    assert run_checker(params, [(1, "xEN"), (2, "xENDy")]) == (2, "stop_string", "x")
    # the earliest occurrence wins, whichever stop string it is
    assert run_checker(params, [(1, "ab\n\ncdEND")]) == (1, "stop_string", "ab")


def test_max_new_tokens_and_rule_order():
    params = SamplingParams(max_new_tokens=3, stop=["!"])
    assert run_checker(params, [(1, "a"), (2, "ab"), (3, "abc"), (4, "abcd")]) == (3, "length", "abc")
    assert run_checker(SamplingParams(max_new_tokens=1), [(1, "a")]) == (1, "length", "a")
    # on the last allowed token a stop token / eos / stop string is reported instead of "length"
    assert run_checker(params, [(1, "a"), (2, "ab"), (EOS, "ab")]) == (3, "eos", "ab")
    assert run_checker(params, [(1, "a"), (2, "ab"), (3, "ab!")]) == (3, "stop_string", "ab")

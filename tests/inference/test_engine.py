"""The engine: continuous batching that does not change a request's tokens, memory that follows the
achieved compression and returns to the pool, admission by a byte budget, and every bad input."""

import pytest
import torch

from dmc_train.errors import InferenceError
from dmc_train.inference.engine import Engine
from dmc_train.inference.sampling import SamplingParams
from tests.inference.conftest import SHAPE

PROMPTS = [[int(t) for t in torch.randint(0, SHAPE.vocab_size, (n,), generator=torch.Generator().manual_seed(n))]
           for n in (5, 17, 1, 30, 9, 12)]


def greedy_by_full_forwards(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model.forward(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("variant", ["full", "dmc_exact"])
def test_greedy_generation_equals_repeated_full_forwards(make_model, variant):
    model = make_model(variant)
    outs = Engine(model, max_batch=4).generate(PROMPTS, SamplingParams(max_new_tokens=12))
    for prompt, out in zip(PROMPTS, outs):
        assert out.finish_reason == "length" and out.error is None
        assert out.tokens == greedy_by_full_forwards(model, prompt, 12)


@pytest.mark.parametrize("variant", ["full", "dmc_window"])
def test_a_request_gets_the_same_tokens_alone_and_joining_a_running_batch(make_model, variant):
    model = make_model(variant)
    params = [SamplingParams(max_new_tokens=15, temperature=0.9, top_k=20, seed=s) for s in range(len(PROMPTS))]
    alone = [Engine(model).generate([p], [sp])[0].tokens for p, sp in zip(PROMPTS, params)]
    engine = Engine(model, max_batch=3)
    for p, sp in zip(PROMPTS[:3], params[:3]):
        engine.add_request(p, sp)
    for _ in range(4):  # the first three run a few steps, then the others join mid-run
        engine.step()
    assert len(engine.running) == 3 and not engine.waiting
    for p, sp in zip(PROMPTS[3:], params[3:]):
        engine.add_request(p, sp)
    while engine.has_work():
        engine.step()
    assert [engine.finished[i].tokens for i in range(len(PROMPTS))] == alone
    assert engine.stats["max_running"] == 3


def test_dmc_memory_follows_the_achieved_compression_and_returns_to_the_pool(make_model):
    model = make_model("dmc_exact")
    engine = Engine(model, max_batch=2)
    engine.add_request(PROMPTS[3], SamplingParams(max_new_tokens=60))
    while not engine.running:
        engine.step()
    for _ in range(40):
        engine.step()
    req = engine.running[0]
    tokens = len(req.prompt) + len(req.tokens) - 1
    entries = engine.cache.entries(req.id)
    rate = tokens * entries.numel() / int(entries.sum())  # achieved compression
    assert 1.3 < rate < 3
    bytes_per_token = SHAPE.num_layers * SHAPE.num_kv_heads * engine.pool.page_bytes // engine.pool.page_size
    allocated = engine.pool.nbytes()["allocated"]
    expected = tokens / rate * bytes_per_token
    assert expected <= allocated < expected + entries.numel() * engine.pool.page_bytes  # within a page per row
    vanilla = Engine(make_model("full"), max_batch=2)
    vanilla.add_request(PROMPTS[3], SamplingParams(max_new_tokens=60))
    for _ in range(41):
        vanilla.step()
    v = vanilla.running[0]
    v_tokens = len(v.prompt) + len(v.tokens) - 1
    assert vanilla.pool.nbytes()["allocated"] == -(-v_tokens // 16) * 16 * bytes_per_token  # whole pages per row
    while engine.has_work():
        engine.step()
    out = engine.finished[req.id]
    assert out.compression["overall"] > 1.3 and len(out.compression["per_layer"]) == SHAPE.num_layers
    assert engine.pool.used_pages == 0 and len(engine.pool.free_pages) == engine.pool.num_pages
    assert engine.memory()["peak"] >= allocated


def test_a_byte_budget_admits_what_fits_and_runs_the_rest_later(make_model):
    model = make_model("full")
    probe = Engine(model)
    budget = 3 * SHAPE.num_layers * SHAPE.num_kv_heads * probe.pool.page_bytes  # one 16-token page per row x 3
    engine = Engine(model, kv_bytes=budget, max_batch=8)
    outs = engine.generate([PROMPTS[0]] * 6, SamplingParams(max_new_tokens=8))  # 5 + 8 tokens: one page per row
    assert engine.stats["max_running"] == 3
    assert all(o.error is None and o.tokens == outs[0].tokens for o in outs)
    assert Engine(model, kv_bytes=f"{budget}B").pool.num_pages == engine.pool.num_pages  # sizes as users write them


def test_running_out_of_pages_preempts_the_newest_and_every_request_finishes(make_model):
    model = make_model("full")
    rows = SHAPE.num_layers * SHAPE.num_kv_heads
    engine = Engine(model, kv_bytes=4 * rows * Engine(model).pool.page_bytes, max_batch=8)
    outs = engine.generate([PROMPTS[0], PROMPTS[0], PROMPTS[0]], SamplingParams(max_new_tokens=20))
    # all three start in one page per row; each needs a second one at token 17: the two oldest get them, the
    # newest gives its pages back and is recomputed when one ends (tests/inference/test_engine_preemption.py)
    alone = Engine(model).generate([PROMPTS[0]], SamplingParams(max_new_tokens=20))[0].tokens
    assert [o.error for o in outs] == [None] * 3 and [o.tokens for o in outs] == [alone] * 3
    assert [o.preemptions for o in outs] == [0, 0, 1] and engine.stats["preemptions"] == 1
    assert engine.pool.used_pages == 0


def test_a_prompt_that_cannot_fit_even_alone_fails_clearly(make_model):
    model = make_model("full")
    engine = Engine(model, kv_bytes=SHAPE.num_layers * SHAPE.num_kv_heads * Engine(model).pool.page_bytes)
    out = engine.generate([PROMPTS[3], PROMPTS[0]], SamplingParams(max_new_tokens=4))
    assert out[0].finish_reason == "error" and "does not fit in the KV budget even alone" in out[0].error
    assert out[1].error is None and len(out[1].tokens) == 4


def test_stop_tokens_and_streaming(make_model):
    model = make_model("dmc_exact")
    full = Engine(model).generate([PROMPTS[1]], SamplingParams(max_new_tokens=10))[0].tokens
    events = list(Engine(model).stream([PROMPTS[1]], SamplingParams(max_new_tokens=10, stop_token_ids=[full[4]])))
    assert [e.token for e in events] == full[: full.index(full[4]) + 1]
    assert events[-1].finished and events[-1].finish_reason == "stop_token"


class ByteTokenizer:
    """Ids as UTF-8 bytes of a few multi-byte characters, so that an output often ends inside one (U+FFFD)."""

    vocab_size = SHAPE.vocab_size
    eos_id = None
    BYTES = ["é".encode(), "€".encode(), b"a", b" "]

    def decode(self, ids):
        return b"".join(self.BYTES[i % 4][: 1 + i % 3] for i in ids).decode("utf-8", errors="replace")


def streamed_eagerly(tok, tokens, final_text):
    """The texts streaming sends, token by token: the output decoded after each token, held back while it ends
    inside a multi-byte character or does not extend what was sent (the engine's rule, written out)."""
    sent, texts = "", []
    for j in range(1, len(tokens) + 1):
        text = final_text if j == len(tokens) else tok.decode(tokens[:j])
        if (j < len(tokens) and text.endswith("\ufffd")) or not text.startswith(sent):
            texts.append("")
        else:
            texts.append(text[len(sent):])
            sent = text
    return texts


@pytest.mark.parametrize("read", ["at_once", "after_the_run", "some_then_all", "backwards"])
def test_streamed_text_does_not_depend_on_when_it_is_read(make_model, read):
    """Events' text is decoded when first read (requests without stop strings): read as produced, after the run,
    partly or last first, every request's events send the texts of an eager decode at every token, and its output
    text."""
    engine = Engine(make_model("full"), ByteTokenizer(), max_batch=3)
    params = [SamplingParams(max_new_tokens=20, temperature=1.0, seed=s, stop=["é€"] if s == 2 else ())
              for s in range(5)]
    events = []
    for event in engine.stream(PROMPTS[:5], params):
        if read == "at_once" or (read == "some_then_all" and event.token is not None and event.token % 3 == 0):
            event.text
        events.append(event)
    if read == "backwards":  # a request's last event first: every event before it is computed then
        for event in events[::-1]:
            event.text
    tok = ByteTokenizer()
    for i in range(5):
        out = engine.finished[i]
        mine = [e for e in events if e.request_id == i]
        assert [e.token for e in mine] == out.tokens and mine[-1].finished
        assert [e.text for e in mine] == streamed_eagerly(tok, out.tokens, out.text)
        if out.finish_reason != "stop_string":
            assert out.text == tok.decode(out.tokens)
    assert any("\ufffd" in tok.decode(engine.finished[i].tokens[:j]) for i in range(5) for j in range(1, 10))


def test_generation_stops_at_the_models_maximum_positions(make_model):
    out = Engine(make_model("full")).generate([[1] * (SHAPE.max_positions - 3)], SamplingParams(max_new_tokens=50))[0]
    assert out.finish_reason == "max_positions" and len(out.tokens) == 3


@pytest.mark.parametrize("kwargs, prompt, message", [
    ({}, [], "the prompt is empty"),
    ({}, [1] * (SHAPE.max_positions + 1), "more than the model's 128 positions"),
    ({}, [SHAPE.vocab_size], "token ids must be in"),
    ({}, "text", "this model has no tokenizer"),
    ({"cache": "lru"}, [1], "unknown cache 'lru'; expected auto or one of full, dmc"),
    ({"cache": "dmc"}, [1], "the 'dmc' cache needs a DMC model"),
    ({"page_size": 24}, [1], "page_size=24 must be a power of two >= 16"),
    ({"kv_bytes": 1000}, [1], "fewer than one page per KV head per layer"),
    ({"max_batch": 0}, [1], "max_batch=0 must be >= 1"),
])
def test_bad_input_is_one_clear_line(make_model, kwargs, prompt, message):
    with pytest.raises(InferenceError, match=message) as err:
        Engine(make_model("full"), **kwargs).generate([prompt])
    assert "\n" not in str(err.value)

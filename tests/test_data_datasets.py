"""Training datasets over indexed prefixes (megatron GPTDataset / BlendedDataset).

Also a torchrun script: ``torchrun --nproc_per_node=2 tests/test_data_datasets.py DATA_DIR OUT_DIR``
builds the datasets on every rank (gloo) and writes each rank's sample digest.
"""

import hashlib
import json
import os
import sys

import numpy as np
import pytest

from dmc_train.data.tokenizer import Tokenizer

EOS = 1
RANGES = {"a": (10, 100), "b": (200, 300)}  # the token ids of each synthetic corpus


class FixedVocab(Tokenizer):
    """A stand-in tokenizer for pre-tokenized synthetic data."""

    kind, path = "test", "fixed-vocab"

    def __init__(self, vocab_size=512, name="v1"):
        self._v, self._name = vocab_size, name

    vocab_size = property(lambda self: self._v)
    eos_id = property(lambda self: EOS)
    bos_id = property(lambda self: None)
    pad_id = property(lambda self: None)
    fingerprint = property(lambda self: self._name)


def write_prefix(prefix, docs):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in docs:
        builder.add_document(np.asarray(d), [len(d)])
    builder.finalize(prefix + ".idx")


def synthetic_corpus(name, n_docs, seed):
    rng = np.random.default_rng(seed)
    lo, hi = RANGES[name]
    return [list(rng.integers(lo, hi, size=rng.integers(20, 60))) + [EOS] for _ in range(n_docs)]


def make_data(root):
    os.makedirs(root, exist_ok=True)
    for i, name in enumerate(RANGES):
        write_prefix(os.path.join(root, name), synthetic_corpus(name, 40, seed=i))
    return {name: os.path.join(root, name) for name in RANGES}


def digest(ds, n=64):
    h = hashlib.sha256()
    for i in range(min(n, len(ds))):
        for k in ("tokens", "labels", "loss_mask", "position_ids"):
            h.update(ds[i][k].numpy().tobytes())
    return h.hexdigest()


def build(prefixes, tmp, **kw):
    from dmc_train.data.datasets import build_gpt_datasets

    args = dict(seq_length=16, seed=3, num_samples=(200, 20, 0), tokenizer=FixedVocab(), split="90,10,0",
                cache_dir=os.path.join(tmp, "cache"))
    args.update(kw)
    return build_gpt_datasets(prefixes, **args)


@pytest.fixture
def data(tmp_path):
    return make_data(str(tmp_path / "data"))


def is_window_of(window, docs):
    """``window`` is a run of the documents concatenated in some order: the end of one document, whole
    documents, then the start of another (or a contiguous piece of one document)."""
    parts, cur = [], []
    for t in window:
        cur.append(t)
        if t == EOS:
            parts.append(cur)
            cur = []
    if cur:
        parts.append(cur)

    def inside(piece, doc):
        return any(doc[i:i + len(piece)] == piece for i in range(len(doc) - len(piece) + 1))

    if len(parts) == 1:
        return any(inside(parts[0], d) for d in docs)
    return (any(d[len(d) - len(parts[0]):] == parts[0] for d in docs)
            and all(p in docs for p in parts[1:-1])
            and any(d[:len(parts[-1])] == parts[-1] for d in docs))


def test_samples_are_shifted_windows_of_the_documents(data, tmp_path):
    import torch

    train, valid, test = build([data["a"]], str(tmp_path))
    assert test is None and len(train) >= 200 and len(valid) >= 20
    docs = [[int(t) for t in d] for d in synthetic_corpus("a", 40, seed=0)]
    for i in range(0, len(train), 7):
        s = train[i]
        assert set(s) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert all(v.shape == (16,) for v in s.values())
        assert s["tokens"].dtype == s["labels"].dtype == s["position_ids"].dtype == torch.int64
        assert s["tokens"][1:].tolist() == s["labels"][:-1].tolist()
        assert s["position_ids"].tolist() == list(range(16)) and s["loss_mask"].tolist() == [1.0] * 16
        assert is_window_of(s["tokens"].tolist() + s["labels"][-1:].tolist(), docs)
    assert not is_window_of(list(range(10, 27)), docs)  # the check itself can fail
    again = build([data["a"]], str(tmp_path / "other"))[0]
    assert digest(train) == digest(again)
    assert digest(train) != digest(build([data["a"]], str(tmp_path), seed=4)[0])


def test_blend_respects_weights(data, tmp_path):
    for weights, expected_a in (([0.25, 0.75], 0.25), ([3, 1], 0.75)):
        train, _, _ = build([data["a"], data["b"]], str(tmp_path), weights=weights, num_samples=(2000, 20, 0))
        from_a = [bool(np.isin(train[i]["tokens"].numpy(), np.arange(*RANGES["a"])).any()) for i in range(len(train))]
        from_b = [bool(np.isin(train[i]["tokens"].numpy(), np.arange(*RANGES["b"])).any()) for i in range(len(train))]
        assert len(train) >= 2000 and not any(a and b for a, b in zip(from_a, from_b, strict=True))
        assert np.mean(from_a) == pytest.approx(expected_a, abs=0.02)


def test_per_split_prefixes(data, tmp_path):
    train, valid, test = build([data["a"]], str(tmp_path), valid_prefixes=[data["b"]], test_prefixes=[data["b"]],
                               num_samples=(100, None, 5))
    assert all(t < 100 or t == EOS for i in range(len(train)) for t in train[i]["tokens"].tolist())
    assert all(t >= 200 or t == EOS for i in range(len(valid)) for t in valid[i]["tokens"].tolist())
    total_b = sum(len(d) for d in synthetic_corpus("b", 40, seed=1))
    assert len(valid) == (total_b - 1) // 16  # None = exactly one epoch
    assert len(test) >= 5


def test_errors_name_the_problem(data, tmp_path):
    from dmc_train.data.datasets import check_vocab_fits
    from dmc_train.errors import DataError, MissingPrefixError

    with pytest.raises(MissingPrefixError) as e:
        build([data["a"], str(tmp_path / "nowhere" / "train")], str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and f"{tmp_path / 'nowhere' / 'train'}.bin" in msg
    assert f"python launch/prepare_data.py INPUTS... --output-prefix {tmp_path / 'nowhere' / 'train'}" in msg
    with pytest.raises(MissingPrefixError, match=r"create it with `python launch/prepare_data.py`$"):
        build([str(tmp_path / "shakespeare" / "train")], str(tmp_path))

    with pytest.raises(DataError, match="the tokenizer has 50000 tokens but the model's vocab_size is 32000"):
        check_vocab_fits(50000, 32000)
    check_vocab_fits(32000, 32000)
    with pytest.raises(DataError, match="512 tokens but the model's vocab_size is 256"):
        build([data["a"]], str(tmp_path), model_vocab_size=256)

    with pytest.raises(DataError, match="blend weights need a number of train samples"):
        build([data["a"], data["b"]], str(tmp_path), weights=[1, 1], num_samples=(None, 1, 0))
    with pytest.raises(DataError, match="2 weights for 1 prefixes"):
        build([data["a"]], str(tmp_path), weights=[1, 1])
    write_prefix(str(tmp_path / "tiny"), [[5, EOS]] * 3)
    with pytest.raises(DataError, match="tiny holds 6 tokens, fewer than one training sequence"):
        build([str(tmp_path / "tiny")], str(tmp_path), split="969,30,1", num_samples=(5, 0, 0))
    write_prefix(str(tmp_path / "small"), [[5] * 8 + [EOS]] * 3)  # 3 documents, more than one sequence
    with pytest.raises(DataError, match="valid part of split '969,30,1' of .*small has no documents"):
        build([str(tmp_path / "small")], str(tmp_path), split="969,30,1")
    # an empty split asked for 0 samples is not built (megatron would loop forever on it)
    train, valid, test = build([str(tmp_path / "small")], str(tmp_path), split="969,30,1", num_samples=(5, 0, 0))
    assert len(train) >= 5 and valid is None and test is None


def test_prefix_made_with_another_tokenizer_is_refused(tmp_path):
    from dmc_train.data.datasets import build_gpt_datasets
    from dmc_train.data.prepare import prepare_corpus
    from dmc_train.data.tokenizer import train_sentencepiece
    from dmc_train.errors import DataError
    from tests.test_data_tokenizer import tiny_docs

    (tmp_path / "x.txt").write_text("".join(tiny_docs(30)))
    prepare_corpus([str(tmp_path / "x.txt")], str(tmp_path / "out" / "c"), vocab_size=330, progress=False,
                   log=lambda _: None)
    other = train_sentencepiece(tiny_docs(30, seed=5), str(tmp_path / "other.model"), vocab_size=330)
    kw = dict(seq_length=16, seed=1, num_samples=(10, None, None), split="100,0,0")
    with pytest.raises(DataError, match="was tokenized with .*tokenizer.model, not with .*other.model"):
        build_gpt_datasets([str(tmp_path / "out" / "c")], tokenizer=other, **kw)
    train, _, _ = build_gpt_datasets([str(tmp_path / "out" / "c")], tokenizer=str(tmp_path / "out" / "tokenizer.model"),
                                     **kw)
    assert (tmp_path / "out" / "index_cache").is_dir() and len(train) >= 10
    default = build_gpt_datasets([str(tmp_path / "out" / "c")], **kw)[0]  # tokenizer named by c.json
    assert digest(default) == digest(train)
    write_prefix(str(tmp_path / "bare"), [[5, EOS]] * 3)
    with pytest.raises(DataError, match="no tokenizer given and .*bare.json .* is missing: set data.tokenizer"):
        build_gpt_datasets([str(tmp_path / "bare")], **kw)


def test_same_samples_with_gloo_initialised(data, tmp_path):
    import torch.distributed as dist

    plain = digest(build([data["a"], data["b"]], str(tmp_path / "c1"), weights=[1, 2])[0])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with_dist = digest(build([data["a"], data["b"]], str(tmp_path / "c2"), weights=[1, 2])[0])
    finally:
        dist.destroy_process_group()
    assert plain == with_dist


@pytest.mark.distributed
def test_two_ranks_see_the_same_samples(data, tmp_path):
    from tests.helpers import run

    run([os.path.relpath(__file__, os.path.dirname(os.path.dirname(__file__))), os.path.dirname(data["a"]),
         str(tmp_path / "out")], nproc=2, timeout=300)
    digests = [json.load(open(tmp_path / "out" / f"rank{r}.json")) for r in (0, 1)]
    expected = digest(build([data["a"], data["b"]], str(tmp_path / "local"), weights=[1, 2])[0])
    assert digests[0] == digests[1] == {"train": expected}


if __name__ == "__main__":  # torchrun worker for test_two_ranks_see_the_same_samples
    import torch.distributed as dist

    data_dir, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train, _, _ = build([os.path.join(data_dir, "a"), os.path.join(data_dir, "b")], out_dir, weights=[1, 2])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"train": digest(train)}, f)
    dist.barrier()
    dist.destroy_process_group()

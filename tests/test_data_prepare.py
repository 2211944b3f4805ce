"""Corpus preparation: exact token streams, determinism, bad input, atomic and idempotent outputs."""

import json
import os

import numpy as np
import pytest

from dmc_train.data import corpus
from dmc_train.data.indexed import read_metadata, read_tokens
from dmc_train.data.prepare import prepare_corpus
from dmc_train.data.tokenizer import load_tokenizer, train_sentencepiece
from dmc_train.data.unigram import unigram_perplexity
from dmc_train.errors import DataError
from tests.helpers import run
from tests.test_data_tokenizer import tiny_docs


def quiet(_msg):
    pass


def make_corpus(root, n_text=6, n_jsonl=5):
    """A directory with text files (one a subdirectory deep) and a JSONL file; returns the docs in
    the order the pipeline must keep (sorted walk: a/..., b.jsonl, t*.txt)."""
    docs = tiny_docs(n_text + n_jsonl, seed=3)
    docs[1] = "Non-ASCII too: café, 日本語, 🙂\n"
    os.makedirs(root / "a")
    (root / "a" / "first.txt").write_text(docs[0])
    with open(root / "b.jsonl", "w") as f:
        for d in docs[n_text:]:
            f.write(json.dumps({"id": 1, "text": d}) + "\n")
    for i in range(1, n_text):
        (root / f"t{i}.txt").write_text(docs[i])
    return [docs[0], *docs[n_text:], *docs[1:n_text]]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok") / "tok.model")
    train_sentencepiece(tiny_docs(), path, vocab_size=400)
    return path


def test_token_stream_is_exact(tmp_path, tok_path):
    expected_docs = make_corpus(tmp_path / "in")
    meta = prepare_corpus([str(tmp_path / "in")], str(tmp_path / "out" / "c"), tokenizer=tok_path,
                          workers=1, progress=False, log=quiet)
    tok = load_tokenizer(tok_path)
    expected = [tok.encode(d) + [tok.eos_id] for d in expected_docs]

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(tmp_path / "out" / "c"))
    assert len(ds) == len(expected) == meta["documents"]
    for i, exp in enumerate(expected):
        assert ds[i].tolist() == exp
    assert read_tokens(str(tmp_path / "out" / "c")).tolist() == sum(expected, [])
    assert meta["tokens"] == sum(map(len, expected))
    assert ds[1].dtype == np.uint16 and meta["eos_id"] == 2
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == open(tok_path, "rb").read()


def test_same_input_same_bytes_for_any_worker_count(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "TEXT_BATCH_FILES", 1)  # one batch per file, so workers interleave
    monkeypatch.setattr(corpus, "JSONL_BATCH_LINES", 2)
    make_corpus(tmp_path / "in", n_text=8, n_jsonl=9)
    for i in range(10):  # alternating large and small files: with 2 workers, batches finish out of order
        (tmp_path / "in" / f"u{i}.txt").write_text("".join(tiny_docs(300 if i % 2 == 0 else 1, seed=i)))
    outs = {}
    for name, workers in (("w1", 1), ("w1again", 1), ("w2", 2)):
        prepare_corpus([str(tmp_path / "in")], str(tmp_path / name / "c"), vocab_size=330, seed=5,
                       workers=workers, progress=False, log=quiet)
        outs[name] = [(tmp_path / name / f).read_bytes() for f in ("c.bin", "c.idx", "tokenizer.model")]
    assert outs["w1"] == outs["w1again"] == outs["w2"]
    assert len(outs["w1"][0]) > 100_000


def test_bad_input_is_skipped_and_counted(tmp_path, tok_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "empty.txt").write_bytes(b"")
    (d / "blank.txt").write_text("  \n\n ")
    (d / "latin1.txt").write_bytes("caf\xe9 ok".encode("latin-1"))  # \xe9 alone is not UTF-8
    (d / "good.txt").write_text("king and queen\n")
    (d / "docs.jsonl").write_text('{"text": "one"}\n'
                                  '{"text": ""}\n'
                                  '{"title": "no text field"}\n'
                                  '\n'
                                  '{"text": "four"\n'
                                  '{"text": 5}\n'
                                  '{"text": "seven"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:3: no 'text' field") as e:
        prepare_corpus([str(d)], str(tmp_path / "out" / "c"), tokenizer=tok_path, progress=False, log=quiet)
    assert "--on-bad-line skip" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out" / "c.bin").exists()

    meta = prepare_corpus([str(d)], str(tmp_path / "out" / "c"), tokenizer=tok_path, on_bad_line="skip",
                          progress=False, log=quiet)
    r = meta["read"]
    assert (r["files"], r["documents"], r["empty_files"], r["empty_documents"], r["bad_lines"]) == (5, 4, 2, 1, 3)
    assert r["replaced_bytes"] == 1 and r["documents_with_replacements"] == 1
    assert [x.split("/")[-1] for x in r["bad_line_examples"]] == [
        "docs.jsonl:3: no 'text' field", "docs.jsonl:5: invalid JSON (Expecting ',' delimiter)",
        "docs.jsonl:6: field 'text' is int, not a string"]
    tok = load_tokenizer(tok_path)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(tmp_path / "out" / "c"))  # keep it alive: its items are views of its mmap
    texts = [tok.decode(ds[i][:-1].tolist()) for i in range(len(ds))]
    assert texts == ["one", "seven", "king and queen\n", "caf\ufffd ok"]


def test_missing_input_fails_at_once(tmp_path):
    with pytest.raises(DataError, match="input not found: .*nope.txt"):
        prepare_corpus([str(tmp_path / "nope.txt")], str(tmp_path / "c"), progress=False, log=quiet)
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="no input files ending in"):
        prepare_corpus([str(tmp_path / "d")], str(tmp_path / "c"), progress=False, log=quiet)


def test_cli_errors_are_one_line(tmp_path):
    p = run(["launch/prepare_data.py", str(tmp_path / "nope.txt"), "--output-prefix", str(tmp_path / "c")],
            check=False)
    assert p.returncode == 2 and p.stderr.strip() == f"error: input not found: {tmp_path / 'nope.txt'}"
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\nnot json\n')
    p = run(["launch/prepare_data.py", str(tmp_path / "x.jsonl"), "--output-prefix", str(tmp_path / "c"),
             "--vocab-size", "300"], check=False)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert f"{tmp_path / 'x.jsonl'}:2: invalid JSON" in p.stderr


def test_failed_rewrite_keeps_old_outputs(tmp_path, tok_path):
    (tmp_path / "x.jsonl").write_text('{"text": "a b c"}\n')
    prefix = str(tmp_path / "out" / "c")
    prepare_corpus([str(tmp_path / "x.jsonl")], prefix, tokenizer=tok_path, progress=False, log=quiet)
    before = {f: (tmp_path / "out" / f).read_bytes() for f in ("c.bin", "c.idx", "c.json")}
    (tmp_path / "x.jsonl").write_text('{"text": "a b c d e"}\n{"text": "f"}\n{broken\n')
    with pytest.raises(DataError, match=":3: invalid JSON"):
        prepare_corpus([str(tmp_path / "x.jsonl")], prefix, tokenizer=tok_path, progress=False, log=quiet)
    assert {f: (tmp_path / "out" / f).read_bytes() for f in before} == before
    assert sorted(os.listdir(tmp_path / "out")) == ["c.bin", "c.idx", "c.json", "tokenizer.model"]


def test_rerun_is_skipped_unless_inputs_change_or_force(tmp_path, tok_path):
    (tmp_path / "x.txt").write_text("king and queen\n")
    prefix = str(tmp_path / "out" / "c")
    logs = []
    prepare_corpus([str(tmp_path / "x.txt")], prefix, tokenizer=tok_path, progress=False, log=logs.append)
    stamp = os.stat(prefix + ".bin").st_mtime_ns
    prepare_corpus([str(tmp_path / "x.txt")], prefix, tokenizer=tok_path, progress=False, log=logs.append)
    assert logs[-1].endswith("up to date") and os.stat(prefix + ".bin").st_mtime_ns == stamp
    prepare_corpus([str(tmp_path / "x.txt")], prefix, tokenizer=tok_path, force=True, progress=False, log=logs.append)
    assert not logs[-1].endswith("up to date")
    (tmp_path / "x.txt").write_text("a longer king and queen\n")
    meta = prepare_corpus([str(tmp_path / "x.txt")], prefix, tokenizer=tok_path, progress=False, log=logs.append)
    assert load_tokenizer(tok_path).decode(read_tokens(prefix)[:-1].tolist()) == "a longer king and queen\n"
    assert read_metadata(prefix) == meta


def test_trained_tokenizer_is_not_silently_replaced(tmp_path):
    (tmp_path / "a.txt").write_text("".join(tiny_docs(10)))
    (tmp_path / "b.txt").write_text("".join(tiny_docs(10, seed=9)))
    prepare_corpus([str(tmp_path / "a.txt")], str(tmp_path / "out" / "a"), vocab_size=330, progress=False, log=quiet)
    with pytest.raises(DataError, match="--tokenizer .*tokenizer.model"):
        prepare_corpus([str(tmp_path / "b.txt")], str(tmp_path / "out" / "b"), vocab_size=330, progress=False,
                       log=quiet)


def test_unigram_perplexity_by_hand():
    # p(0) = (2+1)/(3+3) = 1/2, p(2) = (0+1)/6: perplexity = exp(-(ln 1/2 + ln 1/6) / 2) = sqrt(12)
    assert unigram_perplexity(np.array([0, 0, 1]), np.array([0, 2]), 3) == pytest.approx(12 ** 0.5)
    assert unigram_perplexity(np.array([1] * 5), np.array([1, 1]), 2) == pytest.approx(7 / 6)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        unigram_perplexity(np.array([0, 5]), np.array([0]), 3)

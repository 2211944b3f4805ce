"""Tokenizer: training, byte-fallback round trips, loading errors."""

import random
import sys

import pytest

from dmc_train.data.tokenizer import load_tokenizer, train_sentencepiece
from dmc_train.errors import DataError

WORDS = ("king queen castle night sword crown love death ghost father mother brother sister lord lady "
         "speak hear answer stand honour heaven earth fortune").split()


def tiny_docs(n_docs: int = 20, seed: int = 0) -> list[str]:
    """Deterministic English-like documents (ASCII only: other scripts are unseen at training)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize() + rng.choice(".,;!?")
                 for _ in range(rng.randint(5, 15))]
        docs.append("\n".join(lines) + "\n")
    return docs


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_sentencepiece(tiny_docs(), str(tmp_path_factory.mktemp("tok") / "tok.model"), vocab_size=400)


@pytest.mark.parametrize("text", [
    "To be, or not to be",
    "café, naïve, Straße, über — «quotes»",
    "日本語のテキスト",
    "emoji 🙂🎭 and \U0001F600",
    "  leading spaces,\ttabs\n\n\nand blank lines  \n",
    "",
])
def test_round_trip_exact(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_unseen_characters_use_byte_pieces(tok):
    ids = tok.encode("日")
    pieces = [tok._sp.id_to_piece(i) for i in ids]
    assert [p for p in pieces if p.startswith("<0x")] == ["<0xE6>", "<0x97>", "<0xA5>"]  # UTF-8 of 日
    assert tok._sp.unk_id() not in ids


def test_special_ids_and_vocab(tok):
    assert (tok.vocab_size, tok.eos_id, tok.bos_id, tok.pad_id) == (400, 2, 1, 3)
    assert tok.eos_id not in tok.encode("king queen </s> <s>")  # control tokens are never produced from text
    assert len(tok.encode("king queen castle")) < len("king queen castle") / 2  # merges were learned


def test_training_is_deterministic(tmp_path):
    a = train_sentencepiece(tiny_docs(), str(tmp_path / "a.model"), vocab_size=350, seed=7)
    b = train_sentencepiece(tiny_docs(), str(tmp_path / "b.model"), vocab_size=350, seed=7)
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert a.fingerprint == b.fingerprint
    c = train_sentencepiece(tiny_docs(seed=1), str(tmp_path / "c.model"), vocab_size=350, seed=7)
    assert c.fingerprint != a.fingerprint


def test_vocab_too_large_for_corpus_is_one_line_error(tmp_path):
    with pytest.raises(DataError, match="cannot train a 50000-token") as e:
        train_sentencepiece(tiny_docs(2), str(tmp_path / "t.model"), vocab_size=50000)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "t.model").exists()


def test_load_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="tokenizer not found"):
        load_tokenizer(str(tmp_path / "nope.model"))
    (tmp_path / "garbage.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="cannot load sentencepiece model"):
        load_tokenizer(str(tmp_path / "garbage.model"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(DataError, match="pip install transformers") as e:
        load_tokenizer(str(tmp_path))
    assert "\n" not in str(e.value)

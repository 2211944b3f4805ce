"""Tokenizers: a sentencepiece ``.model`` file or a Hugging Face tokenizer directory, one interface.

    tok = load_tokenizer("data_cache/shakespeare/tokenizer.model")   # or an HF dir (needs transformers)
    ids = tok.encode("To be, or not to be")                          # list[int], no BOS/EOS added
    tok.decode(ids) == "To be, or not to be"

``train_sentencepiece`` trains the project's default tokenizer: BPE with byte fallback (any UTF-8
text round-trips exactly, unknown characters become byte pieces), no text normalisation, ids
``<unk>``=0, ``<s>``=1, ``</s>``=2 (as in Llama) and ``<pad>``=3. Training is deterministic: fixed
seed, fixed thread count (sentencepiece's result depends on it), and a bounded sample (the first
``max_chars`` characters of the corpus, in document order).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
from collections.abc import Iterable, Iterator

from dmc_train.errors import DataError

# Files that define a Hugging Face tokenizer (hashed for the fingerprint; weights are not).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                      "vocab.json", "merges.txt", "added_tokens.json")
TRAIN_CHUNK_CHARS = 2000  # sentencepiece "sentences" fed to the trainer: groups of lines of about this size
MAX_PIECE_CHARS = 4000  # longer lines are cut (sentencepiece skips sentences over max_sentence_length bytes)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Tokenizer:
    """Common interface. ``bos_id``/``pad_id`` are ``None`` when the tokenizer has no such token."""

    kind: str = ""
    path: str = ""

    @property
    def vocab_size(self) -> int:  # number of ids (embedding rows needed), added tokens included
        raise NotImplementedError

    @property
    def eos_id(self) -> int:
        raise NotImplementedError

    @property
    def bos_id(self) -> int | None:
        raise NotImplementedError

    @property
    def pad_id(self) -> int | None:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """sha256 of the tokenizer's defining files: equal fingerprints encode identically."""
        raise NotImplementedError

    def save(self, dest: str) -> str:
        """Copy the tokenizer to ``dest`` (a ``.model`` path or a directory); returns the saved path."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: str):
        import sentencepiece as spm

        self.path = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"cannot load sentencepiece model {path}: {str(e).splitlines()[0]}") from None
        if self._sp.eos_id() < 0:
            raise DataError(f"sentencepiece model {path} has no EOS token (documents end with one)")
        self._fingerprint = file_sha256(path)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def bos_id(self) -> int | None:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def pad_id(self) -> int | None:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def save(self, dest: str) -> str:
        if not os.path.exists(dest) or not os.path.samefile(self.path, dest):
            _atomic_copy(self.path, dest)
        return dest


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer directory, loaded with ``transformers.AutoTokenizer`` (offline)."""

    kind = "huggingface"

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(f"{path} is a Hugging Face tokenizer directory; loading it needs transformers: "
                            f"pip install transformers (or pass its tokenizer.model file, if it has one)") from None
        self.path = path
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises OSError/ValueError/... for unusable directories
            raise DataError(f"cannot load a Hugging Face tokenizer from {path}: {str(e).splitlines()[0]}") from None
        if self._tok.eos_token_id is None:
            raise DataError(f"tokenizer {path} has no EOS token (documents end with one)")
        h = hashlib.sha256()
        for name in HF_TOKENIZER_FILES:
            p = os.path.join(path, name)
            if os.path.isfile(p):
                h.update(name.encode() + b"\0" + file_sha256(p).encode())
        self._fingerprint = h.hexdigest()

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_id(self) -> int:
        return self._tok.eos_token_id

    @property
    def bos_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def pad_id(self) -> int | None:
        return self._tok.pad_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def save(self, dest: str) -> str:
        """Copy the defining files as they are (the copy has the same fingerprint, so data tokenized with it is
        recognised as tokenized with the original)."""
        if os.path.isdir(dest) and os.path.samefile(self.path, dest):
            return dest
        os.makedirs(dest, exist_ok=True)
        for name in HF_TOKENIZER_FILES:
            if os.path.isfile(os.path.join(self.path, name)):
                shutil.copyfile(os.path.join(self.path, name), os.path.join(dest, name))
        return dest


def load_tokenizer(path: str) -> Tokenizer:
    """A sentencepiece model file, or a Hugging Face tokenizer directory."""
    if os.path.isdir(path):
        return HFTokenizer(path)
    if os.path.isfile(path):
        return SentencePieceTokenizer(path)
    raise DataError(f"tokenizer not found: {path} (expected a sentencepiece .model file or a Hugging Face "
                    f"tokenizer directory)")


def training_sentences(documents: Iterable[str], max_chars: int) -> Iterator[str]:
    """Cut documents into the "sentences" sentencepiece trains on: groups of whole lines of about
    ``TRAIN_CHUNK_CHARS`` characters, newlines included (so pieces can contain and follow newlines as
    they do in encoded documents); stops after ``max_chars`` characters in total."""
    total = 0
    for doc in documents:
        buf = ""
        for line in doc.splitlines(keepends=True):
            while len(line) > MAX_PIECE_CHARS:
                if buf:
                    yield buf
                    buf = ""
                yield line[:MAX_PIECE_CHARS]
                total += MAX_PIECE_CHARS
                line = line[MAX_PIECE_CHARS:]
            buf += line
            if len(buf) >= TRAIN_CHUNK_CHARS:
                yield buf
                total += len(buf)
                buf = ""
            if total >= max_chars:
                return
        if buf.strip():
            yield buf
            total += len(buf)
        if total >= max_chars:
            return


def train_sentencepiece(documents: Iterable[str], model_path: str, vocab_size: int, *, seed: int = 1234,
                        max_chars: int = 200_000_000, num_threads: int = 1) -> SentencePieceTokenizer:
    """Train a byte-fallback BPE model on ``documents`` and write it (atomically) to ``model_path``."""
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=training_sentences(documents, max_chars), model_writer=model,
            model_type="bpe", vocab_size=vocab_size, byte_fallback=True, character_coverage=0.9995,
            normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
            allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            input_sentence_size=0, shuffle_input_sentence=False,
            max_sentence_length=4 * (TRAIN_CHUNK_CHARS + MAX_PIECE_CHARS), num_threads=num_threads, minloglevel=2)
    except RuntimeError as e:
        reason = re.sub(r"^.*?\] ", "", str(e).splitlines()[0])  # drop sentencepiece's source location
        raise DataError(f"cannot train a {vocab_size}-token sentencepiece vocabulary on this corpus: {reason} "
                        f"(change --vocab-size or add text)") from None
    os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
    tmp = f"{model_path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp, model_path)
    return SentencePieceTokenizer(model_path)


def _atomic_copy(src: str, dest: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    tmp = f"{dest}.tmp-{os.getpid()}"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dest)

"""Tokenizer files of a Hugging Face export, from the checkpoint's ``data.tokenizer``.

A sentencepiece ``.model`` is written three ways: ``tokenizer.model`` (the original file),
``tokenizer.json`` (a ``tokenizers`` pipeline that encodes exactly like sentencepiece) and a
``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``, so ``AutoTokenizer.from_pretrained``
loads that exact pipeline. Why not ``LlamaTokenizer``: transformers 5's class rebuilds its own
pipeline (a Metaspace pre-tokenizer that skips sentencepiece's dummy prefix before a leading space),
which encodes text starting with a space differently from training. ``LlamaTokenizer.from_pretrained``
still loads the directory (from ``tokenizer.model``). No BOS/EOS is added on encode, as the training
data is tokenized. Before anything is published the encodings of :data:`PROBES` are compared.

A Hugging Face tokenizer directory: its tokenizer files (:func:`hf_tokenizer_files`: vocabulary, merges,
configs, special and added tokens, the chat template) are copied file by file, as the import copies them from
a model directory; no tokenizer -> none written (the manifest says so).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from dmc_train.data.tokenizer import HF_TOKENIZER_FILES
from dmc_train.errors import CheckpointError

# Texts whose ids must agree between sentencepiece and the exported tokenizer (spaces, newlines,
# digits, characters outside the vocabulary that go through byte fallback).
PROBES = ("To be, or not to be", " leading space", "  two  spaces ", "line\n\n  indented\tTab", "x",
          "digits 1234567 and 3.14", "naïve café, 日本語 🙂", "")
# Besides the files that define the encoding (HF_TOKENIZER_FILES), a tokenizer carries its chat templates: the
# default one and the additional_chat_templates/ directory (named templates), as transformers saves them.
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
CHAT_TEMPLATES_DIR = "additional_chat_templates"


def hf_tokenizer_files(directory: str) -> list[str]:
    """The tokenizer files of the Hugging Face directory ``directory`` (paths relative to it, sorted): what
    an import and an export copy, so an instruct model keeps its chat template."""
    names = sorted(n for n in HF_TOKENIZER_FILES + CHAT_TEMPLATE_FILES if os.path.isfile(os.path.join(directory, n)))
    templates = os.path.join(directory, CHAT_TEMPLATES_DIR)
    if os.path.isdir(templates):
        names += [os.path.join(CHAT_TEMPLATES_DIR, n) for n in sorted(os.listdir(templates))
                  if os.path.isfile(os.path.join(templates, n))]
    return names


def copy_hf_tokenizer_files(source: str, dest: str) -> list[str]:
    """Copy :func:`hf_tokenizer_files` of ``source`` into the existing directory ``dest``; returns them."""
    names = hf_tokenizer_files(source)
    for name in names:
        os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
        shutil.copyfile(os.path.join(source, name), os.path.join(dest, name))
    return names


def write_tokenizer(tokenizer: Optional[str], directory: str, model_max_length: int) -> dict:
    """Write the tokenizer files transformers loads into ``directory``; returns facts for the manifest
    and generation config (``kind``, ``files``, ``bos_token_id``, ``eos_token_id``, ``pad_token_id``)."""
    if not tokenizer:
        return {"kind": "none", "note": "the checkpoint names no data.tokenizer; no tokenizer files were written"}
    if os.path.isdir(tokenizer):
        return _copy_hf_tokenizer(tokenizer, directory)
    if not os.path.isfile(tokenizer):
        raise CheckpointError(f"the checkpoint's data.tokenizer {tokenizer} does not exist; restore it at that path "
                              f"to export with its tokenizer")
    return _write_sentencepiece(tokenizer, directory, model_max_length)


def _copy_hf_tokenizer(source: str, directory: str) -> dict:
    from transformers import AutoTokenizer

    copied = copy_hf_tokenizer_files(source, directory)
    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return {"kind": "huggingface", "source": os.path.abspath(source), "files": copied,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def _write_sentencepiece(path: str, directory: str, model_max_length: int) -> dict:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=path)
    shutil.copyfile(path, os.path.join(directory, "tokenizer.model"))
    _pipeline(path, sp).save(os.path.join(directory, "tokenizer.json"))
    ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id(),
           "unk_token_id": sp.unk_id()}
    tokens = {k[:-3]: sp.id_to_piece(v) for k, v in ids.items() if v >= 0}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **tokens, "add_bos_token": False,
                   "add_eos_token": False, "clean_up_tokenization_spaces": False,
                   "model_max_length": model_max_length}, f, indent=2)
    _check_probes(sp, directory, path)
    return {"kind": "sentencepiece", "source": os.path.abspath(path),
            "files": ["tokenizer.model", "tokenizer.json", "tokenizer_config.json"],
            **{k: (v if v >= 0 else None) for k, v in ids.items()}}


def _pipeline(path: str, sp):
    """A ``tokenizers.Tokenizer`` equal to the sentencepiece BPE model at ``path``: its vocabulary and
    merges (read with transformers' extractor), sentencepiece's normalisation (optional charsmap,
    the dummy prefix, spaces -> ``▁``), byte fallback, control pieces as special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    extractor = SentencePieceExtractor(path)
    proto = extractor.proto
    if proto.trainer_spec.model_type != 2:  # 1 unigram, 2 BPE
        raise CheckpointError(f"tokenizer {path} is not a BPE sentencepiece model; export supports BPE models "
                              f"(as Llama's and this project's)")
    if proto.normalizer_spec.remove_extra_whitespaces:
        raise CheckpointError(f"tokenizer {path} collapses whitespace (remove_extra_whitespaces), which the "
                              f"exported tokenizer cannot reproduce exactly")
    parts = extractor.extract(BPE)
    unk = sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None
    tok = Tokenizer(BPE(vocab=parts["vocab"], merges=parts["merges"], unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = []
    if parts.get("_spm_precompiled_charsmap"):
        steps.append(normalizers.Precompiled(parts["_spm_precompiled_charsmap"]))
    if proto.normalizer_spec.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    tok.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if proto.normalizer_spec.add_dummy_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    control = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in control])
    return tok


def _check_probes(sp, directory: str, path: str) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    for text in PROBES:
        want, got = sp.encode(text, out_type=int), hf.encode(text, add_special_tokens=False)
        if want != got:
            raise CheckpointError(f"the exported tokenizer encodes {text!r} as {got[:12]} but {path} as "
                                  f"{want[:12]}; nothing was written - report this as a bug")

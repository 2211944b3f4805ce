"""Tiny random Llama GGUF files written with the ``gguf`` package's writer, as llama.cpp lays them out.

    write_llama_gguf(path, "Q4_1", tied=True)     # weights quantised Q4_1 (norms F32), no output.weight
    write_llama_gguf(path, "Q8_0", tied=False)    # weights quantised Q8_0, its own output.weight

Shapes: every weight's rows are multiples of 32 (the Q4_1 / Q8_0 block). The tokenizer is a byte-level BPE
(``tokenizer.ggml.model = gpt2``: the 256 byte symbols, merges of letter pairs, three control tokens) with a
chat template. ``architecture`` and ``raw_type`` make the bad inputs: a GGUF of another architecture, a
tensor stored in a type gguf cannot dequantise (random bytes of its block size).
"""

from __future__ import annotations

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 64, 128, 2, 4, 2, 128
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """``(tokens, merges, token_types)``: 256 byte symbols, 61 merged letter pairs, 3 control tokens (320)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    merges = []
    for i in range(61):
        a, b = letters[i % 13], letters[(i // 13 + i) % 26]
        if f"{a} {b}" not in merges and a + b not in tokens:
            merges.append(f"{a} {b}")
            tokens.append(a + b)
    while len(tokens) < 320 - len(SPECIAL):  # pad with merges of a space symbol and a letter
        a, b = "Ġ", letters[len(tokens) % 26]
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [1] * len(tokens) + [3] * len(SPECIAL)  # NORMAL, then CONTROL
    return tokens + list(SPECIAL), merges, types


def write_llama_gguf(path: str, quant: str = "Q8_0", tied: bool = True, seed: int = 0, architecture: str = "llama",
                     raw_type: str | None = None) -> None:
    """Write a random tiny Llama GGUF to ``path`` (module docstring)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, merges, types = byte_level_vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(path, architecture)
    w.add_name("tiny-llama")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    qtype = gguf.GGMLQuantizationType[quant]

    def weight(name: str, rows: int, cols: int) -> None:  # [rows, cols] as numpy, weights of logits of order 1
        data = (rng.standard_normal((rows, cols)) * 0.15).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.2 * rng.standard_normal(HIDDEN)).astype(np.float32))

    head_dim = HIDDEN // HEADS
    weight("token_embd.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        weight(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        weight(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        weight(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        weight(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        norm(f"blk.{i}.ffn_norm.weight")
        weight(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        weight(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        weight(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    if not tied:
        weight("output.weight", vocab, HIDDEN)
    if raw_type is not None:  # one more tensor, random bytes in a type of its own
        rtype = gguf.GGMLQuantizationType[raw_type]
        block, nbytes = gguf.GGML_QUANT_SIZES[rtype]
        w.add_tensor("blk.0.extra.weight", rng.integers(0, 256, (HIDDEN, HIDDEN // block * nbytes), dtype=np.uint8),
                     raw_dtype=rtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

"""Real incremental decoding of known sequences through an engine cache: prefill each prompt, then feed
the rest of every sequence token by token (teacher-forced), as generation would, and keep the logits."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def teacher_forced_decode(model, cache, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int],
                          on_step: Optional[Callable[[int, int], None]] = None) -> list[torch.Tensor]:
    """Prefill each prompt, then feed the rest of every sequence in batched decode steps (ragged: a
    sequence leaves the batch when it is done). ``sequences[i]``: token ids ``[n_i]`` (sequence ids in the
    cache are 0..len-1; they stay in it). Returns each sequence's logits ``[n_i, V]``. ``on_step(i, t)``
    runs after sequence i's token at position t went through the cache."""
    logits = []
    for i, (seq, p) in enumerate(zip(sequences, prompt_lens)):
        cache.add(i, len(seq) - p)
        logits.append([model.prefill(cache, i, seq[:p])])
    pos = list(prompt_lens)
    while True:
        active = [i for i, seq in enumerate(sequences) if pos[i] < len(seq)]
        if not active:
            return [torch.cat(parts) for parts in logits]
        out = model.decode(cache, active, torch.stack([sequences[i][pos[i]] for i in active]),
                           torch.tensor([pos[i] for i in active], device=model.device))
        for row, i in enumerate(active):
            logits[i].append(out[row: row + 1])
            if on_step is not None:
                on_step(i, pos[i])
            pos[i] += 1

"""Random-token dataset: a stand-in corpus for tests and benchmarks (no files needed).

Sample ``i`` depends only on ``(seed, i)``, so every rank and every resumed run sees the same tokens.
"""

import torch


class SyntheticDataset(torch.utils.data.Dataset):
    """Samples are dicts of ``tokens``, ``labels``, ``loss_mask``, ``position_ids``, each ``[seq_length]``."""

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int):
        self.vocab_size, self.seq_length, self.num_samples, self.seed = vocab_size, seq_length, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        seq = torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g)
        return {
            "tokens": seq[:-1],
            "labels": seq[1:],
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float),
            "position_ids": torch.arange(self.seq_length),
        }

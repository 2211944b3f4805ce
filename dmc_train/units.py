"""Byte sizes as users write them (``"64MB"``, ``"5GB"``, ``"1GiB"``, a byte count): one parser for every
option that takes one (the engine's ``kv_bytes`` / ``--kv-bytes``, the HF exporter's ``--max-shard-size``).

Torch-free and below everything but ``errors`` (``tests/test_layering.py``), so any layer may use it.
"""

from __future__ import annotations

import numbers
import re

from dmc_train.errors import ConfigError

# Decimal units are powers of ten (as Hugging Face's max_shard_size), binary ones powers of two.
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30}


def parse_size(size: int | str, option: str = "size") -> int:
    """``"500MB"``, ``"2GB"``, ``"1GiB"``, ``"1.5MB"`` or a byte count -> bytes; a one-line ConfigError
    naming ``option`` when it is unreadable or not positive."""
    if isinstance(size, numbers.Integral) and not isinstance(size, bool):
        value = int(size)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
        if m is None:
            raise ConfigError(f"{option} {size!r} is not a size; use e.g. 500MB, 5GB, 1GiB or a byte count")
        value = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if value <= 0:
        raise ConfigError(f"{option} {size!r} must be positive")
    return value

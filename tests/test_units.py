"""Byte sizes as users write them: one parser for the engine's kv_bytes and the exporter's shard size."""

import pytest

from dmc_train.errors import ConfigError
from dmc_train.units import parse_size


@pytest.mark.parametrize("size, expected", [
    (4096, 4096), ("4096", 4096), ("500MB", 500 * 10 ** 6), ("5gb", 5 * 10 ** 9), ("1GiB", 2 ** 30),
    ("64 KiB", 64 * 2 ** 10), ("1.5MB", 1_500_000), ("12B", 12),
])
def test_sizes(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size, message", [
    ("12XB", "kv_bytes '12XB' is not a size; use e.g. 500MB, 5GB, 1GiB or a byte count"),
    ("lots", "kv_bytes 'lots' is not a size"),
    (0, "kv_bytes 0 must be positive"),
    ("-3MB", "kv_bytes '-3MB' is not a size"),
    (True, "kv_bytes True is not a size"),
])
def test_bad_sizes_are_one_line_naming_the_option(size, message):
    with pytest.raises(ConfigError) as err:
        parse_size(size, "kv_bytes")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)

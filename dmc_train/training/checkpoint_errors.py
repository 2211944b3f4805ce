"""What a failed checkpoint read or write raised, in one line.

megatron's ``dist_checkpointing`` and pickle raise many exception types for a truncated or corrupt
checkpoint, and ``torch.distributed.checkpoint`` wraps each rank's exception in a CheckpointException
(whose text holds tracebacks). The readers and writers catch ``READ_ERRORS`` and report ``error_cause``.
"""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

# What a truncated or corrupt checkpoint raises: many Exception types from megatron/pickle, and
# torch.distributed.checkpoint's CheckpointException, which derives from BaseException.
READ_ERRORS = (Exception, CheckpointException)


def causes(error: BaseException) -> list[BaseException]:
    """``error``, its cause chain and the per-rank exceptions a CheckpointException wraps."""
    found, todo = [], [error]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is f for f in found):
            continue
        found.append(e)
        todo += [e.__cause__ or e.__context__]
        if isinstance(e, CheckpointException):
            todo += [wrapped for wrapped, _ in e.failures.values()]
    return found


def error_cause(error: BaseException) -> str:
    """The root exception of ``error`` in one short line (a CheckpointException's text holds tracebacks)."""
    inner = [e for e in causes(error) if not isinstance(e, CheckpointException)] or [error]
    text = " ".join(str(inner[-1]).split()) if not isinstance(inner[-1], CheckpointException) else ""
    return f"{type(inner[-1]).__name__}: {text[:200]}" if text else type(inner[-1]).__name__

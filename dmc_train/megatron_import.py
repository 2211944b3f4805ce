"""Two adjustments to megatron-core 0.16.1, applied the moment its modules are imported.

Installed by ``dmc_train/__init__.py``, so they are in place before any project module imports megatron;
a process that never imports megatron pays nothing (the hook only watches module names). Both only
remove work this project never uses (docs/DESIGN.md#the-cpu-compatibility-layer):

- ``megatron.core.jit``: megatron wraps about 40 fused helpers in ``torch.compile`` at import time, which
  imports dynamo and inductor (2-4 s per process). Every fusion is off in our models
  (``models/llama.py``: ``bias_activation_fusion=False`` and the rest), so none of those helpers runs;
  megatron's own ``disable_jit_fuser`` leaves them as plain functions.
- ``filesystem_async``: megatron's checkpoint writer collects write results through a queue owned by a
  ``multiprocessing.Manager``, a second Python process started with ``spawn`` on the first save (about
  3 s, and again at exit to stop it). That queue exists for asynchronous saves, where another process
  finishes the checkpoint. Every save here is synchronous: results are put and taken in the saving
  process, so an in-process ``queue.Queue`` does the same job.
"""

import importlib.abc
import queue
import sys


def _disable_jit(module) -> None:
    module.disable_jit_fuser()


def _in_process_results_queue(module) -> None:
    module._results_queue = queue.Queue()


_AFTER_IMPORT = {
    "megatron.core.jit": _disable_jit,
    "megatron.core.dist_checkpointing.strategies.filesystem_async": _in_process_results_queue,
}


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds the watched modules with the other finders and runs their adjustment after the module ran."""

    def find_spec(self, name, path, target=None):
        adjust = _AFTER_IMPORT.get(name)
        if adjust is None:
            return None
        spec = next((s for s in (f.find_spec(name, path, target) for f in sys.meta_path
                                 if f is not self and hasattr(f, "find_spec")) if s is not None), None)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_adjust(module):
            exec_module(module)
            adjust(module)

        spec.loader.exec_module = exec_then_adjust
        return spec


def install() -> None:
    """Idempotent. Modules already imported are adjusted at once."""
    for name, adjust in _AFTER_IMPORT.items():
        if name in sys.modules:
            adjust(sys.modules[name])
    if not any(isinstance(f, _AfterImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder())

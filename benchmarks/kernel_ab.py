"""A compiled CPU kernel against a variant of its source, inside the engine's decode steps, in one process.

    python benchmarks/kernel_ab.py --family paged --variant /tmp/paged_variant.c \
        --models base=runs/base_tiny:4 gqa4=runs/base_tiny_gqa2:16

Two builds of one kernel family (``kernels/<family>/cpu_kernel.c`` as checked out, and ``--variant``, a copy of
that file changed; its ``#include "../cpu_math.h"`` must name a path that resolves from where the copy is) are
loaded side by side; each model decodes ``batch`` held-out prompts of ``--prompt`` tokens for ``--steps`` steps per
cycle, the steps alternating between the builds, and prints the median step time of each and their ratio. Steps
of one process alternate within milliseconds, so the machine's drift (which moves separate runs by 20 % here)
cancels out of the ratio. The first steps of a cycle (the prefill) are not timed.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

from inference import prompts  # benchmarks/inference.py (this script's directory is on sys.path)


def family_module(family: str):
    """The module of ``kernels/<family>/cpu.py``: its ``SOURCE`` and cached ``library()``."""
    import importlib

    return importlib.import_module(f"kernels.{family}.cpu")


def load_both(module, variant: Path):
    """``(checked-out build, variant build)`` of the family's library; the module's cache is emptied after (its
    next call loads the checked-out build again, from the kernel cache)."""
    main = module.library()
    source = module.SOURCE
    module.library.cache_clear()
    module.SOURCE = variant
    try:
        other = module.library()
    finally:
        module.SOURCE = source
        module.library.cache_clear()
    if other is None:
        raise SystemExit(f"error: {variant} did not build (see the warning above)")
    return main, other


def step_times(module, builds, checkpoint: str, batch: int, prompt: int, steps: int, cycles: int) -> list[list[float]]:
    """Per build, the seconds of each timed decode step; the builds take turns step by step."""
    from dmc_train.inference.engine import Engine
    from dmc_train.inference.sampling import SamplingParams

    engine = Engine.from_checkpoint(checkpoint, max_batch=batch)
    texts = prompts(engine.tokenizer, batch, prompt)
    params = SamplingParams(max_new_tokens=steps + 6, ignore_eos=True)
    times = [[] for _ in builds]
    library = module.library
    try:
        for cycle in range(cycles):
            for p in texts:
                engine.add_request(p, params)
            for _ in range(4):  # the prefill, then a few steps
                engine.step()
            for i in range(steps):
                which = (i + cycle) % len(builds)
                module.library = lambda b=builds[which]: b
                start = time.perf_counter()
                engine.step()
                times[which].append(time.perf_counter() - start)
            module.library = library
            while engine.has_work():
                engine.step()
    finally:
        module.library = library
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=["layer", "paged", "eviction", "sampling"])
    parser.add_argument("--variant", required=True, type=Path, help="a changed copy of the family's cpu_kernel.c")
    parser.add_argument("--models", nargs="+", required=True, help="name=checkpoint:batch ...")
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=250, help="decode steps per cycle (prompt + steps <= the "
                        "model's positions)")
    parser.add_argument("--cycles", type=int, default=4)
    args = parser.parse_args()
    if not args.variant.is_file():
        raise SystemExit(f"error: no variant source at {args.variant}")
    module = family_module(args.family)
    builds = load_both(module, args.variant.resolve())
    print(f"kernels/{args.family}: checked out vs {args.variant}, {args.cycles} cycles of {args.steps} steps, "
          "median ms per decode step")
    print("model | batch | checked out | variant | variant / checked out")
    for spec in args.models:
        name, rest = spec.split("=", 1)
        checkpoint, _, batch = rest.rpartition(":")
        main_s, variant_s = (statistics.median(t) for t in step_times(
            module, builds, checkpoint, int(batch), args.prompt, args.steps, args.cycles))
        print(f"{name} | {batch} | {main_s * 1e3:.3f} | {variant_s * 1e3:.3f} | {variant_s / main_s:.3f}",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""Where a decode step's time goes: torch.profiler's top operators per model, and the torch calls per step.

    python benchmarks/decode_profile.py --models base=runs/base_tiny_long gqa2=runs/study_full/runs/gqa2 \
        dmc2=runs/study_full/runs/dmc2 --batch 8

Each model decodes ``--batch`` held-out prompts of ``--prompt`` tokens through the engine (its default cache);
after ``--warmup`` steps, ``--steps`` decode steps run under ``torch.profiler`` (CPU). Prints, per model, the
step time, the aten operators called per step (nested calls included) and the ``--top`` operators by self
CPU time with their input shapes. The profile is for finding what to remove; compare step times with
``benchmarks/inference.py`` (interleaved rounds), not with this script's single profiled run.
"""

import argparse
import time

from inference import prompts  # benchmarks/inference.py (this script's directory is on sys.path)


def profile_decode(checkpoint: str, batch: int, prompt: int, warmup: int, steps: int):
    """``(ms per step, profiler)`` of ``steps`` decode steps of ``batch`` sequences."""
    from torch.profiler import ProfilerActivity, profile

    from dmc_train.inference.engine import Engine
    from dmc_train.inference.sampling import SamplingParams

    engine = Engine.from_checkpoint(checkpoint, max_batch=batch)
    params = SamplingParams(max_new_tokens=warmup + steps + 1, ignore_eos=True)
    for p in prompts(engine.tokenizer, batch, prompt):
        engine.add_request(p, params)
    for _ in range(warmup):  # the first step prefills every prompt
        engine.step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        seconds = time.perf_counter() - t0
    return seconds / steps * 1e3, prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", required=True, help="name=checkpoint ...")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    for spec in args.models:
        name, path = spec.split("=", 1)
        ms, prof = profile_decode(path, args.batch, args.prompt, args.warmup, args.steps)
        aten = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        calls = sum(e.count for e in aten) / args.steps
        print(f"\n{name}: {ms:.2f} ms per decode step (profiled) at batch {args.batch}, "
              f"{calls:.0f} aten calls per step")
        print("  self CPU ms/step | calls/step | operator | input shapes")
        by_shape = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
        for e in by_shape[:args.top]:
            print(f"  {e.self_cpu_time_total / 1e3 / args.steps:16.3f} | {e.count / args.steps:10.1f} | {e.key} | "
                  f"{str(e.input_shapes)[:70]}")


if __name__ == "__main__":
    main()

"""The equal-memory study: every method of the project on one base model, each at the same fraction of the
uncompressed KV bytes, measured by the evaluation harness (``harness.py``).

A study is a list of independent **cells** (:class:`Cell`). A cell is a method at a memory fraction: a
training-free cache on the base (a policy at ``fraction x seq_length`` entries, LightCache at settings of
about that many bytes), or a retrofitted model (GQA, DMC, Fixed Memory Pooling, LESS: a training run from
the base, then its own cache). Running a cell = train what it needs (``launch/pretrain.py`` in a
subprocess, resumable), then evaluate it in-process on the first ``max_sequences`` test sequences and
write ``<out>/cells/<name>.json``. A cell whose file exists is skipped, so a study is resumable and its
cells may run as separate jobs (``launch/study.py``: one after another locally, or one Slurm job per cell
through the Hydra submitit launcher). The report (``study_report.py``) reads the cell files.

Presets (:func:`presets`) name the base (a recipe and its run), the retrofits' shared settings and the cells; a
preset's training-free policy cells are every policy of :data:`dmc_train.policies.POLICIES` unless it names some.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from dmc_train.errors import ConfigError, DataError

ROOT_ENV = "DMC_TRAIN_ROOT"  # where runs/ and data_cache/ are (default: the current directory)
CELL_KEYS = ("name", "checkpoint", "cache", "ppl")  # what the report reads of every cell


class Stopped(Exception):
    """The study got SIGTERM while a subprocess ran; the subprocess got it too and has exited (a training run
    saves a checkpoint first), so running the study again resumes the cell."""


@dataclass(frozen=True)
class Cell:
    """One row of the study.

    ``method``: the label of the row's method; ``fraction``: the memory it is meant to hold (1 = the
    uncompressed multi-head cache; the table reports what it measured). ``cache``: the engine cache it is
    evaluated with (``auto``: the run's own); an eviction policy and LESS hold ``fraction x seq_length -
    budget_offset`` entries per KV head (:meth:`budget`). ``options``: the cache's other options.
    ``train``: Hydra overrides of the training run it needs (empty: training-free, on the base; ``{base}``
    and ``{budget}`` are filled in); ``gqa_groups``: the base converted to that many KV heads first (the
    run then starts from the conversion)."""

    name: str
    method: str
    fraction: float
    cache: str = "auto"
    options: dict = field(default_factory=dict)
    train: tuple = ()
    gqa_groups: Optional[int] = None
    budget_offset: int = 0

    def budget(self, seq_length: int) -> int:
        from dmc_train.policies.budget import Budget

        return Budget.of(float(self.fraction)).entries(seq_length) - self.budget_offset


@dataclass(frozen=True)
class Preset:
    """``base``: the base run's recipe overrides (trained first when missing; ``run_dir`` from its
    ``run_name``); ``cells``; ``max_sequences``: test sequences per cell (of the base's ``seq_length``);
    ``model``: model overrides of the base that every retrofit repeats (its weights must fit them);
    ``lm_eval_limit``: documents of each shipped lm-eval task (:data:`LM_EVAL_TASKS`) per cell (0: none)."""

    base: tuple
    cells: tuple
    max_sequences: int = 64
    model: tuple = ()
    lm_eval_limit: int = 0


LM_EVAL_TASKS = ("shakespeare_next_line", "shakespeare_speaker")  # multiple choice: accuracy


def _policies(fractions, names: Optional[tuple] = None) -> list[Cell]:
    """Each policy of ``names`` (default: every registered policy) at each fraction, labelled as it labels itself."""
    from dmc_train.policies import POLICIES

    return [Cell(f"{p}_{_tag(f)}", POLICIES[p].label, f, p) for f in fractions for p in (names or POLICIES)]


def _lightcache(fractions) -> list[Cell]:
    """LightCache at settings whose bytes are about ``fraction`` of the full cache at 256 tokens: the window
    (4 global + local, top-k segments) at full width, every other token at ``r_k + r_v`` of ``2 d`` channels."""
    settings = {0.5: {"local": 64, "top_k": 4, "segment": 8, "r_k": 4, "r_v": 16},
                0.25: {"local": 24, "top_k": 2, "segment": 8, "r_k": 2, "r_v": 6}}
    return [Cell(f"lightcache_{_tag(f)}", "LightCache", f, "lightcache", settings[f]) for f in fractions]


def _tag(fraction: float) -> str:
    return {1.0: "1", 0.5: "1of2", 0.25: "1of4"}.get(fraction, f"{fraction:g}")


# Retrofits from the base, in the controlled retrofit study's regimes (docs/BENCHMARKS.md): GQA in 240 steps
# of 16 sequences under a cosine LR; DMC and Fixed Memory Pooling in 960 steps of 4 sequences under WSD (the
# regime in which DMC reaches its target). Every retrofit sees 0.98M tokens; ``{base}`` is the base run.
_GQA = ("+recipe=gqa_tiny", "train.max_steps=240", "train.global_batch_size=16", "train.eval_interval=120",
        "checkpoint.save_interval=120", "optim.lr=5e-4", "optim.schedule=cosine", "optim.min_lr_ratio=0.1",
        "optim.warmup_steps=0")
_WSD_960x4 = ("checkpoint.init_from={base}", "train.max_steps=960", "train.global_batch_size=4",
              "train.micro_batch_size=4", "optim.lr=5e-4", "optim.schedule=wsd", "optim.anneal_steps=240",
              "optim.min_lr_ratio=0.1", "optim.warmup_steps=0", "train.eval_interval=240",
              "checkpoint.save_interval=240")
_DMC = ("+recipe=dmc_tiny", *_WSD_960x4, "method.zero_out_steps=80", "method.ramp_steps=560", "method.finetune_steps=0")
# LESS on a policy at the cell's budget (entries), 200 steps of the less_tiny recipe's schedule from the base.
_LESS = ("+recipe=less_tiny", "checkpoint.init_from={base}", "method.budget={budget}", "train.max_steps=200",
         "train.eval_interval=100", "checkpoint.save_interval=100")


def _retrofits(fractions, heads: int = 8) -> list[Cell]:
    cells = []
    for f in fractions:
        x = round(1 / f)
        gqa = [Cell(f"gqa{x}", "GQA", f, train=_GQA, gqa_groups=heads // x)] if heads >= x else []
        cells += [*gqa,
                  Cell(f"dmc{x}", "DMC", f, train=(*_DMC, f"method.target_cr={x}")),
                  Cell(f"pool{x}", "Fixed Memory Pooling", f, train=(*_DMC, "method=fixed_pooling",
                                                                    f"method.pool={x}"))]
    return cells


def _less(fractions, policies=("h2o", "streaming_llm"), extra: int = 4) -> list[Cell]:
    """LESS on each policy at ``fraction`` of the bytes: the policy's budget lowered by ``extra`` entries (the
    bytes of LESS's rank-8 state per head, head size 32: ``(8 * 32 + 8) / 64`` entries, about 4), beside the
    policy alone at that lower budget (Baseline); the policy at the full fraction is Baseline+ (its own row)."""
    from dmc_train.policies import POLICIES

    cells = []
    for f in fractions:
        for p in policies:
            label = "Λ-masking" if p == "streaming_llm" else POLICIES[p].label  # the LESS paper's name for it
            cells += [Cell(f"less_{p}_{_tag(f)}", f"LESS ({label})", f, "less", train=(*_LESS, f"method.policy={p}"),
                           budget_offset=extra),
                      Cell(f"baseline_{p}_{_tag(f)}", f"Baseline ({label})", f, p, budget_offset=extra)]
    return cells


_HALF_QUARTER = (0.5, 0.25)


def presets() -> dict[str, Preset]:
    """The study's presets by name, their policy cells read from the registry as it is now."""
    return {
        # Every method at 1/2 and 1/4 of the bytes, on the retrofit study's base.
        "full": Preset(base=("+recipe=base_tiny_long",), lm_eval_limit=100,
                       cells=(Cell("vanilla", "vanilla", 1.0, "full"), *_retrofits(_HALF_QUARTER),
                              *_policies(_HALF_QUARTER), *_lightcache(_HALF_QUARTER), *_less(_HALF_QUARTER))),
        # README command 1's table: base_tiny, two training-free policies at 1/4 and one short GQA 4x retrofit.
        "quickstart": Preset(base=("+recipe=base_tiny",), max_sequences=32,
                             cells=(Cell("vanilla", "vanilla", 1.0, "full"),
                                    *_policies((0.25,), ("h2o", "streaming_llm")),
                                    Cell("gqa4", "GQA", 0.25, gqa_groups=2,
                                         train=(*_GQA, "train.max_steps=60", "train.eval_interval=60",
                                                "checkpoint.save_interval=60")))),
        # Why GQA beats DMC on base_tiny_long (docs/BENCHMARKS.md), controlled: (a) what DMC costs without merging:
        # its zero-out stage and training at target CR 1 (the decision channel taken from q and k, nothing merged)
        # against vanilla continued training with the same tokens and schedule;
        "dmc_cost": Preset(base=("+recipe=base_tiny_long",),
                           cells=(Cell("vanilla", "vanilla", 1.0, "full"),
                                  Cell("continued", "vanilla, continued", 1.0, "full",
                                       train=("+recipe=base_tiny", *_WSD_960x4)),
                                  Cell("dmc1", "DMC at CR 1", 1.0, train=(*_DMC, "method.target_cr=1")))),
        # (b) the DMC and GQA cells again on a base whose heads have 128 channels (2 heads at base_tiny's width,
        # trained like base_tiny_long), as Llama's.
        "head128": Preset(base=("+recipe=base_tiny_long", "run_name=base_tiny_long_h128"),
                          model=("model.num_attention_heads=2",),
                          cells=(Cell("vanilla", "vanilla", 1.0, "full"), *_retrofits(_HALF_QUARTER, heads=2))),
        # Two methods at one budget, seconds per cell: the study's machinery end to end.
        "quick": Preset(base=("+recipe=base_tiny",), max_sequences=8,
                        cells=(Cell("vanilla", "vanilla", 1.0, "full"), *_policies((0.25,), ("h2o", "streaming_llm")))),
    }


# -- running cells ------------------------------------------------------------------------------------
def root() -> str:
    return os.path.abspath(os.environ.get(ROOT_ENV, "."))


def base_config(preset: Preset) -> Any:
    """The base run's composed config (data, tokenizer, run_dir, seq_length); an imported checkpoint as the base
    (``base=["checkpoint.resume=<it>"]``) brings its model and its held-out data (``imported.py``)."""
    from dmc_train.evaluation.imported import imported_overrides
    from dmc_train.recipes import load_config

    return load_config(imported_overrides([*preset.base, *preset.model]))


def cell_path(out: str, name: str) -> str:
    return os.path.join(out, "cells", f"{name}.json")


def select(preset: Preset, names: list[str]) -> list[Cell]:
    """The cells named (all for ``["all"]``, none for ``[]``); one line for an unknown name."""
    if list(names) == ["all"]:
        return list(preset.cells)
    known = {c.name: c for c in preset.cells}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown cell {unknown[0]!r}; this preset's cells are {', '.join(known)}")
    return [known[n] for n in names]


def _python(args: list[str], log: str) -> None:
    """``python -m <args>`` in the study's root, output appended to ``log``; one line if it fails. SIGTERM to
    the study is handed to the subprocess, which is waited for; then :class:`Stopped`."""
    with open(log, "a") as f:
        code, stopped = _run_forwarding_sigterm([sys.executable, "-m", *args], f)
    if stopped:
        raise Stopped(f"stopped by SIGTERM; so was `python -m {args[0]}` (exit {code}, its output is in {log}): "
                      f"run the study again to resume")
    if code:
        raise ConfigError(f"`python -m {' '.join(args)}` failed (exit {code}); its output is in {log}")


def _run_forwarding_sigterm(command: list[str], log) -> tuple[int, bool]:
    """Run ``command`` (output to the file ``log``) to its end, handing it a SIGTERM this process gets meanwhile;
    returns its exit code and whether a SIGTERM came. The handler is in place before the child starts, so no
    signal leaves it running on its own (off the main thread, where Python cannot catch signals: a plain wait)."""
    child: list[subprocess.Popen] = []
    got: list[int] = []

    def forward(signum, frame):
        got.append(signum)
        if child:
            child[0].send_signal(signum)

    try:
        previous = signal.signal(signal.SIGTERM, forward)
    except ValueError:  # not the main thread
        previous = None
    try:
        child.append(subprocess.Popen(command, cwd=root(), stdout=log, stderr=subprocess.STDOUT))
        if got:  # came while the child started
            child[0].send_signal(signal.SIGTERM)
        return child[0].wait(), bool(got)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _finished(run_dir: str, steps: Optional[int] = None) -> bool:
    """``run_dir`` has a checkpoint (at step ``steps`` or later, when given)."""
    from dmc_train.training.checkpoint_dirs import read_latest, read_meta

    ckpt = read_latest(os.path.join(run_dir, "checkpoints"))
    return ckpt is not None and (steps is None or read_meta(ckpt)["step"] >= steps)


def ensure_base(preset: Preset, log: str, say: Callable[[str], None]) -> str:
    """The base run's directory, trained first when it has no checkpoint yet (``launch/pretrain.py``); an imported
    checkpoint named by the base is the base itself."""
    from dmc_train.evaluation.imported import imported_checkpoint

    found = imported_checkpoint(list(preset.base))
    if found is not None:
        return found[0]
    cfg = base_config(preset)
    run_dir = os.path.join(root(), cfg.run_dir)
    if not _finished(run_dir, cfg.train.max_steps):
        say(f"training the base model ({' '.join(preset.base)}; log {log})")
        _python(["launch.pretrain", *preset.base, *preset.model], log)
    return run_dir


def train_cell(cell: Cell, preset: Preset, base_dir: str, out: str, log: str, say: Callable[[str], None]) -> str:
    """The run directory of ``cell``'s retrofit, trained (or resumed) here unless finished."""
    run_dir = os.path.join(out, "runs", cell.name)
    start = base_dir
    if cell.gqa_groups:
        start = os.path.join(out, "runs", f"base_gqa{cell.gqa_groups}")
        if not os.path.exists(os.path.join(start, "meta.json")):
            _python(["checkpoints_tools.convert_gqa", "--input", base_dir, "--output", start,
                     "--groups", str(cell.gqa_groups)], log)
    args = [a.format(base=base_dir, budget=cell.budget(base_config(preset).train.seq_length)) for a in cell.train]
    args += list(preset.model)
    if cell.gqa_groups:
        args += [f"checkpoint.init_from={start}", f"model.num_query_groups={cell.gqa_groups}"]
    args += [f"run_dir={run_dir}", "logging.progress=true"]
    args = list({a.split("=", 1)[0]: a for a in args}.values())  # a later setting of a key replaces an earlier one
    steps = next((int(a.split("=", 1)[1]) for a in args if a.startswith("train.max_steps=")), None)
    if not _finished(run_dir, steps):
        say(f"training {cell.name}: {' '.join(args)} (log {log})")
        _python(["launch.pretrain", *args], log)
    return run_dir


def evaluate_cell(cell: Cell, preset: Preset, checkpoint_dir: str, progress=None, device: str = "cpu") -> dict:
    """The harness's measures of ``cell`` (its run's latest checkpoint, or the base) on the test split, the model
    on ``device``."""
    from dmc_train.data.datasets import build_datasets
    from dmc_train.evaluation.harness import evaluate_cache
    from dmc_train.inference.caches import cache_budget
    from dmc_train.inference.model import LlamaForInference
    from dmc_train.policies import POLICIES
    from dmc_train.training.checkpoint_dirs import find_checkpoint

    ckpt = find_checkpoint(checkpoint_dir)
    model, loaded = LlamaForInference.from_checkpoint(ckpt, device=device)
    cfg = base_config(preset)
    _, _, test = build_datasets(cfg, num_train_samples=cfg.train.global_batch_size)
    cache = model.default_cache if cell.cache == "auto" else cell.cache
    options = dict(cell.options)
    if cache in POLICIES:
        options["budget"] = cell.budget(cfg.train.seq_length)
    start = time.perf_counter()
    r = evaluate_cache(model, test, cache, options, max_sequences=preset.max_sequences,
                       batch_size=cfg.train.micro_batch_size, incremental_sequences=2, kv_budget_seqs=0,
                       progress=progress)
    return {"name": cell.name, "method": cell.method, "fraction": cell.fraction, "checkpoint": ckpt,
            "budget": cache_budget(cache, model, options, cfg.train.seq_length),
            "seconds": time.perf_counter() - start, **r}


def run_cell(cell: Cell, preset: Preset, out: str, say: Callable[[str], None] = print, device: str = "cpu") -> dict:
    """Train what ``cell`` needs, evaluate it on ``device``, write ``<out>/cells/<name>.json``; an existing file is
    returned as it is (delete it to redo the cell), with the lm-eval tasks added when the preset wants them."""
    path = cell_path(out, cell.name)
    if os.path.exists(path):
        result = read_cell(path)
        if preset.lm_eval_limit and "lm_eval" not in result:
            _write(path, _with_lm_eval(result, preset, say))
        return result
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    log = os.path.join(out, "logs", f"{cell.name}.log")
    start = time.perf_counter()
    run_dir = ensure_base(preset, os.path.join(out, "logs", "base.log"), say)
    if cell.train:
        run_dir = train_cell(cell, preset, run_dir, out, log, say)
    say(f"evaluating {cell.name} ({cell.method}, {cell.fraction:g} of the bytes)")
    result = evaluate_cell(cell, preset, run_dir, progress=say, device=device)
    if preset.lm_eval_limit:
        _with_lm_eval(result, preset, say)
    result["cell_seconds"] = time.perf_counter() - start
    _write(path, result)
    say(f"{cell.name}: perplexity {result['ppl']:.2f}, {result['compression']:.2f}x fewer KV bytes "
        f"({result['cell_seconds']:.0f}s)")
    return result


def _with_lm_eval(result: dict, preset: Preset, say: Callable[[str], None]) -> dict:
    from dmc_train.evaluation.lm_eval_run import run_tasks

    say(f"lm-eval on {result['name']}: {', '.join(LM_EVAL_TASKS)}, {preset.lm_eval_limit} documents each")
    result["lm_eval"] = run_tasks(result["checkpoint"], result["cache"], result["options"], LM_EVAL_TASKS,
                                  preset.lm_eval_limit)
    return result


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def load_cells(out: str, cells: list[Cell]) -> list[dict]:
    """The results of those of ``cells`` that are finished under ``out`` (labelled as the cells are now)."""
    results = []
    for cell in cells:
        if os.path.exists(cell_path(out, cell.name)):
            results.append({**read_cell(cell_path(out, cell.name)), "method": cell.method, "fraction": cell.fraction})
    return results


def read_cell(path: str) -> dict:
    """A finished cell's results; one-line :class:`DataError` naming the file when it is not a cell's JSON."""
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"study cell file {path} cannot be read ({e}); delete it to run the cell again") from None
    missing = [key for key in CELL_KEYS if key not in result] if isinstance(result, dict) else list(CELL_KEYS)
    if missing:
        raise DataError(f"study cell file {path} is not a cell's results (no {', '.join(missing)}); delete it to run "
                        f"the cell again")
    return result

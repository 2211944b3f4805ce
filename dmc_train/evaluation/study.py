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

Presets are data (``recipes/study_presets/<name>.yaml``, read by :func:`presets`): the base (a recipe and its run,
or an imported checkpoint), the cells and how many test sequences they read; the retrofits' training regimes are
``recipes/study_regimes.yaml``. A preset's ``policies: all`` is every policy of :data:`dmc_train.policies.POLICIES`.
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
    ``lm_eval_limit``: documents of each shipped lm-eval task (:data:`LM_EVAL_TASKS`) per cell (0: none);
    ``prompt_len``: each test sequence's first tokens are a prompt (prefilled, then compressed), the tokens after
    it are scored (1: every token); ``notes``: lines the report ends with."""

    base: tuple
    cells: tuple
    max_sequences: int = 64
    model: tuple = ()
    lm_eval_limit: int = 0
    prompt_len: int = 1
    notes: tuple = ()


LM_EVAL_TASKS = ("shakespeare_next_line", "shakespeare_speaker")  # multiple choice: accuracy
PRESETS = "study_presets"  # the presets' directory in the recipe tree, one YAML file each
REGIMES = "study_regimes.yaml"  # the retrofits' training regimes, named in the presets' cells


def presets() -> dict[str, Preset]:
    """The study's presets by name (``recipes/study_presets/<name>.yaml``), their policy cells read from the
    registry as it is now."""
    from dmc_train.recipes import recipes_dir

    folder = os.path.join(recipes_dir(), PRESETS)
    regimes = _yaml(os.path.join(recipes_dir(), REGIMES))
    return {name[:-5]: preset_of(_yaml(os.path.join(folder, name)), regimes)
            for name in sorted(os.listdir(folder)) if name.endswith(".yaml")}


def _yaml(path: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path))


def preset_of(spec: dict, regimes: dict[str, list]) -> Preset:
    """A preset from its YAML: ``base``, ``model``, ``notes``, the numbers of :class:`Preset`, and ``cells``, each a
    :class:`Cell`'s fields or a group of cells (:func:`_group`); a ``train`` item ``"@<regime>"`` stands for that
    regime's overrides."""
    cells = [cell for entry in spec["cells"] for cell in _group(entry)]
    cells = tuple(Cell(**{**c, "train": _train(c.get("train", ()), regimes)}) for c in cells)
    return Preset(base=tuple(spec["base"]), cells=cells, model=tuple(spec.get("model", ())),
                  notes=tuple(spec.get("notes", ())),
                  **{key: spec[key] for key in ("max_sequences", "lm_eval_limit", "prompt_len") if key in spec})


def _train(items, regimes: dict[str, list]) -> tuple:
    out = []
    for item in items:
        out += _train(regimes[item[1:]], regimes) if item.startswith("@") else [item]
    return tuple(out)


def _group(entry: dict) -> list[dict]:
    """The cells of one entry of a preset's ``cells``: one cell's fields, or a group named by its key:
    ``policies`` (names, or ``all``: every registered policy) at ``fractions`` under each of ``schedules``;
    ``lightcache`` (fraction -> its options); ``retrofits`` (fractions: GQA, when ``heads`` divide, DMC and Fixed
    Memory Pooling at 1/fraction); ``less`` (fractions: LESS on each of ``policies`` beside the policy alone, at
    the bytes LESS's state leaves, ``extra`` entries fewer; ``train``: overrides after the regime ``less``'s)."""
    from dmc_train.policies import POLICIES

    if "name" in entry:
        return [entry]
    if "less" in entry:
        cells, extra = [], entry.get("extra", 4)
        for f in entry["less"]:
            for p in entry["policies"]:
                label = "Λ-masking" if p == "streaming_llm" else POLICIES[p].label  # the LESS paper's name for it
                cells += [dict(name=f"less_{p}_{tag(f)}", method=f"LESS ({label})", fraction=f, cache="less",
                               train=["@less", f"method.policy={p}", *entry.get("train", [])], budget_offset=extra),
                          dict(name=f"baseline_{p}_{tag(f)}", method=f"Baseline ({label})", fraction=f, cache=p,
                               budget_offset=extra)]
        return cells
    if "policies" in entry:
        names = list(POLICIES) if entry["policies"] == "all" else entry["policies"]
        cells = []
        for schedule in entry.get("schedules", ["decode"]):
            prefill = schedule == "prefill"
            options = {"schedule": "prefill"} if prefill else {}
            cells += [dict(name=f"{p}_{tag(f)}" + ("_prefill" if prefill else ""),
                           method=POLICIES[p].label + (" (prefill)" if prefill else ""), fraction=f, cache=p,
                           options={**options, "compression_ratio": 1 - f} if prefill else options)
                      for f in entry["fractions"] for p in names]
        return cells
    if "lightcache" in entry:
        return [dict(name=f"lightcache_{tag(f)}", method="LightCache", fraction=f, cache="lightcache", options=o)
                for f, o in entry["lightcache"].items()]
    if "retrofits" in entry:
        cells = []
        for f in entry["retrofits"]:
            x = round(1 / f)
            if entry.get("heads", 8) >= x:
                cells.append(dict(name=f"gqa{x}", method="GQA", fraction=f, train=["@gqa"],
                                  gqa_groups=entry.get("heads", 8) // x))
            cells += [dict(name=f"dmc{x}", method="DMC", fraction=f, train=["@dmc", f"method.target_cr={x}"]),
                      dict(name=f"pool{x}", method="Fixed Memory Pooling", fraction=f,
                           train=["@dmc", "method=fixed_pooling", f"method.pool={x}"])]
        return cells
    raise ConfigError(f"a study cell entry {entry} is neither a cell (name, method, fraction, ...) nor a group "
                      f"(policies, lightcache, retrofits, less)")


def tag(fraction: float) -> str:
    """A fraction as cell names write it: 1, 1of2, 1of8."""
    return "1" if fraction == 1 else f"1of{round(1 / fraction)}" if (1 / fraction).is_integer() else f"{fraction:g}"


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
    args = _imported_base_training(preset, base_dir)
    args += [a.format(base=base_dir, budget=cell.budget(base_config(preset).train.seq_length)) for a in cell.train]
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


def _imported_base_training(preset: Preset, base_dir: str) -> list[str]:
    """What a retrofit of an imported base starts from (none for a recipe's base, whose cells name a recipe): the
    checkpoint's model, its held-out data in its tokenizer, the preset's base settings (sequence length, batch) and
    its weights as ``checkpoint.init_from``."""
    from dmc_train.evaluation.imported import imported_checkpoint, imported_overrides

    if imported_checkpoint(list(preset.base)) is None:
        return []
    inherited = imported_overrides(list(preset.base))
    return [*(o for o in inherited if not o.startswith(("checkpoint.resume=", "run_name="))),
            f"checkpoint.init_from={base_dir}"]


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
    r = evaluate_cache(model, test, cache, options, prompt_len=preset.prompt_len, max_sequences=preset.max_sequences,
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

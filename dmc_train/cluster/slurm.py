"""Render and submit a SLURM batch job that trains a recipe with multi-node torchrun.

    spec = JobSpec(overrides=["+recipe=dmc_7b", "parallel.tensor=2"], nodes=2, gpus_per_node=8)
    cfg = check(spec)                # composes the config and checks the layout; raises SubmitError
    script = render(spec, cfg)       # the sbatch script (train.sbatch.tmpl filled in)
    job_id = sbatch(write_script(spec, script, log_dir_of(spec, cfg)))

``launch/submit.py`` is the command line. The job: ``cd <workdir>``, the ``--setup`` lines, then one
``srun`` task per node runs the per-node wrapper (``torchrun_node.sh``) -> ``torchrun
--nnodes=$SLURM_NNODES --nproc_per_node=<gpus> --rdzv_backend=c10d --rdzv_endpoint=<first node>:<port>
--rdzv_id=$SLURM_JOB_ID -m launch.pretrain +recipe=<name> run_dir=<dir> checkpoint.resume=auto
<overrides>``.

The rendered script is self-contained: it needs dmc_train installed in the job's environment (what
``--setup`` activates), not a checkout. The wrapper's text is inlined into the script and run with
``bash -c`` on every node, so no file of this package has to be visible from the compute nodes;
``workdir`` is only the job's working directory (relative run and data paths resolve there).

Template and wrapper are the package data ``launch/slurm/`` (see :func:`slurm_dir`).

Signals: ``#SBATCH --signal=USR1@<seconds>`` (no ``B:``) signals the job step, not the batch shell;
the wrapper keeps SIGUSR1 and SIGTERM from torchrun and hands them to the ranks, also one that comes
before the ranks exist (see torchrun_node.sh).

Job arrays (``--array 0-3``): each task gets ``++array_task_id=$SLURM_ARRAY_TASK_ID`` (the schema's
``array_task_id``) and its own run directory ``<run_dir>/task_<id>``, so each task checkpoints and
resumes independently (e.g. one LESS layer group per task).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from dmc_train.errors import SubmitError

ARRAY_OVERRIDE = "++array_task_id"  # the override each array task receives
DEFAULT_PORT_EXPR = "$(( 29500 + SLURM_JOB_ID % 1000 ))"  # distinct per job on shared nodes
TRAIN_MODULE = "launch.pretrain"  # what torchrun runs on every node (-m)
WRAPPER_EOF = "DMC_TRAIN_NODE_WRAPPER"  # here-document delimiter of the inlined wrapper


def slurm_dir() -> str:
    """The directory of the job template and the per-node wrapper: ``<dmc_train>/../launch/slurm``.

    ``launch`` is a top-level package installed beside ``dmc_train`` by the same wheel (its
    ``slurm/*`` are package data), and in a checkout it is the directory beside ``dmc_train/``; so
    the one rule holds for a source checkout, an editable install and site-packages. It depends on
    where this file is, not on the current directory or ``sys.path``.
    """
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(os.path.dirname(package_dir), "launch", "slurm")


def template_path() -> str:
    return os.path.join(slurm_dir(), "train.sbatch.tmpl")


def node_wrapper_path() -> str:
    return os.path.join(slurm_dir(), "torchrun_node.sh")


@dataclass
class JobSpec:
    """Everything that defines a training job; ``overrides`` are pretrain.py's (must hold ``+recipe=``)."""

    overrides: list[str]
    nodes: int = 1
    gpus_per_node: int = 8
    time: str = "04:00:00"
    partition: Optional[str] = None
    account: Optional[str] = None
    constraint: Optional[str] = None
    cpus_per_task: Optional[int] = None  # CPUs of the one task per node (give all cores of a node)
    job_name: Optional[str] = None  # default: the recipe name
    array: Optional[str] = None  # e.g. "0-3" or "0-7%2"
    log_dir: Optional[str] = None  # default: <run_dir>/slurm (scripts, <job>-<id>.out, <job>-<id>/ per job)
    run_dir: Optional[str] = None  # default: the config's run_dir, made absolute under workdir
    signal_seconds: int = 300  # SIGUSR1 this long before the time limit; 0 = none
    requeue: bool = True  # #SBATCH --requeue (else --no-requeue: `scontrol requeue` is refused)
    port: Optional[int] = None  # rendezvous port; default 29500 + job id % 1000
    setup: list[str] = field(default_factory=list)  # shell lines run before training
    srun_args: list[str] = field(default_factory=list)  # e.g. --container-image=...
    sbatch_args: list[str] = field(default_factory=list)  # extra #SBATCH options, e.g. --exclusive
    workdir: str = field(default_factory=os.getcwd)  # the job's working directory (shared file system)
    gpu_memory_gb: Optional[float] = 80.0  # warn when the memory estimate exceeds it


# ------------------------------------------------------------------------------------------
# Checking
# ------------------------------------------------------------------------------------------
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$")
_ARRAY = re.compile(r"^\d+(-\d+(:\d+)?)?(,\d+(-\d+(:\d+)?)?)*(%\d+)?$")


def recipe_of(overrides: list[str]) -> str:
    names = [o.split("=", 1)[1] for o in overrides if o.startswith("+recipe=")]
    if len(names) != 1:
        raise SubmitError("give exactly one +recipe=<name> (recipes are recipes/recipe/*.yaml)")
    return names[0]


def _user_value(overrides: list[str], key: str) -> Optional[str]:
    vals = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == key]
    return vals[-1] if vals else None


def _check_options(spec: JobSpec) -> None:
    if spec.nodes < 1 or spec.gpus_per_node < 1:
        raise SubmitError(f"--nodes={spec.nodes} and --gpus-per-node={spec.gpus_per_node} must be >= 1")
    if not _TIME.match(spec.time):
        raise SubmitError(f"--time={spec.time!r} is not a SLURM time (minutes, HH:MM:SS or D-HH:MM:SS)")
    if spec.array is not None and not _ARRAY.match(spec.array):
        raise SubmitError(f"--array={spec.array!r} is not a SLURM array spec (e.g. 0-3, 0,2,5 or 0-7%2)")
    if not 0 <= spec.signal_seconds <= 65535:
        raise SubmitError(f"--signal-seconds={spec.signal_seconds} must be in 0..65535")
    if spec.port is not None and not 1024 <= spec.port <= 65535:
        raise SubmitError(f"--port={spec.port} must be in 1024..65535")
    if spec.cpus_per_task is not None and spec.cpus_per_task < 1:
        raise SubmitError(f"--cpus-per-task={spec.cpus_per_task} must be >= 1")
    for option, value in (("partition", spec.partition), ("account", spec.account),
                          ("constraint", spec.constraint), ("job-name", spec.job_name)):
        if value is not None and not value.strip():
            raise SubmitError(f"--{option} is empty; give a value or leave the option out"
                              + (" (the cluster's default partition)" if option == "partition" else ""))
    texts = [spec.time, spec.partition, spec.account, spec.constraint, spec.job_name, spec.array,
             spec.log_dir, spec.run_dir, *spec.setup, *spec.srun_args, *spec.sbatch_args, *spec.overrides]
    if any(t and ("\n" in t or "\r" in t) for t in texts):
        raise SubmitError("options and overrides must not contain newlines (give several --setup lines instead)")
    if not os.path.isdir(spec.workdir):
        raise SubmitError(f"--workdir={spec.workdir} is not a directory (the job's working directory: "
                          f"relative run and data paths resolve there)")


def run_dir_of(spec: JobSpec, cfg: Any) -> str:
    """The absolute base run directory (array tasks add ``/task_<id>``)."""
    run_dir = spec.run_dir or _user_value(spec.overrides, "run_dir") or str(cfg.run_dir)
    return os.path.normpath(os.path.join(spec.workdir, run_dir))


def log_dir_of(spec: JobSpec, cfg: Any) -> str:
    """The absolute log directory: ``--log-dir`` or ``<run_dir>/slurm``."""
    return os.path.abspath(spec.log_dir) if spec.log_dir else os.path.join(run_dir_of(spec, cfg), "slurm")


def _train_overrides(spec: JobSpec) -> list[str]:
    """The user's overrides without run_dir (the script passes its own)."""
    return [o for o in spec.overrides if o.split("=", 1)[0].lstrip("+") != "run_dir"]


def check(spec: JobSpec) -> Any:
    """Compose the config the job will run and check it fits ``nodes x gpus_per_node``; return it."""
    from dmc_train.errors import one_line
    from dmc_train.recipes import load_config, validate

    _check_options(spec)
    recipe_of(spec.overrides)
    extra = [f"{ARRAY_OVERRIDE}=0"] if spec.array else []
    try:
        cfg = load_config(_train_overrides(spec) + extra)
        cfg.run_dir = run_dir_of(spec, cfg)
        validate(cfg, spec.nodes * spec.gpus_per_node)
    except Exception as e:  # hydra/omegaconf/ConfigError: all user config errors here
        raise SubmitError(f"config error: {one_line(e)}") from None
    return cfg


# ------------------------------------------------------------------------------------------
# Rendering
# ------------------------------------------------------------------------------------------
def _sbatch_lines(spec: JobSpec, log_dir: str) -> list[str]:
    name = spec.job_name or recipe_of(spec.overrides)
    out = "%x-%A_%a.out" if spec.array else "%x-%j.out"
    opts = [f"--job-name={name}", f"--nodes={spec.nodes}", "--ntasks-per-node=1",
            f"--gpus-per-node={spec.gpus_per_node}", f"--time={spec.time}"]
    opts += [f"--{k}={v}" for k, v in (("cpus-per-task", spec.cpus_per_task), ("partition", spec.partition),
                                       ("account", spec.account), ("constraint", spec.constraint),
                                       ("array", spec.array)) if v is not None]
    opts += [f"--output={os.path.join(log_dir, out)}", "--open-mode=append"]
    if spec.signal_seconds:
        opts.append(f"--signal=USR1@{spec.signal_seconds}")
    opts.append("--requeue" if spec.requeue else "--no-requeue")
    opts += spec.sbatch_args
    return [f"#SBATCH {sbatch_quote(o)}" for o in opts]


def sbatch_quote(option: str) -> str:
    """``option`` as one argument of an ``#SBATCH`` line. sbatch splits these lines at white space, takes
    ``"``/``'`` as quotes and ``\\`` as an escape, and ends the line at an unquoted ``#``: an option with
    any of them is double-quoted with ``\\`` and ``"`` escaped, which both sbatch's current parser and its
    older one (double quotes only) read back unchanged. Other options are written as they are."""
    if not re.search(r"[\s\"'\\#]", option):
        return option
    return '"' + option.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _estimate_line(spec: JobSpec, cfg: Any) -> tuple[str, Optional[str]]:
    """(comment line, warning or None) from dmc_train.cluster.memory."""
    from dmc_train.cluster.memory import GiB, estimate_memory

    try:
        est = estimate_memory(cfg, spec.nodes * spec.gpus_per_node)
    except Exception as e:  # the estimate is advisory; never block a valid job on it
        return f"Memory estimate unavailable: {e}", None
    total = est["total"] / GiB
    static = est["parameters"] + est["gradients"] + est["optimizer"]
    unit, div = ("GiB", GiB) if est["total"] >= GiB else ("MiB", 2 ** 20)
    line = (f"Estimated peak memory per GPU: {est['total'] / div:.1f} {unit} (weights+grads+optimizer "
            f"{static / div:.1f}, activations {est['activations'] / div:.1f});\n"
            f"# launch/estimate_memory.py prints the breakdown, docs/CLUSTER.md explains it.")
    warn = None
    if spec.gpu_memory_gb and total * GiB > spec.gpu_memory_gb * 1e9 * 0.9:
        warn = (f"estimated {total:.1f} GiB per GPU is over 90% of --gpu-memory-gb={spec.gpu_memory_gb:g}; "
                f"consider more tensor/pipeline parallelism, parallel.distributed_optimizer=true or "
                f"train.recompute=full")
    return line, warn


def render(spec: JobSpec, cfg: Any = None) -> str:
    """The sbatch script for ``spec`` (``cfg``: the result of ``check(spec)``, computed if None)."""
    cfg = check(spec) if cfg is None else cfg
    log_dir, base = log_dir_of(spec, cfg), run_dir_of(spec, cfg)
    q = shlex.quote
    if spec.array:
        run_dir = q(base) + '"/task_${SLURM_ARRAY_TASK_ID}"'
        job_log = q(log_dir) + '"/${SLURM_JOB_NAME}-${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"'
    else:
        run_dir, job_log = q(base), q(log_dir) + '"/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"'
    args = [q(o) for o in _train_overrides(spec)]
    recipe_at = next(i for i, o in enumerate(_train_overrides(spec)) if o.startswith("+recipe="))
    fixed = ['"run_dir=$RUN_DIR"'] + ([] if _user_value(spec.overrides, "checkpoint.resume")
                                      else ["checkpoint.resume=auto"])
    args[recipe_at + 1:recipe_at + 1] = fixed
    if spec.array:
        args.append(f'"{ARRAY_OVERRIDE}=$SLURM_ARRAY_TASK_ID"')
    cpus = [f"--cpus-per-task={spec.cpus_per_task}"] if spec.cpus_per_task else []
    estimate, _ = _estimate_line(spec, cfg)
    signal_note = (f"Slurm sends SIGUSR1 to the job step {spec.signal_seconds} s before the time limit\n"
                   f"# (--signal without \"B:\": the batch shell is not signalled)."
                   if spec.signal_seconds else "no early-warning signal (--signal-seconds=0).")
    values = {
        "sbatch": "\n".join(_sbatch_lines(spec, log_dir)),
        "rendered": time.strftime("%Y-%m-%d %H:%M:%S"),
        "estimate": estimate,
        "signal_note": signal_note,
        "workdir": q(os.path.abspath(spec.workdir)),
        "setup": "\n".join(spec.setup) if spec.setup else ":  # none",
        "gpus": str(spec.gpus_per_node),
        "port": str(spec.port) if spec.port else DEFAULT_PORT_EXPR,
        "run_dir": run_dir,
        "job_log_dir": job_log,
        # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): pass it explicitly
        "srun_args": "".join(q(a) + " " for a in cpus + spec.srun_args),
        "node_wrapper": read_node_wrapper(),
        "wrapper_eof": WRAPPER_EOF,
        "train_module": TRAIN_MODULE,
        "train_args": " ".join(args),
    }
    return fill_template(read_template(), values)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        raise SubmitError(f"{path} is missing: the launch package's slurm/ files were not installed "
                          f"(reinstall dmc_train)") from None


def read_template(path: Optional[str] = None) -> str:
    return _read(path or template_path())


def read_node_wrapper(path: Optional[str] = None) -> str:
    """The per-node wrapper's text as the script inlines it (no trailing newline)."""
    text = _read(path or node_wrapper_path()).rstrip("\n")
    if any(line == WRAPPER_EOF for line in text.splitlines()):
        raise ValueError(f"{path or node_wrapper_path()} contains the here-document delimiter {WRAPPER_EOF}")
    return text


def fill_template(text: str, values: dict[str, str]) -> str:
    """Replace every ``{{name}}``; a name without a value (or a value without a use) is an error."""
    used = set(re.findall(r"\{\{(\w+)\}\}", text))
    if used != set(values):
        raise KeyError(f"template placeholders {sorted(used)} != values {sorted(values)}")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], text)


# ------------------------------------------------------------------------------------------
# Submitting
# ------------------------------------------------------------------------------------------
def write_script(spec: JobSpec, script: str, log_dir: str) -> str:
    """Write the script to ``<log_dir>/<job name>-<timestamp>.sbatch``; return its path."""
    os.makedirs(log_dir, exist_ok=True)
    name = spec.job_name or recipe_of(spec.overrides)
    path = os.path.join(log_dir, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch")
    with open(path, "w") as f:
        f.write(script)
    return path


def sbatch(script_path: str) -> str:
    """Run ``sbatch <script>`` (from PATH); return the job id."""
    exe = shutil.which("sbatch")
    if exe is None:
        raise SubmitError("sbatch not found on PATH (not on a SLURM login node? use --dry-run to print the script)")
    proc = subprocess.run([exe, script_path], capture_output=True, text=True)
    if proc.returncode != 0:
        msg = " ".join((proc.stderr or proc.stdout).split()) or f"exit code {proc.returncode}"
        raise RuntimeError(f"sbatch failed: {msg}")
    m = re.search(r"Submitted batch job (\d+)", proc.stdout) or re.search(r"^(\d+)", proc.stdout.strip())
    if not m:
        raise RuntimeError(f"could not read a job id from sbatch's output: {proc.stdout.strip()!r}")
    return m.group(1)


def run(spec: JobSpec, dry_run: bool = False, out=None, err=None) -> int:
    """Check, render, then print (dry run) or submit. Returns the exit code (2: bad options/config)."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        cfg = check(spec)
        script = render(spec, cfg)
    except SubmitError as e:
        print(f"error: {e}", file=err)
        return 2
    _, warn = _estimate_line(spec, cfg)
    if warn:
        print(f"warning: {warn}", file=err)
    if spec.partition is None:
        print("note: no --partition: the job goes to the cluster's default partition (sbatch refuses it if the "
              "cluster has none)", file=err)
    resume = _user_value(spec.overrides, "checkpoint.resume")
    if resume not in (None, "auto"):
        print(f"warning: checkpoint.resume={resume}: a requeued job will not continue from its own "
              f"checkpoints (the default, auto, does)", file=err)
    if dry_run:
        out.write(script)
        return 0
    log_dir = log_dir_of(spec, cfg)
    path = write_script(spec, script, log_dir)
    try:
        job_id = sbatch(path)
    except SubmitError as e:
        print(f"error: {e}", file=err)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=err)
        return 1
    name = spec.job_name or recipe_of(spec.overrides)
    log = "%s-%s_*.out" % (name, job_id) if spec.array else f"{name}-{job_id}.out"
    print(f"Submitted batch job {job_id} (script {path}; log {os.path.join(log_dir, log)})",
          file=out)
    return 0

"""launch/submit.py and its SLURM script, run against fake sbatch/srun/scontrol/torchrun executables.

The fakes are small shell scripts on PATH that record their argv; the rendered script is executed
with bash under SLURM_* variables, so the whole chain sbatch -> srun -> node wrapper -> torchrun
is checked without a cluster. The script runs `torchrun ... -m launch.pretrain` in --workdir and
inlines the node wrapper, so the job needs dmc_train installed, not a checkout.
"""

import io
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import free_port

from dmc_train.cluster import slurm
from dmc_train.cluster.slurm import JobSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = ["+recipe=tiny_pretrain", "parallel.tensor=2", "data.prefixes=[a b,c]"]

FAKES = {
    # one argv element per line, calls separated by "--"
    "sbatch": 'printf "%s\\n" "$@" -- >> "$REC/sbatch"\necho "Submitted batch job 123"\n',
    "scontrol": 'printf "%s\\n" "$@" -- >> "$REC/scontrol"\n'
                'if [ "$1" = show ] && [ "$2" = hostnames ]; then printf "%s\\n" ${FAKE_HOSTS:-node001 node002}; fi\n',
    # srun: record (NUL-separated: the inlined node wrapper is one multi-line argument), drop its own
    # options, run the command once (as the first node)
    "srun": 'printf "%s\\0" "$@" -- >> "$REC/srun"\n'
            'while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n',
    "torchrun": 'printf "%s\\n" "$@" > "$REC/torchrun"\npwd > "$REC/cwd"\n',
}


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """PATH with fake SLURM tools and torchrun; returns the directory their records go to."""
    bin_dir, rec = tmp_path / "bin", tmp_path / "rec"
    bin_dir.mkdir()
    rec.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("REC", str(rec))
    return rec


def calls(path, sep: str = "\n") -> list[list[str]]:
    if not path.exists():
        return []
    text = path.read_text().split(sep)
    out, cur = [], []
    for line in text[:-1]:
        if line == "--":
            out.append(cur)
            cur = []
        else:
            cur.append(line)
    return out


def spec(tmp_path, **kw) -> JobSpec:
    base = dict(overrides=list(OVERRIDES), nodes=2, gpus_per_node=4, log_dir=str(tmp_path / "logs"),
                run_dir=str(tmp_path / "run"), job_name="job", partition="gpu", account="acct")
    return JobSpec(**{**base, **kw})


def run_script(script: str, tmp_path, **env) -> subprocess.CompletedProcess:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    slurm_env = {"SLURM_JOB_ID": "123", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[001-002]",
                 "SLURM_JOB_NAME": "job", "SLURM_CPUS_ON_NODE": "16", **env}
    return subprocess.run(["bash", str(path)], env={**os.environ, **slurm_env}, capture_output=True,
                          text=True, timeout=600)  # a real training run inside; slow when the machine is shared


@pytest.mark.parametrize("array", [None, "0-3"])
def test_rendered_script_is_valid_bash(tmp_path, array):
    script = slurm.render(spec(tmp_path, array=array, setup=["module load cuda", "echo 'ready'"]))
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --signal=USR1@300" in script and "#SBATCH --requeue" in script
    assert ("#SBATCH --array=0-3" in script) == bool(array)
    assert "\nmodule load cuda\necho 'ready'\n" in script
    assert "{{" not in script


def test_script_launches_srun_and_torchrun(tmp_path, fakes):
    workdir = tmp_path / "work"  # any directory: the job does not need a checkout
    workdir.mkdir()
    script = slurm.render(spec(tmp_path, cpus_per_task=16, workdir=str(workdir)))
    assert "launch/pretrain.py" not in script and "bash launch/" not in script
    proc = run_script(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert calls(fakes / "scontrol") == [["show", "hostnames", "node[001-002]"]]
    wrapper = open(slurm.node_wrapper_path()).read()  # inlined: the shipped wrapper, byte for byte
    assert calls(fakes / "srun", sep="\0") == [["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                                                "--cpus-per-task=16", "bash", "-c", wrapper, "torchrun_node.sh",
                                                *(fakes / "torchrun").read_text().splitlines()]]
    log_dir = tmp_path / "logs" / "job-123"
    assert (fakes / "torchrun").read_text().splitlines() == [
        "--nnodes=2", "--nproc_per_node=4", "--rdzv_backend=c10d",
        "--rdzv_endpoint=node001:29623",  # 29500 + 123 % 1000
        "--rdzv_id=123", f"--log-dir={log_dir}/torchrun", "--tee=3",
        "-m", "launch.pretrain", "+recipe=tiny_pretrain", f"run_dir={tmp_path / 'run'}", "checkpoint.resume=auto",
        "parallel.tensor=2", "data.prefixes=[a b,c]"]
    assert log_dir.is_dir()
    assert "rendezvous node001:29623" in proc.stdout
    assert (fakes / "cwd").read_text().strip() == str(workdir)


def test_relative_run_dir_resolves_under_workdir(tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    cfg = slurm.check(spec(tmp_path, run_dir="runs/x", workdir=str(workdir)))
    assert cfg.run_dir == str(workdir / "runs" / "x")
    assert f"\ncd {workdir}  #" in slurm.render(spec(tmp_path, run_dir="runs/x", workdir=str(workdir)), cfg)


def test_array_task_gets_its_id_and_run_dir(tmp_path, fakes):
    proc = run_script(slurm.render(spec(tmp_path, array="0-3", port=31000)), tmp_path,
                      SLURM_ARRAY_TASK_ID="3", SLURM_ARRAY_JOB_ID="120")
    assert proc.returncode == 0, proc.stderr
    args = (fakes / "torchrun").read_text().splitlines()
    assert "--rdzv_endpoint=node001:31000" in args
    assert f"run_dir={tmp_path / 'run'}/task_3" in args
    assert args[-1] == "++array_task_id=3"
    assert f"--log-dir={tmp_path / 'logs'}/job-120_3/torchrun" in args


def test_submit_calls_sbatch_with_the_written_script(tmp_path, fakes):
    out, err = io.StringIO(), io.StringIO()
    assert slurm.run(spec(tmp_path), out=out, err=err) == 0, err.getvalue()
    (script_path,), = calls(fakes / "sbatch")
    assert script_path.startswith(str(tmp_path / "logs" / "job-")) and script_path.endswith(".sbatch")
    script = open(script_path).read()
    assert "-m launch.pretrain +recipe=tiny_pretrain" in script
    assert f"#SBATCH --output={tmp_path / 'logs'}/%x-%j.out" in script
    assert out.getvalue().startswith("Submitted batch job 123 ")


def sbatch_arguments(line: str, quotes: str = "\"'") -> list[str]:
    """The options sbatch reads from one ``#SBATCH`` line: a port of its parser (src/sbatch/opt.c,
    ``_get_argument``: white space separates, ``\\`` escapes the next character, quotes group, an unquoted
    ``#`` ends the line). Older Slurm versions take only double quotes: ``quotes='"'``."""
    args, i, rest = [], 0, line[len("#SBATCH"):]
    while True:
        while i < len(rest) and rest[i].isspace():
            i += 1
        if i == len(rest):
            return args
        arg, quote, escaped = "", None, False
        while i < len(rest) and (quote or not rest[i].isspace()):
            c = rest[i]
            i += 1
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
                continue
            elif quote:
                if c == quote:
                    quote = None
                    continue
            elif c in quotes:
                quote = c
                continue
            elif c == "#":
                return args + ([arg] if arg else [])
            arg += c
        assert quote is None, f"unmatched {quote} in {line!r}"
        args.append(arg)


@pytest.mark.parametrize("quotes", ["\"'", '"'], ids=["slurm", "old_slurm"])
@pytest.mark.parametrize("name", ["plain", "with space", "it's", 'say "hi"', "a#b", "back\\slash", "tab\there"])
def test_sbatch_lines_read_back_exactly(tmp_path, name, quotes):
    """A run or log directory (or job name) with white space, quotes, # or a backslash reaches sbatch as it is."""
    run_dir = tmp_path / name / "run"
    script = slurm.render(spec(tmp_path, run_dir=str(run_dir), log_dir=None, job_name=f"job {name}",
                               sbatch_args=[f"--comment={name}"]))
    options = [a for line in script.splitlines() if line.startswith("#SBATCH ") for a in sbatch_arguments(line, quotes)]
    assert f"--output={run_dir}/slurm/%x-%j.out" in options
    assert f"--job-name=job {name}" in options and f"--comment={name}" in options
    assert "--requeue" in options and "--open-mode=append" in options


def test_logs_default_to_the_run_dir(tmp_path, fakes):
    assert slurm.run(spec(tmp_path, log_dir=None), out=io.StringIO()) == 0
    (script_path,), = calls(fakes / "sbatch")
    assert os.path.dirname(script_path) == str(tmp_path / "run" / "slurm")
    assert f"#SBATCH --output={tmp_path / 'run' / 'slurm'}/%x-%j.out" in open(script_path).read()


def test_dry_run_prints_and_does_not_submit(tmp_path, fakes):
    out, err = io.StringIO(), io.StringIO()
    assert slurm.run(spec(tmp_path, requeue=False, signal_seconds=0), dry_run=True, out=out, err=err) == 0
    assert out.getvalue().startswith("#!/bin/bash\n")
    assert "#SBATCH --no-requeue" in out.getvalue() and "#SBATCH --signal" not in out.getvalue()
    assert calls(fakes / "sbatch") == [] and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("kw, message", [
    (dict(nodes=1, gpus_per_node=2, overrides=["+recipe=tiny_pretrain", "parallel.tensor=2", "parallel.pipeline=2"]),
     "world size 2 is not divisible by parallel.tensor x parallel.pipeline = 2x2"),
    (dict(overrides=["+recipe=no_such_recipe"]), "no_such_recipe"),
    (dict(overrides=["parallel.tensor=2"]), "+recipe=<name>"),
    (dict(overrides=["+recipe=tiny_pretrain", "parallel.tensr=2"]), "tensr"),
    (dict(time="tomorrow"), "--time="),
    (dict(array="0-3;rm"), "--array="),
    (dict(setup=["echo a\necho b"]), "newlines"),
    (dict(workdir="/nonexistent/dmc_train_work"), "--workdir=/nonexistent/dmc_train_work is not a directory"),
    (dict(partition=""), "--partition is empty; give a value or leave the option out (the cluster's default"),
    (dict(account=" "), "--account is empty"),
])
def test_bad_options_fail_in_one_line_without_sbatch(tmp_path, fakes, kw, message):
    out, err = io.StringIO(), io.StringIO()
    assert slurm.run(spec(tmp_path, **kw), out=out, err=err) == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert out.getvalue() == "" and calls(fakes / "sbatch") == []


def test_missing_partition_means_the_cluster_default(tmp_path, fakes):
    out, err = io.StringIO(), io.StringIO()
    assert slurm.run(spec(tmp_path, partition=None), dry_run=True, out=out, err=err) == 0
    assert "--partition" not in out.getvalue()
    assert "no --partition: the job goes to the cluster's default partition" in err.getvalue()


def test_cli_exit_code_and_one_line(tmp_path, fakes):
    proc = subprocess.run([sys.executable, "launch/submit.py", "+recipe=tiny_pretrain", "parallel.tensor=2",
                           "parallel.pipeline=2", "--nodes", "1", "--gpus-per-node", "2",
                           "--log-dir", str(tmp_path / "logs")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "not divisible" in proc.stderr
    assert calls(fakes / "sbatch") == []
    proc = subprocess.run([sys.executable, "launch/submit.py", *OVERRIDES, "--nodes", "2", "--gpus-per-node", "4",
                           "--log-dir", str(tmp_path / "logs"), "--job-name", "cli"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "Submitted batch job 123" in proc.stdout and len(calls(fakes / "sbatch")) == 1


# like a trainer rank: a handler, then the signal unblocked (the node wrapper starts torchrun, and so the
# ranks, with it blocked; one that came earlier is delivered now)
WORKER = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
open(sys.argv[1] + ".ready", "w").close()
deadline = time.time() + 20
while not got and time.time() < deadline:
    time.sleep(0.01)
open(sys.argv[1], "w").write("got SIGUSR1" if got else "timeout")
"""

# like torchrun: starts the rank in its own session (once the file FAKE_TORCHRUN_GO exists: the test holds it
# back as long as torchrun's imports and rendezvous would), waits for it, no SIGUSR1 handler of its own
FAKE_TORCHRUN = """
import os, subprocess, sys, time
deadline = time.time() + 30
while not os.path.exists(os.environ["FAKE_TORCHRUN_GO"]) and time.time() < deadline:
    time.sleep(0.01)
rank = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]], start_new_session=True)
sys.exit(rank.wait())
"""


def torchrun_without_rank(wrapper) -> bool:
    """Whether the wrapper has started torchrun, which has not started its rank yet, and waits for it (its
    start-up loop's ``sleep``: past the instant it forks torchrun, when it ignores the signals, a gap the
    wrapper documents; a loaded machine can stretch it, so the test signals after it)."""
    try:
        children = psutil.Process(wrapper.pid).children()
        agents = [p for p in children if "torchrun" in " ".join(p.cmdline())]
        waiting = any(p.cmdline()[:1] == ["sleep"] for p in children)
        return bool(agents) and not agents[0].children() and waiting
    except psutil.Error:
        return False


@pytest.mark.parametrize("moment", ["rank_ready", "before_the_rank"])
def test_node_wrapper_hands_sigusr1_to_the_ranks(tmp_path, moment):
    """Slurm signalling the task's process group (or just the wrapper) must reach the ranks and
    must not kill torchrun, also when it comes before torchrun has started them (the wrapper keeps it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "worker.py").write_text(WORKER)
    (bin_dir / "torchrun").write_text(f"#!{sys.executable}\n" + FAKE_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    result, go = tmp_path / "rank0", tmp_path / "torchrun_go"
    if moment == "rank_ready":
        go.touch()  # torchrun starts its rank at once
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_TORCHRUN_GO": str(go)}
    # exactly as the job runs it: the wrapper's text with bash -c
    wrapper = subprocess.Popen(["bash", "-c", slurm.read_node_wrapper(), "torchrun_node.sh",
                                str(tmp_path / "worker.py"), str(result)],
                               cwd=tmp_path, env=env, start_new_session=True)
    try:
        deadline = time.time() + 30
        while not ((tmp_path / "rank0.ready").exists() if moment == "rank_ready" else torchrun_without_rank(wrapper)):
            assert time.time() < deadline and wrapper.poll() is None
            time.sleep(0.02)
        os.killpg(wrapper.pid, signal.SIGUSR1)  # what proctrack/pgid does; cgroup also hits the rank
        if moment == "before_the_rank":
            assert not (tmp_path / "rank0.ready").exists()
            time.sleep(0.2)  # the signal lands while torchrun still holds its rank back, however loaded the machine
            go.touch()
        assert wrapper.wait(30) == 0  # torchrun survived and exited with the rank's status
    finally:
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)
    assert result.read_text() == "got SIGUSR1"


@pytest.mark.distributed
def test_script_trains_with_real_torchrun_and_continues_when_rerun(tmp_path, fakes):
    """The rendered script under fake srun/scontrol and the real torchrun (2 CPU ranks, c10d
    rendezvous): a job limited by train.max_steps_per_job stops at a checkpoint; running the same
    script again (what a requeue does) continues from it (checkpoint.resume=auto). The working
    directory is an empty one: torchrun runs -m launch.pretrain from the environment's dmc_train."""
    torchrun_dir = os.path.dirname(sys.executable)
    os.remove(os.path.join(os.environ["PATH"].split(os.pathsep)[0], "torchrun"))  # use the real one
    workdir = tmp_path / "work"
    workdir.mkdir()
    job = spec(tmp_path, nodes=1, gpus_per_node=2, setup=[f"export PATH={torchrun_dir}:$PATH"], port=free_port(),
               workdir=str(workdir),
               overrides=["+recipe=tiny_pretrain", "train.max_steps=4", "train.max_steps_per_job=2",
                          "checkpoint.save_interval=0", "logging.progress=false"])
    script = slurm.render(job)
    # The job's environment provides dmc_train: installed (pip install -r requirements.txt does), or
    # - in a venv without the install - the checkout through PYTHONPATH, like every test subprocess.
    env = dict(SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", SLURM_CPUS_ON_NODE="2", FAKE_HOSTS="localhost",
               PYTHONPATH=ROOT)
    for attempt, steps in ((0, 2), (1, 4)):
        proc = run_script(script, tmp_path, SLURM_RESTART_COUNT=str(attempt), **env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert f"done: {steps} steps" in proc.stdout
        assert (tmp_path / "run" / "checkpoints" / "latest").exists()
    assert "resumed from" in proc.stdout


def test_hydra_submitit_launcher_config_composes():
    """recipes/hydra/launcher/slurm_gpu.yaml extends the plugin's submitit_slurm (if installed)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dmc_train.recipes import recipes_dir, register_schema

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=recipes_dir(), version_base=None):
        cfg = compose("config", ["+recipe=tiny_pretrain", "hydra/launcher=slurm_gpu", "hydra.launcher.nodes=2"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.gpus_per_node, launcher.tasks_per_node) == (2, 8, 8)
    assert launcher.signal_delay_s == 300 and launcher.additional_parameters.requeue is True
    assert list(launcher.setup) == []  # the tasks use the installed dmc_train

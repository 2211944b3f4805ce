"""Fault injection, table-driven: bad config, corrupt checkpoints, bad data, a full or read-only disk,
divergence.

Each case copies a finished base run (``iter_0000002``, ``iter_0000004``, ``latest``, ``metrics.jsonl``),
breaks something (``prep``), runs ``launch/pretrain.py`` with the case's overrides and checks the
outcome: a rejected run prints exactly one ``error:`` line (no traceback, exit code 2, or 3 for
divergence) and leaves the run directory byte-for-byte as it was (a fresh run directory is not even
created); a run that goes ahead leaves every existing checkpoint byte-for-byte untouched (one it set
aside, ``iter_N.damaged-*`` or ``iter_N.replaced-*``, under its new name; only ``keep_last`` may prune
one of the run's own). All single-process cases run in one process (tests/scripts/fault_cases.py);
torchrun cases are launched separately.
"""

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest

from tests.helpers import run

pytestmark = pytest.mark.slow

COMMON = ["+recipe=tiny_pretrain", "train.eval_interval=0", "logging.progress=false", "checkpoint.save_interval=2"]
BASE = [*COMMON, "train.max_steps=4"]
CKPT2, CKPT4 = "checkpoints/iter_0000002", "checkpoints/iter_0000004"


class Unavailable(Exception):
    """This machine cannot set the fault up (e.g. mounting needs root): the case is skipped with the reason."""


def digests(run_dir: str) -> Optional[dict]:
    """{path relative to run_dir: sha256 of a file, or "dir"}; None if run_dir does not exist."""
    if not os.path.exists(run_dir):
        return None
    found = {}
    for root, dirs, files in os.walk(run_dir):
        for d in dirs:
            found[os.path.relpath(os.path.join(root, d), run_dir)] = "dir"
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, run_dir)] = hashlib.sha256(f.read()).hexdigest()
    return found


# ---- ways to break a run directory (each gets the copy of the base run; may return another run_dir) ----
def write(rel: str, data: bytes) -> Callable:
    def prep(run_dir):
        with open(os.path.join(run_dir, rel), "wb") as f:
            f.write(data)
    return prep


def truncate(rel: str, size: int) -> Callable:
    def prep(run_dir):
        os.truncate(os.path.join(run_dir, rel), size)
    return prep


def drop_meta_key(key: str) -> Callable:
    def prep(run_dir):
        path = os.path.join(run_dir, CKPT4, "meta.json")
        with open(path) as f:
            meta = json.load(f)
        del meta[key]
        with open(path, "w") as f:
            json.dump(meta, f)
    return prep


def remove_meta_4(run_dir):
    """iter_0000004 loses its completeness marker after it was written (the shards are intact)."""
    os.remove(os.path.join(run_dir, CKPT4, "meta.json"))


def with_set_aside_and_newer(run_dir):
    """Beside the run's checkpoints: a directory an earlier run set aside and a complete iter_0000010 (as a
    run resumed from an older checkpoint leaves newer ones behind)."""
    ckpts = os.path.join(run_dir, "checkpoints")
    shutil.copytree(os.path.join(ckpts, "iter_0000002"), os.path.join(ckpts, "iter_0000005.damaged-20250101-000000"))
    shutil.copytree(os.path.join(ckpts, "iter_0000004"), os.path.join(ckpts, "iter_0000010"))


def killed_after_step_4(run_dir):
    """Steps 3-4 were logged, then the run was killed before iter_0000004 was complete."""
    shutil.rmtree(os.path.join(run_dir, CKPT4))
    write("checkpoints/latest", b"iter_0000002")(run_dir)


def fresh(run_dir):
    shutil.rmtree(run_dir)


def short_corpus(run_dir):
    """A fresh run directory and, beside it, an indexed dataset of a few tokens (fewer than one sequence)."""
    from dmc_train.data.prepare import prepare_corpus
    from dmc_train.data.tokenizer import train_sentencepiece
    from tests.test_data_tokenizer import tiny_docs

    fresh(run_dir)
    case_dir = os.path.dirname(run_dir)
    tokenizer = os.path.join(case_dir, "tok.model")
    train_sentencepiece(tiny_docs(30), tokenizer, vocab_size=330)
    with open(os.path.join(case_dir, "tiny.txt"), "w") as f:
        f.write("To be, or not to be.\n")
    prepare_corpus([os.path.join(case_dir, "tiny.txt")], os.path.join(case_dir, "data", "tiny"),
                   tokenizer=tokenizer, progress=False, log=lambda *_: None)


def mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode:
        raise Unavailable(f"mount {' '.join(args)} failed ({proc.stderr.strip()}); needs root")


def small_disk(run_dir):
    """The run (killed after step 4, so it resumes at 2) on a 5 MiB tmpfs: room for iter_0000002 (3.3 MiB)
    but not for the next checkpoint."""
    killed_after_step_4(run_dir)
    mnt = tmpfs(run_dir, "small", "size=5m")
    shutil.copytree(run_dir, os.path.join(mnt, "run"))
    return os.path.join(mnt, "run")


def tmpfs(run_dir, name: str, options: str) -> str:
    """A tmpfs mounted with ``options`` at ``<run_dir's parent>/<name>``; returns the mount point."""
    mnt = os.path.join(os.path.dirname(run_dir), name)
    os.makedirs(mnt)
    mount("-t", "tmpfs", "-o", options, "tmpfs", mnt)
    return mnt


def tiny_disk(run_dir):
    """A fresh run directory on a 1 MiB tmpfs: the first checkpoint does not fit."""
    return os.path.join(tmpfs(run_dir, "tiny", "size=1m"), "run")


def disk_grown(run_dir):
    """The small_disk case's run directory after its tmpfs was grown to 40 MiB."""
    mnt = os.path.join(os.path.dirname(os.path.dirname(run_dir)), "disk_full", "small")
    if not os.path.ismount(mnt):
        raise Unavailable("the disk_full case did not run")
    mount("-o", "remount,size=40m", mnt)
    return os.path.join(mnt, "run")


def read_only_copy(run_dir):
    ro = os.path.join(os.path.dirname(run_dir), "ro")
    os.makedirs(ro)
    mount("--bind", run_dir, ro)
    mount("-o", "remount,bind,ro", ro)
    return ro


def read_only_fs(run_dir):
    return os.path.join(tmpfs(run_dir, "ro", "ro,size=1m"), "run")


# ---- the table --------------------------------------------------------------------------------------------
def unchanged(run_dir):
    pass


@dataclass
class Case:
    id: str
    prep: Callable = unchanged
    overrides: list = field(default_factory=list)  # "{run_dir}" / "{case_dir}" are filled in
    error: Optional[list] = None  # fragments of the one error line; None: the run goes ahead
    output: list = field(default_factory=list)  # fragments expected in stdout + stderr
    steps: Optional[list] = None  # the steps in metrics.jsonl afterwards, each once
    trains: bool = False  # an error case that trains before failing: only the checkpoints are unchanged
    max_file_bytes: Optional[int] = None  # RLIMIT_FSIZE while the case runs (SIGXFSZ ignored)
    check: Optional[Callable] = None  # more assertions: check(run_dir, result)
    code: int = 2  # the exit code of an error case (3: diverged)
    pruned: list = field(default_factory=list)  # existing checkpoints checkpoint.keep_last may delete


def newer_checkpoints_kept(names):
    def check(run_dir, result):
        with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
            assert f.read() == names[-1]
        assert sorted(n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.startswith("iter_")) == names
    return check


def lr_applied(run_dir, result):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = {r["step"]: r for r in map(json.loads, f)}
    # cosine from 0.01 to 0.001 over 6 steps after 2 warm-up steps, at step count 4: halfway (the
    # checkpoint's schedule, 1e-3 decaying over 4 steps, would give 1e-4)
    assert rows[5]["lr"] == pytest.approx(0.0055)
    with open(os.path.join(run_dir, "config.yaml")) as f:
        assert "lr: 0.01\n" in f.read()


def set_aside(result, name: str) -> list[str]:
    """The names ``iter_N.<why>-<time>`` under which the run set ``name`` aside."""
    return sorted({k.split("/")[1] for k in result["after"] if k.startswith(f"checkpoints/{name}.")})


def damaged_set_aside(run_dir, result):
    assert [n.split("-")[0] for n in set_aside(result, "iter_0000004")] == ["iter_0000004.damaged"]
    assert "is missing or invalid" not in result["stdout"]  # latest is not blamed: it names the damaged one
    names = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert [n.split("-")[0] for n in names] == ["iter_0000002", "iter_0000004", "iter_0000004.damaged", "iter_0000006",
                                                "latest"], names
    with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
        assert f.read() == "iter_0000006"


def nothing_saved_after_divergence(run_dir, result):
    assert {k for k in result["after"] if k.startswith("checkpoints/")} == \
        {k for k in result["before"] if k.startswith("checkpoints/")}


def replaced_and_spared(run_dir, result):
    names = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert [n.split("-")[0] for n in names] == ["iter_0000004.replaced", "iter_0000005.damaged", "iter_0000006",
                                                "iter_0000010", "latest"], names


def no_partial_write(run_dir, result):  # as left by the failed save (the next case resumes in run_dir)
    assert not [k for k in result["after"] if k.startswith("checkpoints/iter_0000004")]
    assert result["after"]["checkpoints/latest"] == result["before"]["checkpoints/latest"]


RESUME2 = "checkpoint.resume={run_dir}/checkpoints/iter_0000002"
UNREADABLE = ["checkpoint {run_dir}/checkpoints/iter_0000004 could not be read", "truncated or corrupt", RESUME2]
CASES = [
    # bad config: refused before anything is written (a fresh run_dir is not created)
    Case("vocab_too_small", fresh, ["model.vocab_size=1"],
         error=["config error: model.vocab_size=1 is not allowed; use an integer >= 2"]),
    Case("lr_nan", fresh, ["optim.lr=nan"], error=["config error: optim.lr=nan is not allowed"]),
    Case("global_batch", fresh, ["train.global_batch_size=7"],
         error=["config error: train.global_batch_size=7 is not divisible by train.micro_batch_size"]),
    Case("max_nonfinite_zero", unchanged, ["train.max_nonfinite_steps=0"],
         error=["train.max_nonfinite_steps=0 is not allowed"]),
    Case("resume_path_missing", fresh, ["checkpoint.resume={case_dir}/nowhere"],
         error=["checkpoint {case_dir}/nowhere does not exist"]),
    # bad data
    Case("corpus_shorter_than_a_sequence", short_corpus,
         ["data.kind=indexed", "data.prefixes=[{case_dir}/data/tiny]", "model.vocab_size=4096"],
         error=["{case_dir}/data/tiny holds", "fewer than one training sequence (train.seq_length + 1 = 65)"]),
    # corrupt checkpoints: the message names the newest complete checkpoint to resume from
    Case("meta_lacks_config", drop_meta_key("config"), ["train.max_steps=6"],
         error=["checkpoint {run_dir}/checkpoints/iter_0000004 has a corrupt meta.json (it lacks config)", RESUME2]),
    Case("meta_lacks_layout", drop_meta_key("layout"), ["train.max_steps=6"], error=["(it lacks layout)", RESUME2]),
    Case("metadata_missing", lambda d: os.remove(os.path.join(d, CKPT4, ".metadata")), ["train.max_steps=6"],
         error=UNREADABLE),
    Case("metadata_truncated", truncate(f"{CKPT4}/.metadata", 50), ["train.max_steps=6"], error=UNREADABLE),
    Case("shard_truncated", truncate(f"{CKPT4}/__0_0.distcp", 100), ["train.max_steps=6"], error=UNREADABLE),
    Case("unknown_key", unchanged, ["+foo.bar=1"],
         error=["config error: foo.bar is not a key of the config schema; the closest known key is"]),
    Case("latest_binary_garbage_explicit", write("checkpoints/latest", b"\xff\xfe\x00garbage"),
         ["checkpoint.resume={run_dir}"],
         error=["checkpoint pointer {run_dir}/checkpoints/latest is invalid",
                "checkpoint.resume={run_dir}/checkpoints/iter_0000004"]),
    Case("weights_only_over_checkpoints", unchanged, ["train.max_steps=6", "checkpoint.load_optimizer=false"],
         error=["checkpoint.load_optimizer=false restarts at step 0 and would overwrite the checkpoints in "
                "{run_dir}/checkpoints (newest iter_0000004)",
                "checkpoint.init_from={run_dir}/checkpoints/iter_0000004"]),
    # read-only file systems: refused before any work
    Case("read_only_run_dir", read_only_copy, ["train.max_steps=6"],
         error=["run_dir {run_dir} is not writable", "use a run_dir on a writable file system"]),
    Case("read_only_new_run_dir", read_only_fs, [], error=["run_dir {run_dir} is not writable"]),
    # a full disk while saving: one line, partial write removed, latest untouched; then the run resumes
    Case("disk_full", small_disk, ["train.max_steps=6"],
         error=["no space left writing checkpoint {run_dir}/checkpoints/iter_0000004: it needs about 3.",
                "the partial write was removed and checkpoints/latest still names iter_0000002"],
         trains=True, check=no_partial_write),
    Case("disk_full_first_save", tiny_disk, ["train.max_steps=2"], trains=True,
         error=["no space left writing checkpoint {run_dir}/checkpoints/iter_0000002: it needs about 3.",
                "the partial write was removed and no earlier checkpoint exists"]),
    Case("file_size_limit", unchanged, ["train.max_steps=6"], trains=True, max_file_bytes=1_000_000,
         error=["a file size limit or quota stopped writing checkpoint {run_dir}/checkpoints/iter_0000006 "
                "(it needs about 3.",
                "checkpoints/latest still names iter_0000004"]),
    Case("disk_full_then_resumed", disk_grown, ["train.max_steps=6"], output=["at step 2"],
         steps=[1, 2, 3, 4, 5, 6], check=newer_checkpoints_kept(["iter_0000002", "iter_0000004", "iter_0000006"])),
    # runs that go ahead
    Case("latest_names_older", write("checkpoints/latest", b"iter_0000002"), ["train.max_steps=6"],
         output=["checkpoints/latest names iter_0000002, but iter_0000004 is newer and complete",
                 "resumed from {run_dir}/checkpoints/iter_0000004 at step 4"], steps=[1, 2, 3, 4, 5, 6]),
    Case("killed_before_checkpoint", killed_after_step_4, ["train.max_steps=5"], output=["at step 2"],
         steps=[1, 2, 3, 4, 5]),
    # a damaged checkpoint is set aside, never saved over; the run falls back to the newest complete one
    Case("meta_json_removed", remove_meta_4, ["train.max_steps=6"],
         output=["checkpoint iter_0000004 is damaged: its meta.json is missing ({run_dir}/checkpoints/iter_0000004/"
                 "meta.json); it is kept as checkpoints/iter_0000004.damaged-", "resuming from iter_0000002",
                 "resumed from {run_dir}/checkpoints/iter_0000002 at step 2"],
         steps=[1, 2, 3, 4, 5, 6], check=damaged_set_aside),
    # keep_last prunes the run's own checkpoints up to the one saved: never a set-aside or a newer one;
    # a complete checkpoint of an earlier run at a step the run saves again is set aside, not replaced
    Case("keep_last_and_resave", with_set_aside_and_newer,
         ["train.max_steps=6", "checkpoint.keep_last=1", "checkpoint.resume={run_dir}/checkpoints/iter_0000002"],
         output=["checkpoint iter_0000004 of an earlier run is kept as checkpoints/iter_0000004.replaced-"],
         pruned=["iter_0000002"], check=replaced_and_spared),
    # real divergence: nothing is saved after a non-finite loss, and the message says so
    Case("diverged", unchanged, ["train.max_steps=12", "optim.lr=1e10"], code=3, trains=True,
         error=["training stopped at step 10: 5 consecutive steps with a non-finite loss or gradient; the current "
                "weights produced them and are not saved; the newest checkpoint is "
                "{run_dir}/checkpoints/iter_0000004, saved before the streak"], check=nothing_saved_after_divergence),
    Case("lr_changed_on_resume", unchanged, ["train.max_steps=6", "optim.lr=0.01"],
         output=["optimizer settings differ from checkpoint iter_0000004 (optim.lr: 0.001 -> 0.01)",
                 "the new values apply from its step 4 on"], steps=[1, 2, 3, 4, 5, 6], check=lr_applied),
    Case("warmup_longer_than_run", unchanged, ["train.max_steps=5", "optim.warmup_steps=100"],
         output=["warning: optim.warmup_steps=100 is not below the run's 5 steps"], steps=[1, 2, 3, 4, 5]),
]


def unmount_under(path) -> None:
    mounts = [line.split()[1] for line in open("/proc/mounts") if line.split()[1].startswith(str(path))]
    for mnt in sorted(mounts, reverse=True):
        subprocess.run(["umount", mnt], check=False)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The fault cases' directory; ``work/base`` is the base run once ``results`` ran."""
    work = tmp_path_factory.mktemp("faults")
    yield work
    unmount_under(work)


@pytest.fixture(scope="module")
def results(work):
    run(["tests/scripts/fault_cases.py", str(work), str(work / "results.json")], timeout=900)
    with open(work / "results.json") as f:
        return json.load(f)


def where_now(result, key: str) -> Optional[str]:
    """The digest of the file ``key`` after the run: under the name its checkpoint was set aside as, if it was."""
    parts = key.split("/")
    aside = set_aside(result, parts[1]) if len(parts) > 1 else []
    if aside:
        assert len(aside) == 1, aside
        key = "/".join([parts[0], aside[0], *parts[2:]])
    return result["after"].get(key)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(results, case):
    r = results[case.id]
    if "skipped" in r:
        pytest.skip(r["skipped"])
    run_dir = r["run_dir"]
    fill = [s.format(run_dir=run_dir, case_dir=os.path.dirname(run_dir)) for s in (case.error or case.output)]
    assert "Traceback" not in r["stderr"], r["stderr"][-3000:]
    if case.error is not None:
        errors = [line for line in r["stderr"].splitlines() if line.startswith("error: ")]
        assert r["code"] == case.code and len(errors) == 1, (r["code"], r["stderr"][-3000:])
        for fragment in fill:
            assert fragment in errors[0], errors[0]
        if not case.trains:
            assert r["after"] == r["before"], "the run directory changed"
    else:
        assert r["code"] == 0, r["stderr"][-3000:]
        for fragment in fill:
            assert fragment in r["stdout"] + r["stderr"]
    kept = {k: v for k, v in (r["before"] or {}).items()
            if k.startswith("checkpoints/iter_") and k.split("/")[1] not in case.pruned}
    assert {k: where_now(r, k) for k in kept} == kept, "an existing checkpoint changed"
    if case.steps is not None:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            assert [json.loads(line)["step"] for line in f] == case.steps
    if case.check is not None:
        case.check(run_dir, r)



@pytest.mark.distributed
def test_config_error_under_torchrun(tmp_path):
    """Every rank checks the config before Hydra starts; rank 0 reports the error in one line and the other
    rank, which waits before reporting, is stopped by torchrun. Nothing is created."""
    run_dir = tmp_path / "run"
    proc = run(["launch/pretrain.py", *COMMON, f"run_dir={run_dir}", "train.global_batch_size=6"], nproc=2,
               check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0] == ("error: config error: train.global_batch_size=6 is not divisible by train.micro_batch_size "
                         "x data-parallel size = 2x2")
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]  # torchrun's report: the user-error exit code
    assert not run_dir.exists()


@pytest.mark.distributed
def test_disk_full_under_torchrun(work, results, tmp_path):
    """Both ranks write shards; the one that cannot reports through rank 0, every rank stops, the partial
    write is removed and latest is untouched."""
    try:
        run_dir = small_disk(str(shutil.copytree(work / "base", tmp_path / "run")))
    except Unavailable as e:
        pytest.skip(str(e))
    try:
        before = digests(os.path.join(run_dir, "checkpoints"))
        proc = run(["launch/pretrain.py", *COMMON, f"run_dir={run_dir}", "train.max_steps=6"], nproc=2, check=False,
                   timeout=300)
        after = digests(os.path.join(run_dir, "checkpoints"))
    finally:
        unmount_under(tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert f"no space left writing checkpoint {run_dir}/checkpoints/iter_0000004" in errors[0]
    assert "checkpoints/latest still names iter_0000002" in errors[0]
    assert "exitcode  : 2" in proc.stderr
    assert after == before

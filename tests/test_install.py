"""The package stands on its own: a wheel built from this checkout and installed outside it runs the
entry points (``python -m launch.pretrain`` under torchrun, ``launch.evaluate``, ``launch.submit``,
a console script) and finds its recipes and SLURM files, with no checkout on ``sys.path``.

How the checkout is kept out of the subprocesses: the wheel goes into ``<tmp>/site`` with
``pip install --target``; each command runs with ``PYTHONPATH=<tmp>/site`` (and no other
PYTHONPATH) from an empty directory, so ``sys.path`` is [that directory, <tmp>/site, the standard
library, this interpreter's site-packages]. An editable install of the project (``pip install -r
requirements.txt`` makes one) cannot shadow the wheel: setuptools' editable finder sits after the
path-based import on ``sys.meta_path``, and PYTHONPATH entries come before the site-packages
``.pth`` entries - and the test checks where ``dmc_train`` and ``launch`` were imported from.

Plus two fast structural checks: pyproject.toml lists every package and recipe directory, and no
entry point, benchmark or test script patches ``sys.path``.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_LEVEL = ["dmc_train", "kernels", "checkpoints_tools", "launch"]
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "venv", "runs", "data_cache", "outputs", "wandb", "build",
                                    "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*.pyc")


# ------------------------------------------------------------------------------------------
# Fast checks
# ------------------------------------------------------------------------------------------
def test_pyproject_lists_every_package_and_recipe_dir():
    find_packages = pytest.importorskip("setuptools").find_packages

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    code = set(find_packages(ROOT, include=[f"{t}*" for t in TOP_LEVEL]))
    recipes = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "recipes")):
        if any(f.endswith(".yaml") for f in files):
            rel = os.path.relpath(dirpath, os.path.join(ROOT, "recipes"))
            recipes.add("dmc_train._recipes" + ("" if rel == "." else "." + rel.replace(os.sep, ".")))
            parts = rel.split(os.sep)  # parents of a nested group are packages too
            for i in range(1, len(parts)):
                recipes.add("dmc_train._recipes." + ".".join(parts[:i]))
    wanted = code | recipes
    assert not wanted - listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(wanted - listed)}"
    assert not listed - wanted, f"remove from [tool.setuptools] packages in pyproject.toml: {sorted(listed - wanted)}"


def _python_files(*dirs):
    for d in dirs:
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, d)):
            dirnames[:] = [n for n in dirnames if n != "__pycache__"]
            yield from (os.path.join(dirpath, f) for f in files if f.endswith(".py"))


def test_nothing_patches_sys_path():
    """Entry points, benchmarks and test scripts import the installed package (``pip install -r
    requirements.txt`` installs the checkout editable); that the library never imports the entry
    points' ``dmc_train.cli`` is part of tests/test_layering.py."""
    patched = [os.path.relpath(p, ROOT) for p in _python_files("dmc_train", "kernels", "launch", "checkpoints_tools",
                                                                "benchmarks", "tests")
               if os.path.realpath(p) != os.path.realpath(__file__)
               and ("sys.path.insert" in open(p).read() or "sys.path.append" in open(p).read())]
    assert not patched, f"sys.path patched in {patched}: import the installed package instead"


# ------------------------------------------------------------------------------------------
# The wheel, installed outside the checkout
# ------------------------------------------------------------------------------------------
def _setuptools_can_build_here() -> bool:
    """True if this interpreter can build the wheel without downloading build requirements
    (setuptools >= 70.1 builds wheels itself; older ones need the ``wheel`` package)."""
    try:
        major, minor = (int(x) for x in version("setuptools").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (70, 1) or ((major, minor) >= (68, 0) and importlib.util.find_spec("wheel") is not None)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site, cwd, env): the wheel installed into ``site``; an empty working directory; the environment."""
    tmp = tmp_path_factory.mktemp("install")
    src, wheels, site, cwd = tmp / "src", tmp / "wheels", tmp / "site", tmp / "cwd"
    # build from a copy: nothing (build/, *.egg-info) is left in the checkout, which others may be using
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    # pip's default build isolation would download setuptools; skip it when this interpreter can build
    flags = ["--no-build-isolation"] if _setuptools_can_build_here() else []
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    proc = subprocess.run([*pip, "wheel", "--no-deps", *flags, str(src), "-w", str(wheels)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (wheel,) = wheels.glob("dmc_train-*.whl")
    proc = subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "DMC_TRAIN_RECIPES")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    return site, cwd, env


def _run(installed, *args, timeout=300):
    site, cwd, env = installed
    proc = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, args))}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


IMPORTS_AND_RECIPES = """
import os, sys
root, site = sys.argv[1], os.path.realpath(sys.argv[2])
assert root not in [os.path.realpath(p or os.getcwd()) for p in sys.path], sys.path
import checkpoints_tools, dmc_train, kernels, launch
for m in (dmc_train, kernels, checkpoints_tools, launch):
    assert os.path.realpath(m.__file__).startswith(site + os.sep), (m.__name__, m.__file__)
from dmc_train.cluster import slurm
from dmc_train.recipes import load_config, recipes_dir, validate
assert recipes_dir() == os.path.join(site, "dmc_train", "_recipes"), recipes_dir()
assert slurm.slurm_dir() == os.path.join(site, "launch", "slurm"), slurm.slurm_dir()
cfg = load_config(["+recipe=base_tiny", "train.max_steps=7"])
assert (cfg.model.name, cfg.train.max_steps, cfg.method.name) == ("base_tiny", 7, "none"), cfg
validate(load_config(["+recipe=tiny_pretrain"]), world_size=1)
print("ok")
"""


@pytest.mark.slow
def test_wheel_ships_the_recipe_tree_slurm_files_and_the_cpu_kernel_source(installed):
    site = installed[0]

    def tree(path):
        return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, files in os.walk(path)
                      for f in files if f.endswith(".yaml"))

    assert tree(site / "dmc_train" / "_recipes") == tree(os.path.join(ROOT, "recipes"))
    for name in ("train.sbatch.tmpl", "torchrun_node.sh"):
        with open(site / "launch" / "slurm" / name) as shipped, open(os.path.join(ROOT, "launch", "slurm", name)) as f:
            assert shipped.read() == f.read()
    for source in ("paged/cpu_kernel.c", "layer/cpu_kernel.c", "eviction/cpu_kernel.c", "cpu_math.h"):  # built on use
        assert (site / "kernels" / source).exists()
    assert not (site / "recipes").exists() and not (site / "tests").exists() and not (site / "benchmarks").exists()


@pytest.mark.slow
def test_installed_package_imports_and_composes_without_the_checkout(installed):
    proc = _run(installed, sys.executable, "-c", IMPORTS_AND_RECIPES, os.path.realpath(ROOT), str(installed[0]))
    assert proc.stdout.strip() == "ok"


@pytest.mark.slow
def test_installed_entry_points_train_evaluate_and_submit(installed):
    site, cwd, _ = installed
    common = ["+recipe=tiny_pretrain", "train.max_steps=2", "train.eval_interval=0", "checkpoint.save_interval=0",
              "logging.progress=false"]
    proc = _run(installed, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                f"--master_port={_free_port()}", "-m", "launch.pretrain", *common, "parallel.tensor=2")
    assert "done: 2 steps" in proc.stdout, proc.stdout[-2000:]
    run_dir = cwd / "runs" / "tiny_pretrain"  # the recipe's relative run_dir, under the working directory
    assert (run_dir / "checkpoints" / "latest").exists() and (run_dir / "config.yaml").exists()

    proc = _run(installed, sys.executable, "-m", "launch.evaluate", *common)
    assert (run_dir / "eval.json").exists(), proc.stdout[-2000:]

    proc = _run(installed, sys.executable, "-m", "launch.submit", "+recipe=tiny_pretrain", "--nodes", "1",
                "--gpus-per-node", "2", "--dry-run")
    assert f"\ncd {cwd}  #" in proc.stdout and "-m launch.pretrain +recipe=tiny_pretrain" in proc.stdout
    assert "launch/pretrain.py" not in proc.stdout and "trap '' USR1" in proc.stdout  # wrapper inlined

    _run(installed, sys.executable, "-m", "launch.estimate_memory", "+recipe=tiny_pretrain", "--world-size", "1")
    for module in ("launch.prepare_data", "checkpoints_tools.convert_gqa"):
        assert "usage:" in _run(installed, sys.executable, "-m", module, "--help").stdout
    assert "usage:" in _run(installed, str(site / "bin" / "dmc-submit"), "--help").stdout  # a console script


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

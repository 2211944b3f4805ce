"""Entry points of dmc_train, installed with the package (``pip install .``).

Run them as modules or, in a checkout, as scripts; both need ``dmc_train`` importable (installed, or
the checkout as the current directory for ``-m``) and neither touches ``sys.path``:

    python -m launch.pretrain +recipe=tiny_pretrain           # or: python launch/pretrain.py ...
    torchrun --nproc_per_node=2 -m launch.pretrain +recipe=tiny_pretrain parallel.tensor=2
    python -m launch.evaluate | launch.prepare_data | launch.submit | launch.estimate_memory

Console scripts with the same behaviour: ``dmc-pretrain``, ``dmc-evaluate``, ``dmc-prepare-data``,
``dmc-submit``, ``dmc-estimate-memory`` (pyproject.toml). ``slurm/`` is package data: the job template
and the per-node torchrun wrapper that ``launch.submit`` renders into a self-contained sbatch script.
"""

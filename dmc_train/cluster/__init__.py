"""Cluster tooling: SLURM job rendering/submission (``slurm``) and memory planning (``memory``).

Nothing here imports megatron; ``launch/submit.py`` and ``launch/estimate_memory.py`` stay fast.
"""

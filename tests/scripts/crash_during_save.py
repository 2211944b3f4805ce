"""Train the tiny model, checkpoint at step 1, then crash while writing the step-2 checkpoint.

    python tests/scripts/crash_during_save.py RUN_DIR during_write|before_rename

``during_write``: the process dies after dist_checkpointing wrote part of the files (one is truncated);
``before_rename``: it dies after meta.json is written but before the directory is renamed.
Run by tests/test_checkpoint_atomic.py, which then checks that ``latest`` still names step 1.
"""

import os
import sys


def main(run_dir: str, mode: str) -> None:
    from dmc_train.recipes import load_config
    from dmc_train.training import checkpoint_save
    from dmc_train.training.checkpoint_dirs import META
    from dmc_train.training.loop import train

    def die():
        import psutil

        for child in psutil.Process().children(recursive=True):  # dist_checkpointing's helper processes
            child.kill()
        os._exit(9)

    real_save, real_publish = checkpoint_save.dist_checkpointing.save, checkpoint_save._publish

    def crash_in_write(state, path, *a, **k):
        real_save(state, path, *a, **k)
        if path.endswith("iter_0000002.tmp"):
            files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
            with open(os.path.join(path, files[0]), "r+b") as f:
                f.truncate(10)
            die()

    def crash_before_rename(cfg, tmp, final, meta):
        if final.endswith("iter_0000002"):
            with open(os.path.join(tmp, META), "w") as f:
                f.write("{}")
            die()
        real_publish(cfg, tmp, final, meta)

    if mode == "during_write":
        checkpoint_save.dist_checkpointing.save = crash_in_write
    else:
        checkpoint_save._publish = crash_before_rename
    train(load_config(["+recipe=tiny_pretrain", f"run_dir={run_dir}", "train.max_steps=3",
                       "checkpoint.save_interval=1", "train.eval_interval=0", "logging.progress=false"]))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

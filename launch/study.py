"""Every method at equal memory: run the study's cells (train what a cell needs, evaluate it), then time
every finished cell's decoding in one process and write RESULTS.md with its table and plots.

    python launch/study.py                 # preset full on base_tiny_long (trained first when missing)
    python launch/study.py --quick         # two methods at one budget, minutes
    python launch/study.py preset=quickstart docs=false
    python launch/study.py --multirun cell=gqa2,dmc2 hydra/launcher=submitit_slurm   # one job per cell

Settings: ``recipes/study.yaml``; cells and presets: ``dmc_train/evaluation/study.py``; docs/EVALUATION.md.
Finished cells are skipped (their ``<out>/cells/<name>.json``), so an interrupted study resumes.
"""

import dataclasses
import json
import os
import shlex
import signal
import sys
import time

from dmc_train import cli


def study_app(cfg) -> None:
    from dmc_train.evaluation import study
    from launch import study_report

    t0 = time.perf_counter()

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f}s] {line}", flush=True)

    def run():
        presets = study.presets()
        if cfg.preset not in presets:
            raise study.ConfigError(f"unknown preset {cfg.preset!r}; the presets are {', '.join(presets)}")
        preset = presets[cfg.preset]
        if cfg.base:  # another base model: its recipe overrides
            preset = dataclasses.replace(preset, base=tuple(cfg.base))
        if cfg.max_sequences:
            preset = dataclasses.replace(preset, max_sequences=cfg.max_sequences)
        out = os.path.abspath(cfg.out)
        cells = study.select(preset, [cfg.cell] if cfg.cell else list(cfg.cells))
        for i, cell in enumerate(cells):
            say(f"cell {i + 1}/{len(cells)}: {cell.name}")
            study.run_cell(cell, preset, out, say, cfg.device)
        if cfg.cell or not cfg.report:
            return
        results = study.load_cells(out, list(preset.cells))
        speed = (study_report.decode_speed(results, preset, cfg.speed_rounds, say=say, device=cfg.device)
                 if cfg.speed_rounds else {})
        with open(os.path.join(out, "speed.json"), "w") as f:
            json.dump(speed, f, indent=1)
        args = [shlex.quote(a) for a in sys.argv[1:] if not a.startswith("cells=")]
        command = " ".join(["python launch/study.py", *args])
        sections = study_report.controlled_sections(out, results) if cfg.preset == "full" else []
        markdown = study_report.write(results, out, speed, [command.strip()], cfg.preset, preset,
                                      "docs" if cfg.docs else None, sections)
        print(markdown)
        say(f"wrote {os.path.join(out, study_report.file_names(cfg.preset)[0])}")

    try:
        cli.run_reporting_errors(run)
    except study.Stopped as e:
        cli.fail(str(e), 128 + signal.SIGTERM)


def main() -> None:
    sys.argv = [a if a != "--quick" else "preset=quick" for a in sys.argv]
    cli.hydra_main(study_app, config_name="study")


if __name__ == "__main__":
    main()

"""The study end to end on a seconds-scale base: launch/study.py trains the base, runs its cells (two
training-free policies at 1/4 of the bytes beside the vanilla cache), times their decoding and writes a
well-formed table and plot; a second run skips every finished cell. A retrofit cell trains its run first."""

import json
import os

from dmc_train.evaluation import study
from tests.helpers import run

BASE = ["+recipe=tiny_pretrain", "train.max_steps=4", "train.eval_interval=4", "checkpoint.save_interval=4"]


def test_quick_study_writes_the_table_and_plot_and_resumes(tmp_path):
    base = [*BASE, f"run_dir={tmp_path / 'base'}"]
    args = ["launch/study.py", "--quick", "base=[" + ",".join(f'"{a}"' for a in base) + "]",
            f"out={tmp_path / 'study'}", "max_sequences=4", "speed_rounds=1"]
    first = run(args).stdout
    out = tmp_path / "study"
    cells = sorted(p.stem for p in (out / "cells").iterdir())
    assert cells == ["h2o_1of4", "streaming_llm_1of4", "vanilla"]
    table = (out / "RESULTS.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 3 and all(r.count("|") == 12 for r in rows)
    vanilla = json.loads((out / "cells" / "vanilla.json").read_text())
    h2o = json.loads((out / "cells" / "h2o_1of4.json").read_text())
    assert vanilla["compression"] == 1.0 and h2o["budget"] == 16  # 1/4 of 64 tokens
    assert 3.0 < h2o["compression"] < 4.0  # 4x fewer entries, the policy's scores beside them
    assert "| vanilla | vanilla | 1 | 2,048 | 1.00× |" in table  # 2 x 4 layers x 8 heads x 8 channels x 4 B
    assert (out / "study_pareto.png").stat().st_size > 10_000
    speed = json.loads((out / "speed.json").read_text())
    assert speed["h2o_1of4"]["batch"] > speed["vanilla"]["batch"]
    assert "evaluating h2o_1of4" in first
    again = run(args).stdout
    assert "s] evaluating" not in again and "s] training" not in again  # every cell was finished


def test_a_retrofit_cell_trains_its_run_then_evaluates_it(tmp_path):
    preset = study.Preset(base=(*BASE, f"run_dir={tmp_path / 'base'}"), max_sequences=2, cells=())
    cell = study.Cell("gqa2", "GQA", 0.5, gqa_groups=4,
                      train=("+recipe=tiny_pretrain", "train.max_steps=2", "train.eval_interval=2",
                             "checkpoint.save_interval=2"))
    lines = []
    result = study.run_cell(cell, preset, str(tmp_path / "study"), lines.append)
    assert any(line.startswith("training the base model") for line in lines)
    assert any(line.startswith("training gqa2") for line in lines)
    assert os.path.exists(tmp_path / "study" / "runs" / "gqa2" / "checkpoints" / "latest")
    assert result["compression"] == 2.0 and result["cache"] == "full"  # 4 of 8 KV heads, every token
    assert study.run_cell(cell, preset, str(tmp_path / "study"), lines.append) == result  # skipped: the file

#!/usr/bin/env bash
# The main job on the embedded default: prepare the Shakespeare corpus, pretrain the base_tiny
# model (~15 min on 2 CPU cores), evaluate held-out perplexity against the unigram baseline, then
# compare KV-cache methods at equal memory on it (launch/study.py preset=quickstart: the full cache,
# H2O and StreamingLLM at 1/4 of the bytes, a short GQA 4x retrofit; a few minutes) and print the table.
# Every step is skipped when its output already exists (re-runs are cheap). Arguments go to the training run.
set -euo pipefail
cd "$(dirname "$0")/.."
python launch/prepare_data.py
python launch/pretrain.py +recipe=base_tiny "$@"
python launch/evaluate.py +recipe=base_tiny "$@"
python launch/study.py preset=quickstart

#!/usr/bin/env bash
# The main job on the embedded default: prepare the Shakespeare corpus, pretrain the base_tiny
# model (~15 min on 2 CPU cores), evaluate held-out perplexity against the unigram baseline.
# Every step is skipped when its output already exists (re-runs are cheap).
set -euo pipefail
cd "$(dirname "$0")/.."
python launch/prepare_data.py
python launch/pretrain.py +recipe=base_tiny "$@"
python launch/evaluate.py +recipe=base_tiny "$@"

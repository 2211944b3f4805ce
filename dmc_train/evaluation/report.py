"""Evaluation results as markdown: one row per (checkpoint, cache), read from the harness's JSON files."""

from __future__ import annotations

import json
import os
from typing import Any, Optional


def load_result(path: str) -> dict:
    """A result file written by ``launch/evaluate.py`` (``eval.json`` or ``eval_<cache>[_<budget>].json``)."""
    from dmc_train.errors import ConfigError

    try:
        with open(path) as f:
            result = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; run launch/evaluate.py first (it writes eval_<cache>.json "
                          f"in the run directory)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not a JSON result of launch/evaluate.py ({e})") from None
    result.setdefault("name", run_name(result.get("checkpoint", path)))
    return result


def run_name(checkpoint: str) -> str:
    """``runs/<name>/checkpoints/iter_N`` -> ``<name>``."""
    parts = os.path.normpath(checkpoint).split(os.sep)
    return parts[-3] if len(parts) >= 3 and parts[-2] == "checkpoints" else parts[-1]


def _cell(value: Any, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def budget_cell(entries: Optional[int], fraction: Optional[float]) -> str:
    """A budget both ways: ``64 (0.25)``, entries per (sequence, layer, KV head) and the fraction of the context."""
    if entries is None:
        return "—"
    return f"{entries}" + ("" if fraction is None else f" ({fraction:.3g})")


def markdown_table(results: list[dict], split: str = "test", reference: Optional[float] = None) -> str:
    """Rows of (name, cache, budget (entries and fraction of the evaluated sequence), compression, KV bytes/token,
    perplexity, Δ vs ``reference`` (default:
    the first row), next-token accuracy, the engine's perplexity on the decoded subset, decode tokens/s and
    the batch that fits the KV budget). Columns a result lacks (``eval.json`` of the trained model: no
    cache measures) show —."""
    lines = ["| model | cache | budget | compression | KV bytes/token | perplexity | Δ | accuracy | "
             "engine ppl (subset) | decode tok/s | batch |", "|---" * 11 + "|"]
    for r in results:
        m = r.get(split, {}) if isinstance(r.get(split), dict) else {}
        ppl = r.get(f"{split}_ppl")
        if reference is None:
            reference = ppl
        inc, dec = m.get("incremental", {}), m.get("decode", {})
        delta = None if ppl is None or reference is None else ppl - reference
        budget = budget_cell(r.get("budget"), r.get("budget_fraction"))
        lines.append(f"| {r['name']} | {r.get('cache', 'model')} | {budget} | "
                     f"{_cell(m.get('compression'), '.2f')}× | {_cell(m.get('kv_bytes_per_token'), ',.0f')} | "
                     f"{_cell(ppl, '.2f')} | {_cell(delta, '+.2f')} | {_cell(r.get(f'{split}_accuracy'), '.3f')} | "
                     f"{_cell(inc.get('ppl_engine'), '.2f')} | {_cell(dec.get('decode_tokens_per_s'), ',.0f')} | "
                     f"{_cell(dec.get('batch'), '')} |")
    return "\n".join(lines)

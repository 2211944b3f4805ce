"""DMC models inside Hugging Face transformers: the self-contained modeling file shipped with a DMC export.

The exporter writes ``config.json`` and the weights (``LlamaForCausalLM`` names, unchanged) and calls

    settings = dmc_settings_from_method(cfg.method, head_dim)       # the project's method -> dmc_* fields
    hf_config = write_dmc_files(out_dir, hf_config, settings)      # copies modeling_dmc_llama.py, README.md

to turn a Llama ``config.json`` dict into a ``dmc_llama`` one that
``AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)`` loads. The modeling file
(``modeling_dmc_llama.py``) imports only torch and transformers.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

from dmc_train.errors import ConfigError

MODELING_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "modeling_dmc_llama.py")
MODULE = "modeling_dmc_llama"
AUTO_MAP = {"AutoConfig": f"{MODULE}.DMCLlamaConfig", "AutoModelForCausalLM": f"{MODULE}.DMCLlamaForCausalLM"}
DMC_FIELDS = ("dmc_decision_channel", "dmc_init_offset", "dmc_accumulation", "dmc_window", "dmc_shared_decisions")

MODEL_CARD = """\
# DMC model (Dynamic Memory Compression)

A Llama model retrofitted with DMC by `dmc_train`. The weights are plain `LlamaForCausalLM` weights;
the attention is DMC's, so load it with the bundled modeling file:

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("<this directory>", trust_remote_code=True)
```

Per layer and KV head, each token either appends its key/value to the cache or merges them into the
last slot (a weighted average), decided from channel {channel} of the query/key heads
(`dmc_init_offset` = {init_offset}, accumulation `{accumulation}`{window_note}).

- `model(ids, use_cache=False)` (what lm-eval uses) computes the teacher-forced DMC attention.
- `generate()` uses a `DMCCache`: per (sequence, layer, KV head) a variable-length sequence of slots.
  `generate(..., return_dict_in_generate=True).past_key_values.compression()` reports the achieved
  compression (tokens / slots) overall, per layer and per head; `slot_counts()` gives the lengths.
- Memory: transformers keeps the slots in a padded tensor `[batch, kv_heads, longest head, head_dim]`
  per layer, so in bytes it saves only as much as the longest head (over the batch) compresses. The
  compression reported by the cache is what a paged engine (the `dmc_train` inference engine) turns
  into real memory savings: it stores each head's slots without padding.
"""


def dmc_settings_from_method(method: Any, head_dim: int, step: int | None = None) -> dict[str, Any]:
    """The ``dmc_*`` config fields for the project's ``method`` config (``method=dmc``): an OmegaConf
    node, a dataclass or a plain dict (``meta.json``'s ``config["method"]``).

    ``decision_channel`` last/first -> ``head_dim - 1`` / 0; ``variant=hardc`` -> shared decisions.
    Other methods (Fixed Memory Pooling, ...) and, given the checkpoint's ``step``, a checkpoint still
    in the zero-out stage (vanilla attention) are refused with a one-line ConfigError.
    """
    def field(name: str, default: Any = None) -> Any:
        return method.get(name, default) if isinstance(method, Mapping) else getattr(method, name, default)

    if field("name") != "dmc":
        raise ConfigError(f"method.name={field('name')!r}: only DMC models (method=dmc) can be exported with "
                          f"DMC attention")
    channels = {"last": head_dim - 1, "first": 0}
    channel = field("decision_channel", "last")
    if channel not in channels:
        raise ConfigError(f"method.decision_channel={channel!r}; expected one of last, first")
    zero_out = int(field("zero_out_steps", 0) or 0)
    if step is not None and zero_out and step <= zero_out:  # rows are zeroed as step zero_out starts
        raise ConfigError(f"the checkpoint (step {step}) is still in DMC's zero-out stage "
                          f"(method.zero_out_steps={zero_out}), where attention is vanilla; export a later checkpoint")
    return {
        "dmc_decision_channel": channels[channel],
        "dmc_init_offset": float(field("init_offset", 5.0)),
        "dmc_accumulation": str(field("accumulation", "exact")),
        "dmc_window": int(field("window", 12)),
        "dmc_shared_decisions": field("variant", "dmc") == "hardc",
    }


def write_dmc_files(out_dir: str, hf_config: dict, dmc_settings: dict, model_card: bool = True) -> dict:
    """Copy the modeling file (and a README.md model card, unless one exists) into ``out_dir``; return
    ``hf_config`` (a ``LlamaForCausalLM`` config.json dict) with ``model_type``, ``architectures``,
    ``auto_map`` and the ``dmc_*`` fields set. The caller writes config.json and the weights."""
    unknown = set(dmc_settings) - set(DMC_FIELDS)
    if unknown:
        raise ValueError(f"unknown DMC settings {sorted(unknown)}; expected {', '.join(DMC_FIELDS)}")
    if dmc_settings.get("dmc_accumulation", "exact") not in ("exact", "window"):
        raise ConfigError(f"dmc_accumulation={dmc_settings['dmc_accumulation']!r}; expected exact or window")
    os.makedirs(out_dir, exist_ok=True)
    shutil.copyfile(MODELING_FILE, os.path.join(out_dir, f"{MODULE}.py"))
    config = {**hf_config, **dmc_settings, "model_type": "dmc_llama",
              "architectures": ["DMCLlamaForCausalLM"], "auto_map": dict(AUTO_MAP)}
    card = os.path.join(out_dir, "README.md")
    if model_card and not os.path.exists(card):
        with open(card, "w") as f:
            f.write(model_card_text(config))
    return config


def model_card_text(config: dict) -> str:
    """The README.md model card for a ``dmc_llama`` config dict."""
    window = config.get("dmc_accumulation") == "window"
    return MODEL_CARD.format(channel=config.get("dmc_decision_channel"), init_offset=config.get("dmc_init_offset"),
                             accumulation=config.get("dmc_accumulation", "exact"),
                             window_note=f", window {config.get('dmc_window')}" if window else "")

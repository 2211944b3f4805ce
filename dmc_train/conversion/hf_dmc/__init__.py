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
from typing import Any

from dmc_train.errors import ConfigError
from dmc_train.methods.configs import dmc_settings

MODELING_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "modeling_dmc_llama.py")
MODULE = "modeling_dmc_llama"
AUTO_MAP = {"AutoConfig": f"{MODULE}.DMCLlamaConfig", "AutoModelForCausalLM": f"{MODULE}.DMCLlamaForCausalLM"}
DMC_FIELDS = ("dmc_decision_channel", "dmc_init_offset", "dmc_omega_eps", "dmc_decision_threshold",
              "dmc_accumulation", "dmc_window", "dmc_shared_decisions", "dmc_rope_order")

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
(`dmc_init_offset` = {init_offset}, accumulation `{accumulation}`{window_note}, RoPE order
`{rope_order}`).

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
    node, a dataclass or a plain dict (``meta.json``'s ``config["method"]``); see
    :func:`dmc_train.methods.configs.dmc_settings`. Fixed Memory Pooling is refused (its decisions are
    not in the weights) with a one-line ConfigError.
    """
    name = method.get("name") if hasattr(method, "get") else getattr(method, "name", None)
    if name == "fixed_pooling":
        raise ConfigError("method.name='fixed_pooling': only DMC models (method=dmc) can be exported with "
                          "DMC attention")
    settings = dmc_settings(method, head_dim, step)
    return {
        "dmc_decision_channel": settings.channel,
        "dmc_init_offset": settings.init_offset,
        "dmc_omega_eps": settings.omega_eps,
        "dmc_decision_threshold": settings.decision_threshold,
        "dmc_accumulation": settings.accumulation,
        "dmc_window": settings.window,
        "dmc_shared_decisions": settings.shared,
        "dmc_rope_order": settings.rope_order,
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
                             window_note=f", window {config.get('dmc_window')}" if window else "",
                             rope_order=config.get("dmc_rope_order", "post"))

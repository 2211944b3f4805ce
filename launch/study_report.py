"""The study's report: decode speed of every cell timed in one process, the table, the papers' orderings
checked against the numbers, the perplexity-vs-bytes plot and DMC's per-(layer, head) compression."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Optional, Sequence

from dmc_train.evaluation.report import budget_cell
from dmc_train.evaluation.study import Preset, load_cells, presets, tag

Say = Callable[[str], None]


def decode_speed(results: list[dict], preset: Preset, rounds: int = 2, budget_seqs: int = 4,
                 say: Say = print, device: str = "cpu") -> dict[str, dict]:
    """Decode tokens/s of every cell at one KV budget (``budget_seqs`` uncompressed sequences of the base),
    timed in ``rounds`` interleaved rounds in this process (medians; min and max beside them): each cell
    runs as many sequences as fit (the last 32 tokens of each sequence generated after a prompt of the
    rest), the models on ``device``. Returns ``{cell: {batch, failed, tokens_per_s, min, max}}``."""
    import torch

    from dmc_train.data.datasets import build_datasets
    from dmc_train.evaluation.harness import decode_throughput, samples_of, vanilla_bytes_per_token
    from dmc_train.evaluation.study import base_config
    from dmc_train.inference.model import LlamaForInference

    cfg = base_config(preset)
    _, _, test = build_datasets(cfg, num_train_samples=cfg.train.global_batch_size)
    tokens = samples_of(test, 64)[0]
    models, runs = {}, {}
    for r in results:
        if r["checkpoint"] not in models:
            models[r["checkpoint"]] = LlamaForInference.from_checkpoint(r["checkpoint"], device=device)[0]
    budget = None
    times: dict[str, list[float]] = {r["name"]: [] for r in results}
    for i in range(rounds):
        for r in results:
            model = models[r["checkpoint"]]
            if budget is None:
                budget = budget_seqs * vanilla_bytes_per_token(model) * tokens.shape[1]
            inc = r["incremental"]
            torch.manual_seed(0)
            d = decode_throughput(model, r["cache"], r["options"], tokens[: inc["sequences"]], budget,
                                  inc["max_page_bytes"])
            times[r["name"]].append(d["decode_tokens_per_s"])
            runs[r["name"]] = d
        say(f"decode speed: round {i + 1}/{rounds} done")
    return {name: {"batch": runs[name]["batch"], "failed": runs[name]["failed"],
                   "tokens_per_s": statistics.median(t), "min": min(t), "max": max(t)} for name, t in times.items()}


def _vanilla(results: list[dict]) -> Optional[dict]:
    return next((r for r in results if r["method"] == "vanilla"), None)


def table(results: list[dict], speed: Optional[dict] = None) -> str:
    """The markdown table: one row per cell, sorted by memory fraction then perplexity; lm-eval: the mean
    accuracy over the shipped multiple-choice tasks the cell ran (``lm_eval``)."""
    base = _vanilla(results)
    base_speed = speed.get(base["name"], {}).get("tokens_per_s") if speed and base else None
    lines = ["| method | cell | target bytes | budget (entries, fraction of the sequence) | KV bytes / token "
             "| measured compression | perplexity | Δ vs vanilla "
             "| next-token acc. | lm-eval acc. | batch at equal KV | decode tok/s vs vanilla |",
             "|---" * 12 + "|"]
    for r in sorted(results, key=lambda r: (-r["fraction"], r["ppl"])):
        s = (speed or {}).get(r["name"], {})
        ratio = f"{s['tokens_per_s'] / base_speed:.2f}×" if s and base_speed else "—"
        lm = statistics.mean(r["lm_eval"].values()) if r.get("lm_eval") else None
        delta = f"{r['ppl'] - base['ppl']:+.2f}" if base else "—"
        lines.append(f"| {r['method']} | {r['name']} | {_fraction(r['fraction'])} | "
                     f"{budget_cell(r.get('budget_entries'), r.get('budget_fraction'))} | "
                     f"{r['kv_bytes_per_token']:,.0f} | "
                     f"{r['compression']:.2f}× | {r['ppl']:.2f} | {delta} | {r['accuracy']:.3f} | "
                     f"{'—' if lm is None else f'{lm:.3f}'} | {s.get('batch', '—')} | {ratio} |")
    return "\n".join(lines)


def _fraction(f: float) -> str:
    return "1" if f == 1 else f"1/{round(1 / f)}" if (1 / f).is_integer() else f"{f:g}"


def orderings(results: list[dict]) -> list[str]:
    """The papers' orderings that this study's cells can check, each with its numbers and a verdict: at every
    fraction of the bytes the cells have, and for the policies under each schedule they ran."""
    by = {r["name"]: r for r in results}
    lines = []

    def ppl(name):
        return by[name]["ppl"] if name in by else None

    def check(claim: str, holds: bool, numbers: str) -> None:
        lines.append(f"- {claim}: **{'reproduced' if holds else 'not reproduced'}** ({numbers})")

    fractions = sorted({r["fraction"] for r in results if r["fraction"] < 1}, reverse=True)
    for f in fractions:
        x, t = round(1 / f), tag(f)
        others = {n: ppl(n) for n in (f"gqa{x}", f"h2o_{t}", f"tova_{t}") if ppl(n) is not None}
        if ppl(f"dmc{x}") is not None and others:
            dmc = by[f"dmc{x}"]
            claim = f"DMC {x}× at least as good as GQA, H2O and TOVA at 1/{x} of the bytes (DMC paper)"
            held = {n: by[n]["kv_bytes_per_token"] for n in others}
            if dmc["kv_bytes_per_token"] > 1.1 * max(held.values()):  # the retrofit fell short of its target
                lines.append(f"- {claim}: **not comparable**: DMC holds {dmc['kv_bytes_per_token']:,.0f} KV bytes a "
                             f"token ({dmc['compression']:.2f}×), over 1.1× the others' ("
                             + ", ".join(f"{n} {v:,.0f}" for n, v in held.items()) + ")")
            else:
                check(claim, all(ppl(f"dmc{x}") <= v for v in others.values()),
                      f"DMC {ppl(f'dmc{x}'):.2f} at {dmc['compression']:.2f}×; "
                      + ", ".join(f"{n} {v:.2f}" for n, v in others.items()))
        for p, label in (("h2o", "H2O"), ("streaming_llm", "Λ-masking")):
            less, plus, alone = ppl(f"less_{p}_{t}"), ppl(f"{p}_{t}"), ppl(f"baseline_{p}_{t}")
            if None not in (less, plus, alone):
                check(f"LESS < Baseline+ < Baseline on {label} at 1/{x} of the bytes (LESS paper)",
                      less < plus < alone, f"LESS {less:.2f}, Baseline+ {plus:.2f}, Baseline {alone:.2f}")
        for suffix, schedule in (("", ""), ("_prefill", ", prefill schedule")):
            h2o, key, lsh, knorm, tova, stream = (ppl(f"{n}_{t}{suffix}") for n in
                                                  ("h2o", "keyformer", "lsh_e", "knorm", "tova", "streaming_llm"))
            where = f"at 1/{x} of the bytes{schedule}"
            if None not in (h2o, stream):
                check(f"H2O ahead of StreamingLLM {where} (H2O paper)", h2o < stream,
                      f"H2O {h2o:.2f}, StreamingLLM {stream:.2f}")
            if None not in (tova, h2o, stream):
                check(f"TOVA ahead of H2O and StreamingLLM {where} (TOVA paper)", tova < min(h2o, stream),
                      f"TOVA {tova:.2f}, H2O {h2o:.2f}, StreamingLLM {stream:.2f}")
            if None not in (h2o, key):
                check(f"Keyformer ahead of H2O {where} (Keyformer paper)", key < h2o,
                      f"Keyformer {key:.2f}, H2O {h2o:.2f}")
            if None not in (h2o, lsh, knorm):
                check(f"LSH-E within 2 % of H2O and ahead of Knorm {where} (LSH-E paper)",
                      abs(lsh - h2o) <= 0.02 * h2o and lsh < knorm,
                      f"LSH-E {lsh:.2f}, H2O {h2o:.2f}, Knorm {knorm:.2f}")
    return lines


def dmc_vs_gqa(dmc_cost: list[dict], head128: list[dict], full: list[dict], pending: dict[str, list[str]]) -> list[str]:
    """Why GQA beats DMC on the small base, from the controlled presets: (a) ``dmc_cost``, what giving up the
    decision channel costs without merging (DMC at CR 1 against vanilla training continued with the same
    tokens), set against DMC 2x's gap in ``full``; (b) ``head128``, DMC against GQA with Llama's head size."""
    by = {r["name"]: r["ppl"] for r in dmc_cost}
    lines = ["## Why GQA beats DMC here (controlled runs)", ""]
    if {"continued", "dmc1"} <= set(by):
        cost = by["dmc1"] - by["continued"]
        lines.append(f"- (a) Preset `dmc_cost`: vanilla {by.get('vanilla', float('nan')):.2f}; vanilla trained on "
                     f"with DMC's schedule and tokens {by['continued']:.2f}; DMC at CR 1 (the decision channel "
                     f"taken from q and k, nothing merged) {by['dmc1']:.2f}. Giving up one of the head's channels "
                     f"costs **{cost:+.2f}** ({cost / by['continued']:+.1%}).")
        if "vanilla" in by:
            lines.append(f"  The retrofit's training regime alone (vanilla continued against vanilla) costs "
                         f"**{by['continued'] - by['vanilla']:+.2f}**.")
        dmc2 = next((r["ppl"] for r in full if r["name"] == "dmc2"), None)
        if dmc2 is not None:
            gap = dmc2 - by["continued"]
            lines.append(f"  DMC 2× ({dmc2:.2f}) is {gap:+.2f} from the continued vanilla model: the channel is "
                         f"{cost / gap:.0%} of that gap, merging the rest ({dmc2 - by['dmc1']:+.2f}).")
    else:
        lines.append(f"- (a) Preset `dmc_cost`: not run yet ({', '.join(pending.get('dmc_cost', []))}).")
    by128 = {r["name"]: r for r in head128}
    checks = [(x, by128[f"dmc{x}"]["ppl"], by128[f"gqa{x}"]["ppl"]) for x in (2,)
              if f"dmc{x}" in by128 and f"gqa{x}" in by128]
    if head128:
        lines.append("- (b) Preset `head128` (2 heads of 128 channels, as Llama's, trained like the base): "
                     + "; ".join(f"{r['method']} ({r['name']}) {r['ppl']:.2f}" for r in head128) + ".")
        for x, dmc, gqa in checks:
            lines.append(f"  DMC {x}× at least as good as GQA {x}× with heads of 128: "
                         f"**{'reproduced' if dmc <= gqa else 'not reproduced'}** (DMC {dmc:.2f}, GQA {gqa:.2f}).")
    if pending.get("head128"):
        lines.append(f"- (b) Preset `head128`: cells not run yet: {', '.join(pending['head128'])}.")
    return lines + [""]


def controlled_sections(out: str, results: list[dict]) -> list[str]:
    """:func:`dmc_vs_gqa` from the ``dmc_cost`` and ``head128`` presets' outputs beside ``out``
    (``runs/study_<preset>``, their default) and the ``full`` preset's ``results``."""
    got, pending = {}, {}
    for name in ("dmc_cost", "head128"):
        cells = list(presets()[name].cells)
        got[name] = load_cells(os.path.join(os.path.dirname(out), f"study_{name}"), cells)
        pending[name] = [c.name for c in cells if c.name not in {r["name"] for r in got[name]}]
    return dmc_vs_gqa(got["dmc_cost"], got["head128"], results, pending)


def plot(results: list[dict], path: str) -> None:
    """Perplexity against KV bytes per token (the Pareto view, both axes log): one colour and marker per method,
    its cells joined by a line in order of bytes. Cells more than 3x the vanilla cache's perplexity are drawn at
    the top edge, labelled with their value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    methods = sorted({r["method"] for r in results})
    colours, markers = plt.get_cmap("tab20"), "os^vDP*Xph<>"
    base = _vanilla(results)
    top = min(3 * base["ppl"], max(r["ppl"] for r in results)) if base else max(r["ppl"] for r in results)
    for i, m in enumerate(methods):
        rows = sorted((r for r in results if r["method"] == m), key=lambda r: r["kv_bytes_per_token"])
        ax.plot([r["kv_bytes_per_token"] for r in rows], [min(r["ppl"], top) for r in rows], linewidth=1,
                color=colours(i % 20), marker=markers[i % len(markers)], label=m, markersize=6, zorder=3)
        for r in rows:
            if r["ppl"] > top:
                ax.annotate(f"{m} {r['ppl']:.0f} ↑", (r["kv_bytes_per_token"], top), textcoords="offset points",
                            xytext=(4, -12), fontsize=7)
    if base:
        ax.axhline(base["ppl"], color="black", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("KV bytes held per token (state included; log scale)")
    ax.set_ylabel("test perplexity (log scale)")
    ax.set_title("Every method at equal memory (lower left is better)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def heatmap(results: list[dict], path: str) -> bool:
    """DMC's compression per (layer, KV head) for every DMC cell (tokens / entries on the decoded subset);
    False when the study has no DMC cell."""
    cells = [r for r in results if r["method"] == "DMC"]
    if not cells:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 3.5), squeeze=False)
    for ax, r in zip(axes[0], cells):
        grid = r["incremental"]["head_compression"]
        im = ax.imshow(grid, cmap="viridis")
        for (i, j), v in _cells(grid):
            ax.text(j, i, f"{v:.1f}", ha="center", va="center", color="white", fontsize=7)
        ax.set_title(f"{r['name']}: {r['entry_compression']:.2f}× overall")
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _cells(grid):
    return (((i, j), v) for i, row in enumerate(grid) for j, v in enumerate(row))


def write(results: list[dict], out: str, speed: Optional[dict], commands: list[str], preset_name: str,
          preset: Preset, docs_dir: Optional[str] = None, sections: Sequence[str] = ()) -> str:
    """``<out>/RESULTS.md`` with its PNGs beside it (and the same in ``docs_dir``), ``sections`` (markdown
    lines) at the end; returns the markdown. The files are named after the preset (:func:`file_names`)."""
    md, pareto, heads = file_names(preset_name)
    seconds = sum(r.get("cell_seconds", 0) for r in results)
    pending = [c.name for c in preset.cells if c.name not in {r["name"] for r in results}]
    prompt = (f" The first {preset.prompt_len} tokens of each are a prompt (prefilled, then compressed); the tokens "
              f"after it are scored." if preset.prompt_len > 1 else "")
    text = [f"# Every method at equal memory (study preset `{preset_name}`)", "",
            f"Base model: `{' '.join(preset.base + preset.model)}`; the first {preset.max_sequences} test sequences "
            f"per cell.{prompt} {len(results)} cells finished, {time.strftime('%Y-%m-%d', time.gmtime())}; the "
            f"cells' own time (training and evaluation, one after another): {seconds / 60:.0f} min."
            + (f" Not run yet: {', '.join(pending)}." if pending else ""), "",
            "Commands:", "", *[f"    {c}" for c in commands], "", table(results, speed), "",
            f"![perplexity vs KV bytes]({pareto})", ""]
    if any(r["method"] == "DMC" for r in results):
        text += [f"![DMC compression per layer and head]({heads})", ""]
    checks = orderings(results)
    if checks:
        text += ["The papers' orderings, checked:", "", *checks, ""]
    text += [line for note in preset.notes for line in (note, "")] + list(sections)  # a paragraph each
    markdown = "\n".join(text)
    for folder in [out] + ([docs_dir] if docs_dir else []):
        os.makedirs(folder, exist_ok=True)
        plot(results, os.path.join(folder, pareto))
        heatmap(results, os.path.join(folder, heads))
        with open(os.path.join(folder, md), "w") as f:
            f.write(markdown)
    return markdown


def file_names(preset_name: str) -> tuple[str, str, str]:
    """The report, its Pareto plot and its DMC heatmap: ``RESULTS.md``, ``study_pareto.png``,
    ``study_dmc_heads.png`` for the ``full`` preset (the project's study), ``RESULTS_<preset>.md``,
    ``<preset>_pareto.png``, ``<preset>_dmc_heads.png`` for another, so that presets share ``docs/``."""
    if preset_name == "full":
        return "RESULTS.md", "study_pareto.png", "study_dmc_heads.png"
    return f"RESULTS_{preset_name}.md", f"{preset_name}_pareto.png", f"{preset_name}_dmc_heads.png"

"""Plots people would rather see than read (matplotlib, headless ``Agg`` backend)."""

from __future__ import annotations

import os


def cr_heatmap(cr_per_head: list[list[float]], path: str, title: str = "achieved CR per head") -> str:
    """Layer x KV-head heatmap of achieved compression ratios (as DMC paper Fig. 6); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    data = np.asarray(cr_per_head, dtype=float)
    layers, heads = data.shape
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 + 0.45 * heads), max(2.5, 1.0 + 0.4 * layers)))
    finite = np.where(np.isfinite(data), data, np.nan)
    # Log scale: head CRs span 1x to hundreds of x.
    norm = matplotlib.colors.LogNorm(vmin=1.0, vmax=max(2.0, float(np.nanmax(finite))))
    im = ax.imshow(finite, cmap="viridis", norm=norm, aspect="auto", origin="lower")
    for (i, j), v in np.ndenumerate(data):
        ax.text(j, i, f"{v:.1f}" if np.isfinite(v) else "inf", ha="center", va="center", fontsize=7, color="w")
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(heads))
    ax.set_yticks(range(layers))
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="CR (log scale)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

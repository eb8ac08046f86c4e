"""Plot `GAACCache.stats()`: resident bytes per storage class and layer, against BF16 (needs matplotlib)."""

from __future__ import annotations

from .format import MODE_NAMES

CLASSES = ("slots", "raw", "tail", "block_table")


def plot_stats(stats: dict, path: str | None = None):
    """Stacked bars of resident MiB per GAAC layer (slots, raw tiles, tail, block table) beside the BF16 size,
    and the group-mode shares. Returns the matplotlib figure; saves it when `path` is given."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plotting needs matplotlib: pip install 'gaac-hf[plot]'") from e

    layers = sorted(stats["layers"])
    fig, (ax, ax_modes) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [4, 1]})
    bottom = [0.0] * len(layers)
    for name in CLASSES:
        values = [stats["layers"][i]["bytes"][name] / 2**20 for i in layers]
        ax.bar(layers, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.plot(layers, [stats["layers"][i]["bf16_bytes"] / 2**20 for i in layers], "k_", markersize=12, label="BF16")
    ax.set_xlabel("layer")
    ax.set_ylabel("resident KV (MiB)")
    ax.set_title(f"GAACCache: {100 * stats['saving']:.1f}% saved, ratio {stats['ratio']:.3f}x")
    ax.legend()
    shares = [stats["mode_shares"][m] * 100 for m in MODE_NAMES]
    ax_modes.bar(MODE_NAMES, shares)
    ax_modes.set_ylabel("groups (%)")
    ax_modes.set_title("modes")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig

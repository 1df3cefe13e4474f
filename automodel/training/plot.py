"""A PNG of the loss curve from a metrics file (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from automodel.training.metrics import read_metrics

__all__ = ["plot_loss_curve"]


def plot_loss_curve(metrics_path: str | Path, png_path: str | Path, title: str | None = None) -> Path:
    """Plot training loss per step (and validation loss, if logged) from ``metrics_path``.

    Records with ``"type": "train"`` give ``step``/``loss``; ``"type": "val"`` give ``step``/``val_loss``.
    Returns ``png_path``.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [
        (r["step"], r["loss"])
        for r in records
        if r.get("type") == "train" and isinstance(r.get("loss"), float)
    ]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("type") == "val"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.2, ms=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy per label token")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path

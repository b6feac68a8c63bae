"""What every benchmark plot ends with: grid, legend, the folder, a tight layout, the PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save(fig: Any, ax: Any, png: Path) -> None:
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)

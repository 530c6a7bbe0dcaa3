"""What the model picker shows: every catalog and local model with its size, install state and fit (Qt-free)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine import catalog, demo
from engine.catalog import CatalogEntry


@dataclass
class ModelRow:
    entry: CatalogEntry
    installed: bool
    load_path: Path | None  # what load_model takes once installed
    fit: object | None  # engine.memfit.FitReport
    label: str


def _gb(n: int | None) -> str:
    return "size unknown" if not n else f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def install_state(e: CatalogEntry, models: Path | None) -> tuple[bool, Path | None]:
    """(installed, path to load). A partial or unverified download is never installed."""
    folder = catalog.install_dir(e, models)
    if e.is_demo:
        return demo.is_installed(folder), demo.demo_path(folder)
    if e.is_local:
        return folder.exists(), folder
    from engine.hub.download import is_installed

    return is_installed(folder), folder


def model_rows(models: Path | None = None, context: int = 0, gpu_bytes: int | None = None) -> list[ModelRow]:
    """`gpu_bytes`: the GPU's memory where known (a MoE model too big for it then shows how it streams)."""
    from engine.memfit import check_fit

    rows = []
    for e in catalog.all_models():
        installed, path = install_state(e, models)
        try:
            fit = check_fit(e, context or e.default_context, gpu_bytes_available=gpu_bytes)
        except Exception:  # a fit estimate must never hide a model
            fit = None
        state = "installed" if installed else "not downloaded" if not e.is_local else "missing"
        parts = [e.name, _gb(e.total_bytes), state]
        if not e.runs:
            parts.append("coming soon")
        elif fit is not None and fit.stream is not None:
            parts.append(fit.stream.sentence().split(" (")[0])  # "runs with experts streamed from RAM, about N tok/s"
        elif fit is not None and fit.verdict in ("tight", "wont_fit"):
            parts.append("tight fit" if fit.verdict == "tight" else "won't fit")
        rows.append(ModelRow(e, installed, path, fit, " · ".join(parts)))
    return rows

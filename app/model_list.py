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
    fit_pending: bool = False  # the fit is being worked out off the GUI thread (quick_only)


_NO_ESTIMATE: set[str] = set()  # entries whose estimate failed in fill_fits: not retried forever


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


def model_rows(models: Path | None = None, context: int = 0, shared_memory: bool = False,
               software: bool = False, decode_rate: float | None = None, quick_only: bool = False,
               gpu_bytes: int | None = None, gpu_weights: int | None = None) -> list[ModelRow]:
    """Every model with its install state and fit, as `zerotvm models` reports it. `shared_memory`: the GPU takes
    system RAM (integrated or software); `software`: a software adapter, so the fit also gives the speed (from
    `decode_rate`, the weight bytes/s measured there, when known). Cheap once memfit remembers the estimates;
    `quick_only`: rows whose estimate is not remembered yet get fit None and fit_pending (see fill_fits).
    `gpu_bytes`: the GPU's memory where known (a MoE model too big for it then says how it runs, streamed);
    `gpu_weights`: the weights budget set by hand (None: auto), which the verdicts take as the load will."""
    from engine.memfit import check_fit, fit_is_quick

    rows = []
    for e in catalog.all_models():
        installed, path = install_state(e, models)
        pending = (quick_only and e.runs and e.key not in _NO_ESTIMATE
                   and not fit_is_quick(e, context or e.default_context, gpu_bytes, gpu_weights))
        fit = None
        try:
            if not pending:
                fit = check_fit(e, context or e.default_context, shared_memory=shared_memory, software=software,
                                decode_rate=decode_rate, gpu_bytes_available=gpu_bytes, gpu_weights=gpu_weights)
        except Exception:  # a fit estimate must never hide a model
            fit = None
        state = "installed" if installed else "not downloaded" if not e.is_local else "missing"
        parts = [e.name, _gb(e.total_bytes), state]
        if not e.runs:
            parts.append("coming soon")
        elif pending:
            parts.append("checking fit…")
        elif fit is not None:
            parts.append(fit.summary)
        rows.append(ModelRow(e, installed, path, fit, " · ".join(parts), pending))
    return rows


def fill_fits(rows: list[ModelRow], context: int = 0, gpu_bytes: int | None = None,
              gpu_weights: int | None = None) -> None:
    """Work out the pending rows' estimates (slow: plans each model; a MoE model's streaming plan too on a GPU of
    `gpu_bytes`), so the next model_rows has them. Qt-free; the window runs it on a background thread."""
    from engine.memfit import check_fit

    for row in rows:
        if row.fit_pending:
            try:
                check_fit(row.entry, context or row.entry.default_context, gpu_bytes_available=gpu_bytes,
                          gpu_weights=gpu_weights)
            except Exception:  # shown as no fit, as model_rows does
                _NO_ESTIMATE.add(row.entry.key)

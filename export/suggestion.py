"""A bundle's default drafter as its draft folder suggests it (``head_config.json``'s "serve"),
with the feature head or without it; export/recommend.py measures it against the other modes."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.export.config import ExportConfig


def _recommended(folder: Path, cfg: ExportConfig, with_head: bool) -> dict | None:
    """``head_config.json``'s suggestion (one of the modes export measures, export/recommend.py) for a bundle with the head ("serve", its fields
    overridden by "serve" → the ``--quantize`` name, e.g. "int8": {"gamma": 2, "why": ...}, for
    a quantized target) or without it ("serve" → "without_head"), as a manifest ``drafter``
    entry (with its "stop_below" for the head's chain: ``runtime.proposers.FeatureHead``); None
    when it names nothing this bundle runs, or has no head_config.json (a drafter that needs a head it lacks, or not, a tree
    without --tree-nodes, a bad γ or stop_below)."""
    from specdec.manifest import is_stop
    from specdec.runtime.drafters import DRAFTERS

    path = folder / "head_config.json"
    if not path.is_file():  # an EAGLE-3 head (export/eagle3.py): its folder suggests nothing
        return None
    serve = json.loads(path.read_text()).get("serve") or {}
    entry = {**serve, **(serve.get(cfg.quantize) or {})} if with_head else serve.get("without_head") or {}
    name, gamma = entry.get("drafter", "feature" if with_head else None), entry.get("gamma", 1 if with_head else cfg.gamma)
    reg = DRAFTERS.get(name)
    if reg is None or reg.needs_head != with_head or (reg.tree and not cfg.tree_nodes) or not isinstance(gamma, int) or gamma < 1:
        return None
    why = entry.get("why", f"suggested{'' if with_head else ' without the head'} by its folder's head_config.json")
    stop = entry.get("stop_below", 0.0) if reg.needs_head and not reg.tree else 0.0
    if not is_stop(stop):
        return None
    return {"name": name, "gamma": min(gamma, cfg.gamma), "why": why, **({"stop_below": float(stop)} if stop else {})}


def default_drafter(head: Path, cfg: ExportConfig) -> dict:
    """The head folder's suggestion for a bundle with its feature head (``head_config.json``'s
    "serve": {"drafter", "gamma", "why"}) when this bundle has what it needs, else the head's
    chain at γ = 1: one of the modes export measures (export/recommend.py)."""
    return _recommended(head, cfg, with_head=True) or {
        "name": "feature", "gamma": 1, "why": "the feature head's chain (its folder recommends nothing this bundle runs)"}


def headless_drafter(folder: Path, cfg: ExportConfig) -> dict | None:
    """The default drafter of a bundle that leaves ``folder``'s head out (float16 or quantized):
    ``head_config.json``'s "serve" → "without_head", when it names a drafter this bundle runs
    without a head; else None (the draft model at the bundle's γ)."""
    return _recommended(folder, cfg, with_head=False)

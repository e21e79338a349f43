"""Fit the tuner model's scorer (tuner.model.scorer) on the training cases and put it into a GGUF.

Per kernel, gradient-boosted regression trees (scikit-learn, the [train] extra) learn each measured config's log
time over its case's best from the device descriptor, the shape and the config (`FeatureSpec.row`); the fitted
trees are flattened into the arrays `tuner.model.scorer.Forest` walks with numpy alone. `make model` fits them
with the language model (tuner.train.train); `python -m tuner.train.scorer` fits them for an existing model file
and rewrites it (and its card) in place, so the language model's weights stay as they were.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from edgetune.atomic import write_atomic
from edgetune.errors import BadInput
from tuner.model.scorer import FORMAT, SPEC_KEY, TREES_KEY, FeatureSpec, Scorer
from tuner.train import data as D
from tuner.train.gguf_export import rewrite_with_scorer

# 100 trees of 31 leaves: re-ranking the model's top-15 put a config within 5% of the best into the first batch on
# 30 of the 35 real held-out layers, against 28 in the model's own order (quantized_models/data/recipe-trials.md);
# 400 trees of 63 leaves did no better at five times the size
TREES = 100
LEAVES = 31
LEARNING_RATE = 0.15
CAP = 2.0  # a config more than e^2 = 7.4x slower than its case's best is just "slow": its exact time is noise


def feature_spec(cases: list[D.Case]) -> FeatureSpec:
    """The dims, numeric knobs and categorical values these cases hold (one kernel's)."""
    dims = sorted({d for c in cases for d in c.shape})
    values: dict[str, set] = {}
    for c in cases:
        for cfg in c.configs.values():
            for k, v in cfg.items():
                values.setdefault(k, set()).add(v)
    numeric = sorted(k for k, vs in values.items()
                     if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vs))
    vocab = {k: tuple(sorted(str(v) for v in vs)) for k, vs in sorted(values.items()) if k not in numeric}
    return FeatureSpec(tuple(dims), tuple(numeric), vocab)


def targets(case: D.Case) -> list[tuple[dict, float]]:
    """(config, log of its median time over the case's best), capped at CAP."""
    table = case.table()
    if not table:
        return []
    best = min(table.values())
    return [(case.configs[k], min(math.log(ms / best), CAP)) for k, ms in table.items()]


def fit_kernel(cases: list[D.Case]) -> tuple[dict, dict[str, np.ndarray]]:
    """One kernel's spec entry and its flattened arrays."""
    from sklearn.ensemble import HistGradientBoostingRegressor

    spec = feature_spec(cases)
    rows, y = [], []
    for c in cases:
        for cfg, t in targets(c):
            rows.append(spec.row(c.hw, c.shape, cfg))
            y.append(t)
    model = HistGradientBoostingRegressor(max_iter=TREES, learning_rate=LEARNING_RATE, max_leaf_nodes=LEAVES,
                                          early_stopping=False)  # deterministic: no sampling without it
    X = np.array(rows, dtype=np.float64)
    X[:, np.isnan(X).all(axis=0)] = 0.0  # a feature no row has (no bandwidth measured): constant, never split on
    model.fit(X, np.array(y))
    arrays, depth = flatten([p[0].nodes for p in model._predictors])
    entry = {"features": spec.to_dict(), "baseline": float(np.ravel(model._baseline_prediction)[0]),
             "depth": depth, "trees": len(model._predictors), "rows": len(y)}
    return entry, arrays


def flatten(trees: list[np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    """sklearn's per-tree node records as padded [tree, node] arrays; a leaf (and padding) points to itself with an
    infinite threshold, so a walk deeper than a tree stays on its leaf."""
    n = max(len(t) for t in trees)
    idx = np.arange(n, dtype=np.int32)
    out = {"feature": np.zeros((len(trees), n), np.int32), "threshold": np.full((len(trees), n), np.inf),
           "missing_left": np.ones((len(trees), n), bool), "left": np.tile(idx, (len(trees), 1)),
           "right": np.tile(idx, (len(trees), 1)), "value": np.zeros((len(trees), n))}
    depth = 0
    for i, t in enumerate(trees):
        split = ~t["is_leaf"].astype(bool)
        rows = np.flatnonzero(split)
        out["feature"][i, rows] = t["feature_idx"][rows]
        out["threshold"][i, rows] = t["num_threshold"][rows]
        out["missing_left"][i, rows] = t["missing_go_to_left"][rows].astype(bool)
        out["left"][i, rows] = t["left"][rows]
        out["right"][i, rows] = t["right"][rows]
        leaves = np.flatnonzero(~split)
        out["value"][i, leaves] = t["value"][leaves]
        depth = max(depth, int(t["depth"].max()))
    return out, depth


def fit(cases: list[D.Case]) -> dict[str, Any]:
    """The scorer metadata (SPEC_KEY: JSON text, TREES_KEY: npz bytes) for the kernels these cases hold."""
    by_kernel: dict[str, list[D.Case]] = {}
    for c in cases:
        by_kernel.setdefault(c.kernel, []).append(c)
    kernels, arrays = {}, {}
    for kernel, cs in sorted(by_kernel.items()):
        kernels[kernel], a = fit_kernel(cs)
        arrays.update({f"{kernel}.{name}": v for name, v in a.items()})
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    meta = {SPEC_KEY: json.dumps({"format": FORMAT, "kernels": kernels}, sort_keys=True), TREES_KEY: buf.getvalue()}
    Scorer.from_meta(meta)  # what a device will read must read back
    return meta


def summary(meta: dict[str, Any]) -> dict:
    """What the card says about the scorer."""
    spec = json.loads(meta[SPEC_KEY])
    return {"format": spec["format"], "bytes": len(meta[TREES_KEY]),
            "kernels": {k: {n: v[n] for n in ("trees", "depth", "rows")} for k, v in spec["kernels"].items()},
            "recipe": {"trees": TREES, "leaves": LEAVES, "learning_rate": LEARNING_RATE, "cap": CAP}}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data", action="append", help=f"collector JSONL(.gz) (default: {D.DEFAULT_DATA})")
    ap.add_argument("--records", action="append", default=[], help="results DB or JSONL records to add")
    ap.add_argument("--out", type=Path, help="the directory of the model and its card (default: the bundled one)")


def read_card(out: Path) -> tuple[Path, dict]:
    """(card path, card) of the model in `out`; BadInput naming what is missing."""
    from tuner.model.inference import MODEL_NAME

    card_path = out / f"{MODEL_NAME}.card.json"
    try:
        card = json.loads(card_path.read_text())
        model = out / card["file"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"--out {out}: no readable model card {card_path.name} there ({e}); give the directory "
                       "`make model` or `edgetune train` wrote") from None
    if not model.is_file():
        raise BadInput(f"--out {out}: the card names {model.name}, which is not there")
    return card_path, card


def cmd_scorer(a: argparse.Namespace) -> int:
    from tuner.model.inference import MODEL_DIR

    out = a.out or MODEL_DIR
    card_path, card = read_card(out)
    data, records = D.base_sources(a.data, False)
    train, _ = D.split_cases(D.load_cases(data, records + [Path(p) for p in a.records])[0])
    if not train:
        raise BadInput("no training cases in the data: give --data or --records that hold some")
    meta = fit(train)
    model = out / card["file"]
    rewrite_with_scorer(model, meta)
    card.update(bytes=model.stat().st_size, sha256=hashlib.sha256(model.read_bytes()).hexdigest(),
                scorer=summary(meta))
    write_atomic(card_path, (json.dumps(card, indent=2) + "\n").encode(), mode=card_path.stat().st_mode & 0o777)
    print(f"scorer: {len(train)} cases, {len(meta[TREES_KEY])} bytes; rewrote {model} and its card")
    return 0


def main(argv: list[str] | None = None) -> int:
    from edgetune.main import run_module

    return run_module("python -m tuner.train.scorer", __doc__.split("\n\n")[0], add_arguments, cmd_scorer, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""The tuner model's second opinion: per-kernel regression trees that predict a config's slowdown on a shape.

The language model ranks configs as whole token sequences; it is good at which region of the space fits a shape
and a device, less so at ordering the neighbours inside that region (its top-20 on the real held-out layers holds a
config within 5% of the best on 32 of 35, its top-5 on 27). The trees are fitted to every measured config of the
training cases (log of its time over the case's best), so they order candidates by measured detail; the strategy
lets them re-rank the model's own candidates only (tuner.strategies.llm), so the trees never propose a config the
model did not consider for this device.

The trees ride inside the GGUF as metadata (`edgetune.scorer.spec`: JSON; `edgetune.scorer.trees`: an npz archive
as a uint8 array), so one signed file still carries everything a device runs, and llama.cpp ignores both keys. A
model without them ranks by the language model alone. Evaluating them needs numpy only: the forest is flattened
into padded [tree, node] arrays and all trees walk all candidates at once, one level per step.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tuner.model.prompt import hw_fields

SPEC_KEY = "edgetune.scorer.spec"
TREES_KEY = "edgetune.scorer.trees"
FORMAT = "edgetune-scorer-1"
HW_FEATURES = ("vector_bits", "cores", "l1d", "l2", "l3", "bandwidth_gbps")
_LOG_HW = {"l1d", "l2", "l3"}  # cache sizes enter as log2 bytes


class ScorerError(ValueError):
    """The scorer metadata in a model file is malformed (the model still proposes; only the re-ranking is off)."""


@dataclass(frozen=True)
class FeatureSpec:
    """How one kernel's (device, shape, config) becomes the trees' feature vector; fitted with the trees."""

    dims: tuple[str, ...]  # shape dimensions, entered as log2
    numeric: tuple[str, ...]  # numeric knobs: their value, and log2(dim / value) for every dim
    vocab: dict[str, tuple[str, ...]]  # categorical knob -> its values (the feature is the index)

    @property
    def width(self) -> int:
        return len(HW_FEATURES) + len(self.dims) + len(self.numeric) + len(self.vocab) \
            + len(self.dims) * len(self.numeric)

    def row(self, hw: Any, shape: dict, config: dict) -> list[float]:
        """The feature vector of a config on a shape and a device (an HwDescriptor or the flat dict of the training
        data); anything this spec does not know (a dim, a knob, a value) is NaN, which the trees route down the side
        they learned for missing values."""
        fields = hw_fields(hw)
        out = [_hw_value(fields, name) for name in HW_FEATURES]
        dims = [_log2(shape.get(d)) for d in self.dims]
        out += dims
        nums = [_number(config.get(k)) for k in self.numeric]
        out += nums
        for k, values in self.vocab.items():
            v = config.get(k)
            out.append(float(values.index(str(v))) if v is not None and str(v) in values else math.nan)
        out += [d - _log2(v) for d in dims for v in nums]  # NaN wherever either side is
        return out

    def to_dict(self) -> dict:
        return {"dims": list(self.dims), "numeric": list(self.numeric),
                "vocab": {k: list(v) for k, v in self.vocab.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> FeatureSpec:
        return cls(tuple(d["dims"]), tuple(d["numeric"]), {k: tuple(v) for k, v in d["vocab"].items()})


def _log2(x: Any) -> float:
    v = _number(x)
    return math.log2(max(v, 1.0)) if not math.isnan(v) else math.nan


def _number(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return math.nan
    return float(x)


def _hw_value(hw: dict, name: str) -> float:
    v = _number(hw.get(name))
    return math.log2(max(v, 1.0)) if name in _LOG_HW and not math.isnan(v) else v


@dataclass(frozen=True)
class Forest:
    """One kernel's trees as padded [tree, node] arrays; node 0 is each tree's root, a leaf points to itself."""

    spec: FeatureSpec
    baseline: float
    feature: np.ndarray  # int32: the feature a split tests
    threshold: np.ndarray  # float64: go left when x <= threshold
    missing_left: np.ndarray  # bool: where a NaN goes
    left: np.ndarray  # int32
    right: np.ndarray  # int32
    value: np.ndarray  # float64: a leaf's contribution (0 at splits)
    depth: int

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Predicted log slowdown of each row of X ([candidates, features])."""
        trees = np.arange(self.feature.shape[0])[:, None]
        node = np.zeros((self.feature.shape[0], X.shape[0]), dtype=np.int32)
        cols = np.arange(X.shape[0])[None, :]
        for _ in range(self.depth):
            x = X[cols, self.feature[trees, node]]
            go_left = np.where(np.isnan(x), self.missing_left[trees, node], x <= self.threshold[trees, node])
            node = np.where(go_left, self.left[trees, node], self.right[trees, node])
        return self.baseline + self.value[trees, node].sum(axis=0)

    def score(self, hw: Any, shape: dict, configs: list[dict]) -> list[float]:
        if not configs:
            return []
        X = np.array([self.spec.row(hw, shape, c) for c in configs], dtype=np.float64)
        return self.predict(X).tolist()


class Scorer:
    """kernel -> Forest, read from a model file's metadata."""

    def __init__(self, forests: dict[str, Forest]):
        self.forests = forests

    def knows(self, kernel: str) -> bool:
        return kernel in self.forests

    def score(self, kernel: str, hw: Any, shape: dict, configs: list[dict]) -> list[float]:
        """Predicted log slowdown of each config (lower is faster); the kernel must be known."""
        return self.forests[kernel].score(hw, shape, configs)

    @classmethod
    def from_meta(cls, meta: dict) -> Scorer | None:
        """The scorer a GGUF's metadata carries; None when it carries none; ScorerError when it is malformed."""
        if SPEC_KEY not in meta and TREES_KEY not in meta:
            return None
        try:
            spec = json.loads(meta[SPEC_KEY])
            blob = meta[TREES_KEY]
            if spec.get("format") != FORMAT or not isinstance(blob, bytes):
                raise ScorerError(f"scorer format {spec.get('format')!r}, this edgetune reads {FORMAT!r}")
            with np.load(io.BytesIO(blob), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            forests = {k: _forest(k, s, arrays) for k, s in spec["kernels"].items()}
        except ScorerError:
            raise
        except (KeyError, TypeError, ValueError, OSError) as e:
            raise ScorerError(f"scorer metadata is malformed ({type(e).__name__}: {e})") from e
        return cls(forests)


_ARRAYS = ("feature", "threshold", "missing_left", "left", "right", "value")


def _forest(kernel: str, spec: dict, arrays: dict[str, np.ndarray]) -> Forest:
    a = {n: arrays[f"{kernel}.{n}"] for n in _ARRAYS}
    shape = a["feature"].shape
    fs = FeatureSpec.from_dict(spec["features"])
    n_nodes = shape[1] if len(shape) == 2 else 0
    if len(shape) != 2 or any(v.shape != shape for v in a.values()):
        raise ScorerError(f"scorer trees of {kernel} have mismatched shapes")
    for n in ("left", "right"):
        if a[n].size and (a[n].min() < 0 or a[n].max() >= n_nodes):
            raise ScorerError(f"scorer trees of {kernel} point outside their node table")
    if a["feature"].size and (a["feature"].min() < 0 or a["feature"].max() >= fs.width):
        raise ScorerError(f"scorer trees of {kernel} test a feature outside the {fs.width} it defines")
    return Forest(fs, float(spec["baseline"]), a["feature"].astype(np.int32), a["threshold"].astype(np.float64),
                  a["missing_left"].astype(bool), a["left"].astype(np.int32), a["right"].astype(np.int32),
                  a["value"].astype(np.float64), int(spec["depth"]))

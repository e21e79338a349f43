"""What a tuning result answers (DESIGN.md: "A result is keyed by hw_fingerprint, kernel source hash,
workload/shape, isa, compiler id and model version"): a result is reused only under an equal key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from kernels.spec import KernelSpec, Workload


@dataclass(frozen=True)
class ResultKey:
    kernel: str
    source_hash: str
    workload: str
    shape_json: str  # the shape, canonical JSON (sorted keys)
    hw_fingerprint: str
    isa: str
    compiler_id: str
    strategy: str
    strategy_version: str
    objective: str = "latency"  # an energy-tuned winner answers a different question
    # the tuner model behind the strategy; it reaches the digest through strategy_version (the llm strategy's
    # version carries the model's version and sha256), so a model change is a new key only for llm results
    model_version: str | None = None

    @classmethod
    def of(cls, spec: KernelSpec, wl: Workload, hw: Any, strategy: str, strategy_version: str,
           objective: str = "latency", model_version: str | None = None) -> "ResultKey":
        return cls(spec.name, spec.source_hash(), wl.name, json.dumps(wl.shape, sort_keys=True), hw.hw_fingerprint,
                   hw.isa, hw.compiler.id, strategy, strategy_version, objective, model_version)

    @property
    def shape(self) -> dict:
        return json.loads(self.shape_json)

    def digest(self) -> str:
        """The short key sessions and active entries carry (Helion-style: source, shape, hw, isa, compiler,
        strategy version, objective)."""
        parts = [self.kernel, self.source_hash, self.workload, self.shape_json, self.hw_fingerprint, self.isa,
                 self.compiler_id, f"{self.strategy}-{self.strategy_version}", self.objective]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]

    def to_dict(self) -> dict:
        return asdict(self)


def result_key(spec: KernelSpec, wl: Workload, hw: Any, strategy: Any, objective: str = "latency") -> str:
    """The digest of the key a `strategy` (anything with a name and version) tuning `wl` on `hw` makes."""
    return ResultKey.of(spec, wl, hw, strategy.name, strategy.version, objective).digest()

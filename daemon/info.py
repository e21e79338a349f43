"""The retained `info` document, and the shipped tuner model's identity (part of what makes a result current)."""

from __future__ import annotations

import logging
from typing import Any

from tuner.config import TuningConfig
from edgetune import __version__
from edgetune.protocol import OPS
from kernels.registry import all_specs
from kernels.spec import KernelSpec, Workload

log = logging.getLogger(__name__)


def model_info() -> dict | None:
    """{name, version, sha256} of the shipped tuner model (checked by the tuner's own GGUF reader), or None when
    there is none or it is unusable: then results cannot depend on it."""
    from tuner.model.inference import ModelError, check_gguf, default_model_path

    path = default_model_path()
    if not path.exists():
        return None
    try:
        info = check_gguf(path)
    except ModelError as e:
        log.warning("tuner model: %s", e)
        return None
    return {"name": str(info.meta.get("general.name") or path.name.split(".")[0]), "version": info.model_version,
            "sha256": info.sha256}


def info_doc(device_id: str, hw: Any, model: dict | None, tuning: TuningConfig,
             targets: list[tuple[KernelSpec, Workload]]) -> dict:
    return {
        "device_id": device_id,
        "version": __version__,
        "hw": hw.to_dict(),
        "hw_fingerprint": hw.hw_fingerprint,
        "fw_fingerprint": hw.fw_fingerprint,
        "model": model,
        "kernels": {s.name: {"domain": s.domain, "workloads": [w.name for w in s.workloads]}
                    for s in all_specs().values()},
        "tuning": {"strategy": tuning.strategy, "budget": tuning.budget, "objective": tuning.objective,
                   "targets": [f"{s.name}/{w.name}" for s, w in targets]},
        "commands": {op: list(args) for op, args in OPS.items()},
    }

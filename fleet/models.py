"""The fleet's tuner models: add a GGUF file to the registry (fleet.rollout_store), or build one by retraining on
the fleet's tuning records.

Every file is checked as a device would load it (tuner.model.inference.check_gguf: GGUF header, tensor sizes,
prompt format) before it gets a version, so a model that cannot load is refused here rather than rolled back on
every device. The bundled model is registered as version 1 the first time the registry is used: it is what every
device runs before its first release and what a rollback of the first release returns to.

`build` trains through the same entry point as `edgetune train --records` (tuner.train.train.run): the committed
collector journal and device records are the base, and the fleet DB's records (of all devices, or of those a
selection names) are added, exported to a JSONL file beside the model, as the focus of the training (a share of its
draws, under their own descriptors: `tuner.train.train.run`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from pathlib import Path

from edgetune import paths
from edgetune.errors import BadInput, EdgetuneError
from edgetune.release import NAME_RE, canonical
from edgetune.sqlite import DBError
from fleet import rollout_store as rs
from fleet.store import FleetStore
from tuner.model.inference import MODEL_NAME, ModelError, bundled_model_path, check_gguf


def space_hashes(spaces: dict) -> dict[str, str]:
    """The manifest's `spaces`: per kernel, the first 16 hex digits of the sha256 of the canonical JSON of the knob
    domains the model was trained for (its GGUF `edgetune.spaces`)."""
    return {k: hashlib.sha256(canonical(v)).hexdigest()[:16] for k, v in sorted(spaces.items())}


def _register(store: FleetStore, path: Path, source: str, card: dict | None, note: str | None,
              version: int | None = None) -> dict:
    try:
        info = check_gguf(path)
    except ModelError as e:
        raise BadInput(f"{path}: {e}") from None
    data = path.read_bytes()
    name = str(info.meta.get("general.name") or "")
    name = name if NAME_RE.fullmatch(name) else MODEL_NAME
    return rs.add_model(store, name=name, data=data, sha256=hashlib.sha256(data).hexdigest(),
                        model_version=info.model_version or None,
                        prompt_format=str(info.meta.get("edgetune.prompt_format")), spaces=space_hashes(info.spaces()),
                        card=card,
                        source=source, note=note, now=time.time(), version=version)


def ensure_bundled(store: FleetStore) -> dict:
    """Version 1, the bundled model, registered if it is not yet."""
    found = rs.model(store, rs.BUNDLED_VERSION)
    if found is not None:
        return found
    path = bundled_model_path()
    card_path = path.with_name(f"{MODEL_NAME}.card.json")
    card = json.loads(card_path.read_text()) if card_path.exists() else None
    try:
        return _register(store, path, "bundled", card, "shipped with edgetune", version=rs.BUNDLED_VERSION)
    except (BadInput, DBError):  # another server registered it a moment ago (servers starting together on one
        # PostgreSQL: its row, uncommitted when ours looked, fails our insert on the unique key)
        found = rs.model(store, rs.BUNDLED_VERSION)
        if found is None:
            raise
        return found


def add(store: FleetStore, path: Path, note: str | None = None, card: dict | None = None,
        source: str = "added") -> dict:
    """Register a model file under the next version; its card (`<name>.card.json` beside it) comes along."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"model file {path}: no such file")
    if card is None:
        beside = path.with_name(path.name.split(".")[0] + ".card.json")
        card = json.loads(beside.read_text()) if beside.exists() else None
    ensure_bundled(store)
    return _register(store, path, source, card, note)


def export_records(store: FleetStore, devices: list[str] | None, out: Path) -> dict:
    """The records of `devices` (all when None) as JSONL training data at `out`."""
    wanted = set(devices) if devices is not None else None
    n, seen = 0, set()
    with out.open("w") as f:
        for rec in store.iter_export():
            if wanted is not None and rec.get("device_id") not in wanted:
                continue
            f.write(json.dumps(rec, default=str) + "\n")
            n += 1
            seen.add(rec.get("device_id"))
    return {"records": n, "devices": len(seen), "path": str(out)}


def build(store: FleetStore, devices: list[str] | None, out_dir: Path | None, *, steps: int | None,
          max_minutes: float, no_base: bool = False, focus_share: float | None = None) -> dict:
    """Retrain on the base data plus the fleet's records, which get `focus_share` of the training draws (default:
    the recipe's); the new model is written to `out_dir` with its card and registered. Training output goes to
    stderr."""
    try:
        from tuner.train import data as D
        from tuner.train.train import Recipe, run
    except ImportError as e:
        raise EdgetuneError(f"building a model needs the [train] extra (torch, sentencepiece, gguf, scikit-learn): "
                            f"{e}; install it with `pip install -e '.[train]'`") from None
    out_dir = Path(out_dir) if out_dir else paths.state_dir() / "fleet-models" / time.strftime("build-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    exported = export_records(store, devices, out_dir / "fleet-records.jsonl")
    if not exported["records"]:
        raise BadInput("the fleet DB holds no tuning records from the selected devices: nothing to train on")
    data, base_records = D.base_sources(None, no_base)
    t = time.time()
    with contextlib.redirect_stdout(sys.stderr):
        recipe = Recipe(**({"steps": steps} if steps else {}),
                        **({"focus_share": focus_share} if focus_share is not None else {}))
        mine = Path(exported["path"])
        card = run([p for p in data if p.exists()], base_records + [mine], out_dir, recipe,
                   deadline_s=max_minutes * 60, focus=[mine])
    model = add(store, out_dir / card["file"], note=f"built from {exported['records']} records of "
                                                    f"{exported['devices']} device(s)", card=card, source="built")
    return {**model, "file": str(out_dir / card["file"]), "records": exported["records"],
            "devices": exported["devices"], "seconds": round(time.time() - t, 1)}

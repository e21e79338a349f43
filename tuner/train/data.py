"""Training data: tuning measurements grouped into cases (kernel, ISA, shape), from any of three sources.

- the collector's JSONL journal (`python -m tuner.collect`, committed as quantized_models/data/runs.jsonl.gz);
- a results DB (`ResultsDB.iter_records(running=True)`: every session with its measurements);
- a JSONL export of such records (one session per line, as the fleet writes them).

No torch here: the bench and the model card use it too.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from edgetune.errors import BadInput
from hwprobe.descriptor import vector_registers
from kernels.space import config_key
from tuner.db import FINAL_PHASE, ResultsDB
from tuner.model.prompt import ISA_VECTOR_BITS

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "quantized_models" / "data" / "runs.jsonl.gz"
# tuning records from other devices, committed beside the collector's journal (the fleet loop's input)
DEFAULT_RECORDS = tuple(sorted(DEFAULT_DATA.parent.glob("records.*.jsonl.gz")))


def base_sources(data: list[str] | None, no_base: bool) -> tuple[list[Path], list[Path]]:
    """(collector journals, records) to train on before any --records: the given journals alone, nothing with
    `no_base`, else the committed journal and the committed device records."""
    if data:
        return [Path(p) for p in data], []
    if no_base:
        return [], []
    return [DEFAULT_DATA], list(DEFAULT_RECORDS)


@dataclass
class Case:
    kernel: str
    isa: str
    shape: dict
    workload: str
    split: str  # train | heldout
    hw: dict
    ms: dict[str, list[float]] = field(default_factory=dict)  # config_key -> measured ms (ok only)
    confirm_ms: dict[str, list[float]] = field(default_factory=dict)  # the leaders' side-by-side re-measurements
    confirmation: str | None = None  # the leaders' id of those re-measurements (None: a journal from before ids)
    configs: dict[str, dict] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    focus: bool = False  # measured by a focus records file (`load_cases`): the devices the model is built for

    @property
    def problem(self) -> tuple:
        return problem_key(self.kernel, self.isa, self.shape)

    @property
    def key(self) -> tuple:
        return case_key(self.kernel, self.isa, self.shape, self.hw)

    def table(self) -> dict[str, float]:
        """config_key -> median ms: the reference table of this case."""
        return {k: statistics.median(v) for k, v in self.ms.items() if v}

    @property
    def n_measured(self) -> int:
        """Ok measurements held, confirmations included (a config measured twice counts twice)."""
        return sum(len(v) for v in self.ms.values()) + sum(len(v) for v in self.confirm_ms.values())

    def ranked(self) -> list[tuple[dict, float]]:
        """Configs, fastest first, in the confirmation rounds' time scale. Leaders measured again side by side
        (`phase=confirm`: the collector's confirmation, a device session's final rounds) come first, ranked by those
        rounds alone: they are comparable with each other, while the first measurements span hours of host drift
        (the same configs ran a median 1.64x slower at confirmation than at collection, unevenly), so mixing the two
        would rank configs by when they were measured. The others follow, their times scaled by `confirm_scale`
        (never faster than the fastest leader; a slower leader, such as the default a session always re-measures,
        does not bound them): training weights and histories compare times across the two."""
        t = self.table()
        confirmed = sorted(((k, statistics.median(v)) for k, v in self.confirm_ms.items() if v), key=lambda kv: kv[1])
        scale, floor = self.confirm_scale(), confirmed[0][1] if confirmed else 0.0
        rest = sorted(((k, max(ms * scale, floor)) for k, ms in t.items() if k not in self.confirm_ms),
                      key=lambda kv: kv[1])
        return [(self.configs[k], ms) for k, ms in confirmed + rest]

    def confirm_scale(self) -> float:
        """Confirmation time over first-pass time, the median over the leaders measured in both (1 if none): a
        device's final rounds can run at another speed than its search (another load, another clock)."""
        t = self.table()
        ratios = [statistics.median(v) / t[k] for k, v in self.confirm_ms.items() if v and t.get(k)]
        return statistics.median(ratios) if ratios else 1.0

    def best_ms(self) -> float:
        return min(self.table().values())


def problem_key(kernel: str, isa: str, shape: dict) -> tuple:
    """What a case solves: kernel, ISA cap and shape, on whichever device."""
    return (kernel, isa, json.dumps(shape, sort_keys=True))


def case_key(kernel: str, isa: str, shape: dict, hw: dict) -> tuple:
    """A case is a problem on one device: the same shape tuned on two devices is two cases, each prompted with
    its own descriptor (merged, one device's timings would be trained under the other's)."""
    return problem_key(kernel, isa, shape) + (hw.get("hw_fingerprint") or "",)


def _open(path: Path):
    return gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)


def _rows(path: Path) -> Iterator[dict]:
    with _open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def _local_hw(isa: str) -> dict:
    """Descriptor fields for a record that carries none: this machine's, capped to the record's ISA."""
    from hwprobe import probe

    from tuner.collect import hw_summary

    try:
        return hw_summary(probe(isa_cap=isa, measure_bandwidth=False))
    except Exception:
        return {"isa": isa, "vector_bits": ISA_VECTOR_BITS.get(isa, 128), "cores": 1, "l1d": None, "l2": None,
                "l3": None, "bandwidth_gbps": None}


def load_collector(path: Path, cases: dict | None = None) -> dict[tuple, Case]:
    cases = {} if cases is None else cases
    hws: dict[str, dict] = {}
    for r in _rows(path):
        if r.get("kind") == "hw":
            hws[r["hw"]["isa"]] = r["hw"]
            continue
        if r.get("kind") != "m":
            continue
        add_measurement(cases, r["kernel"], r["isa"], r["shape"], r["workload"], r["split"],
                        hws.get(r["isa"]) or _local_hw(r["isa"]), r["config"], r["ok"], r.get("ms"), r.get("phase", ""),
                        r.get("leaders"), r.get("source_hash"))
    return cases


_REAL_HELDOUT: set | None = None


def is_real_heldout(kernel: str, shape: dict) -> bool:
    """Whether (kernel, shape) is one of bench/real_layers.toml's held-out real layers, on any ISA or device."""
    global _REAL_HELDOUT
    if _REAL_HELDOUT is None:
        from tuner.train.arch_layers import heldout_keys

        _REAL_HELDOUT = heldout_keys()
    try:
        from tuner.train.arch_layers import shape_id

        return shape_id(kernel, shape) in _REAL_HELDOUT
    except (KeyError, TypeError):  # a kernel or dim this edgetune does not know is no held-out layer
        return False


def current_kernel(kernel: str, source_hash: str | None, cfg: dict) -> bool:
    """Whether a measurement describes this edgetune's kernel: a kernel it bundles, from the same C source when the
    row says which (`source_hash`; rows from before it was recorded are taken at their word), with a config of
    exactly its current knobs and values. Records of an older or newer kernel (a device on another edgetune
    version, data collected before a kernel changed) time another implementation, or configs the model cannot
    write: they are left out of training."""
    from kernels.registry import all_specs

    spec = all_specs().get(kernel)
    if spec is None or (source_hash and source_hash != _source_hash(spec)
                        and source_hash not in SAME_GENERIC_CODE.get(_source_hash(spec), ())):
        return False
    return set(cfg) == {p.name for p in spec.params} and all(cfg[p.name] in p.values for p in spec.params)


# current source hash -> earlier sources of the same kernel whose builds for many shapes (the collector's, which
# bake no shape dims) disassemble the same: their rows measured this very code, so they stay. Keyed by the current
# hash, so the next change of that kernel drops the alias until it is checked again.
SAME_GENERIC_CODE: dict[str, frozenset[str]] = {
    # dwconv_3x3 before its builds for one workload also baked C and W (12 of 12 generic builds the same by objdump)
    "0e12e4ce60e2f120": frozenset({"684012c15efb8638"}),
}
_SOURCE_HASHES: dict[str, str] = {}


def _source_hash(spec) -> str:
    if spec.name not in _SOURCE_HASHES:
        _SOURCE_HASHES[spec.name] = spec.source_hash()
    return _SOURCE_HASHES[spec.name]


def add_measurement(cases: dict, kernel: str, isa: str, shape: dict, workload: str, split: str, hw: dict,
                    cfg: dict, ok: bool, ms: float | None, phase: str = "", leaders: str | None = None,
                    source_hash: str | None = None) -> bool:
    """Add one journal row; False when it was left out. A confirmation row of other leaders than the case's current
    ones starts over: a case's leaders only change by more rows joining them, so the later confirmation is of the
    current leaders, and rounds hours apart are not comparable. A held-out real layer (`is_real_heldout`) never
    becomes a case: a device's records of one (the bench tunes them) must not leak into training; nor does a row of
    another kernel version (`current_kernel`)."""
    key = case_key(kernel, isa, shape, hw)
    if not current_kernel(kernel, source_hash, cfg) or key not in cases and is_real_heldout(kernel, shape):
        return False
    c = cases.get(key)
    if c is None:
        c = cases[key] = Case(kernel, isa, dict(shape), workload, split, hw)
    if phase == "confirm" and leaders != c.confirmation:
        c.confirmation, c.confirm_ms = leaders, {}
    k = config_key(cfg)
    c.configs.setdefault(k, dict(cfg))
    if ok and ms and ms > 0 and math.isfinite(ms):
        (c.confirm_ms if phase == "confirm" else c.ms).setdefault(k, []).append(float(ms))
    else:
        c.failed.add(k)
    return True


def iter_record_sources(path: Path) -> Iterable[dict]:
    """Sessions from a results DB (SQLite) or a JSONL export of records."""
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"SQLite format 3"):
        db = ResultsDB(path)
        try:
            yield from db.iter_records(running=True)
        finally:
            db.close()
        return
    yield from _rows(path)


def is_session(rec: object) -> bool:
    """A tuning record: one session's kernel, shape and measurements."""
    return isinstance(rec, dict) and "measurements" in rec and "kernel" in rec


def check_records(path: Path) -> tuple[int, int]:
    """(sessions, other JSON records) in a records file, read before minutes of training are spent on it: a file
    that is neither a results DB nor JSONL records, or holds no session, is BadInput naming it."""
    fix = ("give a results DB (results.db) or a JSONL export of tuning records (`edgetune export --format records` "
           "on a device, `edgetune fleet export-records` on the fleet server)")
    sessions = other = 0
    try:
        for rec in iter_record_sources(path):
            if is_session(rec):
                sessions += 1
            else:
                other += 1
    except (UnicodeDecodeError, OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise BadInput(f"records file {path} cannot be read as records ({e}); {fix}") from None
    if not sessions:
        raise BadInput(f"records file {path} holds no tuning sessions; {fix}")
    return sessions, other


def load_records(path: Path, cases: dict | None = None, heldout: set | None = None) -> tuple[dict, int]:
    """Add every ok measurement of every session; returns (cases, sessions read). Sessions of a `heldout` problem
    (`problem_key`) are skipped, on every device."""
    cases = {} if cases is None else cases
    n = 0
    hw_cache: dict[str, dict] = {}
    for rec in iter_record_sources(path):
        if not is_session(rec):
            continue
        n += 1
        shape = rec["shape"] if isinstance(rec["shape"], dict) else json.loads(rec["shape"])
        isa = rec.get("isa", "x86-64-v2")
        if heldout and problem_key(rec["kernel"], isa, shape) in heldout:
            continue
        hw = rec.get("hw") or hw_cache.get(isa) or hw_cache.setdefault(isa, _local_hw(isa))
        session = f"{rec.get('device_id', '')}/{rec.get('id', n)}/{rec.get('started_at', '')}"
        if isinstance(hw, dict) and "caches" in hw:  # a full HwDescriptor dict
            from hwprobe.descriptor import HwDescriptor

            from tuner.collect import hw_summary

            hw = hw_summary(HwDescriptor.from_dict(hw))
        for m in rec["measurements"]:
            final = m.get("phase") == FINAL_PHASE  # the session's side-by-side rounds: its confirmation
            add_measurement(cases, rec["kernel"], isa, shape, rec.get("workload", ""), "train", hw,
                            m["config"], bool(m.get("ok")), m.get("ms"), "confirm" if final else m.get("phase", ""),
                            session if final else None, source_hash=rec.get("source_hash"))
    return cases, n


def load_cases(data: list[Path], records: list[Path], focus: frozenset[Path] = frozenset()
               ) -> tuple[dict, str, int, int, int]:
    """(cases, dataset sha256, record sessions, measurements they added, cases from the journals) of the collector
    journals and then the tuning records; a case that a records file in `focus` measures is marked `focus`."""
    cases: dict = {}
    h = hashlib.sha256()
    for p in data:
        load_collector(p, cases)
        for row in _rows(Path(p)):  # the training rows only: held-out references may grow without changing it
            if row.get("kind") == "hw" or row.get("split") == "train":
                h.update(json.dumps(row, sort_keys=True).encode())
    heldout = {c.problem for c in cases.values() if c.split == "heldout"}
    n_sessions, from_journal, measured = 0, len(cases), 0
    for p in records:
        before = sum(c.n_measured for c in cases.values())
        counts = {k: c.n_measured for k, c in cases.items()}
        _, n = load_records(p, cases, heldout)
        for k, c in cases.items():
            c.focus |= p in focus and c.n_measured > counts.get(k, 0)
        added = sum(c.n_measured for c in cases.values()) - before  # a record of a journal case's problem on the
        #                                                             same device joins that case
        if not added:
            print(f"warning: the {n} record sessions of {p} added no measurement (records of another kernel "
                  "version, or of held-out problems, are left out)", flush=True)
        n_sessions, measured = n_sessions + n, measured + added
        h.update(Path(p).read_bytes())
    return cases, h.hexdigest(), n_sessions, measured, from_journal


def split_cases(cases: dict[tuple, Case]) -> tuple[list[Case], list[Case]]:
    train = [c for c in cases.values() if c.split == "train" and c.ms]
    held = [c for c in cases.values() if c.split == "heldout" and c.ms]
    return train, held


def targets(case: Case, top: int, tau: float, exclude: set[str] = frozenset()) -> list[tuple[dict, float]]:
    """(config, weight): the case's `top` fastest configs not in `exclude`, weighted by relative speed.

    weight ∝ exp(-(ms/best - 1)/tau), normalised per case, so every case counts the same and the model learns
    the ranking (a config 8% slower than the best gets e^-1 of its weight), not just the top-1.
    """
    ranked = [(cfg, ms) for cfg, ms in case.ranked() if config_key(cfg) not in exclude][:top]
    if not ranked:
        return []
    best = ranked[0][1]
    ws = [math.exp(-(ms / best - 1) / tau) for _, ms in ranked]
    z = sum(ws)
    return [(cfg, w / z) for (cfg, _), w in zip(ranked, ws)]


def training_examples(train: list[Case], top: int = 12, tau: float = 0.08) -> list[tuple[Case, dict, float]]:
    """(case, config, weight) over every training case (`targets`)."""
    return [(c, cfg, w) for c in train for cfg, w in targets(c, top, tau)]


def sample_history(case: Case, rng, size: int, top_pool: int = 16) -> list[tuple[dict, float]]:
    """`size` distinct measured (config, ms) of a case, as a session's first measurements might be: each drawn from
    the case's `top_pool` fastest with probability 1/2 (a model's proposals are mostly good ones), else from all its
    measured configs. Times are the first-pass medians (one scale: the confirmation rounds ran at another speed)."""
    table = case.table()
    ranked = [config_key(cfg) for cfg, _ in case.ranked() if config_key(cfg) in table]
    out: list[tuple[dict, float]] = []
    keys: set[str] = set()
    for _ in range(size * 8):
        if len(out) >= min(size, len(ranked)):
            break
        k = ranked[rng.randrange(min(top_pool, len(ranked)))] if rng.random() < 0.5 else rng.choice(ranked)
        if k not in keys:
            keys.add(k)
            out.append((case.configs[k], table[k]))
    return out


class HwView:
    """Just enough of an HwDescriptor for constraints and the prompt, from a data row's hw summary."""

    def __init__(self, d: dict):
        self._d = d
        self.isa, self.vector_bits, self.cores = d["isa"], d["vector_bits"], d["cores"]
        self.bandwidth_gbps = d.get("bandwidth_gbps")
        self.arch = d.get("arch", "x86_64")
        self.vector_registers = vector_registers(self.arch, self.vector_bits)
        self.big_cores = self.cores  # the collected rows come from hosts whose cores are all equal

    def cache_bytes(self, level: int, kind: str = "Data"):
        return self._d.get({1: "l1d", 2: "l2", 3: "l3"}[level])

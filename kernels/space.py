"""Typed search spaces: the vocabulary a kernel spec declares its knobs in.

It lives in `kernels` (not `tuner`) because every spec declares one and `kernels` sits above `tuner`;
strategies and the grammar export in `tuner` consume it.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping

from edgetune.errors import BadInput

Value = int | str
Config = dict[str, Value]
Shape = dict[str, int]


@dataclass(frozen=True)
class Param:
    """One knob; `values` are in their natural order, which neighbours and the grammar follow."""

    name: str
    kind: Literal["pow2", "enum", "int"]
    values: tuple[Value, ...]
    help: str = ""

    def coerce(self, v: Any) -> Value:
        """Accept "8" for 8 (JSON/CLI input); reject anything not in the allowed values."""
        for allowed in self.values:
            if v == allowed or (isinstance(allowed, int) and isinstance(v, str) and v.strip().lstrip("-").isdigit() and int(v) == allowed):
                return allowed
        raise BadInput(f"knob {self.name}={v!r} is not allowed; allowed values: {', '.join(map(str, self.values))}")


def pow2(name: str, lo: int, hi: int, help: str = "") -> Param:
    assert lo > 0 and lo & (lo - 1) == 0 and hi & (hi - 1) == 0
    return Param(name, "pow2", tuple(1 << i for i in range(int(math.log2(lo)), int(math.log2(hi)) + 1)), help)


def enum(name: str, *values: Value, help: str = "") -> Param:
    return Param(name, "enum", tuple(values), help)


def int_range(name: str, lo: int, hi: int, step: int = 1, help: str = "") -> Param:
    return Param(name, "int", tuple(range(lo, hi + 1, step)), help)


class PartialConfig(dict):
    """A partial config: reading an unassigned knob raises KeyError (the constraint is undetermined). Asking whether
    an unassigned knob is there (`in`, `get`) is allowed, for prefix-aware predicates, and is remembered in
    `asked`: such an answer may change as knobs are assigned. `missed` lists the unassigned knobs read."""

    asked = False
    missed: tuple = ()

    def __missing__(self, key: str) -> Any:
        self.missed += (key,)
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        found = dict.__contains__(self, key)
        self.asked |= not found
        return found

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default


@dataclass(frozen=True)
class Constraint:
    """A predicate over (config, shape, hw); `why` is shown when it rejects a config."""

    why: str
    holds: Callable[[Config, Shape, Any], bool]


@dataclass(frozen=True)
class SearchSpace:
    """A kernel's knobs bound to one workload shape and one device, so constraints can be evaluated."""

    params: tuple[Param, ...]
    constraints: tuple[Constraint, ...]
    default: Config
    shape: Shape
    hw: Any  # hwprobe.HwDescriptor (or any object with the attributes the constraints read)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def violations(self, cfg: Config) -> list[str]:
        return [c.why for c in self.constraints if not c.holds(cfg, self.shape, self.hw)]

    def is_valid(self, cfg: Config) -> bool:
        return all(c.holds(cfg, self.shape, self.hw) for c in self.constraints)

    def validate(self, cfg: Mapping[str, Any], *, complete: bool = False) -> Config:
        """Coerce and check a user config; missing knobs take this shape's valid default unless `complete`.

        Raises BadInput naming the knob and what is allowed, or the constraint that failed.
        """
        unknown = set(cfg) - set(self.names)
        if unknown:
            raise BadInput(f"unknown knob(s) {', '.join(sorted(unknown))}; knobs are: {', '.join(self.names)}")
        if complete and set(cfg) != set(self.names):
            raise BadInput(f"config is missing knob(s): {', '.join(n for n in self.names if n not in cfg)}")
        base = self.default if complete else self.valid_default()
        out: Config = {p.name: p.coerce(cfg[p.name]) if p.name in cfg else base[p.name] for p in self.params}
        bad = self.violations(out)
        if bad:
            raise BadInput(f"config {format_config(out)} violates: {'; '.join(bad)}")
        return out

    def valid_default(self) -> Config:
        """The spec's default, nudged to the nearest valid config when a constraint (e.g. a capped ISA) rejects it:
        the least `distance` from it, ties to the first in enumeration order."""
        if self.is_valid(self.default):
            return dict(self.default)
        best = self._nearest(self.default)
        if best is None:
            raise BadInput(f"no valid config exists for shape {self.shape}")
        return best

    def _nearest(self, target: Mapping[str, Value]) -> Config | None:
        """Uniform-cost search over knob assignments in space order (cost: steps from `target`), pruning partial
        assignments a constraint already rules out: exact, without walking the whole cross product."""
        import heapq

        want = [p.values.index(target[p.name]) if target.get(p.name) in p.values else 0 for p in self.params]
        heap: list[tuple[int, tuple[int, ...]]] = [(0, ())]
        while heap:
            cost, idx = heapq.heappop(heap)
            cfg = PartialConfig({p.name: p.values[i] for p, i in zip(self.params, idx)})
            if len(idx) == len(self.params):
                if self.is_valid(dict(cfg)):
                    return dict(cfg)
                continue
            p = self.params[len(idx)]
            for i in range(len(p.values)):
                cfg[p.name] = p.values[i]
                if self._allowed(cfg):
                    heapq.heappush(heap, (cost + abs(i - want[len(idx)]), idx + (i,)))
        return None

    def size(self) -> int:
        return sum(1 for _ in self.enumerate())

    def cardinality(self) -> int:
        """Size of the unconstrained cross product (cheap; an upper bound on size())."""
        return math.prod(len(p.values) for p in self.params)

    def enumerate(self) -> Iterator[Config]:
        for combo in itertools.product(*(p.values for p in self.params)):
            cfg = dict(zip(self.names, combo))
            if self.is_valid(cfg):
                yield cfg

    def sample(self, n: int, rng: random.Random, exclude: set[str] | None = None) -> list[Config]:
        """Up to n distinct valid configs, uniformly by rejection; deterministic for a seeded rng. A space whose
        constraints reject nearly all of the cross product (a tiny layer: one tile height fits, one depth block
        covers it) is sampled knob by knob instead, each value drawn among those no constraint rules out yet."""
        seen = set(exclude or ())
        out: list[Config] = []
        for attempt in range(max(200, n * 200) + max(50, n * 20)):
            if len(out) >= n:
                break
            cfg = self._draw(rng) if attempt >= max(200, n * 200) else {p.name: rng.choice(p.values)
                                                                        for p in self.params}
            if cfg is None:
                break
            key = config_key(cfg)
            if key in seen or not self.is_valid(cfg):
                continue
            seen.add(key)
            out.append(cfg)
        return out

    def _allowed(self, cfg: PartialConfig) -> bool:
        """No constraint fails on the assigned knobs (one that reads an unassigned knob is undetermined)."""
        for c in self.constraints:
            try:
                if not c.holds(cfg, self.shape, self.hw):
                    return False
            except (KeyError, TypeError):
                continue
        return True

    def _draw(self, rng: random.Random) -> Config | None:
        """One valid config, knob by knob in space order, backtracking past dead ends; None if none exists."""
        cfg = PartialConfig()

        def fill(i: int) -> bool:
            if i == len(self.params):
                return self.is_valid(dict(cfg))
            p = self.params[i]
            for v in rng.sample(p.values, len(p.values)):
                cfg[p.name] = v
                if self._allowed(cfg) and fill(i + 1):
                    return True
                del cfg[p.name]
            return False

        return dict(cfg) if fill(0) else None

    def neighbours(self, cfg: Config) -> list[Config]:
        """Valid configs one step away in one knob (adjacent value in the knob's order)."""
        out = []
        for p in self.params:
            i = p.values.index(cfg[p.name])
            for j in (i - 1, i + 1):
                if 0 <= j < len(p.values):
                    n = dict(cfg)
                    n[p.name] = p.values[j]
                    if self.is_valid(n):
                        out.append(n)
        return out

    def distance(self, a: Config, b: Config) -> int:
        """Steps between two configs, summed over knobs; used to break ties toward the default."""
        return sum(abs(p.values.index(a[p.name]) - p.values.index(b[p.name])) for p in self.params)


def config_key(cfg: Mapping[str, Any]) -> str:
    """Canonical text of a config: the dedup and DB key."""
    return ",".join(f"{k}={cfg[k]}" for k in sorted(cfg))


def format_config(cfg: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def config_from_json(text: str, what: str = "config") -> dict[str, Any]:
    """Parse a user's JSON config object (CLI, MQTT args); knobs are validated later by SearchSpace.validate."""
    import json

    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"{what} is not valid JSON ({e.msg} at column {e.colno}): {text!r}")
    if not isinstance(cfg, dict):
        raise BadInput(f"{what} must be a JSON object of knobs, got {type(cfg).__name__}")
    return cfg


def table_predicate(names: list[str], configs: Iterable[dict]):
    """A constraint-style predicate "the config is in this table" that also prunes partial configs.

    Partial configs (assigned in space order, as the proposer builds them) are kept while some table config
    shares their prefix; a full config must be in the table.
    """
    prefixes: set[tuple] = set()
    for c in configs:
        vals = tuple(c[n] for n in names)
        for i in range(len(vals) + 1):
            prefixes.add(vals[:i])

    def ok(c) -> bool:
        vals = []
        for n in names:
            if n not in c:
                break
            vals.append(c[n])
        return tuple(vals) in prefixes

    return ok

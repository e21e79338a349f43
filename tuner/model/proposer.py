"""Top-K configs from the tuner model: an exact best-first search over field values with KV prefix reuse.

The completion is ` name=value` pairs in space order, so a config's log-probability is the sum over fields of
log P(value | prompt, earlier fields). Each field's distribution is renormalised over the values the grammar
admits that the constraints do not already rule out (a constraint is evaluated on a partial config through a
dict that raises KeyError for unassigned knobs: an error means "undetermined", False prunes). Scores only fall
as fields are added, so popping partial configs best-first yields the exact top-K complete ones, in order. A field
the constraints leave a single value has probability 1 after renormalisation: the search passes through it without
decoding, and the skipped token is decoded with the next one.

KV reuse: the prompt is decoded once into sequence 0. Expanding a node copies its parent's KV sequence
(`llama_memory_seq_cp`, no recompute) and decodes only the node's own value tokens; the first token of every
candidate value is scored from the node's logits, and multi-token values get their remaining tokens decoded in
the same batch, in throw-away sequences that share the node's tokens. Several frontier nodes are expanded per
`llama_decode`, which keeps the search exact (complete configs are still only emitted from the top of the heap).

A model unsure of a shape spreads its mass over many partial configs, and the exact search can spend its
`max_expansions` without completing k of them (a retrained model, on a small gemm, completed 0-1 of 5 in 600
expansions). The search then dives: the deepest open nodes first, the most probable among them (a beam of up to
`per_decode(k)` nodes a level, one decode each), for at most `max_expansions` more or what k configs need.
Those configs follow the exact ones, in score order, and the result says it is not exact.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from kernels.space import Config, PartialConfig, SearchSpace, config_key
from tuner.grammar import export_grammar
from tuner.model.inference import LlamaModel, ModelError, _Batch, log_softmax
from tuner.model.prompt import field_text, prompt_text
from tuner.model.scorer import Scorer, ScorerError

log = logging.getLogger(__name__)


def unknown_knobs(known: Mapping[str, Any] | None, space: SearchSpace) -> dict[str, Any]:
    """Knobs of `space` a model trained on the space `known` (knob -> values, from its GGUF) never saw, each with
    the value it takes: the space's default. Such a model still proposes for the knobs it knows (a kernel that
    gained a knob after the model was trained, until the next model), and the prompt and its history carry only
    those; values a knob gained or lost need nothing (the grammar is the current space's)."""
    if not known:
        return {}
    return {p.name: space.default.get(p.name, p.values[0]) for p in space.params if p.name not in known}


Pending = tuple[tuple[int, "str | None"], ...]  # (constraint index, the unassigned knob its evaluation stopped at)


def undecided(space: SearchSpace, pending: Pending, cfg: PartialConfig) -> Pending | None:
    """The constraints of `pending` that `cfg` leaves undetermined, or None when one of them fails.

    A constraint that held without looking at an unassigned knob holds for every completion of `cfg`, so a search
    node hands its children only the undetermined ones. One whose first look past the assigned knobs was reading
    knob K (a KeyError, nothing asked before) retraces the same reads until K is assigned, so it is skipped until
    then; one that asked `in`/`get` about an unassigned knob, or raised TypeError, is re-evaluated at every depth."""
    left = []
    for i, blocker in pending:
        if blocker is not None and not dict.__contains__(cfg, blocker):
            left.append((i, blocker))
            continue
        cfg.asked, cfg.missed = False, ()
        try:
            if not space.constraints[i].holds(cfg, space.shape, space.hw):
                return None
        except KeyError as e:
            clean = not cfg.asked and cfg.missed == e.args  # stopped at its first look past the assigned knobs
            left.append((i, e.args[0] if clean else None))
            continue
        except TypeError:
            left.append((i, None))
            continue
        if cfg.asked or cfg.missed:
            left.append((i, None))
    return tuple(left)


def candidates(space: SearchSpace, fields: list, names: list[str], node: "_Node",
               extra: Callable[[Config], bool | None] | None) -> list[tuple[Any, list[int], Pending]]:
    """The values of `node`'s next field that no constraint (nor `extra`) rules out: (value, tokens, the
    constraints still undetermined)."""
    name, values = fields[len(node.values)]
    assigned = dict(zip(names, node.values))
    out = []
    for v, vt in values:
        cfg = PartialConfig(assigned)
        cfg[name] = v
        left = undecided(space, node.pending, cfg)
        if left is not None and (extra is None or extra(cfg) is not False):
            out.append((v, vt, left))
    return out


def grammar_values(space: SearchSpace) -> list[tuple[str, list[Any]]]:
    """The (name, values) alternatives of the space's validated GBNF grammar, in order.

    The grammar is validated by llama.cpp's own parser (tuner.grammar) before use; the values are read back from
    it and mapped onto the space's typed values, so the search decodes exactly what the grammar admits.
    """
    g = export_grammar(space)
    out = []
    for p in space.params:
        m = re.search(r'^k-' + re.escape(p.name.replace("_", "-").lower()) + r' ::= " ' + re.escape(p.name)
                      + r'=" \((.*)\)$', g, re.M)
        if not m:
            raise ModelError(f"grammar has no rule for knob {p.name}")
        texts = re.findall(r'"([^"]*)"', m.group(1))
        by_text = {str(v): v for v in p.values}
        out.append((p.name, [by_text[t] for t in texts if t in by_text]))
    return out


@dataclass(slots=True)
class _Node:
    """A partial config; the heap holds (neg, tie, node) tuples, which compare in C."""

    neg: float  # minus its log-probability
    values: tuple  # assigned values, in field order
    tokens: list[int] = field(default_factory=list)  # all completion tokens so far
    own: int = 0  # how many trailing tokens belong to the last field
    parent: "_Node | None" = None
    seq: int | None = None  # KV sequence holding prompt + tokens
    lp: np.ndarray | None = None  # raw logits after the last token
    pending: Pending = ()  # constraints the assigned values leave open


@dataclass
class Proposal:
    config: Config
    logprob: float


@dataclass
class ProposeResult:
    proposals: list[Proposal]
    latency_ms: float
    expansions: int
    decodes: int
    prompt: str
    cpu_ms: float = 0.0  # this thread's CPU time (llama.cpp runs in it, n_threads=1): the latency on an idle core
    exact: bool = True  # False: the exact search hit its cap and the last proposals come from dives


def _load_scorer(info: Any) -> Scorer | None:
    """The scorer the model file carries (None without one). A malformed one is a warning naming the file: the
    model still proposes, in its own order."""
    try:
        return Scorer.from_meta(info.meta)
    except ScorerError as e:
        log.warning("tuner model %s: %s; its proposals keep the model's own order", info.path, e)
        return None


class Proposer:
    def __init__(self, model: LlamaModel | None = None, *, path=None, expand_per_decode: int = 16,
                 max_expansions: int = 600):
        """`expand_per_decode`: the most frontier nodes a `llama_decode` expands; a top-k search expands
        `per_decode(k)`. More nodes a decode means fewer decodes, at the price of expanding nodes an exact top-k
        would not have needed, and a decode's cost grows with its tokens."""
        self.m = model or LlamaModel(path)
        self.expand_per_decode = expand_per_decode
        self.max_expansions = max_expansions
        self._free: list[int] = []

    @property
    def version(self) -> str:
        return self.m.version

    def per_decode(self, k: int) -> int:
        """Frontier nodes a decode expands in a top-k search: 2k, at least 8, at most `expand_per_decode`. A top-1
        (every steered, hedge and local step) needs few nodes a level: 16 of them made each decode dearer without
        saving one (8 decodes either way), and 4 took more decodes. On the 35 real held-out layers, CPU ms p50 /
        p95, same results: a steered top-1 (history, evidence bias) 13.3 / 19.9 with 8 a decode, 11.7 / 25.2 with
        4, 18.3 / 23.6 with 16; a top-1 without a history 9.8 / 17.1 vs 14.4 / 20.3 with 16; a top-15 (16 a
        decode) unchanged. In tuning sessions side by side (35 layers, budget 20): every call's CPU p95 23.0 vs
        28.5 ms, a session's proposal CPU p50 177 vs 207 ms."""
        return min(self.expand_per_decode, max(8, 2 * k))

    @functools.cached_property
    def scorer(self) -> Scorer | None:
        """The model file's scorer, read on first use (~13 ms): only the first batch of a session needs it."""
        return _load_scorer(self.m.info)

    def _alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def propose(self, kernel: str, space: SearchSpace, k: int = 5, *,
                extra: Callable[[Config], bool | None] | None = None,
                history: Sequence[tuple[Config, float]] = (), exclude: Collection[str] = (),
                bias: Mapping[str, Mapping[Any, float]] | None = None, prompt_hw: Any = None,
                unknown_values: Mapping[str, Any] | None = None) -> ProposeResult:
        """Top-k distinct valid configs, best first, each with its log-probability under the model.

        `extra` is an additional predicate (e.g. "config is in the replay table"); it receives a partial config
        that raises KeyError for unassigned knobs, like the space's own constraints. `history` is what the session
        measured so far, (config, ms) in order, which the prompt carries; configs whose key is in `exclude` are
        never returned (the search passes over them to the next best). `bias` adds a log-weight (<= 0) to knob
        values, e.g. evidence from measurements; non-positive keeps the best-first search exact, since a
        partial config's score still only falls as fields are added. `prompt_hw` describes the device to the model
        instead of `space.hw` (which the constraints keep reading): how bench/unseen_hw.py asks what the model
        would propose were the device the nearest one its data knows. A knob the model was trained without
        (`unknown_knobs`) takes its value from `unknown_values` (e.g. the incumbent's), else the default.
        """
        t0, c0 = time.perf_counter(), time.thread_time()
        m = self.m
        if bias and any(b > 0 for vs in bias.values() for b in vs.values()):
            raise ValueError("bias must be <= 0 (a positive one would break the exact best-first search)")
        self._bias = bias or {}
        unknown = unknown_knobs(self.m.info.spaces().get(kernel), space)
        unknown.update({k: v for k, v in (unknown_values or {}).items() if k in unknown})
        fields = [(name, [(v, [] if name in unknown else m.tokenize(field_text(name, v))) for v in values])
                  for name, values in grammar_values(space)]
        prompt = prompt_text(kernel, space.shape, space.hw if prompt_hw is None else prompt_hw, history,
                             [n for n in space.names if n not in unknown])
        ptoks = [m.bos] + m.tokenize(prompt)
        lp0 = self._prefill(ptoks)
        n_prompt = len(ptoks)
        self._free = list(range(m.n_seq_max - 1, 0, -1))
        self._owners: dict[int, _Node] = {}
        self._protected: set = set()
        tie = itertools.count()
        root = _Node(0.0, (), [], 0, None, 0, lp0, tuple((i, None) for i in range(len(space.constraints))))
        heap: list[tuple[float, int, _Node]] = [(0.0, next(tie), root)]
        out: list[Proposal] = []
        seen: set[str] = set()
        expansions = decodes = 0
        nf = len(fields)
        names = self._names = [n for n, _ in fields]
        self._diving = False  # exact: best-first by score alone
        per = max(1, min(self.per_decode(k), (m.n_seq_max - 1) // 3))  # room for nodes, parents, temps
        exact, n_exact, stop = True, 0, self.max_expansions
        while heap and len(out) < k:
            if expansions >= stop:
                if not exact:
                    break
                # dive: deepest first, then by score (a beam of `per` nodes a level, a decode each), for as many
                # expansions again, or as many as beams enough for k complete configs take
                dive = max(self.max_expansions, per * nf * -(-(k - len(out)) // per))
                exact, n_exact, stop = False, len(out), expansions + dive
                self._diving = True
                heap = [(self._rank(n), t, n) for _, t, n in heap]
                heapq.heapify(heap)
            if len(heap[0][2].values) == nf:  # a complete config at the top of the heap: exact next-best
                node = heapq.heappop(heap)[2]
                cfg = dict(zip(names, node.values))
                key = config_key(cfg)
                if key not in seen and key not in exclude and space.is_valid(cfg) \
                        and (extra is None or extra(PartialConfig(cfg)) is not False):
                    seen.add(key)
                    out.append(Proposal(cfg, -node.neg))
                continue
            batch = self._gather(heap, tie, per, space, fields, unknown, extra)
            expansions += len(batch)
            if batch:
                decodes += self._expand(batch, heap, tie, n_prompt)
        m.clear()
        if not exact:  # the dives' configs, in score order after the exact ones (which outscore every open node)
            out[n_exact:] = sorted(out[n_exact:], key=lambda p: -p.logprob)
        return ProposeResult(out, (time.perf_counter() - t0) * 1e3, expansions, decodes, prompt,
                             (time.thread_time() - c0) * 1e3, exact)

    def _prefill(self, ptoks: list[int]) -> Any:
        """Decode the prompt into sequence 0 of a cleared cache; the logits after its last token."""
        m = self.m
        m.clear()
        b = _Batch()
        for i, t in enumerate(ptoks):
            b.add(t, i, [0], i == len(ptoks) - 1)
        return m.decode(b)[len(ptoks) - 1]

    def _gather(self, heap: list, tie, per: int, space: SearchSpace, fields: list, unknown: Mapping[str, Any],
                extra: Callable[[Config], bool | None] | None) -> list[tuple[_Node, list]]:
        """Pop up to `per` open nodes whose next field has a choice to decode (the batch for `_expand`); a node
        with one admissible value gets its child pushed at once, without decoding."""
        names = self._names
        batch: list[tuple[_Node, list]] = []
        while heap and len(batch) < per and len(heap[0][2].values) < len(fields):
            node = heapq.heappop(heap)[2]
            cands = candidates(space, fields, names, node, extra)
            name = names[len(node.values)]
            if cands and name in unknown:  # a knob the model never saw: its default (else the first allowed)
                cands = [next((c for c in cands if c[0] == unknown[name]), cands[0])]
            if len(cands) > 1:
                batch.append((node, cands))
            elif cands and not cands[0][1] and node.lp is not None:
                # assigned without a token: the child is the node's KV state and logits, and takes them over
                child = _Node(node.neg, node.values + (cands[0][0],), node.tokens, node.own, node.parent, node.seq,
                              node.lp, cands[0][2])
                if node.seq is not None and self._owners.get(node.seq) is node:
                    self._owners[node.seq] = child
                self._push(heap, tie, child)
            elif cands:  # one admissible value has probability 1 after renormalisation: nothing to decode
                v, toks, left = cands[0]
                parent, own = (node.parent, node.own + len(toks)) if node.lp is None else (node, len(toks))
                self._push(heap, tie, _Node(node.neg, node.values + (v,), node.tokens + toks, own, parent,
                                            pending=left))
        return batch

    def _expand(self, batch: list[tuple[_Node, list]], heap: list, tie, n_prompt: int) -> int:
        """Materialise each node's KV + logits, score every candidate value of its next field, push children."""
        m = self.m
        b = _Batch()
        plans = []  # (node, candidates [(value, toks, undecided constraints)], temp seqs, batch idx of prefix tokens)
        protected = {n.parent.seq for n, _ in batch if n.parent is not None} | {n.seq for n, _ in batch}
        self._protected = protected
        for node, cands in batch:
            temps = [self._get() if len(toks) > 1 else None for _, toks, _ in cands]
            live_temps = [t for t in temps if t is not None]
            own_idx = None
            if node.lp is None:  # materialise the node: its KV sequence and the logits after its last token
                src = node.parent.seq if node.parent is not None else None
                node.seq = self._get()
                self._owners[node.seq] = node
                if src is None:  # the parent's sequence was recycled: rebuild from the prompt
                    src, start, toks = 0, n_prompt, node.tokens
                else:
                    start, toks = n_prompt + len(node.tokens) - node.own, node.tokens[-node.own:]
                for t in [node.seq] + live_temps:  # free sequences are empty (_get and the temp release clear them)
                    m.seq_cp(src, t)
                    if src == 0:
                        m.seq_rm(t, n_prompt)
                for j, tk in enumerate(toks):
                    own_idx = b.add(tk, start + j, [node.seq] + live_temps, j == len(toks) - 1)
            else:
                for t in live_temps:
                    m.seq_cp(node.seq, t)
            pos0 = n_prompt + len(node.tokens)
            cand_idx = []
            for (v, toks, _), t in zip(cands, temps):
                idx = []
                if t is not None:
                    for j, tk in enumerate(toks[:-1]):
                        idx.append(b.add(tk, pos0 + j, [t], True))
                cand_idx.append(idx)
            plans.append((node, cands, temps, cand_idx, own_idx))
        lps = m.decode(b) if b.tokens else {}  # the root's logits come with the prompt: nothing to decode
        for node, cands, temps, cand_idx, own_idx in plans:
            if node.lp is None:
                node.lp = lps[own_idx]
            # first tokens from the node's raw logits, at once: the renormalisation below cancels the vocabulary's
            # normaliser; a value's later tokens each condition on a different prefix, so they are log-softmaxed
            sc = node.lp[[toks[0] for _, toks, _ in cands]].tolist()
            for c, ((_, toks, _), idx) in enumerate(zip(cands, cand_idx)):
                for j in range(1, len(toks)):
                    sc[c] += float(log_softmax(lps[idx[j - 1]])[toks[j]])
            for t in temps:
                if t is not None:
                    m.seq_rm(t)
                    self._free.append(t)
            top = max(sc)
            base = node.neg + top + math.log(sum(math.exp(x - top) for x in sc))
            field_bias = self._bias.get(self._names[len(node.values)], {}) if self._bias else {}
            for (v, toks, left), x in zip(cands, sc):
                neg = base - x - field_bias.get(v, 0.0)
                self._push(heap, tie, _Node(neg, node.values + (v,), node.tokens + toks, len(toks), node, pending=left))
        return 1 if b.tokens else 0

    def _rank(self, node: _Node) -> float:
        """A node's heap key: its score (minus log-probability), or once diving, deeper nodes first."""
        return node.neg - 1e6 * len(node.values) if self._diving else node.neg

    def _push(self, heap: list, tie, node: _Node) -> None:
        heapq.heappush(heap, (self._rank(node), next(tie), node))

    def _get(self) -> int:
        """A free KV sequence; when none is left, recycle the one of the worst-scoring materialised node that this
        batch does not use (its children rebuild from the prompt if they are ever expanded)."""
        s = self._alloc()
        if s is None:
            victims = [n for q, n in self._owners.items() if q not in self._protected and n.seq == q]
            if not victims:
                raise ModelError("out of KV sequences")
            v = max(victims, key=lambda n: n.neg)
            s, v.seq = v.seq, None
            del self._owners[s]
            self.m.seq_rm(s)
        self._protected.add(s)
        return s

"""Turn an ONNX model into workloads: each layer a bundled kernel can run becomes a shape to tune.

Only shapes matter, so weights are never loaded (external data stays on disk), and a layer that no kernel
runs is counted, never fatal: a model is imported as far as it maps, and the result says what was left out
and why.
"""

from __future__ import annotations

import math
import re
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

from edgetune.errors import BadInput
from kernels.registry import all_specs
from kernels.space import Shape
from kernels.workload_files import WorkloadEntry

DEFAULT_MELS = 40
_SEARCH_DEPTH = 8  # nodes between an STFT/DFT and its mel MatMul (power, reduce, transpose, ...)
_LOG_DEPTH = 3  # nodes between the mel MatMul and its Log (add eps, clip, max)
_SIGNAL_DEPTH = 10  # nodes between the signal and a DFT (pad, gather/reshape framing, window)


@dataclass
class ImportedLayer:
    """One distinct kernel shape of the model; `count` is how often it runs per inference."""

    kernel: str
    shape: Shape
    name: str
    count: int
    sources: list[str]  # one per layer that maps here, "<op> <node name>"


@dataclass
class ImportResult:
    """What a model maps to, and what it does not, so the user can judge how much of it will be tuned."""

    model: str
    entries: list[ImportedLayer]
    skipped: dict[str, int]  # op type → nodes not mapped
    dynamic: list[str]  # symbolic input dims left unset: pass --dim NAME=VALUE
    warnings: list[str] = field(default_factory=list)
    why: dict[str, list[str]] = field(default_factory=dict)  # op → why its nodes were not mapped

    def workload_entries(self) -> list[WorkloadEntry]:
        """What the workloads file holds: one entry per distinct shape, sources summarised."""
        file = Path(self.model).name
        return [WorkloadEntry(e.kernel, e.shape, e.name, e.count,
                              f"{file}: {e.sources[0]}" + (f" (+{len(e.sources) - 1} more)" if len(e.sources) > 1 else ""))
                for e in self.entries]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Skip(Exception):
    """A node no kernel runs; the message is the reason, worded the same for every such node so they aggregate."""


@dataclass
class _Cand:
    kernel: str
    shape: Shape
    count: int = 1
    note: str = ""  # mapped, but the user should know (e.g. padding differs from the kernel's)


def import_onnx(path: str | Path, dims: dict[str, int]) -> ImportResult:
    """Map the layers of `path` onto bundled kernels; `dims` fixes symbolic input dims (e.g. batch=1)."""
    import onnx

    model = _load(path)
    params = _input_params(model.graph)
    for name, value in dims.items():
        if name not in params:
            raise BadInput(f"--dim {name}: {path} has no symbolic input dim {name!r}; "
                           f"its symbolic dims: {', '.join(params) or 'none'}")
        if type(value) is not int or value < 1:
            raise BadInput(f"--dim {name}={value!r} must be a positive integer")
    for vi in chain(model.graph.input, model.graph.output, model.graph.value_info):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in dims:
                d.dim_value = dims[d.dim_param]  # dim_value and dim_param are a oneof: this clears the param
    warnings: list[str] = []
    if model.functions:
        import onnx.inliner

        model = onnx.inliner.inline_local_functions(model)
    try:
        model = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception as e:  # a model onnx cannot fully infer still has the shapes it stores
        warnings.append(f"shape inference failed ({e}); using the shapes stored in the model")
    g = _Graph(model, [p for p in params if p not in dims])
    return _Importer(g, _stem(path), str(path), warnings).run()


def _load(path: str | Path) -> Any:
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path), load_external_data=False)
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}") from e
    except (DecodeError, ValueError) as e:
        raise BadInput(f"{path} is not a readable ONNX model ({e})") from e
    if not model.graph.node:
        raise BadInput(f"{path} is not an ONNX model: it has no graph nodes")
    return model


def _input_params(graph: Any) -> list[str]:
    """Symbolic dim names of the graph inputs, in order of appearance."""
    names = [d.dim_param for vi in graph.input for d in vi.type.tensor_type.shape.dim if d.HasField("dim_param")]
    return list(dict.fromkeys(names))


def _stem(path: str | Path) -> str:
    """The model file's stem as a workload-name prefix ('custom.' is reserved for generated names)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(path).stem).lstrip(".-") or "model"
    return f"model_{stem}" if f"{stem}.".startswith("custom.") else stem


class _Graph:
    """Shapes, constants and edges of the inferred main graph."""

    def __init__(self, model: Any, dynamic: list[str]):
        from onnx import numpy_helper

        g = model.graph
        self.nodes = list(g.node)
        self.dynamic = dynamic
        self.shapes: dict[str, list[int | str | None] | None] = {}
        for vi in chain(g.input, g.value_info, g.output):
            t = vi.type.tensor_type
            self.shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                    for d in t.shape.dim] if t.HasField("shape") else None
        self.consts: dict[str, Any] = {}
        for init in g.initializer:
            self.shapes[init.name] = list(init.dims)
            self.consts[init.name] = init
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            for o in n.output:
                self.producer[o] = i
            for t in n.input:
                self.consumers.setdefault(t, []).append(i)
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
                for a in n.attribute:
                    if a.name == "value":
                        self.consts[n.output[0]] = a.t
                        self.shapes[n.output[0]] = list(a.t.dims)
        self._to_array = numpy_helper.to_array
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)

    def known(self, name: str) -> list[int]:
        """The fully known shape of a tensor, or _Skip saying which dims are missing."""
        shape = self.shapes.get(name)
        if shape is None:
            raise _Skip("shape not known after shape inference")
        if all(isinstance(d, int) and d > 0 for d in shape):
            return shape  # type: ignore[return-value]
        named = sorted({d for d in shape if isinstance(d, str) and d in self.dynamic})
        if named:
            raise _Skip(f"symbolic dim(s) {', '.join(named)} unset: pass " + " ".join(f"--dim {n}=N" for n in named))
        raise _Skip("shape not known after shape inference")

    def const_int(self, name: str) -> int | None:
        """A scalar (or one-element) integer constant input, None when absent or computed at run time."""
        t = self.consts.get(name)
        if t is None:
            return None
        try:
            a = self._to_array(t)
        except Exception:  # external data not loaded: the value is not needed to map any layer
            return None
        return int(a.reshape(-1)[0]) if a.size == 1 else None


def _attr(node: Any, name: str, default: Any = None) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _label(node: Any, idx: int) -> str:
    return f"{node.op_type} {node.name}" if node.name else f"{node.op_type} #{idx}"


def _op(node: Any) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


class _Importer:
    def __init__(self, g: _Graph, stem: str, model: str, warnings: list[str]):
        self.g, self.stem, self.model, self.warnings = g, stem, model, warnings
        self.specs = all_specs()
        self.found: list[tuple[int, _Cand, str]] = []  # node index, candidate, source
        self.skipped: Counter[str] = Counter()
        self.reasons: dict[tuple[str, str], list[str]] = {}  # (op, reason) → node labels
        self.notes: dict[str, list[str]] = {}
        self.consumed: set[int] = set()  # nodes folded into a log-mel front end

    def run(self) -> ImportResult:
        g = self.g
        # front ends first, so their mel MatMul is not also imported as a gemm
        for i, node in enumerate(g.nodes):
            if _op(node) in ("STFT", "DFT"):
                self._try(i, node, lambda: self._logmel(i, node))
        for i, node in enumerate(g.nodes):
            op = _op(node)
            if i in self.consumed or op in ("STFT", "DFT"):
                continue
            mapper = _MAPPERS.get(op)
            if mapper is None:
                self.skipped[op] += 1
                continue
            self._try(i, node, lambda: (mapper(g, node), set()))
        skipped = dict(sorted(self.skipped.items(), key=lambda kv: (-kv[1], kv[0])))
        return ImportResult(self.model, self._merge(), skipped, list(g.dynamic), self.warnings + self._summaries(),
                            self._why(skipped))

    def _try(self, i: int, node: Any, map_node: Any) -> None:
        """Map one node; a _Skip (from the mapping or the spec's own shape check) counts it as skipped."""
        label = _label(node, i)
        try:
            cand, used = map_node()
            spec = self.specs.get(cand.kernel)
            if spec is None:
                raise _Skip(f"kernel {cand.kernel} is not bundled in this build")
            try:
                cand.shape = spec.validate_shape(cand.shape)
            except BadInput as e:
                raise _Skip(str(e)) from e
        except _Skip as e:
            self.skipped[_op(node)] += 1
            self.reasons.setdefault((_op(node), str(e)), []).append(label)
            return
        self.consumed |= used
        mel = [_label(self.g.nodes[j], j) for j in sorted(used) if self.g.nodes[j].op_type == "MatMul"]
        source = " → ".join([label, *mel])
        self.found.append((i, cand, source))
        if cand.note:
            self.notes.setdefault(f"{_op(node)}: {cand.note}", []).append(label)

    def _merge(self) -> list[ImportedLayer]:
        """Equal kernel+shape layers become one entry with a count; names number each kernel's entries in graph order."""
        out: dict[tuple[str, tuple[int, ...]], ImportedLayer] = {}
        per_kernel: Counter[str] = Counter()
        for _, cand, source in sorted(self.found, key=lambda f: f[0]):
            key = (cand.kernel, tuple(cand.shape.values()))
            if key in out:
                out[key].count += cand.count
                out[key].sources.append(source)
            else:
                per_kernel[cand.kernel] += 1
                out[key] = ImportedLayer(cand.kernel, cand.shape, f"{self.stem}.{cand.kernel}.{per_kernel[cand.kernel]}",
                                         cand.count, [source])
        return list(out.values())

    def _summaries(self) -> list[str]:
        def line(head: str, what: str, labels: list[str]) -> str:
            shown = ", ".join(labels[:3]) + (f", +{len(labels) - 3} more" if len(labels) > 3 else "")
            return f"{head} {len(labels)} node(s), {what} ({shown})"

        return ([line("skipped", f"{op}: {r}", ls) for (op, r), ls in self.reasons.items()]
                + [line("mapped", n, ls) for n, ls in self.notes.items()])

    def _why(self, skipped: dict[str, int]) -> dict[str, list[str]]:
        """Each skipped op's distinct reasons, so the not-mapped table says what would map it (a --dim, say)."""
        why: dict[str, list[str]] = {op: [] for op in skipped}
        for op, reason in self.reasons:
            why[op].append(reason)
        return {op: reasons or ["no bundled kernel runs this op"] for op, reasons in why.items()}

    # --- log-mel front ends -------------------------------------------------------------------------------

    def _logmel(self, i: int, node: Any) -> tuple[_Cand, set[int]]:
        """STFT, or a framed DFT, followed by a mel MatMul (and Log): one logmel workload."""
        g = self.g
        if node.op_type == "STFT":
            sig = g.known(node.input[0])  # [batch, samples, 1|2]
            batch, samples = sig[0], sig[1]
            frame_length = node.input[3] if len(node.input) > 3 and node.input[3] else ""
            window = node.input[2] if len(node.input) > 2 and node.input[2] else ""
            if frame_length:
                n_fft = g.const_int(frame_length)
                if n_fft is None:
                    raise _Skip("frame_length is computed at run time")
            elif window:
                n_fft = g.known(window)[0]
            else:
                raise _Skip("neither frame_length nor a window gives n_fft")
            frames = g.known(node.output[0])[1]
        else:
            x = g.known(node.input[0])  # [batch, ..., frames, n_fft, 1|2]
            axis = _attr(node, "axis", 1) if g.opset < 20 else \
                (g.const_int(node.input[2]) if len(node.input) > 2 and node.input[2] else -2)
            if axis is None:
                raise _Skip("the DFT axis is computed at run time")
            axis %= len(x)
            dft_len = node.input[1] if len(node.input) > 1 and node.input[1] else ""
            n_fft = g.const_int(dft_len) if dft_len else x[axis]
            if n_fft is None or axis < 2:
                raise _Skip("not a framed DFT (need [batch, frames, n_fft, 1|2] with a constant length)")
            batch, frames = x[0], x[axis - 1]
        bins = n_fft // 2 + 1
        mel = self._find_mel(node.output[0], bins)
        if node.op_type == "DFT":
            if mel is None or not mel[2]:
                raise _Skip(f"no MatMul with a [{bins}, mels] weight and then a Log: not a log-mel front end")
            samples = self._signal_length(node.input[0], batch, n_fft, frames)
        hop = (g.const_int(node.input[1]) if node.op_type == "STFT" else None) or self._hop(samples, n_fft, frames)
        if mel is None:
            return _Cand("logmel", {"samples": samples, "n_fft": n_fft, "hop": hop, "mels": DEFAULT_MELS}, batch,
                         f"no mel MatMul with a [{bins}, mels] weight found after it: mels={DEFAULT_MELS} assumed"), set()
        return _Cand("logmel", {"samples": samples, "n_fft": n_fft, "hop": hop, "mels": mel[0]}, batch), mel[1]

    def _hop(self, samples: int, n_fft: int, frames: int) -> int:
        """The smallest hop giving this many frames: any hop that does runs the same work."""
        if frames < 2 or samples < n_fft:
            raise _Skip("cannot infer the hop from a single frame")
        hop = (samples - n_fft) // frames + 1
        if 1 + (samples - n_fft) // hop != frames:
            raise _Skip(f"{frames} frames of {n_fft} do not fit {samples} samples")
        return hop

    def _signal_length(self, tensor: str, batch: int, n_fft: int, frames: int) -> int:
        """Walk up from the framed DFT input to the 1-D (per batch item) signal that was framed."""
        g = self.g
        queue, seen = deque([(tensor, 0)]), {tensor}
        while queue:
            t, depth = queue.popleft()
            shape = g.shapes.get(t)
            if shape and all(isinstance(d, int) for d in shape) and t not in g.consts:
                dims = shape[1:] if len(shape) > 1 and shape[0] == batch else shape
                while dims and dims[-1] == 1:
                    dims = dims[:-1]
                if len(dims) == 1 and dims[0] >= n_fft + frames - 1:
                    return int(dims[0])
            p = g.producer.get(t)
            if p is not None and depth < _SIGNAL_DEPTH:
                for u in g.nodes[p].input:
                    if u and u not in seen and u not in g.consts:
                        seen.add(u)
                        queue.append((u, depth + 1))
        raise _Skip("cannot find the signal that was framed")

    def _find_mel(self, tensor: str, bins: int) -> tuple[int, set[int], bool] | None:
        """Breadth-first down from the spectrum to a MatMul with a [bins, mels] weight, then on to a Log."""
        g = self.g
        queue, seen = deque([(tensor, ())]), {tensor}
        while queue:
            t, path = queue.popleft()
            for c in g.consumers.get(t, []):
                node = g.nodes[c]
                if node.op_type == "MatMul":
                    mels = self._mel_weight(node, t, bins)
                    if mels:
                        log = self._find_log(node.output[0])
                        return mels, {*path, c, *(log or ())}, log is not None
                elif len(path) < _SEARCH_DEPTH:
                    for o in node.output:
                        if o not in seen:
                            seen.add(o)
                            queue.append((o, (*path, c)))
        return None

    def _mel_weight(self, node: Any, t: str, bins: int) -> int | None:
        """mels when the other MatMul operand is a filterbank: [bins, mels] on the right or [mels, bins] on the left."""
        right = node.input[0] == t
        w = self.g.shapes.get(node.input[1] if right else node.input[0])
        if not w or len(w) < 2 or not all(isinstance(d, int) for d in w) or math.prod(w[:-2]) != 1:
            return None
        rows, cols = w[-2], w[-1]
        if right and rows == bins:
            return cols
        if not right and cols == bins:
            return rows
        return None

    def _find_log(self, tensor: str) -> tuple[int, ...] | None:
        g = self.g
        queue = deque([(tensor, ())])
        while queue:
            t, path = queue.popleft()
            for c in g.consumers.get(t, []):
                if g.nodes[c].op_type == "Log":
                    return (*path, c)
                if len(path) < _LOG_DEPTH:
                    queue.extend((o, (*path, c)) for o in g.nodes[c].output)
        return None


# --- per-op mappings ----------------------------------------------------------------------------------------

def _conv(g: _Graph, node: Any) -> _Cand:
    x, w = g.known(node.input[0]), g.known(node.input[1])
    rank = len(x) - 2
    k = list(_attr(node, "kernel_shape", w[2:]))
    group = _attr(node, "group", 1)
    strides = list(_attr(node, "strides", [1] * rank))
    if any(d != 1 for d in _attr(node, "dilations", [1] * rank)) and any(kk != 1 for kk in k):
        raise _Skip("dilated convolution has no kernel")
    begins, ends = _pads(node, x[2:], k, strides)
    n, cin, cout = x[0], x[1], w[0]
    ksize = "x".join(map(str, k))
    if all(kk == 1 for kk in k) and rank in (1, 2):  # pointwise: a gemm over every pixel / time step
        if group != 1:
            raise _Skip("grouped 1x1 convolution has no kernel")
        if any(s != 1 for s in strides) or any(begins + ends):
            raise _Skip("1x1 convolution with stride or padding has no kernel")
        return _Cand("gemm", {"M": math.prod([n, *x[2:]]), "N": cout, "K": cin})
    if rank == 2 and k == [3, 3]:
        if strides[0] != strides[1]:
            raise _Skip(f"3x3 convolution with unequal strides {strides} has no kernel")
        s = strides[0]
        note = ""
        if begins + ends != [1, 1, 1, 1]:
            if any((i + b + e - 3) // s + 1 != (i - 1) // s + 1 for i, b, e in zip(x[2:], begins, ends)):
                raise _Skip(f"3x3 convolution with pads {begins + ends}: the kernels assume pad 1")
            note = f"pads {begins + ends} instead of 1, same output size"
        if group == 1:
            return _Cand("conv2d_3x3", {"H": x[2], "W": x[3], "Cin": cin, "Cout": cout, "stride": s}, n, note)
        if group == cin == cout:
            return _Cand("dwconv_3x3", {"H": x[2], "W": x[3], "C": cin, "stride": s}, n, note)
        raise _Skip(f"grouped 3x3 convolution (group {group}, {cin}→{cout} channels) has no kernel")
    if rank == 1:
        if group != 1:
            raise _Skip("grouped 1-D convolution has no kernel")
        t, kk, s = x[2], k[0], strides[0]
        note = ""
        if begins[0] != kk // 2 or ends[0] != kk // 2:
            if (t + begins[0] + ends[0] - kk) // s + 1 != (t + 2 * (kk // 2) - kk) // s + 1:
                raise _Skip(f"1-D convolution with pads {begins + ends}: the kernel pads K//2")
            note = f"pads {begins + ends} instead of K//2, same output size"
        return _Cand("conv1d", {"T": t, "Cin": cin, "Cout": cout, "K": kk, "stride": s}, n, note)
    raise _Skip(f"{rank}-D {ksize} convolution has no kernel")


def _pads(node: Any, spatial: list[int], k: list[int], strides: list[int]) -> tuple[list[int], list[int]]:
    """Effective begin/end pads, resolving auto_pad the way ONNX does."""
    auto = _attr(node, "auto_pad", "NOTSET")
    rank = len(spatial)
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        totals = [max((math.ceil(i / s) - 1) * s + kk - i, 0) for i, kk, s in zip(spatial, k, strides)]
        small = [t // 2 for t in totals]
        big = [t - t // 2 for t in totals]
        return (small, big) if auto == "SAME_UPPER" else (big, small)
    if auto == "VALID":
        return [0] * rank, [0] * rank
    pads = list(_attr(node, "pads", [0] * 2 * rank))
    return pads[:rank], pads[rank:]


def _matmul(g: _Graph, node: Any) -> _Cand:
    a, b = g.known(node.input[0]), g.known(node.input[1])
    a2 = [1, *a] if len(a) == 1 else a
    b2 = [*b, 1] if len(b) == 1 else b
    k, n = b2[-2], b2[-1]
    if math.prod(b2[:-2]) == 1:  # weights (or a broadcast matrix): fold every leading dim of A into M
        return _Cand("gemm", {"M": math.prod(a2[:-1]), "N": n, "K": k})
    batch = math.prod(_broadcast(a2[:-2], b2[:-2]))
    return _Cand("gemm", {"M": a2[-2], "N": n, "K": k}, batch)


def _broadcast(x: list[int], y: list[int]) -> list[int]:
    width = max(len(x), len(y))
    x, y = [1] * (width - len(x)) + x, [1] * (width - len(y)) + y
    return [max(i, j) for i, j in zip(x, y)]


def _gemm(g: _Graph, node: Any) -> _Cand:
    a, b = g.known(node.input[0]), g.known(node.input[1])
    m, k = (a[1], a[0]) if _attr(node, "transA", 0) else (a[0], a[1])
    n = b[0] if _attr(node, "transB", 0) else b[1]
    return _Cand("gemm", {"M": m, "N": n, "K": k})


def _gru(g: _Graph, node: Any) -> _Cand:
    _check_gru_math(node)
    x = g.known(node.input[0])
    t, batch, i = (x[0], x[1], x[2]) if _attr(node, "layout", 0) == 0 else (x[1], x[0], x[2])
    h = _attr(node, "hidden_size") or g.known(node.input[1])[1] // 3  # W is [directions, 3H, I]
    directions = 2 if _attr(node, "direction", "forward") == "bidirectional" else 1
    return _Cand("gru", {"T": t, "I": i, "H": h}, batch * directions)


def _check_gru_math(node: Any) -> None:
    """The gru kernel computes linear_before_reset=1 (PyTorch's GRU) with sigmoid/tanh and no clip; a GRU that
    computes otherwise (ONNX's default linear_before_reset=0 among them) would be tuned as another layer."""
    if _attr(node, "linear_before_reset", 0) != 1:
        raise _Skip("GRU with linear_before_reset=0 (the ONNX default) has no kernel: "
                    "the gru kernel computes linear_before_reset=1, as PyTorch's GRU")
    acts = [a.decode().lower() for a in _attr(node, "activations", [])]
    if acts != ["sigmoid", "tanh"] * (len(acts) // 2):  # one Sigmoid, Tanh pair per direction
        raise _Skip(f"GRU with activations {', '.join(acts)} has no kernel: the gru kernel runs Sigmoid, Tanh")
    if _attr(node, "clip") is not None:
        raise _Skip("GRU with clip has no kernel")


_MAPPERS = {"Conv": _conv, "MatMul": _matmul, "Gemm": _gemm, "GRU": _gru}

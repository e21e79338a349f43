"""The tuner model at run time: a GGUF checked by us first, then loaded by llama.cpp (low-level API).

- `check_gguf(path)` parses the GGUF header and tensor table in pure Python and checks that the file is complete
  (every tensor's data inside the file) and that it is an edgetune tuner model, *before* llama.cpp sees it: a
  truncated or foreign file must become a clear error, never a crash.
- `LlamaModel` loads it with n_threads=1 and llama.cpp's logging silenced, tokenises exactly like the
  sentencepiece tokenizer it was trained with, and decodes batches over several KV sequences so a search can
  share a prompt's KV cache (`seq_cp`) between candidates.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgetune.errors import EdgetuneError

log = logging.getLogger(__name__)

MODEL_DIR = Path(__file__).resolve().parents[2] / "quantized_models"
MODEL_NAME = "edgetune-tuner"
PROMPT_FORMAT = "edgetune-prompt-4"


class ModelError(EdgetuneError):
    """The model file is missing, corrupt or incompatible; the message names the file."""


class PromptFormatError(ModelError):
    """A well-formed tuner model trained for another prompt format than this edgetune writes."""


def default_model_path() -> Path:
    """$EDGETUNE_MODEL, else the model the daemon committed (tuner.model.slots), else the bundled one.

    A committed model this edgetune cannot prompt (it speaks an older prompt format: the device's edgetune was
    upgraded under it) gives way to the bundled one, which always matches, rather than turning every tune into the
    anneal fallback until the fleet sends a new model."""
    env = os.environ.get("EDGETUNE_MODEL")
    if env:
        return Path(env)
    from tuner.model.slots import committed_model

    committed = committed_model()
    if committed is not None:
        try:
            check_gguf(committed, hash_file=False)
        except PromptFormatError as e:
            log.warning("%s: using the bundled tuner model", e)
        except ModelError:
            return committed  # damaged: the tuner's checks name the file (tuner.model.slots repairs it at start)
        else:
            return committed
    return bundled_model_path()


def bundled_model_path() -> Path:
    """The model shipped in quantized_models/: the fallback a device always has."""
    found = sorted(MODEL_DIR.glob("*.Q8_0.gguf"))
    return found[0] if found else MODEL_DIR / f"{MODEL_NAME}.Q8_0.gguf"


# ---- llama.cpp logging ------------------------------------------------------------------------------------

_LOG_CB = None  # the ctypes callback must outlive every llama.cpp call that may log


def silence_llama() -> None:
    global _LOG_CB
    if _LOG_CB is None:
        import llama_cpp.llama_cpp as L

        _LOG_CB = L.llama_log_callback(lambda level, text, user: None)
        L.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


# ---- GGUF header check ------------------------------------------------------------------------------------

# ggml type -> (block elements, block bytes) for the storage types a tuner model may use
_GGML_TYPES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 30: (1, 2)}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
MAX_MODEL_BYTES = 64 << 20


@dataclass
class GGUFInfo:
    path: Path
    version: int
    meta: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], int]]  # name -> (dims, ggml type)
    size: int
    sha256: str = ""

    @property
    def model_version(self) -> str:
        return str(self.meta.get("edgetune.model_version", ""))

    def spaces(self) -> dict:
        try:
            return json.loads(self.meta.get("edgetune.spaces", "{}"))
        except (TypeError, json.JSONDecodeError):
            return {}

    def incompatibility(self, kernel: str, params: Any) -> str | None:
        """Why this model cannot rank configs of `kernel` over knobs `params` (kernels.space.Param), or None when it
        can: it was trained on the kernel and knows at least one of its knobs. A model trained before a kernel gained
        or lost knobs or values still ranks the knobs it knows (tuner.model.proposer.unknown_knobs)."""
        known = self.spaces().get(kernel)
        if known is None:
            return f"it was not trained on kernel {kernel}"
        if not set(known) & {p.name for p in params}:
            return f"it knows none of kernel {kernel}'s knobs (retrain: `make model`)"
        return None


class _Reader:
    def __init__(self, data: bytes, path: Path):
        self.d, self.o, self.path = data, 0, path

    def take(self, n: int) -> bytes:
        if n < 0 or self.o + n > len(self.d):
            raise ModelError(f"model file {self.path} is truncated or corrupt (header runs past the end of the file)")
        b = self.d[self.o:self.o + n]
        self.o += n
        return b

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > 1 << 24:
            raise ModelError(f"model file {self.path} is corrupt (string of {n} bytes in the header)")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, t: int, depth: int = 0):
        if t in _SCALARS:
            return self.scalar(_SCALARS[t])
        if t == 8:
            return self.string()
        if t == 9 and depth == 0:
            et, n = self.scalar("<I"), self.scalar("<Q")
            if n > 1 << 24:
                raise ModelError(f"model file {self.path} is corrupt (array of {n} items in the header)")
            if et == 0:  # uint8: a blob (the scorer's trees, tuner.model.scorer)
                return self.take(n)
            if et in _SCALARS:  # skip numeric arrays fast
                self.take(struct.calcsize(_SCALARS[et]) * n)
                return f"<array of {n}>"
            return [self.value(et, depth + 1) for _ in range(n)]
        raise ModelError(f"model file {self.path} is corrupt (unknown metadata type {t})")


def check_gguf(path: Path, *, hash_file: bool = True) -> GGUFInfo:
    """Parse and check a tuner GGUF; raise ModelError naming the file and what is wrong."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"tuner model file {path} not found")
    size = path.stat().st_size
    if size > MAX_MODEL_BYTES:
        raise ModelError(f"model file {path} is {size} bytes, larger than a tuner model can be")
    data = path.read_bytes()
    if len(data) < 24 or data[:4] != b"GGUF":
        raise ModelError(f"model file {path} is not a GGUF file (bad magic)")
    r = _Reader(data, path)
    r.take(4)
    version = r.scalar("<I")
    if version not in (2, 3):
        raise ModelError(f"model file {path} has unsupported GGUF version {version}")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    if n_tensors > 10_000 or n_kv > 100_000:
        raise ModelError(f"model file {path} is corrupt (implausible header counts)")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        k = r.string()
        meta[k] = r.value(r.scalar("<I"))
    tensors: dict[str, tuple[tuple[int, ...], int]] = {}
    offsets = []
    for _ in range(n_tensors):
        name = r.string()
        nd = r.scalar("<I")
        if nd > 4:
            raise ModelError(f"model file {path} is corrupt (tensor {name!r} with {nd} dims)")
        dims = tuple(r.scalar("<Q") for _ in range(nd))
        t, off = r.scalar("<I"), r.scalar("<Q")
        if t not in _GGML_TYPES:
            raise ModelError(f"model file {path} is incompatible (tensor {name!r} has ggml type {t})")
        tensors[name] = (dims, t)
        blk, nbytes = _GGML_TYPES[t]
        n = int(np.prod(dims)) if dims else 1
        if n % blk:
            raise ModelError(f"model file {path} is corrupt (tensor {name!r} not a whole number of blocks)")
        offsets.append(off + n // blk * nbytes)
    align = int(meta.get("general.alignment", 32) or 32)
    start = (r.o + align - 1) // align * align
    need = start + max(offsets, default=0)
    if size < need:
        raise ModelError(f"model file {path} is truncated: {size} bytes, its tensors need {need}")
    if meta.get("general.architecture") != "llama":
        raise ModelError(f"model file {path} is incompatible: architecture {meta.get('general.architecture')!r}, "
                         "not llama")
    if meta.get("edgetune.prompt_format") != PROMPT_FORMAT:
        raise PromptFormatError(f"model file {path} is incompatible: prompt format "
                         f"{meta.get('edgetune.prompt_format')!r}, this edgetune speaks {PROMPT_FORMAT!r}")
    if "token_embd.weight" not in tensors:
        raise ModelError(f"model file {path} is incompatible: no token_embd.weight")
    info = GGUFInfo(path, version, meta, tensors, size)
    if hash_file:
        info.sha256 = hashlib.sha256(data).hexdigest()
    return info


# ---- llama.cpp model --------------------------------------------------------------------------------------

def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


@dataclass
class _Batch:
    tokens: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    seqs: list[list[int]] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)

    def add(self, tok: int, pos: int, seqs: list[int], logits: bool) -> int:
        self.tokens.append(tok)
        self.pos.append(pos)
        self.seqs.append(seqs)
        self.logits.append(logits)
        return len(self.tokens) - 1


class LlamaModel:
    """One llama.cpp model + context (n_threads=1, logging silenced), with tokenise / decode / seq helpers."""

    def __init__(self, path: Path | None = None, *, n_seq_max: int = 256, n_ctx: int = 2048, threads: int = 1):
        """n_seq_max is llama.cpp's maximum: a search that runs out of sequences recycles materialised nodes, whose
        children then rebuild from the prompt. n_ctx is KV cells shared by all sequences (kv_unified): a sequence
        shares its parent's cells and holds only its own value tokens (a top-40 on the real held-out layers fits in
        512). Every seq_cp / seq_rm / clear walks all the cells, ~60% dearer at 4096."""
        import llama_cpp.llama_cpp as L

        self.L = L
        self.path = Path(path) if path else default_model_path()
        self.info = check_gguf(self.path)
        silence_llama()
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = False  # the CPU repack buffers crash on this tiny Q8_0 model (llama.cpp 0.3.36)
        self.model = L.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self.model:
            raise ModelError(f"llama.cpp could not load the tuner model {self.path} (corrupt or incompatible)")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = 512
        cp.n_ubatch = 512
        cp.n_seq_max = n_seq_max
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.kv_unified = True
        # flash attention (llama.cpp's auto turns it on for the CPU) made a top-1 with a history 20% dearer on
        # this tiny model (CPU ms p50 21.5 vs 17.2, p95 36.6 vs 28.1 on the 35 real held-out layers); in tuning
        # sessions side by side, every proposal call's CPU p95 23.0 vs 18.8 ms
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            self.model = None  # close() must not free it again
            raise ModelError(f"llama.cpp could not create a context for the tuner model {self.path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.bos = L.llama_vocab_bos(self.vocab)
        self.eos = L.llama_vocab_eos(self.vocab)
        self.mem = L.llama_get_memory(self.ctx)
        self.n_seq_max = n_seq_max
        self._cap = 512
        self._batch = L.llama_batch_init(self._cap, 0, n_seq_max)
        self._tok_cache: dict[str, list[int]] = {}

    def close(self) -> None:
        L = self.L
        if getattr(self, "_batch", None) is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    @property
    def version(self) -> str:
        return self.info.model_version

    def tokenize(self, text: str) -> list[int]:
        """Tokens of `text` without BOS (pieces never span whitespace, so ` name=value` is context-free)."""
        hit = self._tok_cache.get(text)
        if hit is not None:
            return hit
        b = text.encode()
        buf = (self.L.llama_token * (len(b) + 8))()
        n = self.L.llama_tokenize(self.vocab, b, len(b), buf, len(buf), False, False)
        if n < 0:
            raise ModelError(f"tokenizer of {self.path} failed on {text!r}")
        out = list(buf[:n])
        if len(self._tok_cache) < 4096:
            self._tok_cache[text] = out
        return out

    def clear(self) -> None:
        """Forget every sequence. Metadata only: zeroing the KV buffers cost ~1 ms a call, and a freed cell's stale
        data is never read (the attention mask only admits cells that hold one of the batch's sequences)."""
        self.L.llama_memory_clear(self.mem, False)

    def seq_cp(self, src: int, dst: int) -> None:
        self.L.llama_memory_seq_cp(self.mem, src, dst, -1, -1)

    def seq_rm(self, seq: int, p0: int = -1) -> None:
        self.L.llama_memory_seq_rm(self.mem, seq, p0, -1)

    def decode(self, b: _Batch) -> dict[int, np.ndarray]:
        """Decode a batch; returns batch index -> raw logits (float32) for the entries that asked for them.

        Raw, not log-softmax: a search that renormalises over a field's admissible values cancels the vocabulary's
        normaliser, and skipping it saves a float64 exp over every row (see `log_softmax` for when it is needed)."""
        n = len(b.tokens)
        if n == 0:
            return {}
        if n > self._cap:
            raise ModelError("batch too large")
        B = self._batch
        token, pos, n_seq_id, seq_id, want = B.token, B.pos, B.n_seq_id, B.seq_id, B.logits
        for i, (t, p, seqs, lg) in enumerate(zip(b.tokens, b.pos, b.seqs, b.logits)):
            token[i] = t
            pos[i] = p
            n_seq_id[i] = len(seqs)
            ids = seq_id[i]
            for j, s in enumerate(seqs):
                ids[j] = s
            want[i] = lg
        B.n_tokens = n
        rc = self.L.llama_decode(self.ctx, B)
        if rc != 0:
            raise ModelError(f"llama_decode failed ({rc}) on the tuner model {self.path}")
        rows = [i for i, lg in enumerate(b.logits) if lg]
        if not rows:
            return {}
        # all output rows at once (llama_get_logits returns them in batch order)
        x = np.ctypeslib.as_array(self.L.llama_get_logits(self.ctx), shape=(len(rows), self.n_vocab)).copy()
        return dict(zip(rows, x))

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Raw logits at every position of one sequence (for the torch/llama.cpp agreement test)."""
        self.clear()
        B = self._batch
        for i, t in enumerate(tokens):
            B.token[i] = t
            B.pos[i] = i
            B.n_seq_id[i] = 1
            B.seq_id[i][0] = 0
            B.logits[i] = 1
        B.n_tokens = len(tokens)
        if self.L.llama_decode(self.ctx, B) != 0:
            raise ModelError("llama_decode failed")
        out = np.stack([np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).copy()
                        for i in range(len(tokens))])
        self.clear()
        return out

"""logmel: the speech front end, audio -> log-mel spectrogram (frames, window, real FFT, power, mel filterbank, log)."""

from __future__ import annotations

import random

import numpy as np

from kernels.space import Constraint, enum
from kernels.spec import C_DIR, Dim, KernelSpec, Workload
from kernels.specs.common import PREFETCH, THREADS, THREADS_FIT_CORES, VEC, VEC_FITS_ISA, onnx_model, rand
from kernels.specs.common import logu, round_to

SAMPLE_RATE = 16000  # the filterbank's frequency axis; every workload is 16 kHz speech
EPS = 1e-6


def frames_of(s: dict) -> int:
    return 1 + (s["samples"] - s["n_fft"]) // s["hop"]


def hann(n: int) -> np.ndarray:
    """Periodic Hann window (torch.hann_window / librosa default)."""
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float32)


def twiddles(n_fft: int) -> np.ndarray:
    """[2, n_fft/2]: cos and -sin of 2*pi*k/n_fft, i.e. exp(-2*pi*i*k/n_fft)."""
    ang = 2 * np.pi * np.arange(n_fft // 2) / n_fft
    return np.stack([np.cos(ang), -np.sin(ang)]).astype(np.float32)


def mel_filterbank(n_fft: int, mels: int, sr: int = SAMPLE_RATE, fmin: float = 0.0,
                   fmax: float | None = None) -> np.ndarray:
    """[n_fft/2+1, mels] HTK-mel triangles with unit peak (torchaudio melscale_fbanks, mel_scale="htk", norm=None)."""
    fmax = sr / 2 if fmax is None else fmax

    def hz_to_mel(f):
        return 2595.0 * np.log10(1.0 + np.asarray(f) / 700.0)

    def mel_to_hz(m):
        return 700.0 * (10.0 ** (np.asarray(m) / 2595.0) - 1.0)

    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    pts = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), mels + 2))
    lo, ce, hi = pts[:-2], pts[1:-1], pts[2:]
    up = (freqs[:, None] - lo[None, :]) / (ce - lo)[None, :]
    down = (hi[None, :] - freqs[:, None]) / (hi - ce)[None, :]
    return np.maximum(0.0, np.minimum(up, down)).astype(np.float32)


def _inputs(s: dict, rng: np.random.Generator) -> list[np.ndarray]:
    n = s["samples"]
    t = np.arange(n) / SAMPLE_RATE
    # speech-like: a few harmonics of a gliding pitch over noise, peak around 0.3
    f0 = 120.0 + 40.0 * np.sin(2 * np.pi * 1.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    voiced = sum(np.sin(h * phase) / h for h in range(1, 6)) * 0.1
    audio = (voiced + rand(rng, n, scale=0.02)).astype(np.float32)
    return [audio, hann(s["n_fft"]), twiddles(s["n_fft"]), mel_filterbank(s["n_fft"], s["mels"])]


def _reference(s: dict, x: list[np.ndarray]) -> list[np.ndarray]:
    audio, win, _, fb = (a.astype(np.float64) for a in x)
    n_fft, hop, frames = s["n_fft"], s["hop"], frames_of(s)
    idx = np.arange(frames)[:, None] * hop + np.arange(n_fft)[None, :]
    spec = np.fft.rfft(audio[idx] * win[None, :], axis=1)
    power = spec.real**2 + spec.imag**2
    return [np.log(power @ fb + EPS).astype(np.float32)]


def _twin(s: dict) -> bytes:
    """STFT (onesided, the kernel's window) -> |X|^2 -> MatMul(filterbank) -> Add eps -> Log.

    The twiddle table is the C FFT's business; the twin passes it through an Identity to a second output so every
    kernel input stays a graph input in order.
    """
    from onnx import TensorProto, helper

    n_fft, mels, frames, samples = s["n_fft"], s["mels"], frames_of(s), s["samples"]
    bins = n_fft // 2 + 1
    nodes = [
        helper.make_node("Reshape", ["audio", "sig_shape"], ["signal"]),
        helper.make_node("STFT", ["signal", "frame_step", "window"], ["stft"], onesided=1),
        helper.make_node("Mul", ["stft", "stft"], ["sq"]),
        helper.make_node("ReduceSum", ["sq", "last_axis"], ["power"], keepdims=0),
        helper.make_node("Reshape", ["power", "pow_shape"], ["power2d"]),
        helper.make_node("MatMul", ["power2d", "melfb"], ["mel"]),
        helper.make_node("Add", ["mel", "eps"], ["mel_eps"]),
        helper.make_node("Log", ["mel_eps"], ["out"]),
        helper.make_node("Identity", ["twiddles"], ["twiddles_out"]),
    ]
    inits = [
        helper.make_tensor("sig_shape", TensorProto.INT64, [3], [1, samples, 1]),
        helper.make_tensor("frame_step", TensorProto.INT64, [], [s["hop"]]),
        helper.make_tensor("last_axis", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("pow_shape", TensorProto.INT64, [2], [frames, bins]),
        helper.make_tensor("eps", TensorProto.FLOAT, [], [EPS]),
    ]
    return onnx_model(
        nodes,
        [("audio", (samples,)), ("window", (n_fft,)), ("twiddles", (2, n_fft // 2)), ("melfb", (bins, mels))],
        [("out", (frames, mels)), ("twiddles_out", (2, n_fft // 2))],
        inits,
    )


def _shape_problems(s: dict) -> list[str]:
    out = []
    if s["samples"] < s["n_fft"]:
        out.append(f"samples={s['samples']} must be >= n_fft={s['n_fft']} (one whole frame)")
    if s["hop"] > s["n_fft"]:
        out.append(f"hop={s['hop']} must be <= n_fft={s['n_fft']} (frames may not skip samples)")
    return out


def _flops(s: dict) -> float:
    n, f, bins = s["n_fft"], frames_of(s), s["n_fft"] // 2 + 1
    fft = 5.0 * (n / 2) * np.log2(n / 2) + 10.0 * (n / 2)  # half-length complex FFT + real split
    return f * (n + fft + 3.0 * bins + 2.0 * bins * s["mels"] + s["mels"])


def _bytes(s: dict) -> float:
    n, bins = s["n_fft"], s["n_fft"] // 2 + 1
    return 4.0 * (s["samples"] + n + n + bins * s["mels"] + frames_of(s) * s["mels"])


def _synthetic(rng: random.Random) -> dict:
    """A seeded edge-range shape for the collector: 0.25-3 s of 16 kHz audio, common FFT sizes and mel counts."""
    n_fft = rng.choice([256, 512, 1024])
    return {"samples": rng.choice([4000, 8000, 16000, 24000, 32000, 48000]), "n_fft": n_fft,
            "hop": round_to(logu(rng, 64, n_fft), 16), "mels": rng.choice([20, 32, 40, 64, 80, 128])}


SPEC = KernelSpec(
    name="logmel",
    domain="speech",
    summary="log-mel spectrogram: framing, window, real FFT (radix-2), power, mel filterbank, log(x+1e-6)",
    source=C_DIR / "logmel.c",
    dims=(
        Dim("samples", "audio samples (16 kHz)"),
        Dim("n_fft", "FFT / frame length (a power of two)", choices=(256, 512, 1024)),
        Dim("hop", "hop between frames, in samples"),
        Dim("mels", "mel filters (output features per frame)"),
    ),
    params=(
        enum("fv", 1, 2, 4, help="frame vectors per tile (tile = fv*vec frames transformed together)"),
        VEC,
        enum("gather", "frame", "point", help="framing loop order: frame by frame, or point by point across frames"),
        enum("fft", "r2", "r4", help="FFT passes: radix-2, or two radix-2 stages fused per pass"),
        enum("mel", "dense", "sparse", help="filterbank over all bins, or each filter's nonzero bin range only"),
        enum("unroll", 1, 2, 4, help="unroll of the butterfly, split and filterbank loops"),
        PREFETCH,
        THREADS,
    ),
    constraints=(
        VEC_FITS_ISA,
        THREADS_FIT_CORES,
        Constraint("a frame tile longer than the frame count only transforms padding",
                   lambda c, s, hw: c["fv"] == 1 or c["fv"] * c["vec"] <= frames_of(s)),
    ),
    default={"fv": 2, "vec": 8, "gather": "point", "fft": "r4", "mel": "sparse", "unroll": 2, "prefetch": 0,
             "threads": 1},
    workloads=(
        Workload("kws.logmel", {"samples": 16000, "n_fft": 512, "hop": 160, "mels": 40},
                 "keyword spotting front end (DS-CNN / TC-ResNet): 1 s @16 kHz, 30 ms windows (480 -> 512), "
                 "10 ms hop, 40 mels"),
        Workload("whisper_tiny.logmel", {"samples": 48000, "n_fft": 512, "hop": 160, "mels": 80},
                 "Whisper tiny encoder input: a 3 s chunk @16 kHz, n_fft 512 (Whisper's 400 is not a power of two), "
                 "hop 160, 80 mels"),
        Workload("wakeword.stream.logmel", {"samples": 16000, "n_fft": 256, "hop": 128, "mels": 32},
                 "streaming wake-word front end: a 1 s window @16 kHz, 16 ms frames, 8 ms hop, 32 mels"),
    ),
    make_inputs=_inputs,
    output_shapes=lambda s: [(frames_of(s), s["mels"])],
    reference=_reference,
    onnx_model=_twin,
    flops=_flops,
    bytes_moved=_bytes,
    rtol=1e-3,
    atol=1e-3,
    shape_problems=_shape_problems,
    inputs=("audio", "window", "twiddles", "filterbank"),
    constant_inputs=(1, 2, 3),
    synthetic=_synthetic,
)

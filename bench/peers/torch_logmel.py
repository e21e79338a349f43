"""torch.stft + mel filterbank as the log-mel peer (what a PyTorch speech front end runs), when torch imports."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from bench.peers.cases import PeerCase
from bench.peers.timing import time_calls


def available() -> str | None:
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"torch is not installed ({e}); it comes with the [train] extra"
    return None


def _logmel(case: PeerCase) -> Callable[[], Any]:
    import torch

    from kernels.specs.logmel import EPS

    audio, window, _, melfb = (torch.from_numpy(a) for a in case.inputs)
    n_fft, hop = case.shape["n_fft"], case.shape["hop"]

    def run() -> Any:
        with torch.inference_mode():
            spec = torch.stft(audio, n_fft, hop_length=hop, window=window, center=False, return_complex=True)
            power = spec.real.square() + spec.imag.square()  # [bins, frames]
            return torch.log(power.T @ melfb + EPS)

    return run


class TorchPeer:
    def __init__(self, case: PeerCase, threads: int, min_time_s: float = 0.02):
        import torch

        self.torch, self.threads, self.min_time_s = torch, threads, min_time_s
        self.run = _logmel(case)
        torch.set_num_threads(threads)
        self.error = case.check(np.asarray(self.run().numpy()))
        self.times: list[float | None] = []

    def sample(self) -> None:
        self.torch.set_num_threads(self.threads)  # process-wide: another row may have changed it
        self.times.append(time_calls(self.run, self.min_time_s))

    def series(self) -> dict[str, list[float | None]]:
        return {"torch": self.times}

"""numpy/OpenBLAS as a sanity line for gemm, timed in a child process of its own.

Some hosts set OPENBLAS_CORETYPE (and OPENBLAS_L2_SIZE) because older OpenBLAS builds crash or compute wrong on
their CPU; they slow a current OpenBLAS, and OpenBLAS reads them when it loads. So only this child, which times
numpy and nothing else, starts without them, and it reports the kernel threadpoolctl says OpenBLAS then runs.

    python -m bench.peers.numpy_blas   (started by NumpyProcess; one JSON request per line on stdin)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.peers.cases import PeerCase
from bench.peers.timing import time_calls

BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
ROOT = Path(__file__).resolve().parents[2]


class NumpyProcess:
    """The parent's handle on the child; `blas` is threadpoolctl's description of the BLAS it loaded."""

    def __enter__(self) -> "NumpyProcess":
        env = {k: v for k, v in os.environ.items() if k not in BLAS_ENV}
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.peers.numpy_blas"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.unset = [k for k in BLAS_ENV if k in os.environ]
        self.blas = self.ask({"op": "info"})["blas"]
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)

    def ask(self, req: dict) -> dict:
        """The child's reply; a request it failed to serve (not a wrong result) raises."""
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the numpy child died (exit code {self.proc.wait()})")
        reply = json.loads(line)
        if "failed" in reply:
            raise RuntimeError(f"numpy child: {reply['failed']}")
        return reply

    def describe(self) -> str:
        b = self.blas
        unset = f"; {' and '.join(self.unset)} unset for it" if self.unset else ""
        return f"{b.get('internal_api')} {b.get('version')} kernel {b.get('architecture')}{unset}"


class NumpyPeer:
    def __init__(self, case: PeerCase, threads: int, proc: NumpyProcess, min_time_s: float = 0.02):
        self.proc, self.times = proc, []
        self.req = {"op": "time", "kernel": case.spec.name, "workload": case.workload.name, "bias": case.epilogue.bias,
                    "act": case.epilogue.act, "threads": threads, "min_time_s": min_time_s}
        self.error = proc.ask({**self.req, "op": "check"}).get("error")

    def sample(self) -> None:
        self.times.append(self.proc.ask(self.req).get("ms"))

    def series(self) -> dict[str, list[float | None]]:
        return {"numpy": self.times}


# ---- child side ----------------------------------------------------------------------------------------------

def _gemm(case: PeerCase) -> Any:
    """C = A B (+ bias, activation) with preallocated output, as a layer written in numpy would run."""
    import numpy as np

    a, b = case.inputs[:2]
    c = np.empty(case.want.shape, np.float32)

    def run() -> Any:
        np.matmul(a, b, out=c)
        if case.bias is not None:
            np.add(c, case.bias, out=c)
        if case.epilogue.act != "none":
            np.clip(c, 0, 6 if case.epilogue.act == "relu6" else None, out=c)
        return c

    return run


def _serve(req: dict, cases: dict) -> dict:
    from threadpoolctl import threadpool_info, threadpool_limits

    from bench.peers.cases import Epilogue, make_case
    from kernels.registry import get_spec

    if req["op"] == "info":
        return {"blas": next((i for i in threadpool_info() if i.get("user_api") == "blas"), {})}
    key = (req["kernel"], req["workload"], req["bias"], req["act"])
    if key not in cases:
        spec = get_spec(req["kernel"])
        case = make_case(spec, spec.workload(req["workload"]), Epilogue(req["bias"], req["act"]))
        cases.clear()
        cases[key] = (case, _gemm(case))
    case, run = cases[key]
    with threadpool_limits(req["threads"], user_api="blas"):
        if req["op"] == "check":
            return {"error": case.check(run())}
        return {"ms": time_calls(run, req["min_time_s"])}


def main() -> None:
    cases: dict = {}
    for line in sys.stdin:
        try:
            reply = _serve(json.loads(line), cases)
        except Exception as e:  # a bad request must not kill the child silently
            reply = {"failed": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

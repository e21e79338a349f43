"""GBNF export of a search space: the completion grammar the tuner model decodes under.

An invalid grammar crashes llama.cpp (DESIGN.md), so every export is parsed by llama.cpp's own grammar parser
in a throwaway subprocess before it is returned; parsed grammars are remembered by hash. The subprocess loads the
very libllama the bindings loaded, through bare ctypes: importing the llama_cpp package there cost 0.25 s of a
0.34 s check, paid by every kernel's first tune on a fresh device.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

from edgetune import paths
from edgetune.errors import EdgetuneError
from kernels.space import SearchSpace

_CHECK = r"""
import ctypes, sys
init = ctypes.CDLL(sys.argv[1]).llama_sampler_init_grammar
init.restype, init.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
sys.exit(0 if init(None, sys.stdin.buffer.read(), b"root") else 3)
"""


class GrammarError(EdgetuneError):
    pass


def _rule(name: str) -> str:
    return "k-" + name.replace("_", "-").lower()


def to_gbnf(space: SearchSpace) -> str:
    """Admits exactly the space's values, as ` name=value` pairs in space order (constraints are not encoded)."""
    lines = ["root ::= " + " ".join(_rule(p.name) for p in space.params)]
    for p in space.params:
        alts = " | ".join(f'"{v}"' for v in p.values)
        lines.append(f'{_rule(p.name)} ::= " {p.name}=" ({alts})')
    return "\n".join(lines) + "\n"


def validate(grammar: str) -> None:
    """Raise GrammarError unless llama.cpp's parser accepts `grammar`."""
    digest = hashlib.sha256(grammar.encode()).hexdigest()[:20]
    marker = paths.cache_dir() / "grammars" / f"{digest}.ok"
    if marker.exists():
        return
    import llama_cpp.llama_cpp as L  # the library the proposer runs on

    try:
        proc = subprocess.run([sys.executable, "-c", _CHECK, L._lib._name], input=grammar.encode(),
                              capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise GrammarError("grammar check timed out")
    if proc.returncode != 0:
        why = "rejected by llama.cpp's parser" if proc.returncode == 3 else f"crashed llama.cpp (exit {proc.returncode})"
        raise GrammarError(f"grammar {why}:\n{grammar[:400]}")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def export_grammar(space: SearchSpace) -> str:
    g = to_gbnf(space)
    validate(g)
    return g

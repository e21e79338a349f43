"""The contenders of bench/kernels_vs_peers.py: edgetune's kernels and the peer runtimes a device already ships.

Each peer runs the kernel's op in its own native layout with the same weights (onnxruntime, XNNPACK through
LiteRT, numpy/OpenBLAS, torch), is checked against the spec's numpy reference before it is timed, and yields one
time per interleaved round (`rounds`).
"""

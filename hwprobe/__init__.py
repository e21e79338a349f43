"""Probe the device: caches, SIMD ISA and width, cores, memory bandwidth, compiler, fingerprints."""

from hwprobe.descriptor import CacheLevel, Compiler, HwDescriptor
from hwprobe.probe import probe

__all__ = ["CacheLevel", "Compiler", "HwDescriptor", "probe"]

"""edgetune: make a device's own vision and speech kernels fast on that exact device."""

__version__ = "0.1.0"

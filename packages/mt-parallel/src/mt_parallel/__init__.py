"""mt-parallel: placeholder until its issue lands; it provides no features yet."""

__version__ = "0.1.0"

__all__ = ["__version__"]

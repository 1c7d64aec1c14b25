"""Skyring: distributed timers as a service (setTimeout/clearTimeout over HTTP)."""

__version__ = "0.1.0"
__all__ = ["__version__"]

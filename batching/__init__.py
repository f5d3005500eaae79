"""Durable dynamic batching for model inference.

Producers put scoring requests in a SQL queue table; scorers claim them, form dynamic
micro-batches, run a PyTorch model and commit outputs exactly once in effect.

``import batching`` loads the standard library only: torch, sqlalchemy, pyarrow and openlineage
load when the module that owns them is imported.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]

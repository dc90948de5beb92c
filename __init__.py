"""deepinfer: a compiler-driven inference toolkit for DeepSeek-V4.1-Flash and V4-Flash."""

__version__ = "0.1.0"

from deepinfer.errors import DeepInferError  # noqa: E402

__all__ = ["DeepInferError", "__version__"]

"""Op definitions. Importing this package registers every op; add a module here to add ops."""

from deepinfer.ir.ops import attention, core, fused, hyper, moe, quant  # noqa: F401

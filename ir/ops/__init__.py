"""Op definitions. Importing this package registers every op; add a module here to add ops."""

from deepinfer.ir.ops import attention, batched, collectives, core, engram, fused, hyper, moe, quant, v41  # noqa: F401

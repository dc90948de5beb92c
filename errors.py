"""The user-facing error hierarchy.

Every error a user can cause (bad IR text, a malformed plan, an unknown op, a bad config) raises a
DeepInferError subclass whose message is one line naming the input and what is wrong. The CLI prints
that line and exits 2; the traceback only appears under ``--debug``.
"""


class DeepInferError(Exception):
    """Base class of every error deepinfer raises on bad input."""


class IRError(DeepInferError):
    """A malformed graph, value or op use."""


class ShapeError(IRError):
    """Shapes or dtypes that do not fit an op (raised at build time, naming both shapes)."""


class VerificationError(IRError):
    """The verifier found a broken graph; the message names the node."""


class ParseError(IRError):
    """Malformed IR text; the message gives `file:line:col`."""


class SerializationError(DeepInferError):
    """A JSON plan or ONNX file that cannot be read back (missing field, unknown op)."""


class UnknownOpError(IRError):
    """An op name that is not registered."""


class ConfigError(DeepInferError):
    """A bad model config, target config or environment variable."""


class CheckpointError(DeepInferError):
    """Missing or malformed weights."""


class NotBuiltError(DeepInferError):
    """A feature that is not built yet (said plainly instead of faking a result)."""

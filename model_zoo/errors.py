"""Typed errors: the library raises these; the CLI turns each into one line and a non-zero exit."""


class FllamaError(Exception):
    """Base of every error a user can cause (bad input, missing files, impossible options)."""


class ModelSourceError(FllamaError):
    """A model source that is missing, unreadable, or of an unsupported kind."""


class CorruptCheckpointError(FllamaError):
    """A checkpoint file that exists but cannot be parsed (truncated, wrong header, bad tensors)."""


class UnsupportedArchitectureError(FllamaError):
    """A model whose architecture is not LLaMA-family."""


class ConfigError(FllamaError, ValueError):
    """An invalid configuration value (model shape, sampling option, calibration option)."""


class PromptError(FllamaError):
    """An empty prompt, or a prompt that does not fit the context."""


class TextSourceError(FllamaError):
    """An unknown or unreadable text source (for eval and calibrate)."""


class DeviceError(FllamaError):
    """The requested device cannot be used (no GPU, no driver, no nvcc, no pycuda, out of memory)."""

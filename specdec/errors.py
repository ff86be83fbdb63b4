"""The specdec error hierarchy.

Every error a user can cause is one of these, with a one-line message that names the value,
what was expected, and the fix. The CLI prints that line and exits with status 2.
Bad input subclasses ``ValueError``; failures of a well-formed request subclass ``RuntimeError``.
"""

from __future__ import annotations


class SpecDecError(Exception):
    """Base of every error specdec raises on purpose."""


class ConfigError(SpecDecError, ValueError):
    """A parameter is out of range (alpha, cost, gamma, max-seq-len, ...)."""


class SamplingError(SpecDecError, ValueError):
    """Sampling settings are invalid (temperature < 0, top_p outside (0, 1], ...)."""


class InputError(SpecDecError, ValueError):
    """A request's input is invalid (empty prompt, token id outside the vocabulary, ...)."""


class ModelError(SpecDecError, ValueError):
    """A source model cannot be used (missing path, unsupported family, vocab mismatch, ...)."""


class BundleError(SpecDecError, ValueError):
    """A bundle is missing, incomplete, corrupt, or points outside itself."""


class SignatureError(BundleError):
    """A graph's inputs or outputs differ from what the manifest says."""


class ExportError(SpecDecError, RuntimeError):
    """Export failed on a well-formed request."""


class ValidationError(ExportError):
    """Exported graphs disagree with the PyTorch reference beyond tolerance."""


class EngineError(SpecDecError, RuntimeError):
    """A backend cannot run here (no GPU, TensorRT missing, provider unavailable, ...)."""


class BusyError(SpecDecError, RuntimeError):
    """A decoder is asked for a second request while its first is still running in the same thread."""


class QueueFullError(SpecDecError, RuntimeError):
    """The batched engine's waiting queue is full: retry later (a server answers 503)."""

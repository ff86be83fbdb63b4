"""What the libraries under an export say, kept in a log beside the bundle instead of on the screen.

torch.onnx, transformers, onnxscript and friends print notices, deprecations and progress bars
that no exporting user can act on (``torchvision is not installed``, ``torch_dtype is
deprecated``, a tokenizer's legacy notice, a GGUF loader's bar). Inside ``captured()`` their
``warnings`` and ``logging`` records go to one text buffer; the pipeline writes it into the
bundle as ``export.log`` (the manifest names it). specdec's own warnings, which say what the
user chose or lost, still reach the screen.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

LOG_FILE = "export.log"
# Loggers that carry their own handlers (propagation off), besides the root's.
LIBRARY_LOGGERS = ("torch", "transformers", "onnxscript", "onnx_ir", "huggingface_hub", "accelerate", "gguf")


def _ours(filename: str) -> bool:
    """Whether a warning was raised from specdec's own code (its four code folders, wherever installed)."""
    import specdec
    import specdec.engines
    import specdec.export
    import specdec.runtime

    path = Path(filename).resolve()
    return any(path.is_relative_to(Path(m.__file__).resolve().parent) for m in (specdec, specdec.engines, specdec.export, specdec.runtime))


class ExportLog:
    """The captured text, with each record's time since the export began."""

    def __init__(self) -> None:
        self.buffer, self.t0 = io.StringIO(), time.perf_counter()

    def write(self, source: str, text: str) -> None:
        self.buffer.write(f"[{time.perf_counter() - self.t0:8.2f} s] {source}: {text.rstrip()}\n")

    def text(self) -> str:
        return self.buffer.getvalue()


class _Handler(logging.Handler):
    def __init__(self, log: ExportLog) -> None:
        super().__init__(logging.INFO)  # not torch's structured-trace records (DEBUG, "torch.__trace")
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log.write(f"{record.levelname.lower()} {record.name}", record.getMessage())


@contextlib.contextmanager
def captured(log: ExportLog | None = None, *, torch: bool = True) -> Iterator[ExportLog]:
    """Route third-party warnings and library log records into an ``ExportLog`` (``log``, or a
    new one) for the block. ``torch=False`` does not import torch for its loggers: the export
    reads configs in such a block, so a refusal from them does not wait for torch's exporter
    stack (4.5 s a refused export here, against 7.5); the block that loads weights nests
    ``captured(log)``, and torch's own loggers join the log there."""
    log = log if log is not None else ExportLog()
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if _ours(filename):  # the user is meant to read it
            shown(message, category, filename, lineno, file, line)
        else:
            log.write(f"{category.__name__} {filename}:{lineno}", str(message))

    bars = _transformers_bars(False)  # first: transformers and torch attach their handlers on first use
    if torch:
        with contextlib.suppress(ImportError):
            import torch as _  # noqa: F401
    handler, saved = _Handler(log), {}
    # torch gives dozens of its loggers a stderr handler each ("torch.onnx", "torch.export", ...)
    named = [n for n, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger) and lg.handlers]
    for name in dict.fromkeys(["", *LIBRARY_LOGGERS, *named]):
        if name.split(".")[0] == "specdec":
            continue
        lg = logging.getLogger(name)
        saved[name] = (lg.handlers[:], lg.propagate)
        lg.handlers, lg.propagate = [handler], False
    with warnings.catch_warnings():
        warnings.showwarning = show
        try:
            yield log
        finally:
            warnings.showwarning = shown
            for name, (handlers, propagate) in saved.items():
                lg = logging.getLogger(name)
                lg.handlers, lg.propagate = handlers, propagate
            _transformers_bars(bars)


def _transformers_bars(enabled: bool) -> bool:
    """Turn transformers' progress bars (the GGUF loader's) on or off; whether they were on."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return enabled
    hf_logging.get_verbosity()  # configures its library logger now, not inside the block
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    return was

"""Every error qladder raises on purpose, in one place.

    QladderError                    base: a clear, one-line message for the user
     ├── ConfigError                 a bad option: unknown rung, malformed fault spec, bad sampling value
     ├── ModelError                  the model file is missing, corrupt, or of an unsupported architecture
     ├── InputError                  the request cannot be served as given (e.g. longer than the context)
     ├── TokenizerMismatchError      a handoff between engines whose tokenizers differ is refused
     ├── EngineError                 recoverable: one engine step failed (kernel error, bad state)
     ├── QueueFullError              admission refused, the queue is at its bound (HTTP 429)
     └── EngineDeadError             fatal: a serving thread died; nothing more is served there

Recoverable errors (EngineError) are caught by the ladder and become hazards; the others are
raised to the caller before any token is produced.
"""

from __future__ import annotations


class QladderError(Exception):
    """Base class of qladder's own errors."""


class ConfigError(QladderError, ValueError):
    """An option or argument is invalid."""


class ModelError(QladderError):
    """The model file cannot be used."""


class InputError(QladderError, ValueError):
    """The request cannot be served as given."""


class TokenizerMismatchError(QladderError):
    """Two engines do not share a tokenizer, so token ids cannot be handed over."""


class EngineError(QladderError, RuntimeError):
    """An engine step failed; the session that raised it must not be trusted any more."""


class QueueFullError(QladderError):
    """Admission refused: the serving queue is at its bound (an HTTP server answers 429)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(QladderError, RuntimeError):
    """A serving engine's thread is gone: no request can be served by it any more (fatal)."""

"""Every error qladder raises on purpose, in one place.

    QladderError                    base: a clear, one-line message for the user
     ├── ConfigError                 a bad option: unknown rung, malformed fault spec, bad sampling value
     ├── ModelError                  the model file is missing, corrupt, or of an unsupported architecture
     ├── InputError                  the request cannot be served as given (e.g. longer than the context)
     ├── TokenizerMismatchError      a handoff between engines whose tokenizers differ is refused
     └── EngineError                 recoverable: one engine step failed (kernel error, bad state)

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

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

The HTTP server's refusals are not QladderErrors (no `except QladderError` may swallow one: each
maps to its own status in server/app.py), and neither is a remote stream that broke:

    Unsupported                     a parameter qladder knows and does not serve (400)
    UnknownModel                    the request names a model this server does not serve (404)
    EngineFailed                    a bare configuration's engine failed mid-answer (502)
    AllPoolsOpen                    every pool's breaker refuses new requests (503)
    Draining                        the server is shutting down (503)
    ClientDisconnected              the client went away before its answer (no response)
    RemoteStreamError               a server answered, but not with a usable stream
     └── RemoteTransportError        the server failed it (5xx, cut short): a replica's sibling goes on
          └── EndpointsDownError     no replica of the rung is in rotation: the rung is down
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


def check_prompt_fits(n_tokens: int, n_ctx: int) -> None:
    """The one context-fit check of a prompt (the ladder, the serving engine and both local engines
    call it): InputError when it is empty or leaves no room for a token in a context of n_ctx."""
    if n_tokens <= 0:
        raise InputError("empty prompt")
    if n_tokens >= n_ctx:
        raise InputError(f"prompt of {n_tokens} tokens does not fit the context of {n_ctx}; truncate it "
                         f"(qladder.sanitize) or raise n_ctx")


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


class Unsupported(Exception):
    """A parameter qladder knows and does not serve (HTTP 400, code `unsupported_parameter`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class UnknownModel(Exception):
    """The request names a model this server does not serve (HTTP 404)."""


class EngineFailed(Exception):
    """A bare configuration's engine failed mid-answer (no rung to defend it): HTTP 502."""


class AllPoolsOpen(Exception):
    """Every pool's breaker refuses new requests."""


class Draining(Exception):
    """The server is shutting down and admits nothing new (HTTP 503)."""


class ClientDisconnected(Exception):
    """The HTTP client disconnected before its answer was ready."""


class RemoteStreamError(Exception):
    """The server answered, but not with a usable stream (non-200, error or malformed chunk, cut short)."""


class RemoteTransportError(RemoteStreamError):
    """The server, not the model, failed the stream: a 5xx answer, or a stream cut short (a
    replica that died). A pool of replicas continues the answer on a sibling."""


class EndpointsDownError(RemoteTransportError):
    """Every replica of a remote rung is out of rotation: the rung is down (its pool probes it)
    until one of them answers its `/health`."""


class StreamSilentError(QladderError):
    """A remote stream sent nothing within its allowed gap (`limit` seconds): the caller's
    deadline hazard, never another timeout's."""

    def __init__(self, limit: float):
        super().__init__(f"no item within {limit:.1f} s")
        self.limit = limit

    def __reduce__(self) -> tuple[type[StreamSilentError], tuple[float]]:  # (its args are not its message)
        return (type(self), (self.limit,))


def server_down(exc: BaseException) -> bool:
    """Whether a remote call's failure (caught as RemoteStreamError, a transport error or a
    timeout) says the server is down, not that it failed this request: unreachable, hung, or
    every replica out. A down rung is probed until it answers; a request's failure is that
    request's alone."""
    return not isinstance(exc, RemoteStreamError) or isinstance(exc, EndpointsDownError)

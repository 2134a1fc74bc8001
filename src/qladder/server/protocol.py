"""The OpenAI API's request shapes (the part qladder serves), as pydantic models, and its error body.

Strict types (a string is not a number); unknown fields are ignored, as OpenAI's own clients
send fields a server may not know. Fields qladder knows but cannot honour (tools, n > 1, logit
bias, penalties, echo, ...) are refused with a 400 naming the parameter, never silently dropped.
qladder's own request options live in one extension object, `"qladder"` (the `openai` client
passes it as `extra_body`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qladder.errors import Unsupported

# OpenAI's documented default for a legacy completion that names no max_tokens (vLLM keeps it too);
# chat completions without one get the server's default_max_tokens (qladder.types.DEFAULT_MAX_TOKENS).
OPENAI_COMPLETIONS_MAX_TOKENS = 16

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class QladderOptions(BaseModel):
    """`"qladder": {...}` in a request body."""

    model_config = ConfigDict(strict=True, extra="forbid")
    faults: list[str] = Field(default_factory=list, max_length=16,
                              description="Fault specs as the CLI's --fault (nan@step=3, ...); needs --allow-faults")
    return_token_ids: bool = Field(False, description="The answer's token ids and the rung of each in the "
                                                      "response's \"qladder\" extension")
    precision: Literal["fast", "verified"] | None = Field(
        None, description="\"verified\": INT4 drafts, full precision decides every token (its answer); "
                          "\"fast\": INT4's answer, guarded; default: the pool's")


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Role = Field(description="system, developer, user or assistant (tool and function are refused)")
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Model):
    include_usage: bool = False


class _Sampling(_Model):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, description="an extension, as in vLLM and llama.cpp's server")
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    qladder: QladderOptions | None = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stops) > 4:
            raise Unsupported("stop", "at most 4 stop sequences")
        return tuple(s for s in stops if s)

    def check_common(self) -> None:
        if self.n not in (None, 1):
            raise Unsupported("n", "n > 1 is not supported: send one request per choice")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise Unsupported(name, f"{name} is not supported (only 0)")
        if self.logit_bias:
            raise Unsupported("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise Unsupported("stream_options", "stream_options needs stream: true")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        self.check_common()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise Unsupported(name, f"{name} (function calling) is not supported")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise Unsupported(name, f"{name} is not supported")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise Unsupported("response_format", "only response_format {\"type\": \"text\"} is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise Unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        for k, m in enumerate(self.messages):
            if m.role in ("tool", "function"):
                raise Unsupported(f"messages[{k}].role", f"role {m.role!r} (function calling) is not supported")

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=OPENAI_COMPLETIONS_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise Unsupported("echo", "echo is not supported")
        if self.suffix:
            raise Unsupported("suffix", "suffix (insertion) is not supported")
        if self.best_of not in (None, 1):
            raise Unsupported("best_of", "best_of > 1 is not supported")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise Unsupported("prompt", "the prompt is empty")
        ids = [t for t in p if isinstance(t, int)]
        if len(ids) == len(p):
            return ids
        if len(p) != 1:
            raise Unsupported("prompt", "batched prompts are not supported: send one prompt per request")
        one = p[0]
        assert not isinstance(one, int)  # [id] is a list of ids, returned above
        return one


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}

"""Input defence and prompt building: sanitize each message, render the chat template, tokenize.

    p = Preparer(info, tokenize, n_ctx)
    ids, text, reports = p.prepare("Hello", max_tokens=128)     a user prompt (str, bytes or messages)
    ids, reports = p.encode_text("raw completion prompt", 128)    no template (/v1/completions)
    ids, reports = p.defend_ids(ids, token_bytes, control_ids)    a token-id prompt (/v1/completions)

Every change the sanitizer makes is in the reports (one `SanitizeResult` per message), so a front
end can tell its client. The CLI (through `service.Qladder`) and the HTTP gateway both use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qladder.errors import InputError
from qladder.model import Message, ModelInfo, encode_segments, render_chat
from qladder.sanitize import PRESETS as SANITIZE_PRESETS
from qladder.sanitize import SanitizeConfig, SanitizeResult, sanitize, sanitize_bytes

TEMPLATE_ROOM = 64  # tokens kept free for the chat template around the messages


class Preparer:
    def __init__(self, info: ModelInfo, tokenize: Callable[[str, bool], list[int]], n_ctx: int,
                 sanitize_config: SanitizeConfig | None = None):
        self.info = info
        self.tokenize = tokenize
        self.n_ctx = n_ctx
        self.sanitize_config = sanitize_config or SANITIZE_PRESETS["default"]

    def _count_tokens(self, text: str) -> int:
        return len(self.tokenize(text, False))

    def _budget(self, max_tokens: int, room: int) -> int:
        budget = self.n_ctx - max_tokens - room
        if budget < 16:
            raise InputError(f"max_tokens {max_tokens} leaves no room for a prompt in a context of {self.n_ctx}")
        return budget

    def encode_messages(self, messages: Sequence[Message], max_tokens: int) -> tuple[list[int], list[SanitizeResult]]:
        """Sanitize each message's content (over-long input truncated to fit), render, tokenize."""
        budget = self._budget(max_tokens, TEMPLATE_ROOM)
        cleaned: list[Message] = []
        reports: list[SanitizeResult] = []
        for m in messages:
            rep = sanitize(m["content"], self.sanitize_config, count_tokens=self._count_tokens,
                           max_tokens=budget // max(len(messages), 1))
            reports.append(rep)
            cleaned.append({"role": m["role"], "content": rep.text})
        segments = render_chat(self.info.chat_template, cleaned)
        return encode_segments(segments, self.tokenize), reports

    def encode_text(self, text: str, max_tokens: int) -> tuple[list[int], SanitizeResult]:
        """A raw prompt (no chat template): sanitized, then tokenized with special tokens parsed,
        since the client writes the whole prompt (as llama.cpp's server does for completions)."""
        rep = sanitize(text, self.sanitize_config, count_tokens=self._count_tokens,
                       max_tokens=self._budget(max_tokens, 0))
        return self.tokenize(rep.text, True), rep

    def defend_ids(self, ids: Sequence[int], token_bytes: Callable[[Sequence[int]], bytes],
                   control_ids: frozenset[int]) -> tuple[list[int], list[SanitizeResult]]:
        """The input defence on a token-id prompt: control tokens (a chat template's) stay; each run
        of other ids between them is read as the bytes it spells, and where the sanitizer would
        change them (invalid UTF-8 from raw byte tokens, control characters, zero-width and bidi
        characters, ...) the run is sanitized and tokenized again, the change reported. A run the
        sanitizer leaves alone keeps its ids exactly. No truncation: a prompt too long is refused."""
        out: list[int] = []
        reports: list[SanitizeResult] = []
        run: list[int] = []

        def flush() -> None:
            if run:
                rep = sanitize_bytes(token_bytes(run), self.sanitize_config)
                if rep.changed:
                    reports.append(rep)
                    out.extend(self.tokenize(rep.text, False))
                else:
                    out.extend(run)
                run.clear()

        for t in ids:
            if t in control_ids:
                flush()
                out.append(t)
            else:
                run.append(t)
        flush()
        return out, reports

    def prepare(self, prompt: str | bytes | Sequence[Message], max_tokens: int
                ) -> tuple[list[int], str, list[SanitizeResult]]:
        """Sanitize, template and tokenize: the ids, the prompt text (for incidents), the reports."""
        if isinstance(prompt, bytes):
            first = sanitize_bytes(prompt, self.sanitize_config)
            messages: Sequence[Message] = [{"role": "user", "content": first.text}]
            pre = [first]
        elif isinstance(prompt, str):
            messages, pre = [{"role": "user", "content": prompt}], []
        else:
            messages, pre = prompt, []
        ids, reports = self.encode_messages(messages, max_tokens)
        return ids, "\n".join(m["content"] for m in messages), pre + reports

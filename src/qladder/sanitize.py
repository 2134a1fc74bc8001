"""Input defence (layer 1 of the ladder): make untrusted prompt text safe to tokenize.

What it defends against:

* Raw bytes that are not text. ``b"\\x00\\xff\\xfe"`` is a NUL plus two bytes that are not UTF-8;
  ``sanitize_bytes`` drops the invalid sequences (and says how many) instead of feeding U+FFFD
  replacement characters to the model, and NUL and the other C0/C1 controls are removed.
* Invisible or misleading Unicode: lone surrogates (a ``str`` can hold them, UTF-8 cannot),
  noncharacters, bidi embedding/override/isolate controls ("Trojan Source"), zero-width characters,
  tag characters and chains of variation selectors (used to smuggle hidden instructions), and
  compatibility homoglyphs such as fullwidth or mathematical letters, folded by NFKC.  Cross-script
  confusables (Cyrillic "а" for Latin "a") are not folded: that needs a confusables table.
  A ZWJ between two emoji is kept, so sequences such as 👩‍💻 survive.
* Long repeats: a character or a short pattern repeated thousands of times is a known way to
  produce activation outliers in quantized models and to push generation into loops.  Runs are
  collapsed to a bounded length.
* Sheer size: a hard character cap, then an optional token budget; both keep the head and tail and
  put ``MARKER`` between them.

(As a ``str``, "\x00\xff\xfe" is NUL plus the letters ÿ and þ: only the NUL goes.)

Order of one pass: lone surrogates -> controls (CRLF/CR -> LF) -> noncharacters -> bidi controls ->
zero-width -> Unicode normalization -> character runs -> pattern runs -> character cap.  Removals
come before normalization because a removed character can block a composition.  Since one step can
expose work for another (NFKC can create a run, a cut can strand a ZWJ), the pass is repeated until
the text stops changing (at most ``_MAX_PASSES``), which makes ``sanitize`` idempotent.  To bound
the work on huge inputs, text longer than twice ``max_chars`` is cut to that at the start of a pass
and again after normalization (NFKC can expand a character 18 times), so a 1 MB or 100 MB input
costs about the same.  Token truncation comes last; its result is cleaned once more and checked
against the budget.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, cast

MARKER = "\n[...]\n"
_LABELS = {  # Change kinds, in pipeline order, with the wording of their detail
    "invalid_utf8": "{verb} {n} invalid UTF-8 sequence{s}",
    "surrogate_removed": "removed {n} lone surrogate{s}",
    "control_removed": "removed or replaced {n} control character{s}",
    "noncharacter_removed": "removed {n} noncharacter{s}",
    "bidi_removed": "removed {n} bidi control character{s}",
    "zero_width_removed": "removed {n} zero-width or invisible character{s}",
    "normalized": "normalized {n} character{s}",
    "run_collapsed": "collapsed {n} over-long character run{s}",
    "pattern_collapsed": "collapsed {n} over-long repeated pattern{s}",
    "truncated_chars": "cut {n} character{s} from the middle",
    "truncated_tokens": "cut {n} token{s} from the middle",
}
KINDS = tuple(_LABELS)
_MAX_PASSES = 6
_Form = Literal["NFC", "NFD", "NFKC", "NFKD"]
_FORMS = (None, "NFC", "NFD", "NFKC", "NFKD")

_NONCHARS = "\ufdd0-\ufdef" + "".join(chr(p + 0xFFFE) + chr(p + 0xFFFF) for p in range(0, 0x110000, 0x10000))
_SURROGATE_RE = re.compile("[\ud800-\udfff]+")
_CONTROL_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]+")
_NONCHAR_RE = re.compile(f"[{_NONCHARS}]+")
_BIDI_RE = re.compile("[\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]+")
_EMOJI = "\u2190-\u21ff\u2300-\u23ff\u2460-\u27bf\u2900-\u297f\u2b00-\u2bff\U0001f000-\U0001faff"
_VS = "\ufe00-\ufe0f\U000e0100-\U000e01ef"
_ZW_RE = re.compile(
    "(?P<keep>\U0001f3f4[\U000e0030-\U000e0039\U000e0061-\U000e007a]{1,6}\U000e007f)"  # subdivision flag
    "|[\u00ad\u180e\u200b\u200c\u2060-\u2064\ufeff]+"  # zero-width and invisible operators
    f"|(?<![{_EMOJI}\ufe0f])\u200d|\u200d(?![{_EMOJI}])"  # ZWJ not joining two emoji
    "|[\U000e0000-\U000e007f]+"  # tag characters outside a flag
    f"|(?<=[{_VS}])[{_VS}]+"  # a chain of variation selectors keeps only its first
)
_CLINGS = re.compile(f"[\u200d{_VS}\U000e0000-\U000e007f]")

_Tally = dict[str, Counter[str]]


@dataclass(frozen=True)
class SanitizeConfig:
    """What ``sanitize`` does; ``None`` disables a limit."""

    normalize: str | None = "NFKC"
    strip_controls: bool = True
    strip_surrogates: bool = True
    strip_noncharacters: bool = True
    strip_bidi: bool = True
    strip_zero_width: bool = True
    strip_invalid_utf8: bool = True
    max_char_run: int | None = 32
    max_pattern_run: int | None = 8
    max_pattern_len: int = 16
    max_chars: int | None = 200_000

    def __post_init__(self) -> None:
        if self.normalize not in _FORMS:
            raise ValueError(f"normalize must be one of {_FORMS}, got {self.normalize!r}")
        for name in ("max_char_run", "max_pattern_run", "max_chars"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.max_pattern_len < 2:
            raise ValueError(f"max_pattern_len must be >= 2, got {self.max_pattern_len}")


DEFAULT = SanitizeConfig()
PRESETS: dict[str, SanitizeConfig] = {
    "default": DEFAULT,
    "strict": SanitizeConfig(max_char_run=8, max_pattern_run=4, max_pattern_len=32, max_chars=32_000),
    "off": SanitizeConfig(
        normalize=None, strip_controls=False, strip_surrogates=False, strip_noncharacters=False,
        strip_bidi=False, strip_zero_width=False, strip_invalid_utf8=False,
        max_char_run=None, max_pattern_run=None, max_chars=None,
    ),
}


@dataclass(frozen=True)
class Change:
    """One kind of change, aggregated: ``count`` characters (runs for ``*_collapsed``, tokens for
    ``truncated_tokens``, net characters cut for ``truncated_chars``)."""

    kind: str
    count: int
    detail: str


@dataclass(frozen=True)
class SanitizeResult:
    """The cleaned text and what was done to it, in pipeline order (``KINDS``)."""

    text: str
    changes: tuple[Change, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "changed": self.changed,
            "changes": [{"kind": c.kind, "count": c.count, "detail": c.detail} for c in self.changes],
        }


def _strip(text: str, regex: re.Pattern[str], kind: str, tally: _Tally) -> str:
    found = regex.findall(text)
    if not found:
        return text
    tally[kind].update("".join(found))
    return regex.sub("", text)


def _controls(text: str, tally: _Tally) -> str:
    crs = text.count("\r")
    if crs:
        tally["control_removed"]["CR->LF"] += crs
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _strip(text, _CONTROL_RE, "control_removed", tally)


def _zero_width(text: str, tally: _Tally) -> str:
    removed: Counter[str] = Counter()

    def repl(m: re.Match[str]) -> str:
        if m.group("keep"):
            return m.group(0)
        removed.update(m.group(0))
        return ""

    text = _ZW_RE.sub(repl, text)
    if removed:
        tally["zero_width_removed"].update(removed)
    return text


def _normalize(text: str, form: _Form, tally: _Tally) -> str:
    if unicodedata.is_normalized(form, text):
        return text
    out = unicodedata.normalize(form, text)
    changed = Counter({c: n for c, n in Counter(text).items() if unicodedata.normalize(form, c) != c})
    if not changed:  # only compositions of several characters into one
        changed["composition"] = max(1, len(text) - len(out))
    tally["normalized"].update(changed)
    return out


@lru_cache(maxsize=16)
def _run_re(max_run: int) -> re.Pattern[str]:
    return re.compile(rf"(.)\1{{{max_run},}}", re.DOTALL)


@lru_cache(maxsize=16)
def _pattern_re(max_run: int, max_len: int) -> re.Pattern[str]:
    # The first two characters must differ so a plain run is left to ``_run_re``; any other
    # periodic text has a rotation of its period that starts this way.
    return re.compile(rf"((.)(?!\2).{{1,{max_len - 1}}}?)\1{{{max_run},}}", re.DOTALL)


def _collapse(text: str, regex: re.Pattern[str], keep: int, kind: str, tally: _Tally) -> str:
    hits: Counter[str] = Counter()

    def repl(m: re.Match[str]) -> str:
        unit = m.group(1)
        hits[unit if len(unit) == 1 else repr(unit)] += 1
        return unit * keep

    text = regex.sub(repl, text)
    if hits:
        tally[kind].update(hits)
    return text


def _clings(c: str) -> bool:
    """A mark, joiner, variation selector or tag: belongs to the character before it."""
    return unicodedata.category(c)[0] == "M" or bool(_CLINGS.match(c))


def _head_end(text: str, i: int) -> int:
    """Move a head cut left so that it does not split a character from what clings to it."""
    stop = max(0, i - 32)
    while stop < i < len(text) and _clings(text[i]):
        i -= 1
    return i


def _tail_start(text: str, j: int) -> int:
    """Move a tail cut right past what clings to the character before it."""
    stop = min(len(text), j + 32)
    while 0 < j < stop and (_clings(text[j]) or text[j - 1] == "\u200d"):
        j += 1
    return j


def _middle_cut(text: str, keep: int) -> str:
    """Keep about 3/4 of ``keep`` characters from the head and 1/4 from the tail, with MARKER."""
    room = keep - len(MARKER)
    if room < 2:
        return text[: max(keep, 0)]
    head = _head_end(text, room * 3 // 4)
    tail = _tail_start(text, len(text) - (room - room * 3 // 4))
    return text[:head] + MARKER + text[tail:]


def _cap(text: str, limit: int, tally: _Tally) -> str:
    if len(text) <= limit:
        return text
    out = _middle_cut(text, limit)
    tally["truncated_chars"][""] += len(text) - len(out)
    return out


def _pass(text: str, cfg: SanitizeConfig, tally: _Tally) -> str:
    work_cap = 2 * cfg.max_chars if cfg.max_chars else None
    if work_cap:
        text = _cap(text, work_cap, tally)
    if cfg.strip_surrogates:
        text = _strip(text, _SURROGATE_RE, "surrogate_removed", tally)
    if cfg.strip_controls:
        text = _controls(text, tally)
    if cfg.strip_noncharacters:
        text = _strip(text, _NONCHAR_RE, "noncharacter_removed", tally)
    if cfg.strip_bidi:
        text = _strip(text, _BIDI_RE, "bidi_removed", tally)
    if cfg.strip_zero_width:
        text = _zero_width(text, tally)
    if cfg.normalize:
        text = _normalize(text, cast(_Form, cfg.normalize), tally)
        if work_cap:
            text = _cap(text, work_cap, tally)
    if cfg.max_char_run:
        text = _collapse(text, _run_re(cfg.max_char_run), cfg.max_char_run, "run_collapsed", tally)
    if cfg.max_pattern_run:
        regex = _pattern_re(cfg.max_pattern_run, cfg.max_pattern_len)
        text = _collapse(text, regex, cfg.max_pattern_run, "pattern_collapsed", tally)
    if cfg.max_chars:
        text = _cap(text, cfg.max_chars, tally)
    return text


def _fixed_point(text: str, cfg: SanitizeConfig, tally: _Tally) -> str:
    for _ in range(_MAX_PASSES):
        out = _pass(text, cfg, tally)
        if out == text:
            break
        text = out
    return text


def _fit_tokens(text: str, count_tokens: Callable[[str], int], max_tokens: int) -> str:
    """Largest middle cut of ``text`` within budget, by bisection on the kept length (O(log n) calls)."""
    lo, hi = 0, len(text)  # _middle_cut(text, lo) always fits (lo == 0 gives ""); hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(_middle_cut(text, mid)) <= max_tokens:
            lo = mid
        else:
            hi = mid
    return _middle_cut(text, lo)


def _truncate_tokens(
    text: str, cfg: SanitizeConfig, tally: _Tally, count_tokens: Callable[[str], int], max_tokens: int
) -> str:
    before = count_tokens(text)
    if before <= max_tokens:
        return text
    out = _fixed_point(_fit_tokens(text, count_tokens, max_tokens), cfg, tally)
    after = count_tokens(out)
    keep = len(out)
    while after > max_tokens and out:  # cleaning the cut re-tokenized above budget (rare): shrink
        keep //= 2
        out = _fixed_point(_middle_cut(text, keep), cfg, tally)
        after = count_tokens(out)
    tally["truncated_tokens"][""] += max(before - after, 1)
    return out


def _label(kind: str, n: int, verb: str = "removed") -> str:
    return _LABELS[kind].format(n=f"{n:,}", s="" if n == 1 else "s", verb=verb)


def _name(key: str) -> str:
    return f"U+{ord(key):04X}" if len(key) == 1 else key


def _changes(tally: _Tally) -> tuple[Change, ...]:
    changes = []
    for kind in KINDS:
        counter = tally.get(kind)
        if not counter:
            continue
        n = sum(counter.values())
        detail = _label(kind, n)
        names = [_name(k) + (f" x{v:,}" if v > 1 else "") for k, v in counter.most_common(6) if k]
        if names:
            detail += " (" + ", ".join(names[:5]) + (", ..." if len(names) > 5 else "") + ")"
        changes.append(Change(kind, n, detail))
    return tuple(changes)


def sanitize(
    text: str,
    config: SanitizeConfig = DEFAULT,
    *,
    count_tokens: Callable[[str], int] | None = None,
    max_tokens: int | None = None,
) -> SanitizeResult:
    """Clean ``text`` for tokenization; never raises for a ``str``, and is idempotent."""
    if max_tokens is not None and count_tokens is None:
        raise TypeError("max_tokens needs count_tokens")
    text = str(text)
    tally: _Tally = {kind: Counter() for kind in KINDS}
    text = _fixed_point(text, config, tally)
    if count_tokens is not None and max_tokens is not None:
        text = _truncate_tokens(text, config, tally, count_tokens, max(max_tokens, 0))
    return SanitizeResult(text, _changes(tally))


def sanitize_bytes(data: bytes, config: SanitizeConfig = DEFAULT, **kw: Any) -> SanitizeResult:
    """Decode UTF-8, drop (or with ``strip_invalid_utf8=False`` replace) invalid sequences, sanitize."""
    data = bytes(data)
    replaced = data.decode("utf-8", errors="replace")
    # U+FFFD that were in the input as valid UTF-8 (EF BF BD) are real text, not decoding errors.
    invalid = replaced.count("\ufffd") - data.count(b"\xef\xbf\xbd")
    text = data.decode("utf-8", errors="ignore") if config.strip_invalid_utf8 else replaced
    result = sanitize(text, config, **kw)
    if not invalid:
        return result
    verb = "removed" if config.strip_invalid_utf8 else "replaced with U+FFFD"
    change = Change("invalid_utf8", invalid, _label("invalid_utf8", invalid, verb))
    return SanitizeResult(result.text, (change, *result.changes))

"""A prompt's class for the drift audit and the router: code, math, qa or chat (and "abnormal" for
a prompt the input defence changed), from its text alone, by a few rules.

The rules are the corpus's own classes written as patterns (qladder.validate.corpora's normal
prompts, written from the train half): code fences, code keywords and language names -> code;
arithmetic between numbers, an equation to solve, a percentage, divisibility -> math; a request
to write, tell or advise -> chat; a question word, "explain", "define", "name" -> qa; the rest
-> chat. A client that knows better names the class itself (`"qladder": {"class": ...}`).
`tests/test_units.py` measures the rules against the labelled corpus.
"""

from __future__ import annotations

import re

CLASSES = ("chat", "qa", "code", "math", "abnormal")

_CODE = re.compile(
    r"```|\b(def|class|function|return|import|SELECT|regex|regular expression|unit test|compile|bug|"
    r"python|rust|javascript|typescript|java|c\+\+|golang|sql|bash|shell script|html|css|json|api|"
    r"algorithm|recursion|variable|array|code|program)\b", re.IGNORECASE)
_MATH = re.compile(
    r"\d\s*[-+*/x×÷^%]\s*\d|\bsolve\b|\bequation\b|\d+\s*%\s*of\b|\bpercent|\bsquare root\b|\bderivative\b|"
    r"\bintegral\b|\bsum of\b|\bproduct of\b|\bdivisible\b|\bcalculate\b|\bcompute\b|"
    r"\bhow (much|many)\b[^.?]*\d|\d[^.?]*\bhow (much|many)\b", re.IGNORECASE)
_CHAT = re.compile(r"\b(write|tell me|give me|tips|poem|story|haiku|joke|advice|recommend|suggest)\b",
                   re.IGNORECASE)
_QA = re.compile(r"^\s*(what|who|whom|whose|when|where|which|why|how|is|are|does|do|did|name|list)\b|"
                 r"\b(explain|define|describe the difference|difference between|facts?)\b", re.IGNORECASE)


def classify(text: str | None, changed: bool = False) -> str:
    """The class of a prompt's text (None: chat); `changed`: the input defence changed it."""
    if changed:
        return "abnormal"
    if not text:
        return "chat"
    if _CODE.search(text):
        return "code"
    if _MATH.search(text):
        return "math"
    if _CHAT.search(text):
        return "chat"
    if _QA.search(text):
        return "qa"
    return "chat"

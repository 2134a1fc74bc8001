"""The precision boundary table of `qladder validate`: INT4's answers against full precision's, when
no number goes wrong.

The same prompt ids (after the input defence) through five modes, greedy, one request at a time:
    int4       the bare INT4 serving engine (no guard)
    guarded    the guarded serving engine (INT4, guard, fp32 standby)
    w4a16      the W4A16 rung alone (4-bit weights, fp16 activations: GPU INT4 numerics)
    verified   the guarded serving engine, verified decoding (INT4 drafts, fp32 decides)
    fp32       the fp32 rung alone: the reference (validate.replay.greedy), never compared
               with itself: its row has tok/s and known answers, no identity columns
on the normal reference prompts (chat, qa, code, math), a few abnormal ones (no fault) and
`KNOWN`, questions with a known answer written by the project (capitals, planets, arithmetic,
facts). Each answer is one Outcome (phase "precision", population "precision") with:
    fp32_reference_ids     fp32's greedy answer on the same ids (the table recomputes from it)
    fp32_identical         the same ids as fp32's greedy answer
    fp32_first_divergence  the first position where they differ (None: identical)
    fp32_top1_agreement    the share of the answer's positions where its token is fp32's argmax
                           on the answer's own context (teacher-forced, one fp32 forward)
    known_correct          for a known-answer question: an accepted answer appears as a word
`figures` (recompute) reads them into one table by mode and class, with each mode's tok/s (its
tokens over its latency, the prompts run one after the other).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from qladder.validate.corpora import Prompt
from qladder.validate.outcome import Outcome

MODES = ("int4", "guarded", "w4a16", "verified", "fp32")
CLASSES = ("chat", "qa", "code", "math", "abnormal", "known")

# (question, accepted answers): written by the project; an answer counts as right when one of the
# accepted strings appears in it as a whole word, case-insensitive.
KNOWN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("What is the capital of France?", ("Paris",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("What is the capital of Italy?", ("Rome",)),
    ("What is the capital of Kenya?", ("Nairobi",)),
    ("What is the capital of Canada?", ("Ottawa",)),
    ("What is the capital of Egypt?", ("Cairo",)),
    ("What is the capital of Germany?", ("Berlin",)),
    ("What is the capital of Spain?", ("Madrid",)),
    ("Which planet is the largest in our solar system?", ("Jupiter",)),
    ("Which planet is closest to the Sun?", ("Mercury",)),
    ("Which planet is known as the Red Planet?", ("Mars",)),
    ("What is 12 times 7?", ("84",)),
    ("What is 15 plus 27?", ("42",)),
    ("What is 100 minus 37?", ("63",)),
    ("What is 9 times 9?", ("81",)),
    ("What is 144 divided by 12?", ("12", "twelve")),
    ("Who painted the Mona Lisa?", ("Leonardo", "da Vinci")),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("What is the chemical symbol for gold?", ("Au",)),
    ("At what temperature in degrees Celsius does water freeze?", ("0", "zero")),
    ("How many days are there in a week?", ("7", "seven")),
    ("How many legs does a spider have?", ("8", "eight")),
)


def known_prompts(n: int | None = None) -> list[Prompt]:
    items = KNOWN if n is None else KNOWN[:n]
    return [Prompt(f"known-{k:03d}", "known", q) for k, (q, _) in enumerate(items)]


def known_correct(prompt_id: str, text: str) -> bool:
    _, accepted = KNOWN[int(prompt_id.split("-")[1])]
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", text, re.IGNORECASE) for a in accepted)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def top1_agreement(fp32: Any, ids: Sequence[int], answer: Sequence[int]) -> float | None:
    """The share of the answer's positions where its token is fp32's argmax given the prompt and
    the answer before it (one teacher-forced forward on the one-sequence fp32 engine)."""
    import torch  # here: the table itself (recompute) is read without torch

    if not answer:
        return None
    with torch.inference_mode():
        logits = fp32.model(input_ids=torch.tensor([[*ids, *answer]]), use_cache=False).logits[0]
    best = logits[len(ids) - 1: len(ids) + len(answer) - 1].argmax(dim=-1)
    return float((best == torch.tensor(list(answer))).float().mean())


Runner = Callable[[list[int], Outcome], list[int]]  # fills the outcome's answer; returns its ids


def run_table(prompts: Sequence[tuple[Prompt, list[int]]], runners: dict[str, Runner], fp32: Any,
              run: str, tick: Callable[[], None] = lambda: None,
              only: dict[str, set[str]] | None = None) -> list[Outcome]:
    """Every prompt through every mode (fp32 first: the others are compared with it); `only`: the
    prompt ids a mode is limited to (W4A16 in fp16 has no fast kernels on a CPU: ~6 s for a
    6-token answer here, 40x fp32)."""
    out: list[Outcome] = []
    for p, ids in prompts:
        ref: list[int] | None = None
        for mode in ("fp32", *[m for m in MODES if m != "fp32"]):
            if only is not None and mode in only and p.id not in only[mode]:
                tick()
                continue
            o = Outcome(run, mode, p.id, p.cls, "precision", phase="precision", split=p.split, prompt=str(p.prompt),
                        prompt_tokens=len(ids))
            t0 = time.perf_counter()
            try:
                answer = runners[mode](ids, o)
            except Exception as exc:  # counted, never dropped
                o.status, o.error, answer = "error", f"{type(exc).__name__}: {exc}"[:160], []
            o.latency_ms = (time.perf_counter() - t0) * 1e3
            o.token_ids = list(answer)
            if mode == "fp32":
                ref = list(answer)
            if o.ok and ref is not None and mode != "fp32":  # fp32 is the reference, not a row compared with it
                o.fp32_reference_ids = list(ref)
                o.fp32_identical = o.token_ids == ref
                o.fp32_first_divergence = first_divergence(o.token_ids, ref)
                o.fp32_top1_agreement = top1_agreement(fp32, ids, o.token_ids)
            if p.cls == "known":
                o.known_correct = o.ok and known_correct(p.id, o.text)
            out.append(o)
            tick()
    return out


def table(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The precision table (recompute.figures' `precision`): by mode, then class ("all" too)."""
    rows = [o for o in outcomes if o.phase == "precision"]
    result: dict[str, Any] = {}
    for mode in MODES:
        mine = [o for o in rows if o.config == mode]
        if not mine:
            continue
        cells: dict[str, Any] = {}
        for cls in (*CLASSES, "all"):
            group = [o for o in mine if cls == "all" or o.prompt_class == cls]
            if not group:
                continue
            ok = [o for o in group if o.ok]
            known = [o for o in group if o.known_correct is not None]
            cells[cls] = {"answers": len(group), "errors": len(group) - len(ok),
                          "known_right": sum(bool(o.known_correct) for o in known) if known else None,
                          "known_asked": len(known) if known else None}
            if mode == "fp32":
                cells[cls]["reference"] = True
                continue
            compared = [o for o in ok if o.fp32_reference_ids is not None]
            same = [o for o in compared if o.token_ids == o.fp32_reference_ids]
            div = [d for o in compared if (d := first_divergence(o.token_ids, o.fp32_reference_ids or [])) is not None]
            top1 = [o.fp32_top1_agreement for o in compared if o.fp32_top1_agreement is not None]
            cells[cls] |= {
                "compared": len(compared), "identical_to_fp32": len(same),
                "identical_share": len(same) / len(compared) if compared else None,
                "first_divergence_median": sorted(div)[len(div) // 2] if div else None,
                "top1_agreement": sum(top1) / len(top1) if top1 else None,
            }
        tokens = sum(len(o.token_ids) for o in mine if o.ok)
        seconds = sum(o.latency_ms for o in mine) / 1e3
        result[mode] = {"classes": cells, "tok_s": tokens / seconds if seconds > 0 else None}
    return result

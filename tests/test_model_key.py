"""The on-disk caches' key for a GGUF (model.ModelInfo.cache_key): its contents, not its mtime."""

from __future__ import annotations

import dataclasses
import os
import shutil

from qladder.model import bundled_model_path, inspect_model


def test_the_cache_key_is_the_files_contents_not_its_mtime(tmp_path):
    """A reinstalled package (a fresh venv: same bytes, a new mtime) finds the fp32 checkpoint it
    dequantized before; a copy that differs by one byte, or a file changed in place, does not."""
    info = inspect_model()
    src = bundled_model_path()

    def copy(folder: str):
        dst = tmp_path / folder / src.name
        dst.parent.mkdir()
        shutil.copyfile(src, dst)
        return dataclasses.replace(info, path=dst)

    a, b, c = copy("a"), copy("b"), copy("c")
    st = b.path.stat()
    os.utime(b.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**12))
    assert a.cache_key == b.cache_key == info.cache_key
    with open(c.path, "r+b") as f:  # one byte of the last tensor's data
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert c.cache_key != a.cache_key
    with open(a.path, "r+b") as f:  # the same change, in place (same size, a new mtime)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    os.utime(a.path, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**12))
    assert a.cache_key == c.cache_key != b.cache_key

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


def test_a_file_replaced_by_another_with_the_same_size_and_mtime_gets_its_own_key(tmp_path):
    """The digest is memoized by the file's stat: a copy that kept the mtime (cp -p, rsync -t)
    moved over the file is another inode, so it is hashed again."""
    info = inspect_model()
    src = bundled_model_path()
    dst, other = tmp_path / src.name, tmp_path / "other.gguf"
    shutil.copyfile(src, dst)
    before = dataclasses.replace(info, path=dst).cache_key
    shutil.copyfile(src, other)
    with open(other, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    st = dst.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, dst)
    assert (dst.stat().st_size, dst.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert dataclasses.replace(info, path=dst).cache_key != before

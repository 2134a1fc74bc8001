#!/usr/bin/env bash
# Byte-compile a venv's site-packages on every core (what `pip install` does one file at a time;
# the installs run with --no-compile and end here). Files already compiled are skipped (a stat
# each). Without .pyc files every process would compile what it imports again, as this project's
# machines set PYTHONDONTWRITEBYTECODE. A file that does not compile (some packages ship Python 2
# examples) is skipped, as pip skips it: compileall's status is not the install's.
# Usage: scripts/compile_site.sh VENV_PYTHON
set -euo pipefail
py=${1:?python}
site=$("$py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$py" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true

"""Compile the fake NVML library (fakenvml.c) into a ``libnvidia-ml.so.1`` that pynvml loads like the real one.

``omit`` builds a library that lacks some NVML symbols altogether, the way an old driver lacks functions that
newer pynvml knows about: pynvml then raises ``NVMLError_FunctionNotFound`` when it looks the symbol up.
``extra`` adds symbols the exporter does not know, the way a newer driver exports functions that no pynvml
release wraps yet: each is a stub returning ``NVML_ERROR_NOT_SUPPORTED``. Builds are cached by a hash of the
source, the omitted and extra names and the compiler command. This module must never
touch anything outside ``out_dir`` and never fall back to a prebuilt or system NVML.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

SOURCE = Path(__file__).with_name("fakenvml.c")
LIBRARY_NAME = "libnvidia-ml.so.1"
# -ffp-contract=off: no fused multiply-add, so C and scenario.py compute bit-identical doubles.
_CFLAGS = ["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-pthread", "-ffp-contract=off"]
_STAMP = ".fakenvml-build-hash"


class CompilerNotFound(RuntimeError):
    """No C compiler: the fake NVML library cannot be built."""


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "")) or ["cc"]
    if shutil.which(cc[0]) is None:
        raise CompilerNotFound(
            f"C compiler {cc[0]!r} not found (set CC or install gcc/clang): needed to build the fake "
            f"{LIBRARY_NAME} used by the NVML tests"
        )
    return cc


def exported_functions(source: str | None = None) -> set[str]:
    """The names fakenvml.c exports (every ``EXPORT`` function)."""
    text = SOURCE.read_text() if source is None else source
    return set(re.findall(r"^EXPORT\s[^(]*?\b(\w+)\(", text, flags=re.MULTILINE))


def build_library(out_dir: Path, omit: Iterable[str] = (), extra: Iterable[str] = ()) -> Path:
    """Build ``out_dir/libnvidia-ml.so.1`` (cached) and return its path.

    ``omit``: NVML function names to leave out of the library's dynamic symbol table.
    ``extra``: further function names to export (stubs answering ``NVML_ERROR_NOT_SUPPORTED``).
    """
    out_dir = Path(out_dir)
    omitted = sorted(set(omit))
    added = sorted(set(extra))
    source = SOURCE.read_text()
    exported = exported_functions(source)
    unknown = set(omitted) - exported
    if unknown:
        raise ValueError(f"cannot omit {sorted(unknown)}: fakenvml.c does not export them")
    bad = [n for n in added if n in exported or not re.fullmatch(r"nvml[A-Za-z0-9_]+", n)]
    if bad:
        raise ValueError(f"cannot add {bad}: extra symbols must be new nvml* C identifiers")
    cc = _compiler()
    digest = hashlib.sha256(
        "\0".join([source, ",".join(omitted), ",".join(added), " ".join(cc + _CFLAGS)]).encode()
    ).hexdigest()
    target = out_dir / LIBRARY_NAME
    stamp = out_dir / _STAMP
    if target.exists() and stamp.exists() and stamp.read_text() == digest:
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        tmp_lib = Path(tmp) / LIBRARY_NAME
        cmd = [*cc, *_CFLAGS, "-o", str(tmp_lib), str(SOURCE)]
        if added:
            stubs = Path(tmp) / "extra.c"
            # 3 = NVML_ERROR_NOT_SUPPORTED; never called by the exporter, only present.
            stubs.write_text("".join(f"__attribute__((visibility(\"default\"))) int {n}(void) {{ return 3; }}\n"
                                     for n in added))
            cmd.append(str(stubs))
        if omitted:
            # Exact names in "local" win over the "global" wildcard (GNU ld and lld alike).
            script = Path(tmp) / "omit.map"
            script.write_text("{\n  global: *;\n  local: " + "; ".join(omitted) + ";\n};\n")
            cmd.append(f"-Wl,--version-script={script}")
        cmd.append("-lm")
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"building the fake NVML library failed: {shlex.join(cmd)}\n{proc.stderr}")
        # rename: a process that already mapped the old library keeps a valid file
        os.replace(tmp_lib, target)
    stamp.write_text(digest)
    return target

"""Python models whose workers do not go quietly, for the tests of what kills them: one
that never finishes loading, one that ignores SIGTERM, one that holds memory. Each writes
its worker's pid to a file as it loads (:func:`pid_in` reads it)."""

from __future__ import annotations

from pathlib import Path

from tests.support.model_files import python_config, tensor

CONFIG = python_config([tensor("x", "TYPE_FP32", "2")], [tensor("y", "TYPE_FP32", "2")])
REQUEST = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}

_IGNORE_SIGTERM = """
        # The model loads off the main thread, where signal.signal refuses: ignore SIGTERM
        # for the whole process through libc.
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(int(signal.SIGTERM), 1)  # SIG_IGN"""


def model_source(
    pid_file: Path, *, hangs: bool = False, ignores_sigterm: bool = False, ballast_mib: int = 0
) -> str:
    """A ``model.py`` (Sluice's ``class Model``, y = x) that writes its worker's pid to
    ``pid_file``; ``hangs``: its load never ends; ``ignores_sigterm``: its worker does;
    ``ballast_mib``: memory its worker holds (written, so its own)."""
    lines = ["import ctypes", "import os", "import signal", "import time", "", "class Model:"]
    lines.append("    def __init__(self):")
    if ignores_sigterm:
        lines.append(_IGNORE_SIGTERM)
    if ballast_mib:
        lines.append(f'        self.ballast = b"x" * ({ballast_mib} << 20)')
    lines.append(f"        with open({str(pid_file)!r}, 'w') as out:")
    lines.append("            out.write(str(os.getpid()))")
    if hangs:
        lines.append("        time.sleep(3600)  # (its load never ends)")
    lines += ["", "    def execute(self, inputs):", '        return {"y": inputs["x"]}', ""]
    return "\n".join(lines)


def pid_in(path: Path) -> int | None:
    """The pid a model wrote to ``path``, None before it has."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None

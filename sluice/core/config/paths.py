"""The names a model configuration gives to files and models, checked before any is opened.

A configuration may come from a client (a load's ``parameters.config``), so each name is
hostile: it must stay inside the model's own folder (or name one model of the repository),
whatever it says. The checks are lexical; a model folder staged from a request holds no
links of the client's making.
"""

from __future__ import annotations

from pathlib import PurePosixPath


def plain_name_problem(name: str) -> str | None:
    """Why ``name`` is not one entry of a folder (no separator, not ``.`` or ``..``, no NUL,
    at most 255 bytes); None when it is."""
    if not name:
        return "must not be empty"
    if "/" in name or "\\" in name or name in (".", ".."):
        return "must be a plain name (no '/', '\\', '.' or '..')"
    if "\0" in name:
        return "must not contain a NUL character"
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        return "must be at most 255 bytes long"
    return None


def model_name_problem(name: str) -> str | None:
    """Why ``name`` does not name one model folder of a repository: not a plain name
    (:func:`plain_name_problem`; 255 bytes of UTF-8, which the filesystem counts), hidden
    (a leading ``.``), or with a control character (which would forge the lines of the logs
    that name it); None when it does."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # (a lone surrogate)
        return "must be valid UTF-8"
    problem = plain_name_problem(name)
    if problem:
        return problem
    if name.startswith("."):
        return "must not start with '.'"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "must not contain control characters"
    return None


def inside_path_problem(path: str) -> str | None:
    """Why ``path`` is not a relative path inside a folder (absolute, a ``..`` part, a
    NUL); None when it is."""
    if not path:
        return "must not be empty"
    if "\0" in path:
        return "must not contain a NUL character"
    if path.startswith("/") or ".." in PurePosixPath(path).parts:
        return "must be a relative path inside the model's folder (no leading '/', no '..')"
    return None

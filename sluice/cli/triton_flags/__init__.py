"""Triton's command line for ``sluice up``: tritonserver's flags, spelled as Triton spells them.

:data:`FLAGS` is the one table of every flag of ``tritonserver`` and what Sluice does with it:

- ``option``: ``sluice up`` has an option of that name (``--http-port``, ``--model-store``, ...);
- ``mapped``: the flag becomes a setting of ``sluice up`` (:class:`TritonArgs.overrides`) or a
  ``SLUICE_*`` variable set before anything reads settings (:class:`TritonArgs.environment`),
  which the gateways and workers ``sluice up`` starts inherit;
- ``ignored``: tuning of Triton's own internals that means nothing here; accepted with one
  warning line naming it;
- ``refused``: ignoring it would quietly change what the deployment does (turning HTTP off,
  ...); an error says what to do instead.

A flag may also have values for which Sluice already does what they ask (``--allow-http=true``,
``--grpc-use-ssl=false``): those are taken without a word, whatever its kind.

:func:`parse` reads what click left over (``ctx.args`` of ``sluice up``), ``--flag=value`` or
``--flag value``, and values as Triton parses them (booleans: ``true``/``on``/``1`` and
``false``/``off``/``0``, any case). A bad value is a :class:`typer.BadParameter` naming the
flag; a refused flag, and an option neither Sluice nor Triton has (``No such option``), a
:class:`FlagError`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

from sluice.cli.triton_flags.handlers import REDIS_CACHE_BYTES
from sluice.cli.triton_flags.table import FLAGS, FLAGS_LIST
from sluice.cli.triton_flags.values import (
    VALUE_CHECKS,
    FlagError,
    TritonArgs,
    TritonFlag,
    bad_value,
    parse_bool,
    parse_float,
    parse_int,
)

__all__ = [
    "FLAGS",
    "FLAGS_LIST",
    "REDIS_CACHE_BYTES",
    "FlagError",
    "TritonArgs",
    "TritonFlag",
    "bad_value",
    "parse",
    "parse_bool",
    "parse_float",
    "parse_int",
]

# --- parsing ------------------------------------------------------------------------------


def _no_such_option(option: str, known: Iterable[str]) -> FlagError:
    """Click's words for an unknown option, with the close names of Sluice and Triton."""
    close = difflib.get_close_matches(option, sorted(set(known)), n=3, cutoff=0.8)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return FlagError(f"No such option: {option}{hint}")


def parse(args: Sequence[str], sluice_options: Iterable[str] = ()) -> TritonArgs:
    """What Triton's flags in ``args`` (what ``sluice up``'s own options left) ask for.
    ``sluice_options``: the names of ``sluice up``'s options, offered when a name is mistyped."""
    out = TritonArgs()
    known = [*sluice_options, *(flag.option for flag in FLAGS_LIST)]
    index = 0
    while index < len(args):
        token = args[index]
        index += 1
        if token.startswith("-") and not token.startswith("--") and len(token) > 1:
            raise _no_such_option(token.partition("=")[0], known)
        if not token.startswith("--") or token == "--":
            raise FlagError(f"Got unexpected extra argument ({token})")
        name, equals, text = token[2:].partition("=")
        flag = FLAGS.get(name)
        if flag is None or flag.kind == "option":
            raise _no_such_option(f"--{name}", known)
        if flag.value == "none":
            if equals:
                raise bad_value(flag, f"takes no value, got {text!r}")
        elif not equals:
            if index >= len(args):
                raise FlagError(f"Option '{flag.option}' requires a value.")
            text = args[index]
            index += 1
        _take(flag, text, out)
    return out


def _take(flag: TritonFlag, text: str, out: TritonArgs) -> None:
    if flag.apply is None:  # what applies a value checks it, as its own flag reads it
        VALUE_CHECKS[flag.value](flag, text)
    if flag.fine is not None and flag.fine(text):
        return
    if flag.apply is not None:
        flag.apply(flag, text, out)
    elif flag.kind == "refused":
        shown = f"{flag.option}={text}" if flag.value != "none" else flag.option
        raise FlagError(f"{shown} is refused: {flag.does}")
    elif flag.kind == "ignored":
        out.warnings.append(f"warning: {flag.option} ignored: {flag.does}")

"""What Triton's flags are (:class:`TritonFlag`), what they ask of ``sluice up``
(:class:`TritonArgs`), and their values read as Triton reads them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import typer

Kind = Literal["option", "mapped", "ignored", "refused"]
ValueKind = Literal["bool", "int", "float", "text", "none"]


class FlagError(typer.BadParameter):
    """A Triton flag Sluice refuses, or an option nobody has: a usage error (exit status 2)
    shown as it is, without click's ``Invalid value for`` before it."""

    def format_message(self) -> str:
        return self.message


@dataclass
class TritonArgs:
    """What Triton's flags ask of ``sluice up``."""

    overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of UpSettings."""
    environment: dict[str, str] = field(default_factory=dict)
    """``SLUICE_*`` variables for ``sluice up`` and every process it starts."""
    warnings: list[str] = field(default_factory=list)
    """One line per flag (or backend setting) accepted but ignored."""
    addresses: dict[str, str] = field(default_factory=dict)
    """``--grpc-address`` / ``--metrics-address`` as given: Sluice serves every port on the
    HTTP address, so each must be that one (see :meth:`check_addresses`)."""

    def check_addresses(self, http_host: str) -> None:
        """Refuse an address other than the HTTP address (known once settings are read)."""
        for name, address in self.addresses.items():
            if address != http_host:
                raise FlagError(
                    f"--{name}={address}: Sluice serves HTTP, gRPC and metrics on one address, "
                    f"here {http_host}; give --http-address {address} instead"
                )


@dataclass(frozen=True)
class TritonFlag:
    """One flag of ``tritonserver`` and what Sluice does with it."""

    name: str
    """Without the leading ``--``."""
    value: ValueKind
    kind: Kind
    does: str
    """What Sluice does with it (for ``ignored``: why it is ignored; for ``refused``: what to
    do instead). One sentence or two, shown in the warning, the error and the docs."""
    apply: Callable[[TritonFlag, str, TritonArgs], None] | None = None
    """``mapped`` (and flags with settings of their own): record what the value asks."""
    fine: Callable[[str], bool] | None = None
    """Values for which Sluice already does what the flag asks: taken without a word."""

    @property
    def option(self) -> str:
        return f"--{self.name}"


# --- values, as Triton parses them --------------------------------------------------------

TRUE_TEXTS = ("true", "on", "1")
FALSE_TEXTS = ("false", "off", "0")


def bad_value(flag: TritonFlag | str, message: str) -> typer.BadParameter:
    name = flag.option if isinstance(flag, TritonFlag) else flag
    return typer.BadParameter(message, param_hint=f"'{name}'")


def parse_bool(flag: TritonFlag, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in TRUE_TEXTS:
        return True
    if lowered in FALSE_TEXTS:
        return False
    raise bad_value(flag, f"invalid value for bool option: {text}")


def parse_int(flag: TritonFlag, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise bad_value(flag, f"{text!r} is not an integer") from None


def parse_float(flag: TritonFlag, text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise bad_value(flag, f"{text!r} is not a number") from None


VALUE_CHECKS: dict[ValueKind, Callable[[TritonFlag, str], object]] = {
    "bool": parse_bool,
    "int": parse_int,
    "float": parse_float,
    "text": lambda _flag, text: text,
    "none": lambda _flag, text: text,
}

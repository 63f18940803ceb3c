"""The warning ``sluice up`` gives when anyone beyond this machine could call it freely.

Without API keys every route is open to one tenant, ``anonymous``: harmless on loopback,
where only local users reach the gateway, but on any other address whoever reaches the port
may run models, read every job and manage the deployment.
"""

from __future__ import annotations

import ipaddress
import logging

from sluice.core.settings import ApiKeySettings

log = logging.getLogger("sluice.up")


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this machine only (a host name other than
    ``localhost`` counts as reachable from elsewhere: what it resolves to may change)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def has_keys(keys: ApiKeySettings | None) -> bool:
    """Whether any inference or admin key is set (a key file that cannot be read counts as
    set: the gateway refuses to start on it and says why)."""
    if keys is None:
        return False
    for read in (keys.inference_keys, keys.admin_key_list):
        try:
            if read():
                return True
        except OSError:
            return True
    return False


def warn_if_open_beyond_loopback(host: str, keys: ApiKeySettings | None) -> bool:
    """Log one warning line when the gateway listens beyond loopback without API keys;
    whether it did."""
    if is_loopback(host) or has_keys(keys):
        return False
    log.warning(
        "the gateway listens on %s without API keys: anyone who reaches it may run models, "
        "read every job and manage the deployment; set SLUICE_API_KEYS (tenant:key entries, "
        "or SLUICE_API_KEYS_FILE) and SLUICE_ADMIN_KEYS, or listen on 127.0.0.1",
        host,
    )
    return True

"""A broker that listens beyond loopback runs with auth: the first start on such an address without a token makes
an admin token, and a config that turns auth off explicitly does not start there unless told ``--insecure``.

The design is the simplest that is safe by default: ``tangram serve --host 0.0.0.0`` on defaults ends up with auth
on and one admin token, shown once on stderr (the store keeps only its SHA-256; ``tangram token create`` makes
more); nothing changes for a broker on loopback, where ``tangram.server.request_guard`` keeps other hosts' names and
pages out instead. ``[auth] required = false`` is a deliberate choice that this module will not overrule by
making a token, so it refuses the address instead: ``--insecure`` accepts it for one start (the request guard
then still answers only requests addressed to a loopback name, as through a port published on loopback).
"""

from __future__ import annotations

import logging

from tangram.core.errors import ConfigError
from tangram.core.loopback import is_loopback
from tangram.server.auth import Authenticator

log = logging.getLogger("tangram.server.auth")

MINTED_NOTE = "made at the first start on a non-loopback address"


def check_bind(host: str, required: bool | None, *, insecure: bool) -> None:
    """Refuse (``ConfigError``) a non-loopback ``host`` while the config says ``[auth] required = false``, unless
    ``insecure``. Checked before anything starts."""
    if is_loopback(host) or required is not False or insecure:
        return
    raise ConfigError("auth.required", f"is false, but server.host {host!r} is not a loopback address: anyone who "
                                       f"reaches it could run commands here. Remove `required = false` (a start "
                                       f"there then makes an admin token), bind 127.0.0.1, or start with "
                                       f"--insecure to accept it")


async def token_for_bind(auth: Authenticator, host: str) -> str | None:
    """With auth off (no token anywhere, ``required`` unset) on a non-loopback ``host``: a new admin token in the
    store, which turns auth on; the token is returned for the caller to show once. None otherwise."""
    if is_loopback(host):
        return None
    await auth.refresh()  # the store's tokens, before the app loads them at its start
    if auth.enabled:
        return None
    if auth.access.auth.required is False:  # allowed by --insecure (check_bind refused it otherwise)
        log.warning("binding %r with auth off (--insecure): only requests addressed to a loopback name are "
                    "answered", host)
        return None
    _, token = await auth.create(None, MINTED_NOTE)
    return token

"""Which names and addresses stay on this host: the bind address that needs auth, and the ``Host`` and ``Origin``
headers a broker without auth answers (so that a web page elsewhere, or one that rebinds its name to this host's
address, cannot drive it through the visitor's browser)."""

from __future__ import annotations

import re
from functools import lru_cache
from urllib.parse import urlsplit

from tangram.core.loopback import is_loopback

#: a ``Host`` header: a name or IPv4 address, or an IPv6 address in brackets, then an optional port
HOST_HEADER = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:\[\]/@\s]+))(?::(?P<port>[0-9]{1,5}))?\Z")


@lru_cache(maxsize=256)  # asked on every request, nearly always with the same few values
def host_header_is_loopback(value: str) -> bool:
    """A ``Host`` header (``name[:port]``, ``[v6][:port]``) that names this host only."""
    match = HOST_HEADER.match(value.strip())
    return match is not None and is_loopback(match["v6"] or match["name"])


def origin_is_loopback(value: str) -> bool:
    """An ``Origin`` header (``scheme://host[:port]``) of a page served from this host; ``null`` (a sandboxed
    frame, a file) is not."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or parts.path or parts.query or parts.fragment:
        return False
    return host_header_is_loopback(parts.netloc)

"""Which names and addresses are this host only: 127.0.0.0/8, ::1 (IPv4-mapped too) and the name ``localhost``.
Everything this project runs on one machine stays on them (Ray, the tests), and a broker without auth answers only
requests addressed to them."""

from __future__ import annotations

import ipaddress

#: the only name taken for loopback: other names may resolve anywhere, and a page can make its own resolve here
LOOPBACK_NAME = "localhost"


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, IPv6 with or without brackets or a zone, no port) is this host only. An empty
    host, ``0.0.0.0`` and ``::`` mean every interface: not loopback."""
    name = host.strip().lower().removeprefix("[").removesuffix("]").split("%")[0]
    if name in (LOOPBACK_NAME, LOOPBACK_NAME + "."):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return (mapped or address).is_loopback

"""Where a sandbox's egress proxy (``sandboxes/egress_proxy.py``) may connect: the environment's allow-list of host
names, and the node's rules on the addresses those names resolve to.

Two checks, both needed. The allow-list is the task's: ``host``, ``host:port``, ``*.suffix`` or ``*.suffix:port``
(a host is a DNS name or an IP literal, IPv6 in brackets; ``*.suffix`` matches names below ``suffix``, not
``suffix`` itself; no port: any port). The address rules are the operator's and are checked on each address *after*
resolution, whatever name led there, so no name (``localhost``, a DNS record pointing at 127.0.0.1 or
169.254.169.254, a decimal IP) reaches what the allow-list did not mean:

* never: unspecified, multicast, reserved and link-local addresses (the cloud's metadata service is 169.254.169.254);
* the node's own addresses (loopback, and those of its interfaces) only with ``allow_loopback``, and never on a port
  the process running the proxy (the broker, or a node's agent) listens on, nor on a ``deny_ports`` one (the Docker
  engine's TCP ports, Ray's);
* other non-global addresses (private networks, CGNAT, IPv6 ULA) only with ``allow_private``;
* never a ``deny_ports`` port, on any address.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

#: entries an allow-list may hold
MAX_RULES = 64
#: the longest DNS name (RFC 1035), and an entry: a name, "*." before it and ":65535" after it
MAX_HOST_CHARS = 253
MAX_RULE_CHARS = MAX_HOST_CHARS + len("*.") + len(":65535")
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)\Z")
_PORT = re.compile(r"^[0-9]{1,5}\Z")
#: the Docker engine's TCP ports, Ray's GCS, client server and dashboard: never a destination, on any address
DEFAULT_DENY_PORTS = (2375, 2376, 6379, 8265, 10001)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def normal_host(text: str) -> str:
    """A host as rules and requests compare it: an IP literal in its canonical form (brackets dropped), a DNS name
    lower-cased without its final dot. Raises ValueError saying what is wrong."""
    if text.startswith("[") and text.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(text[1:-1]))
        except ValueError:
            raise ValueError("has brackets around something that is not an IPv6 address") from None
    try:
        return str(ipaddress.IPv4Address(text))
    except ValueError:
        pass
    name = text.lower().removesuffix(".")
    if not name or len(name) > MAX_HOST_CHARS:
        raise ValueError(f"must be a host name of 1 to {MAX_HOST_CHARS} characters")
    if not all(_LABEL.match(label) for label in name.split(".")):
        raise ValueError("must be a DNS name (labels of a-z, 0-9 and '-', at most 63 characters each), an IPv4 "
                         "address or an IPv6 address in brackets")
    return name


def split_authority(text: str) -> tuple[str, int | None]:
    """``host[:port]`` (``[v6]:port`` for IPv6) as (normal host, port or None). Raises ValueError."""
    host, port = text, None
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or end + 1 < len(text) and text[end + 1] != ":":
            raise ValueError("must be [IPv6] or [IPv6]:port")
        host, rest = text[:end + 1], text[end + 2:] if end + 1 < len(text) else None
        port = _port(rest) if rest is not None else None
    elif ":" in text:
        host, rest = text.rsplit(":", 1)
        port = _port(rest)
    return normal_host(host), port


def _port(text: str) -> int:
    if not _PORT.match(text) or not 0 < int(text) < 65536:
        raise ValueError("must end in a port from 1 to 65535")
    return int(text)


@dataclass(frozen=True)
class HostRule:
    """One allow-list entry: ``host`` itself, or (``wildcard``) any name below it; on ``port``, or any port."""

    host: str
    wildcard: bool = False
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> HostRule:
        if len(text) > MAX_RULE_CHARS:
            raise ValueError(f"is longer than {MAX_RULE_CHARS} characters")
        wildcard = text.startswith("*.")
        host, port = split_authority(text[2:] if wildcard else text)
        if wildcard and _is_ip(host):
            raise ValueError("a wildcard takes a DNS suffix, not an IP address")
        return cls(host, wildcard, port)

    def matches(self, host: str, port: int) -> bool:
        """Whether it admits ``host`` (normal, ``normal_host``) on ``port``."""
        if self.port is not None and port != self.port:
            return False
        return host.endswith("." + self.host) if self.wildcard else host == self.host

    def within(self, ceiling: HostRule) -> bool:
        """Whether every destination this rule admits, ``ceiling`` admits too."""
        if ceiling.port is not None and self.port != ceiling.port:
            return False
        if not ceiling.wildcard:
            return not self.wildcard and self.host == ceiling.host
        return self.host.endswith("." + ceiling.host)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return ("*." if self.wildcard else "") + host + (f":{self.port}" if self.port is not None else "")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class AllowList:
    """An environment's hosts: a destination is let through only if one of its rules admits it."""

    rules: tuple[HostRule, ...]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        """Raises ``BadRule`` naming the entry's index."""
        rules = []
        for index, entry in enumerate(entries):
            try:
                rules.append(HostRule.parse(entry))
            except ValueError as error:
                raise BadRule(index, str(error)) from None
        return cls(tuple(rules))

    def permits(self, host: str, port: int) -> bool:
        return any(rule.matches(host, port) for rule in self.rules)

    def outside(self, ceiling: AllowList) -> int | None:
        """The index of the first rule ``ceiling`` does not cover, or None when all are within it."""
        return next((i for i, rule in enumerate(self.rules) if not any(rule.within(c) for c in ceiling.rules)),
                    None)

    def entries(self) -> tuple[str, ...]:
        return tuple(map(str, self.rules))


class BadRule(ValueError):
    """An allow-list entry that is no ``host``, ``host:port``, ``*.suffix`` or ``*.suffix:port``."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index
        self.reason = reason


@dataclass(frozen=True)
class NodeView:
    """What is the node's own, read when a connection is checked: its interfaces' addresses and the TCP ports the
    process running the proxy listens on (the broker's API, or a node agent's)."""

    addresses: frozenset[Address]
    own_ports: frozenset[int]

    @classmethod
    def read(cls) -> NodeView:
        """Blocking (a /proc scan): call it off the event loop."""
        addresses = set()
        for entries in psutil.net_if_addrs().values():
            for entry in entries:
                try:
                    addresses.add(ipaddress.ip_address(entry.address.split("%", 1)[0]))
                except ValueError:  # a link-layer address
                    continue
        ports = {conn.laddr.port for conn in psutil.Process().net_connections(kind="inet")
                 if conn.status == psutil.CONN_LISTEN and conn.laddr}
        return cls(frozenset(addresses), frozenset(ports))


@dataclass(frozen=True)
class AddressRules:
    """The operator's rules on resolved addresses (``[cpu.egress]``)."""

    allow_loopback: bool = False
    allow_private: bool = False
    deny_ports: frozenset[int] = frozenset(DEFAULT_DENY_PORTS)

    def refusal(self, address: Address, port: int, node: NodeView) -> str | None:
        """Why a connection to ``address``:``port`` is refused, or None when it may be made."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if address.is_unspecified or address.is_multicast or address.is_reserved or address.is_link_local:
            return f"{address} is an unspecified, multicast, reserved or link-local (metadata) address"
        if port in self.deny_ports:
            return f"port {port} is one of the node's services ([cpu.egress] deny_ports)"
        if address.is_loopback or address in node.addresses:
            if not self.allow_loopback:
                return f"{address} is the node's own address ([cpu.egress] allow_loopback is off)"
            if port in node.own_ports:
                return f"{address}:{port} is the broker's or node agent's own listening port"
            return None
        if not address.is_global and not self.allow_private:
            return f"{address} is a private address ([cpu.egress] allow_private is off)"
        return None

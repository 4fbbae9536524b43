"""The address a rank gives its peers to connect to: one rule for every rendezvous, never the host name.

Two rendezvous use it: the trainers' torch.distributed world (`world_store`, trainer 0's address) and
each weight-sync group (its source's address, and each member's own end of the group's connections,
areal_hpc.weight_sync.broadcast). The host name is no answer: `gethostbyname(getfqdn())` is 127.0.1.1 on
Debian-style hosts and a management address elsewhere, and gloo's default device makes the same guess.

    cluster.network_interface set   -> that interface's IPv4 address on this node (an error naming it,
                                       with the node's interfaces, when the node has no such interface)
    else                            -> the address of the interface the kernel routes to a peer by:
                                       a UDP socket connected to the peer (no packet leaves) and its
                                       getsockname(); 127.0.0.1 when the peer is this host

The peer is a member of the same group on another host (`peer_of`: the first, by rank), by the name
its host reported, resolved here: Slurm needs its node names to resolve, and the route to a real
member says which network the members share, where the controller's host (one more candidate) may
sit on another one (CPU nodes). With several networks between the nodes, the route picks one that
works, not necessarily the fastest: set cluster.network_interface for that. Every group checks the
address at start (weight_sync's start-up broadcast, `areal-hpc doctor`), so a wrong one fails there.
One rank picks where a rendezvous meets and broadcasts it (`offer`); when it cannot, its error reaches
every rank of the rendezvous instead, so none waits for an address that never comes. It offers a store
it has already opened, at a port the OS picked: a port picked first and bound later can be taken in
between by another process of the node (seen: EADDRINUSE at a trainer's init on a busy node).

Hand-written: no well-kept library answers "which of my addresses do these peers reach"; psutil (a
dependency of vLLM) only lists the interfaces.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Sequence
from typing import TypeVar

from areal_hpc.errors import ConfigError

LOOPBACK = "127.0.0.1"
T = TypeVar("T")


class AddressError(RuntimeError):
    """No usable address toward the peers from this node, or (`offer`) none from the rank that offers
    it; the message names the peer or that rank, and the fix."""


def interfaces() -> dict[str, list[str]]:
    """This node's network interfaces, each with its IPv4 addresses (possibly none)."""
    import psutil

    return {
        name: [a.address for a in addrs if a.family == socket.AF_INET] for name, addrs in psutil.net_if_addrs().items()
    }


def check_interface(name: str) -> None:
    """Raise ConfigError naming `name` (cluster.network_interface) when this node has no such interface
    with an IPv4 address; an empty name (the libraries' own choice) passes."""
    if name:
        interface_address(name)


def interface_address(name: str) -> str:
    """The IPv4 address of interface `name` on this node."""
    found = interfaces()
    if found.get(name):
        return found[name][0]
    listed = ", ".join(f"{n} ({', '.join(a) or 'no IPv4 address'})" for n, a in sorted(found.items()))
    what = "has no IPv4 address" if name in found else "is not an interface"
    raise ConfigError(
        f"cluster.network_interface {name!r} {what} on host {socket.gethostname()} (its interfaces: {listed}): "
        "set it to an interface every node has (`ip -brief address` on a node lists them), or leave it empty"
    )


def peer_of(hosts: Sequence[str]) -> str:
    """The peer to route toward: the first of `hosts` (the group's members, as each reported
    `socket.gethostname()`) that is not this host; LOOPBACK when every member is on this host."""
    here = socket.gethostname()
    return next((h for h in hosts if h != here), LOOPBACK)


def own_address(interface: str, peer: str) -> str:
    """This node's address for traffic with `peer` (a host name or an address): `interface`'s when set,
    else the local address of the route to the peer (module docstring)."""
    if interface:
        return interface_address(interface)
    try:
        target = socket.getaddrinfo(peer, None, socket.AF_INET)[0][4][0]
    except OSError as e:
        raise AddressError(
            f"host {peer!r}, a peer of this rank, does not resolve on {socket.gethostname()} ({e}): "
            "set cluster.network_interface to the interface the nodes share"
        ) from e
    if ipaddress.ip_address(target).is_loopback and peer not in (LOOPBACK, "localhost", socket.gethostname()):
        raise AddressError(
            f"host {peer!r}, a peer on another host, resolves to the loopback address {target} on "
            f"{socket.gethostname()} (/etc/hosts?): set cluster.network_interface to the interface the nodes share"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, 9))  # UDP: only picks the route; nothing is sent
        address = s.getsockname()[0]
    return address


def address(interface: str, hosts: Sequence[str]) -> str:
    """The address a group's first member offers the others (`hosts`: every member's host)."""
    return own_address(interface, peer_of(hosts))


def interface_of(addr: str) -> str | None:
    """The name of this node's interface holding `addr`, or None."""
    return next((name for name, addrs in interfaces().items() if addr in addrs), None)


def offer(comm, make: Callable[[], T], offerer: str) -> T:
    """Rank 0's `make()` (where to meet: an address, a port), broadcast to every rank of `comm`
    (collective over MPI). When `make` raises there, every rank raises: rank 0 its own error, the others
    an AddressError with its text, naming `offerer` (rank 0, as errors name it): none waits for ever in
    a broadcast that rank 0 never reaches."""
    made, failed = None, None
    if comm.Get_rank() == 0:
        try:
            made = make()
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            failed = e
    sent = (True, made) if failed is None else (False, f"{type(failed).__name__}: {failed}")
    ok, value = comm.bcast(sent, root=0)
    if failed is not None:
        raise failed
    if not ok:
        raise AddressError(f"{offerer} offered no address to meet at: {value}")
    return value


def world_store(comm, interface: str, timeout_s: float):
    """The TCPStore of a torch.distributed world of `comm`'s ranks (collective over MPI): rank 0 opens it
    at its address (`address`) on a port the OS picks and offers both to all (`offer`); the others
    connect to it. Every rank also points gloo at its own interface toward that address
    (GLOO_SOCKET_IFNAME, unless set: gloo's default is the host name), for the process groups torch and
    Megatron create in that world."""
    import datetime

    import torch.distributed as dist

    from areal_hpc.protocol import arrive  # numpy: not at import, the doctor's probe checks a bare python with this

    arrive(comm)
    hosts = comm.allgather(socket.gethostname())
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None

    def open_store() -> tuple[str, int]:
        nonlocal store
        addr = address(interface, hosts)
        store = dist.TCPStore(addr, 0, comm.Get_size(), True, timeout=timeout, wait_for_workers=False)
        return addr, store.port

    addr, port = offer(comm, open_store, f"rank 0 of this torch.distributed world, on host {hosts[0]},")
    if store is None:
        store = dist.TCPStore(addr, port, comm.Get_size(), False, timeout=timeout)
    gloo = interface_of(own_address(interface, addr))
    if gloo:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", gloo)
    return store


__all__ = [
    "AddressError",
    "address",
    "check_interface",
    "interface_address",
    "offer",
    "own_address",
    "peer_of",
    "world_store",
]

"""The address a rank offers its peers (areal_hpc.network), and `cluster.network_interface` refused before
any rank starts where a node lacks it: by the local launcher, and by each rank at its start (what covers
Slurm's nodes). The rendezvous that use the address run in tests/test_weight_sync.py and
tests/test_trainer_worker.py."""

import subprocess
import sys

import pytest

from areal_hpc import network
from areal_hpc.cli import main as cli_main
from areal_hpc.config import ConfigError, load_config
from areal_hpc.rundir import prepare_run_dir
from tests.support.helpers import REPO, TINY


def _routable() -> dict[str, str]:
    """This machine's interfaces with a non-loopback IPv4 address: {name: address}."""
    return {n: a[0] for n, a in network.interfaces().items() if a and not a[0].startswith("127.")}


def test_the_interface_named_gives_its_address_and_one_missing_is_named_with_the_nodes():
    assert network.interface_address("lo") == "127.0.0.1"
    network.check_interface("")  # the libraries' own choice
    network.check_interface("lo")
    with pytest.raises(ConfigError) as e:
        network.check_interface("nosuch0")
    text = str(e.value)
    assert text.startswith("cluster.network_interface 'nosuch0' is not an interface on host ")
    assert "lo (127.0.0.1)" in text and "or leave it empty" in text
    for name, addr in _routable().items():  # the interface wins over any route
        assert network.own_address(name, "127.0.0.1") == addr


def test_without_an_interface_the_route_to_the_peer_picks_the_address():
    assert network.own_address("", "127.0.0.1") == "127.0.0.1"
    for addr in _routable().values():  # toward an address of this host, its own interface's
        assert network.own_address("", addr) == addr
    assert network.interface_of("127.0.0.1") == "lo"
    assert network.interface_of("203.0.113.99") is None


def test_the_peer_is_the_first_member_on_another_host(monkeypatch):
    monkeypatch.setattr(network.socket, "gethostname", lambda: "n1")
    assert network.peer_of(["n1", "n1"]) == network.LOOPBACK  # one host: loopback, for every member
    assert network.peer_of(["n1", "n3", "n2"]) == "n3"
    assert network.address("", ["n1", "n1"]) == "127.0.0.1"


def test_a_peer_that_resolves_to_loopback_or_not_at_all_is_refused_with_the_fix(monkeypatch):
    # This host's own name resolves to loopback here (/etc/hosts): seen from a host of another name, it is a
    # peer whose address would be this machine's loopback, the host-name trap the rule avoids.
    here = network.socket.gethostname()
    if not network.socket.gethostbyname(here).startswith("127."):
        pytest.skip(f"{here} does not resolve to a loopback address on this machine")
    monkeypatch.setattr(network.socket, "gethostname", lambda: "elsewhere")
    with pytest.raises(network.AddressError, match=rf"host '{here}', a peer on another host, resolves to the loopback"):
        network.address("", ["elsewhere", here])
    with pytest.raises(network.AddressError, match=r"'no-such-host.invalid', a peer of this rank, does not resolve"):
        network.own_address("", "no-such-host.invalid")


def test_a_local_run_with_a_missing_interface_fails_before_starting_anything(tmp_path, capsys):
    code = cli_main(["run", str(TINY), "cluster.network_interface=nosuch0", f"experiment.root={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "config error: cluster.network_interface 'nosuch0' is not an interface on host" in err
    assert not any(tmp_path.iterdir())  # no run directory, no rank


def test_a_rank_on_a_node_without_the_interface_stops_before_mpi_naming_it(tmp_path):
    # what every rank started by Slurm does on its node (the login node cannot know the nodes' interfaces)
    cfg = load_config(TINY, ["cluster.network_interface=nosuch0", f"experiment.root={tmp_path}"])
    run_dir = prepare_run_dir(cfg)
    proc = subprocess.run(
        [sys.executable, "-m", "areal_hpc.main", str(run_dir)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("areal-hpc: cluster.network_interface 'nosuch0' is not an interface on host ")
    assert not (run_dir / "logs").exists() or not any((run_dir / "logs").iterdir())

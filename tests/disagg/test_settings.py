"""Role settings and addresses are checked when made."""

from __future__ import annotations

import sys

import pytest

from kvabi.disagg.settings import DisaggSettings
from kvabi.transfer.tcp_transport import TcpTransport
from kvabi.transfer.transport import split_address

SECRET = b"0123456789abcdef"


def test_settings_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="role: one of"):
        DisaggSettings("both", SECRET)
    with pytest.raises(ValueError, match="transport: one of"):
        DisaggSettings("decode", SECRET, transport="rdma")
    with pytest.raises(ValueError, match="expected host:port"):
        DisaggSettings("decode", SECRET, peers=("localhost",))
    with pytest.raises(ValueError, match="16 bytes"):
        DisaggSettings("prefill", b"short")
    settings = DisaggSettings("decode", SECRET, peers=("127.0.0.1:9000",), io_timeout_s=2)
    assert isinstance(settings.make_transport(), TcpTransport)
    assert settings.transport_config().io_timeout_s == 2


def test_addresses_default_to_loopback():
    assert split_address(":8100") == ("127.0.0.1", 8100)
    assert split_address("10.0.0.2:7") == ("10.0.0.2", 7)


def test_nixl_without_the_package_is_a_clear_error(monkeypatch):
    from kvabi.transfer.nixl_memory import NixlUnavailableError, load_nixl
    from kvabi.transfer.nixl_transport import NixlTransport
    from kvabi.transfer.transport import TransportConfig

    monkeypatch.setitem(sys.modules, "nixl._api", None)  # as if nixl were not installed
    with pytest.raises(ValueError, match=r"nixl package is not installed .*kvabi\[nixl\]"):
        DisaggSettings("decode", SECRET, peers=("127.0.0.1:9000",), transport="nixl")
    with pytest.raises(NixlUnavailableError, match="kvabi\\[nixl\\]"):
        load_nixl()
    with pytest.raises(NixlUnavailableError):
        NixlTransport(TransportConfig(SECRET))
    assert DisaggSettings("decode", SECRET).transport == "tcp"  # the default needs nothing

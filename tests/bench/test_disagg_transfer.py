"""`kvabi bench disagg`, transfer part: the prefill-side process serves the payload and the raw
baseline, and the figures describe the bytes that really crossed."""

from __future__ import annotations

import pytest

from kvabi.abi.catalog import catalog_model
from kvabi.abi.presets import preset_descriptor
from kvabi.bench.disagg_bench import transfer
from kvabi.bench.transfer_peer import SRC_PRESET
from kvabi.transfer.nixl_memory import is_nixl_available
from kvabi.wire.container_format import container_size


def test_transfer_rows_measure_the_container_of_whole_blocks(capsys):
    figures = transfer("smollm2-135m", 40, 2)  # 40 tokens: two blocks of 16 are sent
    desc = preset_descriptor(SRC_PRESET, catalog_model("smollm2-135m"))
    assert figures["num_tokens"] == 32
    assert figures["bytes"] == container_size(desc, 32, 2)
    for key in ("raw_socket_gbps", "tcp_transport_gbps", "fetch_and_place_gbps"):
        assert figures[key] > 0, key
    assert figures["tcp_vs_raw_socket_ratio"] == pytest.approx(
        figures["tcp_transport_gbps"] / figures["raw_socket_gbps"]
    )
    assert (figures["nixl_transport_gbps"] is not None) == is_nixl_available()
    assert figures["ran_on"]["cpu"] and figures["ran_on"]["cpus"] >= 1
    out = capsys.readouterr().out
    assert "kvabi tcp transport (fetch)" in out and "ran on" in out


@pytest.mark.skipif(not is_nixl_available(), reason="nixl is not installed")
def test_nixl_rows_have_both_baselines_and_the_pool_read(capsys):
    figures = transfer("smollm2-135m", 40, 2)
    for key in ("raw_nixl_read_gbps", "nixl_fetch_and_place_gbps", "nixl_pool_read_gbps"):
        assert figures[key] > 0, key
    assert figures["nixl_pool_read_vs_raw_nixl_ratio"] == pytest.approx(
        figures["nixl_pool_read_gbps"] / figures["raw_nixl_read_gbps"]
    )
    assert "nixl pool to pool (READ into reserved blocks)" in capsys.readouterr().out

import pytest

from kvabi.cli import demo

pytestmark = pytest.mark.slow


def test_make_run_demo_round_trips_llamacpp_through_vllm_layout(tmp_path, monkeypatch, capsys):
    pytest.importorskip("llama_cpp")
    monkeypatch.chdir(tmp_path)
    assert demo.main() == 0
    out = capsys.readouterr().out
    assert "greedy tokens identical: True" in out and "Paris" in out
    assert (tmp_path / "out/demo/vllm-flashinfer-hnd.kvabi").stat().st_size > 1_000_000

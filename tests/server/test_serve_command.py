"""`kvabi serve` options: the API key from the flag or the environment, the served model name."""

from __future__ import annotations

import shlex

from kvabi.cli.main import build_parser
from kvabi.cli.serve import banner, served_name


def test_the_api_key_comes_from_the_flag_or_kvabi_api_key(monkeypatch):
    monkeypatch.delenv("KVABI_API_KEY", raising=False)
    assert build_parser().parse_args(["serve"]).api_key is None
    assert build_parser().parse_args(["serve", "--api-key", "k1"]).api_key == "k1"
    monkeypatch.setenv("KVABI_API_KEY", "k2")
    args = build_parser().parse_args(["serve", "--port", "9001"])
    assert (args.api_key, args.port, args.host) == ("k2", 9001, "127.0.0.1")


def test_served_names(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "folder").mkdir()
    assert served_name(None) == served_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert served_name(str(tmp_path / "m.gguf")) == "m"
    assert served_name(str(tmp_path / "folder")) == "folder"


def test_the_banner_curl_line_is_one_pasteable_command():
    text = banner("tiny", "127.0.0.1", 8123, has_key=True)
    curl = text.splitlines()[1].removeprefix("try: ")
    words = shlex.split(curl)
    assert words[:2] == ["curl", "http://127.0.0.1:8123/v1/chat/completions"]
    assert "Authorization: Bearer $KVABI_API_KEY" in words
    assert '"model": "tiny"' in words[-1]

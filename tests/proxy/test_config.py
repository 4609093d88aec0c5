"""Configuration: validation names the bad key; the example config is valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorverse.cli import main
from tensorverse.config import ConfigError, load_config, parse_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tensorverse.toml"


def test_example_config_is_valid():
    cfg = load_config(EXAMPLE)
    assert cfg.primary.url.startswith("http")
    roles = sorted(b.role for b in cfg.shadows)
    assert roles == ["secondary", "shadow", "shadow"]
    assert {b.name for b in cfg.shadows} >= {"flashinfer", "fp8-kv"}


def test_the_example_in_the_docs_is_the_example_file():
    """docs/proxy.md shows examples/tensorverse.toml whole: a change to one is made to both."""
    doc = (EXAMPLE.parents[1] / "docs" / "proxy.md").read_text()
    start = doc.index("## Example: primary + FlashInfer shadow")
    shown = doc[doc.index("```toml\n", start) + len("```toml\n"):]
    assert shown[:shown.index("```\n")] == EXAMPLE.read_text()


@pytest.mark.parametrize(
    "data, key, words",
    [
        ({}, "primary", "required"),
        ({"primary": {"url": "http://x"}, "proxy": {"lisen": "x"}}, "proxy.lisen", "unknown key"),
        ({"primary": {"url": "ftp://x"}}, "primary.url", "http"),
        ({"primary": {"url": "http://x"}, "proxy": {"listen": "nohost"}}, "proxy.listen", "HOST:PORT"),
        ({"primary": {"url": "http://x"}, "shadows": [{"name": "a", "url": "http://a"}, {"name": "b", "url": "http://b", "timeout_s": 0}]},
         "shadows[1].timeout_s", "greater than 0"),
        ({"primary": {"url": "http://x"}, "capture": {"sample": 2}}, "capture.sample", "less than or equal"),
        ({"primary": {"url": "http://x"}, "capture": {"modes": ["forced", "fre"]}}, "capture.modes[1]", "forced"),
        ({"primary": {"url": "http://x"}, "shadows": [{"name": "a b", "url": "http://a"}]}, "shadows[0].name", "letters"),
        ({"primary": {"url": "http://x"}, "capture": {"backends": ["nope"]}}, "capture.backends", "unknown backend"),
        ({"primary": {"url": "http://x"}, "recording": {"top_logprobs": 50}}, "recording.top_logprobs", "20"),
    ],
)
def test_errors_name_the_key(data, key, words):
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    text = str(e.value)
    assert key in text and words in text, text  # the message naming the key is the contract
    assert e.value.reason == "invalid"


def test_toml_and_yaml_files(tmp_path):
    t = tmp_path / "c.toml"
    t.write_text('[primary]\nurl = "http://127.0.0.1:8000/v1"\n[sessions]\ntags = {agent = "a"}\n')
    cfg = load_config(t)
    assert cfg.primary.url == "http://127.0.0.1:8000" and cfg.sessions.tags == {"agent": "a"}
    bad = tmp_path / "bad.toml"
    bad.write_text("[primary\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert e.value.reason == "syntax"
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "missing.toml")
    assert e.value.reason == "unreadable"
    top = tmp_path / "list.yaml"
    top.write_text("- primary\n")
    with pytest.raises(ConfigError) as e:
        load_config(top)
    assert e.value.reason == "shape"
    y = tmp_path / "c.yaml"
    y.write_text("primary:\n  url: http://h:1\nshadow:\n  queue_size: 3\n")
    assert load_config(y).shadow.queue_size == 3


def test_cli_check(capsys, tmp_path):
    assert main(["proxy", "--config", str(EXAMPLE), "--check"]) == 0
    assert "ok" in capsys.readouterr().out
    bad = tmp_path / "b.toml"
    bad.write_text('[primary]\nurl = "http://x"\n[store]\npaht = "x"\n')
    assert main(["proxy", "--config", str(bad)]) == 2
    assert "store.paht: unknown key" in capsys.readouterr().err

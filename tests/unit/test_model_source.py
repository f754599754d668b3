"""The model path checks that run before anything loads (waferscale.models.source): no PyTorch, no model."""

from __future__ import annotations

import json

import pytest

from waferscale.models.source import ModelLoadError, model_source


def folder(tmp_path, config) -> str:
    if config is not None:
        (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, "has no config.json"),
        ("[1, 2]", "config.json is not a JSON object"),
        ("{not json", "config.json is not a JSON object"),
        ({"model_type": "gpt2"}, "unsupported architecture 'gpt2'"),
    ],
    ids=["no-config", "a-list", "not-json", "gpt2"],
)
def test_a_folder_the_server_cannot_serve_is_named_with_the_reason(tmp_path, config, expected):
    with pytest.raises(ModelLoadError, match=expected):
        model_source(folder(tmp_path, config))


@pytest.mark.parametrize("config", [{"model_type": "qwen2"}, {"architecture": "llama"}], ids=["hf", "converted"])
def test_a_hugging_face_folder_or_a_converted_one_passes(tmp_path, config):
    assert str(model_source(folder(tmp_path, config))) == str(tmp_path)


def test_a_gguf_file_passes_on_its_magic_and_anything_else_is_refused(tmp_path):
    good, bad = tmp_path / "m.gguf", tmp_path / "n.gguf"
    good.write_bytes(b"GGUF\x03\x00\x00\x00")
    bad.write_bytes(b"PK\x03\x04")
    assert model_source(good) == good
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        model_source(bad)

"""The model path checks that run before anything loads (waferscale.models.source): no PyTorch, no model."""

from __future__ import annotations

import hashlib
import json

import pytest

from waferscale.models import source
from waferscale.models.source import ChunkedModel, ModelLoadError, assemble_chunks, model_source


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


def chunk_files(tmp_path, parts: list[bytes]) -> list:
    paths = []
    for k, data in enumerate(parts):
        paths.append(tmp_path / f"m.gguf.part{k:02d}")
        paths[-1].write_bytes(data)
    return paths


def test_assembled_chunks_are_their_concatenation_checked_by_digest(tmp_path):
    parts = [b"GGUF\x03", b"\x00\x00", b"\x00rest"]
    target = tmp_path / "cache" / "m.gguf"
    got = assemble_chunks(chunk_files(tmp_path, parts), target, hashlib.sha256(b"".join(parts)).hexdigest())
    assert got == target and target.read_bytes() == b"".join(parts)
    assert [p.name for p in target.parent.iterdir()] == ["m.gguf"]


def test_an_assembled_file_is_reused_not_rewritten(tmp_path):
    parts = [b"GGUF", b"1234"]
    chunks, target = chunk_files(tmp_path, parts), tmp_path / "m.gguf"
    assemble_chunks(chunks, target, hashlib.sha256(b"GGUF1234").hexdigest())
    target.write_bytes(b"GGUFkept")  # same size: the cached file stands
    again = assemble_chunks(chunks, target, hashlib.sha256(b"GGUF1234").hexdigest())
    assert again.read_bytes() == b"GGUFkept"


def test_chunks_with_another_digest_leave_no_file_behind(tmp_path):
    target = tmp_path / "cache" / "m.gguf"
    with pytest.raises(ModelLoadError, match="sha256 is .* reinstall"):
        assemble_chunks(chunk_files(tmp_path, [b"GGUF", b"bad"]), target, "0" * 64)
    assert list(target.parent.iterdir()) == []


def test_a_missing_chunk_package_names_the_extra_to_install(monkeypatch):
    missing = ChunkedModel("x.gguf", ("waferscale_no_such_chunk_pkg",), ("data/x",), "0" * 64, "gemma3")
    monkeypatch.setitem(source.BUILTIN_MODELS, "x-model", missing)
    with pytest.raises(ModelLoadError, match=r"pip install 'waferscale\[gemma3\]'"):
        model_source("x-model")


def test_an_unknown_built_in_name_lists_the_known_ones():
    with pytest.raises(ModelLoadError, match="gemma-3-270m"):
        source.builtin_model_path("gemma-9")

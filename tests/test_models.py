"""Model loading: GGUF and Hugging Face folders, the llama/mistral/qwen2 code path, the conversion cache, errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest
import torch
from conftest import MODEL, Server, fresh_cache

from waferscale.engine import LLMEngine, SamplingParams
from waferscale.engine.kv_cache import KVPool, prefill_batch
from waferscale.models import ModelLoadError, load_model


def greedy(loaded, ids: list[int], n: int) -> list[int]:
    engine = LLMEngine(loaded)
    engine.add_request("t", ids, SamplingParams(max_tokens=n, temperature=0))
    out: list[int] = []
    while engine.has_work():
        for ev in engine.step():
            out += ev.token_ids
    return out


def our_logits(loaded, ids: list[int]) -> torch.Tensor:
    cfg = loaded.config
    blocks = len(ids) // 16 + 2
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype, blocks, 16)
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), prefill_batch(pool, len(ids)))
    return loaded.model.logits(hidden)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, hf_reference, hf_tokenizer):
    """A real Hugging Face folder (config.json, model.safetensors, tokenizer.json) of the built-in model."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("SmolLM2-HF")
    # save_pretrained refuses GGUF-loaded models, so write the folder's three parts directly
    state = {k: v.contiguous() for k, v in hf_reference.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(folder / "model.safetensors"))
    config = hf_reference.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    hf_tokenizer.save_pretrained(folder)
    return folder


def test_hf_folder_and_gguf_give_the_same_greedy_tokens(hf_folder):
    gguf = load_model(dtype="float32", progress=False)
    hf = load_model(hf_folder, dtype="float32", progress=False)
    assert hf.tokenizer.eos_token_ids == gguf.tokenizer.eos_token_ids == [2]
    assert hf.tokenizer.info.chat_template
    prompt = "The three primary colours are"
    ids = gguf.tokenizer.encode(prompt)
    assert hf.tokenizer.encode(prompt) == ids
    assert greedy(hf, ids, 12) == greedy(gguf, ids, 12)


def _tiny(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    if kind == "llama":  # explicit head_dim, llama3 rope scaling, untied head
        return LlamaConfig(
            **common,
            head_dim=32,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "mistral":
        return MistralConfig(**common, rope_theta=1e6, sliding_window=None)
    return Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)  # q/k/v biases, tied head


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_one_code_path_matches_transformers_per_architecture(kind, tmp_path, hf_folder):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _tiny(kind)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases so that a dropped bias would show
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_folder / f, tmp_path / f)
    ours = load_model(tmp_path, dtype="float32", progress=False)
    assert ours.config.architecture == kind
    ids = torch.randint(0, 49152, (40,)).tolist()
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    assert torch.allclose(our_logits(ours, ids), theirs, atol=1e-4, rtol=1e-4)


def test_converted_copy_is_cached_and_reused(tmp_path, monkeypatch):
    import waferscale.models.loader as loader

    monkeypatch.setenv("WAFERSCALE_CACHE_DIR", str(fresh_cache(tmp_path)))
    first = load_model(progress=False)
    assert list((tmp_path / "converted").glob("*/complete"))

    def no_conversion(*_a, **_k):
        raise AssertionError("the cached conversion should have been used")

    monkeypatch.setattr(loader, "read_gguf", no_conversion)
    second = load_model(progress=False)
    ids = first.tokenizer.encode("Hello there")
    assert greedy(second, ids, 4) == greedy(first, ids, 4)


def test_builtin_model_name_is_derived_from_the_file():
    assert load_model(progress=False).name == MODEL


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "waferscale", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_first_start_shows_progress_and_complete_prints_text(tmp_path):
    r = run_cli(
        "complete",
        "The capital of France is",
        "--max-tokens",
        "4",
        env={"WAFERSCALE_CACHE_DIR": str(fresh_cache(tmp_path))},
    )
    assert r.returncode == 0, r.stderr
    assert "converting SmolLM2-135M-Instruct.Q4_1.gguf" in r.stderr and "272/272" in r.stderr
    assert r.stdout.strip()


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: p / "missing.gguf", "does not exist"),
        (
            lambda p: (p / "junk.gguf").write_bytes(b"not a gguf at all") and p / "junk.gguf",
            "not a readable GGUF",
        ),
        (
            lambda p: (p / "config.json").write_text(json.dumps({"model_type": "gpt2"})) and p,
            "unsupported architecture",
        ),
        (
            lambda p: (p / "notes.txt").write_text("x") and p / "notes.txt",
            "not a GGUF file or a Hugging Face folder",
        ),
    ],
    ids=["missing", "corrupt-gguf", "unsupported-arch", "other-file"],
)
def test_bad_model_path_stops_with_one_clear_line(tmp_path, make, expected):
    path = make(tmp_path)
    r = run_cli("serve", "--model", str(path), "--port", "1")
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("waferscale: error:") and expected in lines[0], r.stderr


def test_a_bad_model_path_is_refused_before_pytorch_is_imported(tmp_path):
    """The path is checked first, so a typo costs a moment, not the seconds that importing PyTorch takes."""
    script = (
        "import sys\n"
        "from waferscale.cli import main\n"
        "try:\n"
        f"    main(['serve', '--model', {str(tmp_path / 'missing.gguf')!r}])\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, 'torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], r.stderr


def test_load_model_raises_model_load_error_for_bad_dtype():
    with pytest.raises(ModelLoadError):
        load_model(dtype="int3")


def test_serve_help_explains_each_option():
    out = run_cli("serve", "--help").stdout
    for option in (
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--dtype",
        "--quantization",
        "--max-model-len",
        "--api-key",
    ):
        assert option in out


@pytest.fixture(scope="module")
def short_server():
    s = Server("--max-model-len", "64")
    yield s
    s.stop()


def test_null_max_tokens_runs_to_the_context_limit(short_server):
    with httpx.Client(base_url=short_server.url, timeout=120) as http:
        body = {"model": MODEL, "prompt": "It was a dark and stormy night", "temperature": 0}
        out = http.post("/v1/completions", json={**body, "max_tokens": None, "min_tokens": -1}).json()
        assert out["usage"]["completion_tokens"] == 64 - 7
        assert out["choices"][0]["finish_reason"] == "length"
        out = http.post("/v1/completions", json={**body, "max_tokens": -1}).json()
        assert out["usage"]["completion_tokens"] <= 64 - 7
        r = http.post("/v1/completions", json={**body, "max_tokens": 58})
        assert r.status_code == 400 and "64" in r.json()["error"]["message"]


def test_max_model_len_beyond_the_model_is_refused():
    r = run_cli("serve", "--max-model-len", "100000", "--port", "1")
    assert r.returncode == 2 and "outside 1..8192" in r.stderr

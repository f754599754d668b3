"""One server, several models (`serve --models FILE`): a request's `model` picks its engine, models load on first
use within --memory-budget, the least recently used one is unloaded once its requests end. A real server over
loopback with the two built-in models and the official SDK; the budget holds one of them at a time."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from conftest import Server, cerebras_for

# a model's budget share is at least its GGUF on disk plus its KV cache (api/models_registry.estimate_bytes: SmolLM2
# 94 MiB + 256 MiB, Gemma 3 270M 241 MiB + 256 MiB), and what the process grew by loading it once loaded (measured:
# about 390 and 680 MiB); 800 MiB holds either, never both
MODELS_TOML = """
[[model]]
name = "small"
aliases = ["tiny"]
path = "smollm2-135m-instruct"
kv_cache_memory = "256MiB"
max_num_seqs = 4

[[model]]
name = "gemma"
path = "gemma-3-270m"
kv_cache_memory = "256MiB"
max_num_seqs = 4

[[model]]
name = "broken"
path = "no-such-model.gguf"
"""
PROMPT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "models.toml"
    path.write_text(MODELS_TOML)
    s = Server("--models", str(path), "--memory-budget", "800MiB", "--speculative", "none")
    yield s
    s.stop()


@pytest.fixture
def sdk(fleet):
    with cerebras_for(fleet.url) as client:
        yield client


def fingerprint(sdk, model: str) -> str:
    reply = sdk.chat.completions.create(model=model, messages=PROMPT, max_tokens=3, temperature=0)
    assert reply.model == model
    assert reply.choices[0].message.content
    return reply.system_fingerprint


def health(fleet) -> dict:
    return httpx.get(fleet.url + "/health").json()["models"]


def test_each_name_is_answered_by_its_own_model_loaded_on_demand(fleet, sdk):
    cold: list[str] = []  # two requests arrive while small loads: one load, both answered
    asking = [threading.Thread(target=lambda: cold.append(fingerprint(sdk, "small"))) for _ in range(2)]
    for t in asking:
        t.start()
    for t in asking:
        t.join(timeout=120)
    assert len(cold) == 2 and cold[0] == cold[1]
    assert fingerprint(sdk, "tiny") == cold[0]  # an alias picks the same engine
    assert (
        fingerprint(sdk, "gemma") != cold[0]
    )  # each model's weights and tokenizer stamp its own fingerprint
    state = health(fleet)
    assert (state["small"]["loads"], state["small"]["unloads"], state["small"]["state"]) == (1, 1, "unloaded")
    assert (state["gemma"]["loads"], state["gemma"]["state"]) == (1, "loaded")


def test_models_lists_every_configured_model_and_whether_it_is_loaded(fleet):
    body = httpx.get(fleet.url + "/v1/models").json()
    assert [m["id"] for m in body["data"]] == ["small", "tiny", "gemma", "broken"]
    for card in body["data"]:
        assert card["object"] == "model" and card["owned_by"] and isinstance(card["created"], int)
        assert isinstance(card["loaded"], bool)
    assert not next(m for m in body["data"] if m["id"] == "broken")["loaded"]


def test_metrics_are_labelled_by_model(fleet, sdk):
    fingerprint(sdk, "gemma")
    text = httpx.get(fleet.url + "/metrics").text
    assert 'waferscale_model_loaded{model="gemma"} 1.0' in text
    assert 'waferscale_model_loaded{model="small"} 0.0' in text
    assert 'waferscale_model_unloads_total{model="small"} 1.0' in text
    assert 'waferscale_generated_tokens_total{model="gemma"}' in text
    assert 'waferscale_kv_blocks_free{model="gemma"}' in text


def test_unknown_model_is_404_listing_the_served_names(sdk):
    from cerebras.cloud.sdk import NotFoundError

    with pytest.raises(NotFoundError) as info:
        sdk.chat.completions.create(model="no-such-model", messages=PROMPT, max_tokens=1)
    assert all(name in str(info.value) for name in ("small", "tiny", "gemma", "broken"))


def test_a_model_that_cannot_load_answers_with_its_error_while_the_others_serve(sdk):
    from cerebras.cloud.sdk import InternalServerError

    with pytest.raises(InternalServerError) as info:  # 503
        sdk.chat.completions.create(model="broken", messages=PROMPT, max_tokens=1)
    assert "no-such-model.gguf" in str(info.value) and "does not exist" in str(info.value)
    assert fingerprint(sdk, "gemma")


def test_budget_unloads_the_idle_model_after_its_stream_completes(fleet, sdk):
    fingerprint(sdk, "gemma")  # loaded; the budget has no room for small beside it
    stream = sdk.chat.completions.create(
        model="gemma",
        messages=PROMPT,
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"min_tokens": 16},
    )
    first = next(stream)  # gemma is serving this stream when small is asked for
    other: dict = {}
    asking = threading.Thread(target=lambda: other.update(fp=fingerprint(sdk, "small")))
    asking.start()
    chunks = [first, *stream]
    asking.join(timeout=120)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 12
    assert (
        chunks[-1].choices[0].finish_reason == "length"
    )  # the stream ran to its end, then gemma was unloaded
    assert other["fp"]  # and small, loaded again in its place, answered
    state = health(fleet)
    assert (state["gemma"]["state"], state["gemma"]["unloads"]) == ("unloaded", 1)
    assert (state["small"]["state"], state["small"]["loads"]) == ("loaded", 2)


def test_tokenize_uses_the_requested_models_tokenizer(fleet):
    body = httpx.post(
        fleet.url + "/v1/tokenize", json={"model": "tiny", "prompt": "Hello"}, timeout=120
    ).json()
    assert body["max_model_len"] == 8192  # SmolLM2's context (Gemma 3 270M's is 32768)
    assert body["count"] == len(body["tokens"]) > 0


def models_file_error(tmp_path, text: str) -> str:
    from waferscale.api.models_file import ModelsFileError, read_models_file
    from waferscale.engine.settings import EngineSettings

    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ModelsFileError) as info:
        read_models_file(path, EngineSettings())
    return str(info.value)


def test_models_file_unknown_option_is_refused_with_its_line(tmp_path):
    message = models_file_error(tmp_path, '[[model]]\nname = "a"\npath = "gemma-3-270m"\nkv_cache = "1GiB"\n')
    assert message.startswith(f"{tmp_path / 'models.toml'}:4: unknown option 'kv_cache'")


def test_models_file_duplicate_name_is_refused_with_its_line(tmp_path):
    text = '[[model]]\nname = "a"\npath = "gemma-3-270m"\n\n[[model]]\nname = "b"\naliases = ["a"]\npath = "x.gguf"\n'
    message = models_file_error(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'models.toml'}:7: duplicate model name 'a'")


def test_models_file_options_override_the_command_line_defaults(tmp_path):
    from waferscale.api.models_file import read_models_file
    from waferscale.engine.settings import EngineSettings

    path = tmp_path / "models.toml"
    path.write_text(
        '[[model]]\nname = "a"\npath = "gemma-3-270m"\nkv-cache-memory = "64MiB"\npinned = true\n'
    )
    (spec,) = read_models_file(path, EngineSettings(dtype="float32", max_num_seqs=7))
    assert (spec.name, spec.pinned, spec.settings.model) == ("a", True, "gemma-3-270m")
    assert spec.settings.kv_cache_memory == 64 << 20
    assert (spec.settings.dtype, spec.settings.max_num_seqs) == ("float32", 7)


def test_models_file_gives_a_model_its_own_draft_and_kv_cache_dtype(tmp_path):
    from waferscale.api.models_file import read_models_file
    from waferscale.engine.settings import EngineSettings

    (tmp_path / "drafts").mkdir()
    path = tmp_path / "models.toml"
    path.write_text(
        '[[model]]\nname = "a"\npath = "gemma-3-270m"\ndraft-model = "self:int4"\ndraft_kv_cache_memory = "32MiB"\n'
        'kv_cache_dtype = "int8"\n\n[[model]]\nname = "b"\npath = "smollm2-135m-instruct"\n'
        'draft_model = "drafts/small.gguf"\n\n[[model]]\nname = "c"\npath = "smollm2-135m-instruct"\n'
    )
    a, b, c = read_models_file(path, EngineSettings())
    assert (a.settings.speculative, a.settings.draft_model) == ("draft", "self:int4")  # as --draft-model does
    assert (a.settings.draft_kv_cache_memory, a.settings.kv_cache_dtype) == (32 << 20, "int8")
    assert b.settings.draft_model == str(tmp_path / "drafts" / "small.gguf")  # read from the file's folder
    assert (c.settings.speculative, c.settings.draft_model) == ("ngram", None)


def test_models_file_draft_with_speculation_off_is_refused_with_its_line(tmp_path):
    from waferscale.api.models_file import ModelsFileError, read_models_file
    from waferscale.engine.settings import EngineSettings

    path = tmp_path / "models.toml"
    path.write_text(
        '[[model]]\nname = "a"\npath = "gemma-3-270m"\ndraft_model = "self:int8"\nspeculative = "none"\n'
    )
    with pytest.raises(
        ModelsFileError, match=r"models.toml:1: model 'a': a draft-model is given but speculative"
    ):
        read_models_file(path, EngineSettings())


def test_serve_refuses_a_bad_models_file_at_start_with_its_line(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "models.toml"
    path.write_text('[[model]]\nname = "a"\npath = "gemma-3-270m"\nmax_num_seqs = "many"\n')
    out = subprocess.run(
        [sys.executable, "-m", "waferscale", "serve", "--models", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert f"waferscale: error: {path}:4: max_num_seqs = 'many' is not an integer" in out.stderr


def test_pinned_model_loads_at_start_and_shutdown_drains_every_model(tmp_path):
    import signal

    path = tmp_path / "models.toml"
    path.write_text(
        '[[model]]\nname = "small"\npath = "smollm2-135m-instruct"\nkv_cache_memory = "64MiB"\npinned = true\n\n'
        '[[model]]\nname = "gemma"\npath = "gemma-3-270m"\nkv_cache_memory = "64MiB"\n'
    )
    server = Server("--models", str(path), "--shutdown-grace", "5")
    try:
        deadline = time.time() + 120
        while (state := health(server)["small"]["state"]) != "loaded":  # nobody asked for it: pinned
            assert time.time() < deadline and state in ("unloaded", "loading")
            time.sleep(0.2)
        body = {"prompt": "Hello", "max_tokens": 2, "min_tokens": 2}
        assert httpx.post(
            server.url + "/v1/completions", json={**body, "model": "gemma"}, timeout=120
        ).is_success
        out: dict = {}

        def ask(model: str, tokens: int) -> threading.Thread:
            req = {**body, "model": model, "max_tokens": tokens, "min_tokens": tokens}
            t = threading.Thread(
                target=lambda: out.update(
                    {model: httpx.post(server.url + "/v1/completions", json=req, timeout=60)}
                )
            )
            t.start()
            return t

        def wait_until(ready) -> None:
            deadline = time.time() + 30
            while not ready():
                assert time.time() < deadline
                time.sleep(0.05)

        asking = [ask("gemma", 4000)]
        wait_until(lambda: health(server)["gemma"]["in_flight"] == 1)
        asking.append(ask("small", 2))
        wait_until(lambda: "small" in out or health(server)["small"]["in_flight"] == 1)
        server.proc.send_signal(signal.SIGTERM)
        for t in asking:
            t.join(60)
        assert out["small"].status_code == 200  # finished within the grace period
        assert out["gemma"].status_code == 503 and "shutting down" in out["gemma"].json()["error"]["message"]
        assert server.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        server.stop()


RAY_MODELS_TOML = """
[[model]]
name = "small"
aliases = ["tiny"]
path = "smollm2-135m-instruct"
kv_cache_memory = "128MiB"
max_num_seqs = 8

[[model]]
name = "gemma"
path = "gemma-3-270m"
kv_cache_memory = "128MiB"
max_num_seqs = 8
"""


@pytest.fixture(scope="module")
def ray_fleet(tmp_path_factory):
    """Both models on engine replicas (the `ray` extra): each its own deployment of one replica x 1 thread."""
    pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[ray]')")
    path = tmp_path_factory.mktemp("ray-models") / "models.toml"
    path.write_text(RAY_MODELS_TOML)
    s = Server("--models", str(path), "--replicas", "1", "--replica-threads", "1", "--speculative", "none")
    yield s
    s.stop(timeout=60)  # Serve drains and Ray stops its local cluster


@pytest.mark.ray
def test_under_replicas_each_name_is_answered_by_its_own_models_replicas(ray_fleet):
    with cerebras_for(ray_fleet.url) as sdk:
        small = fingerprint(sdk, "small")
        assert fingerprint(sdk, "tiny") == small
        assert fingerprint(sdk, "gemma") != small
    listed = httpx.get(ray_fleet.url + "/v1/models").json()["data"]
    assert [(m["id"], m["loaded"]) for m in listed] == [("small", True), ("tiny", True), ("gemma", True)]
    missing = httpx.post(ray_fleet.url + "/v1/chat/completions", json={"model": "nope", "messages": PROMPT})
    assert missing.status_code == 404 and "small, tiny, gemma" in missing.json()["message"]


@pytest.mark.ray
def test_under_replicas_interleaved_requests_to_both_models_are_all_answered(ray_fleet):
    replies: list[httpx.Response] = []

    def ask(model: str) -> None:
        body = {"model": model, "messages": PROMPT, "max_tokens": 8, "temperature": 0}
        replies.append(httpx.post(ray_fleet.url + "/v1/chat/completions", json=body, timeout=120))

    asking = [threading.Thread(target=ask, args=(("small", "gemma")[i % 2],)) for i in range(16)]
    for t in asking:
        t.start()
    for t in asking:
        t.join(timeout=180)
    assert len(replies) == 16 and all(r.status_code == 200 for r in replies)
    assert sorted(r.json()["model"] for r in replies) == ["gemma"] * 8 + ["small"] * 8


@pytest.mark.ray
def test_under_replicas_metrics_label_each_models_replicas(ray_fleet):
    with cerebras_for(ray_fleet.url) as sdk:
        fingerprint(sdk, "gemma")
    time.sleep(1.5)  # replicas post their stats every 0.5 s; the front reads them as often
    text = httpx.get(ray_fleet.url + "/metrics").text
    assert 'waferscale_replicas{model="small"} 1.0' in text and 'waferscale_replicas{model="gemma"} 1.0' in text
    assert 'waferscale_model_loaded{model="gemma"} 1.0' in text
    assert text.count('waferscale_replica_kv_cache_usage{model="gemma",replica=') == 1
    assert 'waferscale_generated_tokens_total{model="gemma"}' in text

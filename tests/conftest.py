"""Shared fixtures: real waferscale servers on loopback, started as subprocesses with the built-in model."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy
import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
ALIAS = "llama3.1-8b"
os.environ.setdefault("WAFERSCALE_CACHE_DIR", str(ROOT / ".cache" / "waferscale"))
os.environ.setdefault("WAFERSCALE_DATA_DIR", str(ROOT / ".cache" / "data"))  # files and batches of every server


def fresh_cache(tmp_path: Path) -> Path:
    """An empty model cache sharing the suite's compiled kernels (each build takes ~17 s, and is not what's tested)."""
    shared = Path(os.environ["WAFERSCALE_CACHE_DIR"]) / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels").symlink_to(shared)
    return tmp_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `waferscale serve` subprocess; `url` is its base URL (no /v1)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = ROOT / ".cache" / f"server-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "waferscale", "serve", "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not start:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 15) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


@pytest.fixture(scope="session")
def server():
    """The default server: built-in model, bfloat16, also served as llama3.1-8b, fault injection on."""
    s = Server("--served-model-name", ALIAS, "--enable-fault-injection")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def server_f32():
    """float32 server for numerics checked against transformers."""
    s = Server("--dtype", "float32")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def ray_server():
    """float32 on engine replicas: a local Ray cluster, 2 replicas x 1 thread behind the front (the `ray` extra)."""
    pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[ray]')")
    s = Server(
        "--replicas", "2", "--replica-threads", "1", "--dtype", "float32", "--served-model-name", ALIAS,
        "--enable-fault-injection", "--shutdown-grace", "5",
    )  # fmt: skip
    yield s
    s.stop(timeout=60)  # Serve drains and Ray stops its local cluster: give it the time rather than kill it


_GGUF_READERS: dict = {}


class _PlainMaps:
    """numpy for gguf's reader, whose file mapping is taken as a plain ndarray: the same mapped bytes, without
    np.memmap's Python-level indexing, which it calls for each of a 262k-word vocabulary's strings (15 s of 18)."""

    def __getattr__(self, name: str):
        return getattr(numpy, name)

    @staticmethod
    def memmap(path, mode: str = "r") -> numpy.ndarray:
        return numpy.memmap(path, mode=mode).view(numpy.ndarray)


@contextlib.contextmanager
def reused_gguf_parsing():
    """While transformers loads a GGUF (the built-in's, Gemma 3's): one gguf.GGUFReader per file for the session, and one tensor-name
    map per load. transformers parses the file anew for the config, the weights and the tokenizer (3-6 s each on
    the 2-core machine) and rebuilds gguf's name map for each of its 397 tensors (7 s); the same library code still
    reads the same bytes, once."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in _GGUF_READERS:
            module = gguf.gguf_reader
            module.np = _PlainMaps()
            try:
                _GGUF_READERS[key] = real_reader(path, *args, **kwargs)
            finally:
                module.np = numpy
        return _GGUF_READERS[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


@pytest.fixture(scope="session")
def hf_tokenizer():
    """The reference tokenizer (transformers, from the same GGUF), for token-id prompts in tests."""
    from transformers import AutoTokenizer

    from waferscale.models import builtin_model_path

    path = builtin_model_path()
    with reused_gguf_parsing():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M GGUF (the gemma3 extra, which `make install` installs), assembled in the test cache."""
    from waferscale.models.source import builtin_model_path

    return builtin_model_path("gemma-3-270m")


@pytest.fixture(scope="session")
def gemma_tokenizers(gemma3_gguf):
    """(ours, transformers') for the real Gemma 3 GGUF. transformers' GemmaTokenizer is the class AutoTokenizer
    picks for this file; taken directly, it skips parsing the whole file again for the config (seconds)."""
    from transformers import GemmaTokenizer

    from waferscale.models.gguf_file import read_gguf_file
    from waferscale.models.tokenizer import ModelTokenizer

    ours = ModelTokenizer.from_gguf_metadata(read_gguf_file(gemma3_gguf).metadata)
    with reused_gguf_parsing():
        theirs = GemmaTokenizer.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name)
    return ours, theirs


@pytest.fixture(scope="session")
def hf_reference():
    """The reference model: transformers' float32 load of the same GGUF file. It runs on one thread: the tests'
    servers share the machine's cores, and an OpenMP team that loses a core to them stalls at every barrier (a
    24-token reference took 22 s on two threads on a busy 2-core machine, 8 s on one)."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from waferscale.models import builtin_model_path

    path = builtin_model_path()
    with reused_gguf_parsing():
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()


@pytest.fixture(scope="session")
def engine():
    """An in-process float32 engine (64 MiB KV pool) for tests that look inside it."""
    from waferscale.engine import LLMEngine
    from waferscale.models import load_model

    return LLMEngine(load_model(None, dtype="float32", progress=False), kv_cache_bytes=64 << 20)


def run_to_end(engine) -> tuple[dict, dict]:
    """Step the engine until idle; the text and the finished event of every request."""
    texts, finished = {}, {}
    while engine.has_work():
        for ev in engine.step():
            texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
            if ev.finished:
                finished[ev.request_id] = ev
    return texts, finished


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture
def http_f32(server_f32):
    with httpx.Client(base_url=server_f32.url, timeout=120) as client:
        yield client


def cerebras_for(url: str):
    """The official Cerebras SDK pointed at url, strict response validation on, no retries."""
    from cerebras.cloud.sdk import Cerebras

    return Cerebras(api_key="unused", base_url=url, max_retries=0, _strict_response_validation=True)


def openai_for(url: str):
    """The OpenAI SDK pointed at url's /v1, no retries."""
    from openai import OpenAI

    return OpenAI(api_key="unused", base_url=url + "/v1", max_retries=0)


@pytest.fixture
def cerebras(server):
    with cerebras_for(server.url) as client:
        yield client


@pytest.fixture
def openai_client(server):
    with openai_for(server.url) as client:
        yield client


# Tests that compare the answers of two requests for the same prompt use the float32 server: the second one finds the
# prompt in the prefix cache and computes only its tail, and in bfloat16 that rounds otherwise than computing the
# prompt whole (docs/api.md, "Repeatable answers"), enough to flip a near tie between two tokens.


@pytest.fixture
def cerebras_f32(server_f32):
    with cerebras_for(server_f32.url) as client:
        yield client

def complete(http: httpx.Client, **body):
    """POST /v1/completions with the built-in model's name unless given; return the parsed JSON (asserting 200)."""
    body.setdefault("model", MODEL)
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(http: httpx.Client, path: str = "/v1/completions", **body) -> list:
    """The `data:` payloads of a streamed request to `path`, [DONE] included as the string."""
    import json

    body.setdefault("model", MODEL)
    body["stream"] = True
    out = []
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def pytest_collection_modifyitems(config, items):
    """Tests marked `ray` run last, together: the local Ray cluster they share lives until the session ends, and
    even idle its actors take a third of a core, which would slow every test after the first Ray one."""
    items.sort(key=lambda item: item.get_closest_marker("ray") is not None)  # stable: file order otherwise

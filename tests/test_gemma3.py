"""The real Gemma 3 270M (the gemma3 extra): at float32 its greedy tokens equal transformers' on text prompts (our
tokenizer, its 512-token sliding window and all), and a server started with `--model gemma-3-270m` answers
completions and chat (its default Gemma turn template) through the official SDKs."""

from __future__ import annotations

import pytest
import torch
from conftest import Server, cerebras_for, openai_for, reused_gguf_parsing

NEW_TOKENS = 12
PROMPTS = {
    "short": "The capital of France is",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    # longer than the 512-token window of the local layers
    "long": " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} apples." for i in range(60))
    + "\nQuestion: what does item 5 hold?\nAnswer:",
}


@pytest.fixture(scope="module")
def gemma_pair(gemma3_gguf):
    """(transformers' float32 load of the GGUF, ours at float32 with every weight dequantized)."""
    from transformers import AutoModelForCausalLM

    from waferscale.models import load_model

    ours = load_model("gemma-3-270m", dtype="float32", quantization="none", progress=False)
    with reused_gguf_parsing():  # its 262k-token vocabulary makes each parse of the file cost ~15 s
        ref = AutoModelForCausalLM.from_pretrained(
            str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name, dtype=torch.float32
        ).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # for this module's comparisons only: later tests keep every core
    yield ref, ours
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_tokens_match_transformers_on_text(gemma_pair, gemma_tokenizers, name):
    from waferscale.engine import LLMEngine, SamplingParams

    ref, ours = gemma_pair
    _, theirs_tok = gemma_tokenizers
    ids = ours.tokenizer.encode(PROMPTS[name])
    assert ids == theirs_tok(PROMPTS[name])["input_ids"]
    if name == "long":
        assert len(ids) > 600
    engine = LLMEngine(ours, kv_cache_bytes=64 << 20)
    engine.add_request("g", ids, SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0))
    got: list[int] = []
    while engine.has_work():
        for ev in engine.step():
            got += ev.token_ids
    with torch.no_grad():
        gen = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=0)
    assert got == gen[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def gemma_server(gemma3_gguf):
    server = Server("--model", "gemma-3-270m", "--kv-cache-memory", "256MiB")
    yield server
    server.stop()


def test_the_server_serves_it_under_its_built_in_name(gemma_server):
    models = [m.id for m in openai_for(gemma_server.url).models.list().data]
    assert models == ["gemma-3-270m"]


def test_a_completion_through_the_cerebras_sdk(gemma_server):
    out = cerebras_for(gemma_server.url).completions.create(
        model="gemma-3-270m", prompt="1, 2, 3, 4, 5, 6,", max_tokens=6, temperature=0
    )
    assert out.choices[0].text.startswith(" 7, 8")
    assert out.usage.completion_tokens == 6


def test_a_chat_through_the_openai_sdk_uses_gemma_turns_and_ends_its_turn(gemma_server):
    chat = openai_for(gemma_server.url).chat.completions.create(
        model="gemma-3-270m",
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hello."}],
        max_completion_tokens=40,
        temperature=0,
    )
    choice = chat.choices[0]
    assert choice.message.content and "<end_of_turn>" not in choice.message.content
    assert chat.usage.prompt_tokens > 8

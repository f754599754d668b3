"""Speculative decoding by a draft model (`--draft-model`): the built-in model's own weights again at int4
(`self:int4`) propose, the float32 target verifies; the output is exactly the output without speculation, and a
draft with another tokenizer is refused at start."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import MODEL, Server, free_port, openai_for

PROMPTS = [
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName three uses of copper and explain one.<|im_end|>\n<|im_start|>assistant\n",
]


def _settings(*argv: str):
    """The engine settings of a `waferscale serve` command line."""
    from waferscale.cli import build_parser
    from waferscale.engine.settings import settings_from_args

    args = build_parser().parse_args(["serve", *argv])
    args.model = None  # as cli.main leaves a single --model
    return settings_from_args(args)


def test_a_draft_model_means_draft_speculation_unless_told_otherwise():
    settings = _settings("--draft-model", "self:int4", "--draft-kv-cache-memory", "64MiB")
    assert (settings.speculative, settings.draft_model, settings.draft_kv_cache_memory) == (
        "draft",
        "self:int4",
        64 << 20,
    )
    assert _settings().speculative == "ngram" and _settings().draft_model is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--speculative", "ngram", "--draft-model", "self:int4"],
            "a draft-model is given but speculative is ngram",
        ),
        (["--speculative", "draft"], "speculative draft needs a draft-model"),
        (["--draft-model", "self:q8"], "choose self:int4 or self:int8"),
    ],
)
def test_inconsistent_draft_options_are_refused(argv, message):
    from waferscale.engine.settings import SettingsError

    with pytest.raises(SettingsError, match=message):
        _settings(*argv)


@pytest.fixture(scope="module")
def servers():
    """(without speculation, with the self:int4 draft), both float32, one after the other: the draft server times
    its steps and its draft at start, and whether drafts pay follows from those times."""
    started = [Server("--dtype", "float32", "--speculative", "none")]
    started.append(Server("--dtype", "float32", "--draft-model", "self:int4"))
    yield started
    for s in started:
        s.stop()


def _tokens(url: str, prompt: str, **params) -> tuple[list[int], str]:
    with openai_for(url) as client:
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=32, extra_body={"return_raw_tokens": True}, **params
        )
    return r.choices[0].model_extra["tokens"], r.choices[0].text


def _accepted(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("waferscale_speculative_accepted_tokens"):
            return float(line.split()[-1])
    raise AssertionError("waferscale_speculative_accepted_tokens not in /metrics")


def test_greedy_output_is_token_for_token_the_output_without_speculation(servers):
    plain, draft = servers
    before = _accepted(draft.url)
    expected = [_tokens(plain.url, p, temperature=0)[0] for p in PROMPTS]
    with ThreadPoolExecutor(
        2
    ) as pool:  # decoding together: the draft proposes for both in one forward a position
        got = list(pool.map(lambda p: _tokens(draft.url, p, temperature=0)[0], PROMPTS))
    assert got == expected and min(len(t) for t in expected) > 20
    assert _accepted(draft.url) > before + 20  # the draft's tokens were verified and mostly accepted
    assert _accepted(plain.url) == 0


def test_a_seeded_sample_is_the_same_text_with_the_draft(servers):
    plain, draft = servers
    params = dict(temperature=0.9, seed=11)
    assert _tokens(draft.url, PROMPTS[0], **params)[1] == _tokens(plain.url, PROMPTS[0], **params)[1]


def test_a_sequence_the_draft_pool_cannot_hold_decodes_without_drafts_and_blocks_are_freed():
    from waferscale.engine import LLMEngine, SamplingParams
    from waferscale.engine.build import _load_draft
    from waferscale.engine.settings import EngineSettings
    from waferscale.engine.speculation import SpeculativeConfig
    from waferscale.models import load_model

    target = load_model(None, dtype="float32", progress=False)
    draft = _load_draft(EngineSettings(dtype="float32", speculative="draft", draft_model="self:int4"), target)
    cfg = draft.config
    block = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * 16  # float32, 16 tokens
    params = SamplingParams(max_tokens=12, temperature=0)

    def run(engine: LLMEngine) -> tuple[list[list[int]], int]:
        """Outputs, and the most sequences holding draft blocks at once."""
        out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), target.tokenizer.encode(prompt), params)
        most = 0
        while engine.has_work():
            for ev in engine.step():
                out[ev.request_id] += ev.token_ids
            most = max(
                most, sum(1 for s in engine.running if s.draft is not None and any(s.draft.block_tables))
            )
        return list(out.values()), most

    expected, _ = run(LLMEngine(target, kv_cache_bytes=32 << 20))
    # room for one sequence of 17 prompt tokens, 12 generated and drafts (3 blocks and the null page), not two
    engine = LLMEngine(
        target, kv_cache_bytes=32 << 20, speculative=SpeculativeConfig("draft"), draft=draft,
        draft_kv_cache_bytes=4 * block,
    )  # fmt: skip
    outputs, most = run(engine)
    assert outputs == expected and most == 1 and engine.stats().speculative_accepted_tokens > 0
    assert (
        engine.drafter.blocks.num_used == 0 and not engine.drafter.tracked
    )  # freed as the sequences finished


def test_a_few_tokens_after_a_computed_prefix_run_as_decode_rows_with_the_prefill_paths_numbers():
    """The draft catches up the tokens the target accepted as decode rows (ModelRunner rows_upto): its next token
    and logits are those of the same tokens run as a prefill chunk."""
    import torch

    from waferscale.engine import LLMEngine
    from waferscale.engine.model_runner import ModelRunner
    from waferscale.engine.params import SamplingParams
    from waferscale.engine.scheduler import ScheduledBatch
    from waferscale.engine.sequence import Sequence
    from waferscale.models import load_model

    loaded = load_model(None, dtype="float32", progress=False)
    engine = LLMEngine(loaded, kv_cache_bytes=32 << 20)
    chunked = engine.runner
    as_rows = ModelRunner(loaded.model, engine.pool, chunked.native, engine.blocks, rows_upto=4)
    seq = Sequence("s", loaded.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=4), detokenizer=None)
    seq.block_tables = [[engine.blocks.allocate(k) for _ in range(4)] for k in range(len(engine.blocks.kinds))]
    seq.dropped = [0] * len(seq.block_tables)
    head = len(seq.token_ids) - 3
    with torch.inference_mode():
        chunked.forward(ScheduledBatch(prefills=[(seq, head)]))
        seq.num_computed = head
        by_rows = as_rows.forward(ScheduledBatch(prefills=[(seq, 3)]))
        by_chunk = chunked.forward(ScheduledBatch(prefills=[(seq, 3)]))
        assert by_rows.sample_rows == by_chunk.sample_rows == [(seq, 2)]  # the chunk's last row
        rows = loaded.model.logits(by_rows.hidden[[2]])
        chunk = loaded.model.logits(by_chunk.hidden[[2]])
    assert torch.argmax(rows) == torch.argmax(chunk) and (rows - chunk).abs().max() < 1e-3


def test_a_draft_with_another_tokenizer_is_refused_at_start(tmp_path: Path):
    folder = _tiny_model_of_seven_words(tmp_path / "seven-words")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "waferscale",
            "serve",
            "--port",
            str(free_port()),
            "--draft-model",
            str(folder),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()[-1]
    assert "another tokenizer" in error and "7 tokens against the target's 49152" in error
    assert "--draft-model a model with the same tokenizer" in error


def _tiny_model_of_seven_words(folder: Path) -> Path:
    """A 1-layer Llama folder whose tokenizer knows 7 words (transformers makes it here)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "hello", "world", "the", "sea"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)
    cfg = LlamaConfig(
        vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder

"""Speculative decoding by n-gram lookup: drafts from a sequence's own prompt and output, verified in one forward;
the output is exactly the output without speculation (float32: tokens, logprobs, seeded samples)."""

from __future__ import annotations

import httpx
import pytest
from conftest import MODEL

from waferscale.engine import LLMEngine, SamplingParams
from waferscale.engine.speculation import NgramState, SpeculativeConfig

DOC = (
    "The committee met on Tuesday to review the budget. The chair noted that spending on roads rose by twelve "
    "percent, while spending on parks fell by three percent. Members asked for a full report by Friday."
)
GROUNDED = f"<|im_start|>user\nRepeat the following text exactly:\n{DOC}<|im_end|>\n<|im_start|>assistant\n"


def test_the_longest_earlier_suffix_proposes_what_followed_it():
    state = NgramState()
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3, 4]
    assert state.propose(tokens, 3) == [5, 9, 9]  # [2, 3, 4] occurred before, followed by 5, 9, 9


def test_the_latest_occurrence_wins_and_nothing_is_proposed_without_one():
    state = NgramState()
    assert state.propose([7, 8, 1, 7, 8, 2, 7, 8], 1) == [2]
    assert NgramState().propose([1, 2, 3, 4], 4) == []


def test_drafts_grow_after_full_acceptance_and_pause_after_misses():
    state = NgramState(k=4)
    state.update(proposed=4, accepted=4, max_k=8)
    assert state.k == 8
    state.update(proposed=8, accepted=2, max_k=8)
    assert state.k == 3
    state.update(proposed=3, accepted=0, max_k=8)
    state.update(proposed=1, accepted=0, max_k=8)
    assert state.pause == 4 and state.propose([1, 2, 1, 2], 4) == []  # paused: nothing proposed
    assert state.pause == 3


def test_drafts_stop_at_the_first_token_the_grammar_forbids():
    from types import SimpleNamespace

    from waferscale.engine.drafts import draft_tokens

    class AllowsTwo:  # llguidance's LLMatcher.validate_tokens: how many of the tokens the grammar would commit
        def validate_tokens(self, tokens: list[int]) -> int:
            return min(2, len(tokens))

    def seq(matcher):
        params = SimpleNamespace(prediction=None, max_tokens=100)
        tokens = [5, 6, 7, 8, 9, 5, 6, 7]  # [5, 6, 7] occurred before, followed by 8, 9, 5, 6, 7
        return SimpleNamespace(params=params, num_generated=0, token_ids=tokens, ngram=None, draft=None,
                               matcher=matcher)  # fmt: skip

    config = SpeculativeConfig(method="ngram", max_draft=4)
    assert draft_tokens(seq(None), 8, 1000, config, True) == [8, 9, 5, 6]
    assert draft_tokens(seq(AllowsTwo()), 8, 1000, config, True) == [8, 9]


def test_an_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'"):
        SpeculativeConfig("medusa")


@pytest.fixture(scope="module")
def loaded():
    from waferscale.models import load_model

    return load_model(None, dtype="float32", progress=False)


def _generate(loaded, method: str, params: SamplingParams, prompt: str = GROUNDED):
    engine = LLMEngine(loaded, kv_cache_bytes=32 << 20, speculative=SpeculativeConfig(method))
    engine.add_request("r", loaded.tokenizer.encode(prompt), params)
    tokens, logprobs, steps = [], [], 0
    while engine.has_work():
        steps += 1
        for ev in engine.step():
            tokens += ev.token_ids
            logprobs += [lp.logprob for lp in ev.logprobs]
    return tokens, logprobs, steps, engine.stats()


def test_the_engine_times_its_steps_by_rows_once_and_gives_their_blocks_back(loaded):
    from waferscale.engine.row_costs import measure_row_costs, row_sizes

    engine = LLMEngine(loaded, kv_cache_bytes=32 << 20, speculative=SpeculativeConfig("ngram", max_draft=8))
    costs = engine.scheduler.row_costs
    assert sorted(costs.seconds) == row_sizes(8, 4) and min(costs.seconds.values()) > 0
    again = LLMEngine(loaded, kv_cache_bytes=32 << 20, speculative=SpeculativeConfig("ngram", max_draft=8))
    assert again.scheduler.row_costs is costs  # measured once a process: drafts never follow the moment's timing
    free = engine.blocks.num_available
    measure_row_costs(engine.runner, engine.blocks, engine.runner.logits, [1, 3], 0)
    assert engine.blocks.num_available == free
    assert LLMEngine(loaded, kv_cache_bytes=32 << 20).scheduler.row_costs is None  # speculation off: nothing timed


def test_greedy_output_and_logprobs_are_those_without_speculation_in_fewer_steps(loaded):
    params = SamplingParams(max_tokens=48, temperature=0, logprobs=0)
    off, off_lp, off_steps, _ = _generate(loaded, "none", params)
    on, on_lp, on_steps, stats = _generate(loaded, "ngram", params)
    assert on == off and len(on) > 20
    assert max(abs(a - b) for a, b in zip(on_lp, off_lp)) < 1e-5
    assert stats.speculative_accepted_tokens > 10 and on_steps < off_steps * 0.7


def test_a_seeded_sample_is_the_same_text_with_speculation(loaded):
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=11)
    assert _generate(loaded, "ngram", params)[0] == _generate(loaded, "none", params)[0]


def test_a_stop_string_inside_accepted_drafts_ends_the_output_there(loaded):
    params = SamplingParams(max_tokens=48, temperature=0, stop=["roads"])
    off, on = _generate(loaded, "none", params)[0], _generate(loaded, "ngram", params)[0]
    assert on == off and loaded.tokenizer.decode(on).endswith(
        "roads"
    )  # the token reaching the stop is the last


def test_a_draft_forward_is_timed_in_turns_with_the_targets_one_row_step_and_their_blocks_are_given_back(loaded):
    from waferscale.engine.row_costs import DRAFT_ROUNDS, draft_cost_ratio

    target, draft = LLMEngine(loaded, kv_cache_bytes=32 << 20), LLMEngine(loaded, kv_cache_bytes=16 << 20)
    order: list[str] = []
    for name, engine in (("target", target), ("draft", draft)):
        forward = engine.runner.forward
        engine.runner.forward = lambda batch, interrupt=None, f=forward, n=name: order.append(n) or f(batch, interrupt)
    free = (target.blocks.num_available, draft.blocks.num_available)
    ratio = draft_cost_ratio(
        (target.runner, target.blocks, target.runner.logits), (draft.runner, draft.blocks, draft.runner.logits), 0
    )
    assert order == ["target", "draft"] * DRAFT_ROUNDS  # a busy stretch slows both sides, not one
    assert (target.blocks.num_available, draft.blocks.num_available) == free
    assert 0.5 < ratio < 2  # the same model on both sides


def test_the_server_speculates_by_default_and_reports_it_in_metrics(http):
    body = {"model": MODEL, "prompt": GROUNDED, "max_tokens": 40, "temperature": 0}
    before = _counter(http, "waferscale_speculative_accepted_tokens")
    assert http.post("/v1/completions", json=body).status_code == 200
    assert _counter(http, "waferscale_speculative_accepted_tokens") > before


def _counter(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")

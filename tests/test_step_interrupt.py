"""A step of batch work alone stops between layers when an interactive request arrives (AsyncEngine sets
`interactive_arrived`), so the request waits for one layer, not a whole step; the stopped step commits nothing and
is run again, so batch answers are the same as if it had never stopped."""

from __future__ import annotations

from conftest import run_to_end

from waferscale.engine.params import BATCH_PRIORITY, SamplingParams

PROMPTS = ["The sea is", "Once upon a", "def add(a, b):", "Colours of the rainbow:"]  # < one block: nothing cached


def batch_params() -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0, priority=BATCH_PRIORITY)


def add_all(engine, tag: str, params: SamplingParams) -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", engine.tokenizer.encode(prompt), params)


def test_batch_steps_stopped_midway_give_the_same_answers(engine):
    add_all(engine, "ref", batch_params())
    reference, _ = run_to_end(engine)
    forwards = []

    def arrive_midway(*_):  # every other forward reaches layer 10, then an "arrival" stops it
        forwards.append(1)
        if len(forwards) % 2 == 1 and len(forwards) < 12:
            engine.interactive_arrived.set()

    before = engine.interrupted_steps
    hook = engine.model.layers[10].register_forward_pre_hook(arrive_midway)
    try:
        add_all(engine, "cut", batch_params())
        texts, finished = {}, {}
        while engine.has_work():
            for ev in engine.step():
                texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
                finished[ev.request_id] = ev
            engine.interactive_arrived.clear()  # AsyncEngine's part: the arrival is taken in with the next commands
    finally:
        hook.remove()
    assert engine.interrupted_steps - before == 6
    assert engine.stats().interrupted_steps == engine.interrupted_steps
    for i in range(len(PROMPTS)):
        assert texts[f"cut{i}"] == reference[f"ref{i}"]
        assert finished[f"cut{i}"].num_generated_tokens == 12


def test_a_step_with_interactive_work_is_never_stopped(engine):
    before = engine.interrupted_steps
    engine.add_request("chat", engine.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=4, temperature=0))
    engine.add_request("batch", engine.tokenizer.encode(PROMPTS[1]), batch_params())
    engine.interactive_arrived.set()  # and never cleared while the chat request runs
    chat = []
    try:
        while not chat:
            chat += [ev for ev in engine.step() if ev.request_id == "chat" and ev.finished]
    finally:
        engine.interactive_arrived.clear()
    assert chat[0].num_generated_tokens == 4
    assert engine.interrupted_steps == before  # every step beside it ran whole
    _, finished = run_to_end(engine)
    assert finished["batch"].num_generated_tokens == 12

import pytest

from kvabi.engine.llm import LLM
from kvabi.engine.sampling_params import SamplingParams
from tests.engine.tiny import tiny_loaded


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.from_loaded(tiny_loaded(), fingerprint="tiny", block_size=4)


def test_generate_keeps_prompt_order_and_accepts_text_or_ids(llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(["abc", [5, 6, 7, 8], "hello there"], params)
    assert [o.prompt_token_ids for o in outs] == [
        tuple(llm.tokenizer.encode("abc")),
        (5, 6, 7, 8),
        tuple(llm.tokenizer.encode("hello there")),
    ]
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


def test_stream_yields_the_same_text_and_tokens_as_generate(llm):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, n=2)
    whole = llm.generate(["stream me"], params)[0]
    pieces: dict[int, list] = {0: [], 1: []}
    finish = {}
    for delta in llm.stream("stream me", params):
        pieces[delta.index].append(delta)
        if delta.finish_reason:
            finish[delta.index] = delta.finish_reason
    for c in whole.outputs:
        assert "".join(d.text for d in pieces[c.index]) == c.text
        assert sum((d.token_ids for d in pieces[c.index]), ()) == c.token_ids
        assert finish[c.index] == "length"
    assert len(pieces[0]) > 1  # streamed, not delivered at the end
    assert not llm.engine.has_unfinished()


def test_stream_reports_each_finish_once_and_never_text_a_stop_string_cuts(llm):
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    text = llm.generate(["cut here"], free)[0].outputs[0].text
    stop = text[4:7]  # appears in the greedy output: the engine cuts the text before it
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], n=2)
    whole = llm.generate(["cut here"], params)[0]
    deltas = list(llm.stream("cut here", params))
    for c in whole.outputs:
        mine = [d for d in deltas if d.index == c.index]
        assert "".join(d.text for d in mine) == c.text == text[: text.find(stop)]
        assert [d.finish_reason for d in mine if d.finish_reason] == ["stop"]


def test_a_bad_prompt_among_good_ones_starts_no_work(llm):
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


def test_abandoned_stream_aborts_its_request(llm):
    stream = llm.stream("abandon", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.cache.pool.num_free == llm.engine.cache.pool.num_blocks

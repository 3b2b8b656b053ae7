"""The engine's deltas: new text per choice, unsettled text held back, each finish reported once;
joined again (`OutputBuffer`), they are the whole output, whose text is the plain full decode."""

from __future__ import annotations

from kvabi.engine.detokenizer import Detokenizer
from kvabi.engine.outputs import CompletionOutput, OutputBuffer, RequestOutput, request_delta
from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.sequence import SeqStatus, Sequence
from tests.engine.tiny import run_all, tiny_engine, tiny_tokenizer


def _seqs(n: int = 1, stop: tuple[str, ...] = ()) -> list[Sequence]:
    params = SamplingParams(stop=stop, n=n)
    return [Sequence(i, "r", i, (1, 2), params, arrival=i) for i in range(n)]


def _produce(seq: Sequence, text: str, num_tokens: int = 1, finish: str | None = None) -> None:
    """What an engine step does to a sequence: new tokens, the text they settled, a finish."""
    seq.output_ids += range(len(seq.output_ids), len(seq.output_ids) + num_tokens)
    seq.text += text
    if finish:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, finish


def _delta(seqs: list[Sequence]) -> list[tuple[int, str, int, str | None]]:
    out = request_delta("r", seqs)
    return [(d.index, d.text, len(d.token_ids), d.finish_reason) for d in out.outputs]


def test_a_half_decoded_character_waits_for_its_other_bytes():
    tokenizer, detok, (seq,) = tiny_tokenizer(), Detokenizer(), _seqs()
    steps = []
    for token in tokenizer.encode("abé"):  # "é" is two byte tokens
        _produce(seq, detok.add(tokenizer, token))
        steps.append(_delta([seq]))
    assert steps == [[(0, "a", 1, None)], [(0, "b", 1, None)], [(0, "", 1, None)]] + [
        [(0, "é", 1, None)]
    ]


def test_text_that_may_start_a_stop_string_is_held_until_it_cannot():
    (seq,) = seqs = _seqs(stop=("xyz", "q"))
    steps = []
    for text, num_tokens, finish in [("hello x", 7, None), ("y", 1, None), ("a", 1, None)] + [
        ("", 1, "length")
    ]:
        _produce(seq, text, num_tokens, finish)
        steps.append(_delta(seqs))
    assert steps == [
        [(0, "hello", 7, None)],  # "x" and the space before could begin "xyz": held (2 chars)
        [(0, " ", 1, None)],
        [(0, "x", 1, None)],  # not "xyz" after all
        [(0, "ya", 1, "length")],  # finished: the rest goes out
    ]


def test_each_choice_is_tracked_alone_and_finishes_once():
    a, b = seqs = _seqs(n=2)
    steps = []
    for (ta, fa), (tb, fb) in [(("a", None), ("b", None)), (("!", "stop"), ("b", None))]:
        _produce(a, ta, finish=fa)
        _produce(b, tb, finish=fb)
        steps.append(_delta(seqs))
    _produce(b, "b", finish="length")
    steps.append(_delta(seqs))
    assert steps == [
        [(0, "a", 1, None), (1, "b", 1, None)],
        [(0, "!", 1, "stop"), (1, "b", 1, None)],
        [(1, "b", 1, "length")],  # choice 0 is not repeated
    ]
    assert request_delta("r", seqs).finished


def test_a_step_without_new_tokens_gives_no_delta():
    (seq,) = seqs = _seqs()
    _produce(seq, "a")
    assert _delta(seqs) == [(0, "a", 1, None)] and _delta(seqs) == []


def _out(*choices: tuple[int, str, int, str | None]) -> RequestOutput:
    outputs = tuple(
        CompletionOutput(i, text, tuple(range(n)), None, finish) for i, text, n, finish in choices
    )
    return RequestOutput("r", (1, 2), outputs, all(c.finish_reason for c in outputs))


def test_the_buffer_joins_each_choice_and_takes_what_came_since_the_last_take():
    buffer = OutputBuffer()
    buffer.add(_out((1, "x", 1, None), (0, "ab", 2, None)))
    buffer.add(_out((0, "c", 1, "stop")))
    taken = buffer.take()
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in taken.outputs] == [
        (0, "abc", (0, 1, 0), "stop"),
        (1, "x", (0,), None),
    ]
    buffer.add(_out((1, "yz", 2, "length")))
    assert buffer.take().outputs == (CompletionOutput(1, "yz", (0, 1), None, "length"),)
    assert buffer.is_finished


def test_whole_text_is_the_full_decode_of_sampled_bytes():
    # Random bytes: half characters, invalid UTF-8 and EOS (its text is left out) anywhere.
    engine = tiny_engine(block_size=4)
    tokenizer = engine.tokenizer
    for seed in range(4):
        params = SamplingParams(max_tokens=40, temperature=1.5, seed=seed, n=3, logprobs=1)
        (out,) = run_all(engine, [[5, 6, 7]], params)
        for c in out.outputs:
            ids = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
            assert c.text == tokenizer.decode(ids, skip_special_tokens=True)
            assert len(c.logprobs) == len(c.token_ids)

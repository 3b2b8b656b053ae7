"""DeltaTracker: new text per choice, unsettled text held back, each finish reported once."""

from __future__ import annotations

from kvabi.engine.deltas import DeltaTracker
from kvabi.engine.outputs import CompletionOutput, RequestOutput


def _out(*choices: tuple[str, int, str | None]) -> RequestOutput:
    outputs = tuple(
        CompletionOutput(i, text, tuple(range(num_tokens)), None, finish)
        for i, (text, num_tokens, finish) in enumerate(choices)
    )
    return RequestOutput("r", (1, 2), outputs, all(c.finish_reason for c in outputs))


def _texts(
    tracker: DeltaTracker, *outs: RequestOutput
) -> list[list[tuple[int, str, int, str | None]]]:
    return [
        [(d.index, d.text, len(d.token_ids), d.finish_reason) for d in tracker.deltas(out)]
        for out in outs
    ]


def test_a_half_decoded_character_waits_for_its_other_bytes():
    steps = _texts(
        DeltaTracker(), _out(("ab", 2, None)), _out(("ab\ufffd", 3, None)), _out(("abé", 4, None))
    )
    assert steps == [[(0, "ab", 2, None)], [(0, "", 1, None)], [(0, "é", 1, None)]]


def test_text_that_may_start_a_stop_string_is_held_until_it_cannot():
    tracker = DeltaTracker(stop=("xyz", "q"))
    steps = _texts(
        tracker,
        _out(("hello x", 7, None)),  # "x" and the space before could begin "xyz": held (2 chars)
        _out(("hello xy", 8, None)),
        _out(("hello xya", 9, None)),  # not "xyz" after all
        _out(("hello xya", 10, "length")),  # finished: the rest goes out
    )
    assert steps == [
        [(0, "hello", 7, None)],
        [(0, " ", 1, None)],
        [(0, "x", 1, None)],
        [(0, "ya", 1, "length")],
    ]


def test_each_choice_is_tracked_alone_and_finishes_once():
    tracker = DeltaTracker()
    steps = _texts(
        tracker,
        _out(("a", 1, None), ("b", 1, None)),
        _out(("a!", 2, "stop"), ("bb", 2, None)),
        _out(("a!", 2, "stop"), ("bbb", 3, "length")),
    )
    assert steps == [
        [(0, "a", 1, None), (1, "b", 1, None)],
        [(0, "!", 1, "stop"), (1, "b", 1, None)],
        [(1, "b", 1, "length")],  # choice 0 is not repeated
    ]


def test_a_step_without_new_tokens_gives_no_delta():
    tracker = DeltaTracker()
    assert _texts(tracker, _out(("a", 1, None)), _out(("a", 1, None))) == [[(0, "a", 1, None)], []]

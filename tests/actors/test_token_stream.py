"""TokenCursor and StreamedAttempts: deltas that repeat, overlap or skip ahead pass on each token
once, in order; a failed attempt is continued from exactly the tokens passed on."""

from __future__ import annotations

from rlactors.actors.token_stream import StreamedAttempts, TokenCursor
from rlactors.types import Completion, SamplingParams, TokenDelta


def delta(start, tokens, version=0):
    return TokenDelta(start, list(tokens), [-t / 10 for t in tokens], [version] * len(tokens))


def test_the_cursor_passes_each_token_once_and_waits_over_gaps():
    cursor = TokenCursor()
    assert cursor.advance(delta(0, [5, 6])) == delta(0, [5, 6])
    assert cursor.advance(delta(0, [5, 6])) is None  # a repeat
    assert cursor.advance(delta(3, [8])) is None  # a gap: token 2 is not here yet
    assert cursor.advance(delta(1, [6, 7])) == delta(2, [7])  # an overlap: only the new token
    completion = Completion("r", [1], [5, 6, 7, 8, 9], [-0.5, -0.6, -0.7, -0.8, -0.9], [0] * 5, "length")
    assert cursor.tail(completion) == delta(3, [8, 9])
    assert cursor.token_ids == [5, 6, 7, 8, 9] and cursor.logprobs == [-0.5, -0.6, -0.7, -0.8, -0.9]


def test_a_failed_attempt_continues_from_the_tokens_passed_on():
    attempts = StreamedAttempts([1, 2], SamplingParams(max_tokens=6, stop_token_ids=(0,), seed=3))
    assert attempts.next_request() == ([1, 2], attempts.sampling)
    assert attempts.forward(delta(0, [5, 6])) == delta(0, [5, 6])
    # The replica dies: the next attempt asks for the rest of the completion after [5, 6].
    prompt, sampling = attempts.next_request()
    assert prompt == [1, 2, 5, 6] and sampling.max_tokens == 4 and sampling.seed == 3
    assert attempts.forward(delta(0, [7], version=1)) == delta(2, [7], version=1)
    completion = attempts.completed(Completion("r", prompt, [7, 0], [-0.7, 0.0], [1, 1], "stop", replica=1))
    assert (completion.prompt_token_ids, completion.token_ids, completion.versions) == ([1, 2], [5, 6, 7, 0],
                                                                                        [0, 0, 1, 1])
    assert completion.logprobs == [-0.5, -0.6, -0.7, 0.0] and completion.replica == 1


def test_tokens_passed_on_that_end_the_completion_need_no_new_attempt():
    for tokens, reason in (([5, 0], "stop"), ([5, 6, 7], "length")):
        attempts = StreamedAttempts([1], SamplingParams(max_tokens=3, stop_token_ids=(0,)))
        attempts.next_request()
        attempts.forward(delta(0, tokens))
        assert attempts.next_request() is None
        ended = attempts.ended("r")
        assert (ended.token_ids, ended.finish_reason, ended.prompt_token_ids) == (tokens, reason, [1])

"""TextStream: never half a character, never part of a stop string, never a loop's repeats."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from qladder.stream import TextStream, _complete, decode

# A byte-level vocabulary: id -> bytes. 0-2 split "é" (C3 A9) and "€" (E2 82 AC) over tokens.
VOCAB = {0: b"\xc3", 1: b"\xa9", 2: b"\xe2\x82", 3: b"\xac", 4: b"a", 5: b"b", 6: b"\n", 7: b"\n\nUser", 8: b":",
         9: b" ", 10: b"\xff"}


def pieces(ids):
    return b"".join(VOCAB[i] for i in ids)


def run(ids, stops=(), loop=0):
    s = TextStream(pieces, stops, loop)
    shown = ""
    for t in ids:
        s.push(t, None)
        shown += s.release()[1]
        if s.stopped_at is not None:
            break
    if s.stopped_at is None:
        shown += s.release(final=True)[1]
    return s, shown


def test_a_character_split_over_tokens_waits_for_its_last_byte():
    s = TextStream(pieces)
    s.push(4, None)
    assert s.release() == (1, "a")
    s.push(2, None)
    assert s.release() == (0, "")  # "€" is not whole yet
    s.push(3, None)
    assert s.release() == (2, "€")


def test_a_whole_answer_can_be_withdrawn_released_tokens_and_all_a_streamed_one_cannot():
    """An answer its client reads whole (none sent before its end) starts again from nothing when
    the endpoint writing it is ejected; a streamed one's released tokens are the client's."""
    import pytest

    s = TextStream(pieces, ("\n\n",))
    s.whole = True
    for t in (4, 6, 5):
        s.push(t, None)
        s.release()
    assert s.released == 3 and s.text == "a\nb"
    s.withdraw()
    assert (s.ids, s.tags, s.released, s.text, s.stopped_at) == ([], [], 0, "", None)
    s.push(5, None)
    assert s.release(final=True) == (1, "b") and s.final_ids == [5]
    streamed = TextStream(pieces)
    streamed.push(4, None)
    streamed.release()
    with pytest.raises(AssertionError, match="released tokens are the client's"):
        streamed.withdraw()
    streamed.truncate(0)  # (a rollback never goes below what was released)
    assert streamed.ids == [4]


def test_an_answer_cut_inside_a_character_drops_the_partial_tokens():
    s, shown = run([4, 0, 1, 4, 2])  # "aéa" then the first two bytes of "€"
    assert shown == "aéa" == s.text and "\ufffd" not in shown
    assert s.final_ids == [4, 0, 1, 4]
    assert decode(pieces(s.final_ids)) == s.text


def test_the_models_own_invalid_bytes_still_show_as_replacement():
    _, shown = run([4, 10, 4])
    assert shown == "a\ufffda"


def test_a_stop_string_is_never_partly_shown_and_ids_agree_with_text():
    s, shown = run([4, 6, 5, 6, 6, 4, 4], stops=("\n\n",))
    assert shown == "a\nb" and s.stopped_at == 3
    assert decode(pieces(s.final_ids)) == shown


def test_a_stop_string_inside_a_token_cuts_that_token():
    s, shown = run([4, 5, 7, 8, 4], stops=("User:",))
    assert shown == "ab" and s.final_ids == [4, 5]


def test_a_possible_stop_start_is_released_when_it_turns_out_not_to_be_one():
    s = TextStream(pieces, ("ab",))
    s.push(4, None)
    assert s.release() == (0, "")  # "a" might start "ab"
    s.push(4, None)
    assert s.release() == (1, "a")  # the first "a" is not a stop; the second still might be


def test_a_repeating_tail_is_held_past_its_first_copy():
    s = TextStream(pieces, (), loop_max_period=4)
    for t in [4, 5, 9, 4, 5, 9, 4]:  # "ab ab a": a period-3 tail seen more than once
        s.push(t, None)
        s.release()
    assert s.text == "ab "
    s.push(6, None)  # the loop breaks: everything is released
    s.release()
    assert s.text == "ab ab a\n"


@example([0, 7], ("\n\n",))  # a stop right after a lead byte: the lead byte's token goes too
@given(st.lists(st.integers(0, 10), max_size=40), st.sampled_from([(), ("\n\n",), ("b:", "a\n")]))
def test_released_text_is_always_the_decoded_released_ids(ids, stops):
    s, shown = run(ids, stops, loop=8)
    assert shown == s.text == decode(pieces(s.final_ids))
    assert _complete(pieces(s.final_ids))  # a U+FFFD is the model's own invalid byte, never a cut
    for stop in stops:
        assert stop not in shown

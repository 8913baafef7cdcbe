"""`slide_hf.data.rendered_spans`: replies found in a final render by the template's own markers.

Whole conversations through real templates are in test_data_chat.py and test_data_cli.py; these pin the
rules on hand-written renders, including a Llama-3-style template whose end of turn has nothing after it.
"""

from __future__ import annotations

import pytest

from slide_hf.data.options import IGNORE
from slide_hf.data.rendered_spans import (
    ReplyNotFound,
    TurnMarkers,
    answer_of,
    dropped_reasoning,
    labels_in_spans,
    locate_replies,
    reasoning_of,
    turn_markers,
)

CHATML = ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]


def test_markers_come_from_the_prefix_renders():
    before = "<|im_start|>user\nHi<|im_end|>\n"
    prompt = before + "<|im_start|>assistant\n"
    through = prompt + "<think>\n\n</think>\n\nHello!<|im_end|>\n"
    assert turn_markers(before, prompt, through, CHATML) == TurnMarkers("<|im_start|>assistant\n", "<|im_end|>", "\n")
    llama = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    opening = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    specials = ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    assert turn_markers(llama, llama + opening, llama + opening + "Hello!<|eot_id|>", specials) == TurnMarkers(
        opening, "<|eot_id|>", ""
    )


def test_a_prefilled_generation_prompt_opens_replies_at_the_role_header():
    """DeepSeek-R1's prompt ends with ``<think>\\n`` for the model to reason after; its rendered replies lack
    it, so the opening is the part of the prompt the reply shares."""
    before = "Sys.<｜User｜>2+2?"
    through = before + "<｜Assistant｜>\n\n4<｜end▁of▁sentence｜>"
    specials = ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]
    marks = turn_markers(before, before + "<｜Assistant｜><think>\n", through, specials)
    assert marks == TurnMarkers("<｜Assistant｜>", "<｜end▁of▁sentence｜>", "")


def test_no_markers_when_the_renders_do_not_show_them():
    before = "<|im_start|>user\nHi<|im_end|>\n"
    assert turn_markers(None, before, before, CHATML) is None  # a render failed
    assert turn_markers(before, before, before + "Hello!<|im_end|>\n", CHATML) is None  # no generation prompt
    assert turn_markers(before, before + "A: ", before + "A: Hello!\n", CHATML) is None  # no special token ends it
    assert turn_markers(before, before + "<|im_start|>assistant\n", "Hi" + before, CHATML) is None  # re-rendered


def test_replies_are_found_in_order_and_named_when_lost():
    marks = TurnMarkers("<|im_start|>assistant\n", "<|im_end|>", "\n")
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "<think>\nsame\n</think>\n\nHello!"},
    ]
    rendered = (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>"
    )
    spans = locate_replies(rendered, messages, {1: marks, 3: marks})
    assert [rendered[a:b] for a, b in spans] == ["Hello!<|im_end|>\n", "Hello!<|im_end|>"]
    lost = rendered.replace("<|im_start|>assistant\nHello!<|im_end|>\n", "", 1)
    with pytest.raises(ReplyNotFound) as info:  # the second reply cannot stand in for the first twice
        locate_replies(lost, messages, {1: marks, 3: marks})
    assert info.value.index == 3
    other = rendered.replace("Hello!<|im_end|>\n<|im_start|>user", "Bye.<|im_end|>\n<|im_start|>user")
    with pytest.raises(ReplyNotFound, match="its content is not in the reply") as info:
        locate_replies(other, messages, {1: marks, 3: marks})
    assert info.value.index == 1
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather"}}]}
    with pytest.raises(ReplyNotFound, match="'get_weather'"):
        locate_replies("<|im_start|>assistant\n<|im_end|>", [call], {0: marks})


def test_answer_and_reasoning_of_a_reply():
    inline = {"role": "assistant", "content": "<think>\n a \n</think>\n\n b \n"}
    assert answer_of(inline) == "b" and reasoning_of(inline) == "a"
    field = {"role": "assistant", "content": "b", "reasoning_content": "\na\n"}
    assert answer_of(field) == "b" and reasoning_of(field) == "a"
    assert (
        dropped_reasoning("<|im_start|>assistant\nb<|im_end|>", [inline, field, {"role": "user", "content": "a"}]) == 0
    )
    assert (
        dropped_reasoning(
            "<|im_start|>assistant\nb<|im_end|>", [{"role": "assistant", "content": "b", "reasoning_content": "x"}]
        )
        == 1
    )


def test_a_token_is_trained_when_it_overlaps_a_span():
    ids = [10, 11, 12, 13, 14]
    offsets = [(0, 3), (3, 6), (6, 9), (9, 12), (12, 15)]
    assert labels_in_spans(ids, offsets, [(3, 9), (12, 15)]) == [IGNORE, 11, 12, IGNORE, 14]
    # A token straddling either edge of a span holds some of the reply: trained, as
    # apply_chat_template(..., return_assistant_tokens_mask=True) trains it (a byte-level " Hello" starts
    # at the space before a generation block); tokens that only touch an edge are not.
    assert labels_in_spans(ids, offsets, [(4, 10)]) == [IGNORE, 11, 12, 13, IGNORE]
    assert labels_in_spans(ids, offsets, [(3, 6)]) == [IGNORE, 11, IGNORE, IGNORE, IGNORE]
    # A token with no characters (an added token rendered empty) counts as its first character.
    assert labels_in_spans([7, 8], [(3, 3), (6, 6)], [(3, 6)]) == [7, IGNORE]


def test_overlapping_and_nested_spans_label_every_token_inside_any_of_them():
    ids = list(range(100, 110))
    offsets = [(10 * i, 10 * i + 10) for i in range(10)]
    # (0, 100) holds (10, 20): a token at 50 lies inside the outer span though the inner one opened later.
    assert labels_in_spans(ids, offsets, [(0, 100), (10, 20)]) == ids
    assert labels_in_spans(ids, offsets, [(10, 20), (0, 100)]) == ids
    overlapping = labels_in_spans(ids, offsets, [(0, 45), (30, 60), (35, 40)])
    assert overlapping == [*ids[:6], *[IGNORE] * 4]

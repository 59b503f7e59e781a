"""The boundary rule: appending text re-tokenizes at most the state's last token."""

from __future__ import annotations

from typing import Any

from frontend_dsl.fake_backend import FakeBackend
from frontend_dsl.stream_data import StreamData
from frontend_dsl.tokens import align_generated, plan_append


def test_plain_append_keeps_every_existing_id(fake: FakeBackend) -> None:
    ids = fake.encode("The capital of France")
    keep, new = plan_append(ids, " is Paris.", fake)
    assert keep == len(ids)
    assert ids + new == fake.encode("The capital of France is Paris.")


def test_split_word_merges_into_one_token(fake: FakeBackend) -> None:
    ids = fake.encode("Hel")
    keep, new = plan_append(ids, "lo world", fake)
    assert keep == len(ids) - 1  # the last token was re-tokenized
    assert ids[:keep] + new == fake.encode("Hello world")


def test_special_token_text_maps_to_special_ids(fake: FakeBackend) -> None:
    data = StreamData()
    data.append_text("<|im_start|>user\n", fake)
    data.append_text("Hi<|im_end|>\n", fake)
    assert data.ids == [1, 4093, 198, 26843, 2, 198]
    assert fake.decode(data.ids) == data.text


def test_state_ids_always_decode_to_state_text(fake: FakeBackend) -> None:
    data = StreamData()
    pieces = ["Answer", ":", " ", "Par", "is", "\n", "\n", "é", "t", "é ", "ok"]
    for piece in pieces:
        before = list(data.ids)
        data.append_text(piece, fake)
        assert data.ids[: len(before) - 1] == before[:-1]  # at most the last id changed
        assert fake.decode(data.ids) == data.text
    assert data.text == "".join(pieces)


def test_branches_share_parent_ids(fake: FakeBackend) -> None:
    parent = StreamData()
    parent.append_text("Question: what is 2+2?\nAnswer:", fake)
    a, b = parent.branch(), parent.branch()
    a.append_text(" 4", fake)
    b.append_text(" four", fake)
    shared = len(parent.ids) - 1
    assert a.ids[:shared] == b.ids[:shared] == parent.ids[:shared]


def test_align_generated_drops_tokens_of_a_cut_stop_string(fake: FakeBackend) -> None:
    generated = fake.encode("Paris.\nQuestion")
    assert align_generated("Paris.", generated, fake) == fake.encode("Paris.")
    assert align_generated("Paris.\nQuestion", generated, fake) == generated


def test_align_generated_keeps_model_ids_even_when_not_canonical(fake: FakeBackend) -> None:
    odd: list[Any] = fake.encode("Par") + fake.encode("is")  # not how "Paris" encodes
    assert align_generated("Paris", odd, fake) == odd

from __future__ import annotations

import pytest

from memplan.checkpoint_setting import FULL, NONE, OP, Checkpointing


@pytest.mark.parametrize("text", ["none", "full", "op", "blocks:3", "every:2"])
def test_the_text_form_reads_back(text):
    assert str(Checkpointing.parse(text)) == text


def test_bools_read_as_none_and_full():
    assert Checkpointing.parse(False) == NONE and Checkpointing.parse(True) == FULL
    assert not NONE and FULL and OP


@pytest.mark.parametrize("bad", ["blocks", "blocks:0", "every:-1", "half", 3, None])
def test_a_bad_setting_names_the_field_and_the_forms(bad):
    with pytest.raises(ValueError, match="plan.checkpointing must be one of 'none'"):
        Checkpointing.parse(bad, name="plan.checkpointing")


def test_fields_are_checked():
    with pytest.raises(ValueError, match="blocks must be >= 1 for mode 'blocks'"):
        Checkpointing(mode="blocks")
    with pytest.raises(ValueError, match="every must be >= 1"):
        Checkpointing(mode="full", every=2)


def test_selected_blocks():
    assert Checkpointing(mode="blocks", blocks=2).selected(5) == [0, 1]
    assert Checkpointing(mode="every", every=2).selected(5) == [1, 3]
    assert FULL.selected(3) == OP.selected(3) == [0, 1, 2] and NONE.selected(3) == []


def test_memory_order():
    two, three = Checkpointing(mode="blocks", blocks=2), Checkpointing(mode="blocks", blocks=3)
    assert NONE.saves_no_less_than(two) and two.saves_no_less_than(three) and three.saves_no_less_than(FULL)
    assert OP.saves_no_less_than(FULL) and not FULL.saves_no_less_than(OP)
    assert not OP.saves_no_less_than(two) and not two.saves_no_less_than(OP)

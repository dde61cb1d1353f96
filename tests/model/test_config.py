"""model/config.py: the one type check of a raw value against a field, and the Literal helpers."""
from typing import Literal

import pytest

from model.config import GPTConfig, choices, config_from_dict, field_value


@pytest.mark.parametrize("hint, value, want", [
    (float, 15, 15.0), (float, 0.5, 0.5), (int, 3, 3), (bool, True, True), (str, "x", "x"),
    (list[float], (0.9, 0.95), [0.9, 0.95]), (Literal["a", "b"], "c", "c"),  # choices are checked apart
])
def test_a_value_of_the_field_type_is_taken_as_the_field_holds_it(hint, value, want):
    got = field_value(hint, value)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("hint, value, name", [
    (int, True, "int"), (float, False, "float"), (int, 1.0, "int"), (bool, 1, "bool"), (str, 3, "str"),
    (list[float], 0.9, "list"), (Literal["a", "b"], 1, "str"),
])
def test_a_value_of_another_type_names_the_field_type(hint, value, name):
    with pytest.raises(TypeError) as e:
        field_value(hint, value)
    assert str(e.value) == name


def test_choices_are_the_literal_values_and_a_checkpoint_dict_is_checked_by_the_same_rule():
    assert choices(Literal["sdpa", "flex"]) == ("sdpa", "flex") and choices(int) == ()
    assert config_from_dict({"logit_softcap": 15, "n_layer": 2}) == GPTConfig(logit_softcap=15.0, n_layer=2)

"""sdpa_book.checks: the one integer check of the book's helpers."""

import numpy as np
import pytest

from sdpa_book.checks import check_count


@pytest.mark.parametrize("value", [3, np.int64(3), np.uint8(3)])
def test_integers_of_any_kind_come_back_as_int(value):
    out = check_count(value, "n")
    assert out == 3 and type(out) is int


@pytest.mark.parametrize(
    "value, minimum, error, message",
    [
        (True, 0, TypeError, "n must be an int; got True"),
        (np.bool_(True), 0, TypeError, "n must be an int; got "),
        (3.0, 1, TypeError, "n must be an int; got 3.0"),
        (None, 1, TypeError, "n must be an int; got None"),
        (0, 1, ValueError, "n must be at least 1; got 0"),
        (-1, 0, ValueError, "n must be at least 0; got -1"),
        (3, 4, ValueError, "n must be at least 4; got 3"),
    ],
)
def test_refuses_what_is_not_a_count_naming_the_argument(value, minimum, error, message):
    with pytest.raises(error, match=message):
        check_count(value, "n", minimum=minimum)


def test_the_minimum_itself_is_allowed():
    assert check_count(0, "n", minimum=0) == 0
    assert check_count(4, "n", minimum=4) == 4

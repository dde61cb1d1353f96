"""A param group's split: equal row blocks or a tuple of row counts, as Blocks of equal matrices in row order."""
import pytest

from optim.views import Block, blocks, view_rows


def test_an_int_is_equal_blocks_and_a_tuple_the_row_count_of_each_matrix():
    assert view_rows((12, 4), 3) == (4, 4, 4) and blocks((12, 4), 3) == [Block(0, 3, 4)]
    assert blocks((12, 4), 1) == [Block(0, 1, 12)]
    # Q and K in pairs of heads (4 heads of 2 rows: [4, 8] pairs), then V whole: two blocks
    pairs = (4, 4, 4, 4, 8)
    assert view_rows((24, 8), pairs) == pairs and blocks((24, 8), pairs) == [Block(0, 4, 4), Block(16, 1, 8)]
    assert blocks((24, 8), [4] * 4 + [8]) == blocks((24, 8), pairs)  # a list, as a state dict may hand it back
    # equal sizes only stack where they are neighbours
    assert blocks((7, 3), (2, 3, 2)) == [Block(0, 1, 2), Block(2, 1, 3), Block(5, 1, 2)]
    assert [b.stop for b in blocks((7, 3), (2, 3, 2))] == [2, 5, 7]


@pytest.mark.parametrize("split, message", [
    (3, r"split=3 must divide the rows of the parameter of shape \(8, 4\) into equal matrices; use a divisor of 8"),
    (0, r"split=0 must divide the rows"),
    ((4, 3), r"split=\(4, 3\) must be positive row counts adding up to the 8 rows of the parameter of shape \(8, 4\)"),
    ((8, 0), r"split=\(8, 0\) must be positive row counts"),
    ((), r"split=\(\) must be positive row counts"),
])
def test_a_split_that_does_not_fit_the_rows_says_so(split, message):
    with pytest.raises(ValueError, match=message):
        blocks((8, 4), split)

"""Messages count in words a person would write: "1 file", not "1 files"; the config's key names, not the code's."""
import pytest

from data.loader import TokenLoader
from data.val import val_batches
from data.shards import ShardError
from tests.helpers import make_shards


def test_eval_errors_name_eval_tokens_and_count_one_file_as_one(tmp_path):
    [val] = make_shards(tmp_path, [10], vocab=100)
    with pytest.raises(ShardError, match=r"holds 10 tokens in 1 file, but eval\.tokens = 10 targets need 11 .*; "
                                         r"lower eval\.tokens to at most 9"):
        val_batches(str(val), 2, 4, 10)
    with pytest.raises(ShardError, match=r"held-out tail \(data\.val = 'holdout'\) of eval\.tokens = 10 must be "):
        TokenLoader(str(val), 2, 4, holdout_tokens=10)
    with pytest.raises(ShardError, match=r"starting with bos_id=500 in 1 file \("):
        next(TokenLoader(str(val), 2, 4, bos_id=500))

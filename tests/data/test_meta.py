"""meta.json's reader (data.meta): a missing file, a file that is not JSON, and one that is not an object."""
import json
import re

import pytest

from data.meta import META, MetaError, read_meta


def test_a_folder_without_meta_json_reads_as_empty_unless_it_must_have_one(tmp_path):
    assert read_meta(tmp_path) == {}
    with pytest.raises(OSError):
        read_meta(tmp_path, missing_ok=False)


def test_meta_json_is_read_as_written(tmp_path):
    (tmp_path / META).write_text(json.dumps({"vocab_size": 257, "eot_token": 256}))
    assert read_meta(tmp_path) == {"vocab_size": 257, "eot_token": 256}


@pytest.mark.parametrize("text,problem", [("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object (a list)"),
                                          (b"\xff\xfe", "not valid JSON")])
def test_a_broken_meta_json_names_the_file_and_the_fix(tmp_path, text, problem):
    path = tmp_path / META
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(MetaError, match=rf"{path}: {re.escape(problem)}.*re-run python -m data.prepare") as e:
        read_meta(tmp_path)
    assert e.value.path == path and e.value.problem.startswith(problem)

"""The stream-digest data, written once for the tests of data.streams and data.val."""
from pathlib import Path

import pytest

from tests import stream_digests


@pytest.fixture(scope="module")
def digest_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("digests")
    stream_digests.write_data(root)
    return root

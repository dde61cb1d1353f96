"""bash run.sh wheels (scripts/wheels.py): the folder's own list of what a node installs."""
from pathlib import Path

from scripts import wheels


def test_the_wheel_folder_lists_what_the_node_installs_and_leaves_out_what_it_has():
    assert wheels.project("tomli-w>=1.0,<2         # config.toml writer") == "tomli-w"
    assert wheels.project("huggingface_hub>=0.24") == "huggingface-hub"
    assert wheels.wheel_project(Path("charset_normalizer-3.5.3-cp311-cp311-manylinux1_x86_64.whl")) == \
        "charset-normalizer"
    assert wheels.names("numpy, SciPy,huggingface_hub") == {"numpy", "scipy", "huggingface-hub"}
    # every glibc from CentOS 7's on: pip matches the tags exactly
    assert "manylinux_2_17_x86_64" in wheels.PLATFORMS and "manylinux_2_28_x86_64" in wheels.PLATFORMS

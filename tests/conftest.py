import os

import pytest

# Tests never reach the network; every model is built in code.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def launched(request, tmp_path_factory):
    """`launched(NAME)`: run NAME's output directory and stderr (tests/_launched.py), every run of
    its config that a selected test names launched together on first use."""
    from _launched import Launches

    return Launches(request.session.items, tmp_path_factory.mktemp("launched"))

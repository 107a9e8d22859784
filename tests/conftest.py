"""Session-wide test settings."""

import importlib.util

import pytest
import torch

from specdecode import profile
from specdecode.models import registry


@pytest.fixture(autouse=True, scope="session")
def profiles_in_tmp(tmp_path_factory):
    """The tiny models' forward-time profiles (K='auto', hybrid) go to a temporary
    directory, not the user's cache: each session's tiny models are new ones."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(profile, "PROFILE_DIR", tmp_path_factory.mktemp("profiles"))
        yield


@pytest.fixture(autouse=True, scope="session")
def cache_in_tmp(tmp_path_factory):
    """The session's specdecode cache is a temporary one: what tests leave there (int8 / q4
    weights of tiny and real models, the kernel build) is not the user's. The fetched models
    (``models/``, ``gguf/``, fetched by `make models`) are linked from the user's cache."""
    user = registry.cache_dir()
    tmp = tmp_path_factory.mktemp("cache")
    for sub in ("models", "gguf"):
        if (user / sub).is_dir():
            (tmp / sub).symlink_to(user / sub)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(tmp))
        yield


@pytest.fixture(autouse=True)
def one_thread(request):
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's
    barriers make them 10x slower: every test runs on one thread except those marked
    ``real`` (the real models), which keep every core. Restored after each test."""
    if request.node.get_closest_marker("real") is not None:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


LLAMACPP = importlib.util.find_spec("llama_cpp") is not None


def pytest_report_header(config):
    if not LLAMACPP:
        return ("llama.cpp extra not installed: the tests marked llamacpp (llama.cpp itself) "
                "are deselected; `make test-llamacpp` installs it and runs them")


def pytest_collection_modifyitems(config, items):
    """Tests on llama.cpp itself need the optional extra (compiled for this CPU in 10-20
    minutes): without it they are deselected, and the header says so."""
    if LLAMACPP:
        return
    keep = [i for i in items if i.get_closest_marker("llamacpp") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep

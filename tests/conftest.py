"""Session-wide test settings."""

import pytest
import torch

from specdecode import profile


@pytest.fixture(autouse=True, scope="session")
def profiles_in_tmp(tmp_path_factory):
    """The tiny models' forward-time profiles (K='auto', hybrid) go to a temporary
    directory, not the user's cache: each session's tiny models are new ones."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(profile, "PROFILE_DIR", tmp_path_factory.mktemp("profiles"))
        yield


@pytest.fixture(scope="session")
def _cache_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def cache_in_tmp(request, _cache_tmp):
    """What the tiny models leave in the specdecode cache (int8 / q4 weights, the kernel
    build) goes to a temporary one, also for the subprocesses a test starts; the real
    models' tests (marker ``real``) use the user's cache, where the models are."""
    if request.node.get_closest_marker("real") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(_cache_tmp))
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

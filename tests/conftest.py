"""Session-wide test settings."""

import pytest

from specdecode import schedule


@pytest.fixture(autouse=True, scope="session")
def profiles_in_tmp(tmp_path_factory):
    """The tiny models' forward-time profiles (K='auto', hybrid) go to a temporary
    directory, not the user's cache: each session's tiny models are new ones."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(schedule, "PROFILE_DIR", tmp_path_factory.mktemp("profiles"))
        yield

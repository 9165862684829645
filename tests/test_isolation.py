"""The test suite keeps out of the user's dflash folders: the runtime API (which reads no environment)
defaults its compiled kernels and kernel choices to ~/.cache/dflash, so tests point them elsewhere
(conftest.py); before they did, `dflash doctor` showed a tiny test model's bf16 choice."""

from pathlib import Path

from runtime.engine.models import kernels
from runtime.engine.models.kernels.choice import choice_file


def test_kernels_and_kernel_choices_stay_out_of_the_users_cache():
    users = Path.home() / ".cache" / "dflash"
    for path in (kernels.cache_dir(), choice_file()):
        assert users not in path.parents, path

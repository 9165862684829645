"""The test suite keeps out of the user's dflash folders: the runtime API (which reads no environment)
defaults its compiled kernels and kernel choices to ~/.cache/dflash, and the CLI to $DFLASH_HOME or
the user's cache folder, so tests point both elsewhere (conftest.py). Before they did, `dflash doctor`
showed a tiny test model's bf16 choice, and a module-scoped fixture that ran the CLI (set up before a
test's own DFLASH_HOME) sent the rest of its test process's kernels to ~/.cache/dflash."""

from pathlib import Path

import pytest

from dflash_cli.common import configure_kernels, data_home, state_dir
from runtime.engine.models import kernels
from runtime.engine.models.kernels.choice import choice_file

USERS = Path.home() / ".cache" / "dflash"


@pytest.fixture(scope="module")
def cli_configured_in_a_module_fixture() -> Path:
    """What a module-scoped fixture that runs a CLI command does first: set the kernels up from the
    environment, before any test's own DFLASH_HOME."""
    configure_kernels()
    return kernels.cache_dir()


def test_kernels_and_kernel_choices_stay_out_of_the_users_cache():
    for path in (kernels.cache_dir(), choice_file()):
        assert USERS not in path.parents, path


def test_a_module_fixture_running_the_cli_stays_out_of_the_users_folders(cli_configured_in_a_module_fixture):
    for path in (cli_configured_in_a_module_fixture, kernels.cache_dir(), choice_file(), data_home(), state_dir()):
        assert USERS not in path.parents and path != USERS, path
        assert not str(path).startswith(str(Path.home() / ".local" / "share" / "dflash")), path

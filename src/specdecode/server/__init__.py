"""``specdecode serve``: an OpenAI-compatible server over the speculative engine
(:mod:`.app` the HTTP layer, :mod:`.protocol` the wire format, :mod:`.worker` generation,
:mod:`.metrics` Prometheus)."""

from .app import create_app, serve_in_thread
from .metrics import Metrics
from .worker import Worker

__all__ = ["Metrics", "Worker", "create_app", "serve_in_thread"]

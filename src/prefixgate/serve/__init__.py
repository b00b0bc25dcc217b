"""``prefixgate serve``: an OpenAI-compatible HTTP front with Prometheus metrics.

Needs the ``serve`` extra (FastAPI, uvicorn, pydantic, sse-starlette, prometheus-client; vLLM
installs them all). :func:`create_app` builds the app around a gateway you own (embed it in your
own FastAPI service); ``prefixgate serve`` (:mod:`prefixgate.serve.cli`) runs it in front of
in-process vLLM engines or remote vLLM servers.
"""

from .app import ClientDisconnected, RetrySpread, create_app, error_response
from .metrics import METRICS, ServeMetrics

__all__ = ("METRICS", "ClientDisconnected", "RetrySpread", "ServeMetrics", "create_app", "error_response")

"""The HTTP side of the remote backend: server URLs as users type them, one ``httpx`` connection
pool per backend, requests whose failures become the runtime's errors (``RemoteError``, exit 7;
401/403 a ``ConfigError``, 400/413/422 an ``InputError``), and the ``data`` payloads of a
server-sent-event stream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from runtime.errors import ConfigError, DFlashError, InputError, ModelNotFoundError

if TYPE_CHECKING:
    # httpx (and httpx-sse, which imports it) is imported where a request is made: `import httpx`
    # also imports its command line, i.e. click and rich (87 of its 119 ms, measured with -X
    # importtime), and importing the runtime must load no UI package (tests/test_boundary.py).
    import httpx


class RemoteError(DFlashError):
    """The server cannot be reached, or it failed while generating."""

    exit_code = 7


def normalize_url(url: str) -> str:
    """``http://host:port`` from what users type (``host:port``, a trailing ``/``, a trailing ``/v1``)."""
    url = url.strip()
    if not url:
        raise ConfigError("the server URL is empty; pass e.g. --server http://127.0.0.1:8000")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"unsupported server URL {url!r}; use http:// or https://")
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def error_message(body: bytes) -> str:
    """The ``message`` of an OpenAI-style error body (else the body's first 300 characters)."""
    try:
        err = json.loads(body.decode("utf-8", "replace"))
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:300]
    if isinstance(err, dict):
        e = err.get("error", err)
        if isinstance(e, dict):
            return str(e.get("message") or e)
        return str(e if err.get("message") is None else err["message"])
    return str(err)


class HttpTransport:
    """Requests to one server (the base of ``RemoteBackend``).

    Args:
        url: server root (``http://host:port``; a trailing ``/v1`` is accepted).
        api_key: sent as ``Authorization: Bearer`` (None: no header).
        timeout: seconds to wait for a connection or for the next chunk (a queued request waits).
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.url = normalize_url(url)
        self.api_key = api_key or None
        self.timeout = timeout
        self._http: httpx.Client | None = None

    def _headers(self) -> dict[str, str]:
        h = {"Accept": "application/json, text/event-stream", "User-Agent": "dflash"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    @property
    def _client(self) -> httpx.Client:
        import httpx

        # One connection pool per backend (httpx clients are thread-safe); proxies and CA
        # certificates from the environment apply as they did with urllib.
        if self._http is None:
            self._http = httpx.Client(base_url=self.url, headers=self._headers(), timeout=self.timeout)
        return self._http

    def close(self) -> None:
        """Close the connection pool (a later request opens a new one)."""
        if self._http is not None:
            self._http.close()
            self._http = None

    def _open(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """Send a request and return the response with its body not read yet (the caller closes it).

        Raises:
            RemoteError: the server cannot be reached; the error ``_http_error`` maps a status to.
        """
        import httpx

        try:
            req = self._client.build_request("POST" if body is not None else "GET", path, json=body)
            resp = self._client.send(req, stream=True)
        except httpx.TransportError as e:
            raise RemoteError(
                f"cannot reach the server at {self.url}: {e or type(e).__name__}; is it running?"
            ) from None
        if resp.status_code >= 400:
            try:
                message = error_message(resp.read())
            except httpx.TransportError:
                message = resp.reason_phrase
            finally:
                resp.close()
            raise self._http_error(resp.status_code, message, path)
        return resp

    def _served_models(self) -> tuple[str, ...]:
        """The server's model ids, named in a model-not-found error (none known here)."""
        return ()

    def _http_error(self, status: int, message: str, path: str) -> DFlashError:
        where = f"{self.url}{path}"
        if status in (401, 403):
            return ConfigError(
                f"the server at {self.url} refused the API key ({status}: {message}); "
                "set DFLASH_API_KEY (or OPENAI_API_KEY)"
            )
        if status == 404 and "model" in message.lower():
            return ModelNotFoundError(f"{message} (server {self.url}; its models: {', '.join(self._served_models())})")
        if status == 404:
            return RemoteError(f"{where} does not exist (404): is {self.url} an OpenAI-compatible server?")
        if status in (400, 413, 422):
            return InputError(f"the server rejected the request: {message}")
        return RemoteError(f"the server at {self.url} answered {status}: {message}")

    def _get_json(self, path: str) -> Any:
        import httpx

        resp = self._open(path)
        try:
            return json.loads(resp.read())
        except httpx.TransportError as e:
            raise RemoteError(f"the connection to {self.url} failed: {e or type(e).__name__}") from None
        except ValueError:
            raise RemoteError(f"{self.url}{path} did not answer JSON: is it an OpenAI-compatible server?") from None
        finally:
            resp.close()


def sse_data(resp: httpx.Response) -> Iterator[str]:
    """The ``data`` payloads of a server-sent-event stream (``httpx-sse``).

    A plain JSON body (a server that ignored ``stream: true``) is yielded whole.
    """
    from httpx_sse import EventSource

    if "text/event-stream" not in resp.headers.get("content-type", ""):
        yield resp.read().decode("utf-8", "replace")
        yield "[DONE]"
        return
    for sse in EventSource(resp).iter_sse():
        yield sse.data

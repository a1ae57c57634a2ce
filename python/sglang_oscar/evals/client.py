"""Chat-completions client for any OpenAI-compatible server (SGLang, vLLM, ...).

Policy (spec §9.2):

* long read timeout (default 6 h: thinking models generate for hours), short connect/write/
  pool timeouts; the ``openai`` library's own retries are off, so a long generation is never
  silently re-submitted behind our back;
* connection errors, 408/409/429 and 5xx answers and malformed bodies are retried here with
  exponential back-off; a connection that still fails after all retries raises
  :class:`ServerUnreachable`;
* a request that outlives the read timeout is not re-submitted (that would double the
  server's load): it is recorded as failed and asked again by the next run;
* the preflight ``GET /models`` has its own short read timeout (30 s): a server that accepts
  connections but never answers is reported at once instead of after 7 x 6 h;
* a loopback server (``127.0.0.0/8``, ``::1``, ``localhost``) is reached directly, never
  through ``http_proxy`` / ``https_proxy`` / ``all_proxy``;
* other 4xx answers (400 context length, 404 unknown model, 422 ...) are *rejections*: not
  retried, returned as such, never scored as an answer.
"""

from __future__ import annotations

import ipaddress
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Iterator

from sglang_oscar.evals.errors import EvalError, ServerUnreachable

DEFAULT_REQUEST_TIMEOUT_S = 6 * 3600.0
DEFAULT_RETRIES = 6
DEFAULT_BACKOFF_S = 2.0
MAX_BACKOFF_S = 120.0
MODELS_TIMEOUT_S = 30.0
# SGLang ServerArgs fields that change a model's answers (GET /server_info): an eval folder's answers
# come from one such server.
IDENTITY_KEYS = ("model_path", "revision", "load_format", "kv_cache_dtype", "dtype", "quantization",
                 "json_model_override_args")
# The INT2 settings are not ServerArgs fields: the plugin keeps them on the ServerArgs object under this
# attribute, which SGLang's scheduler reports in /server_info's "internal_states" (Scheduler.
# get_internal_state: vars(server_args), dataclasses turned into dicts).
OSCAR_STATE_KEY = "_oscar_config"


@dataclass
class SamplingParams:
    """Sampling settings sent with every request (``top_k`` None: the server's default)."""

    max_tokens: int = 32768
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The four settings as a plain dict (recorded in ``metrics.json``)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }


@dataclass
class Completion:
    """Outcome of one request. ``status``: ok | rejected | error."""

    status: str
    content: str = ""
    reasoning: str | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    attempts: int = 1
    elapsed_s: float = 0.0


class MalformedResponse(Exception):
    """The server answered 200 with a body that is not a usable chat completion."""


def _usage_dict(usage: Any) -> dict[str, Any] | None:
    if usage is None:
        return None
    try:
        return {k: v for k, v in usage.model_dump().items() if isinstance(v, (int, float))}
    except Exception:  # pragma: no cover - defensive
        return None


class ChatClient:
    """Thread-safe wrapper around ``openai.OpenAI`` with the retry policy above."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        connect_timeout: float = 10.0,
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF_S,
        models_timeout: float | None = None,
    ):
        """``base_url``: server root or ``.../v1``; ``model``: the served name sent with every
        request; timeouts in seconds (``models_timeout``: the read timeout of ``GET /models``,
        default :data:`MODELS_TIMEOUT_S`); ``retries``: extra attempts after a connection error,
        408/409/429/5xx or malformed answer, with back-off ``backoff * 2**attempt`` (at most
        120 s). Raises :class:`EvalError` for a URL that is not http(s)."""
        import httpx
        import openai

        self._openai = openai
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.retries = max(0, int(retries))
        self.request_timeout = float(request_timeout)
        self.models_timeout = float(MODELS_TIMEOUT_S if models_timeout is None else models_timeout)
        self.backoff = float(backoff)
        self._stop = threading.Event()
        timeout = httpx.Timeout(
            connect=connect_timeout, read=request_timeout, write=30.0, pool=30.0
        )
        self._models_timeout = httpx.Timeout(
            connect=connect_timeout, read=self.models_timeout, write=30.0, pool=30.0
        )
        http_client = None
        if is_loopback_url(self.base_url):
            # http_proxy & co. must not apply to a server on this machine (a corporate proxy
            # cannot reach our 127.0.0.1); trust_env=False ignores them.
            http_client = openai.DefaultHttpxClient(trust_env=False, timeout=timeout)
        self._client = openai.OpenAI(
            base_url=self.base_url,
            api_key=api_key or "EMPTY",
            timeout=timeout,
            max_retries=0,
            http_client=http_client,
        )

    def stop(self) -> None:
        """Make pending back-off sleeps end early (used when a run aborts)."""
        self._stop.set()

    def _attempts(self) -> Iterator[int]:
        """Attempt numbers 0..retries, sleeping the back-off before each retry; stops early
        (yields no more) once :meth:`stop` was called."""
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(MAX_BACKOFF_S, self.backoff * (2 ** (attempt - 1)))
                if delay > 0:
                    self._stop.wait(delay)
            if self._stop.is_set():
                return
            yield attempt

    def _unreachable(self, last: Exception | None, hint: str) -> ServerUnreachable:
        return ServerUnreachable(
            f"cannot reach the server at {self.base_url} after {self.retries + 1} attempts "
            f"({_describe(last)}); is it running? {hint}"
        )

    # ------------------------------------------------------------------ preflight
    def served_models(self) -> list[str]:
        """Model ids listed by ``GET /models`` (``[]`` when the server has no such route or
        answers something unreadable). Connection errors and 5xx/429 are retried like a
        request; raises :class:`ServerUnreachable` when the server cannot be reached at all,
        or at once when it accepts the connection but does not answer within
        ``models_timeout`` seconds."""
        o = self._openai
        last: Exception | None = None
        client = self._client.with_options(timeout=self._models_timeout)
        for _ in self._attempts():
            try:
                page = client.models.list()
                return [m.id for m in page.data]
            except o.APITimeoutError:  # a subclass of APIConnectionError: test it first
                raise ServerUnreachable(
                    f"the server at {self.base_url} accepted the connection but did not answer "
                    f"GET /models within {self.models_timeout:g} s; is it stuck or still "
                    "starting? (check its log)"
                ) from None
            except (o.APIConnectionError, o.InternalServerError, o.RateLimitError) as exc:
                last = exc
            except o.APIStatusError as exc:
                if exc.status_code == 404 and "text/html" in exc.response.headers.get("content-type", ""):
                    raise EvalError(f"{self.base_url}/models answers HTTP 404 with an HTML page: not an "
                                    "OpenAI-compatible server; check --base-url (SGLang's root, e.g. "
                                    "http://127.0.0.1:30000)") from None
                return []  # reachable, but no /models endpoint
            except Exception:  # malformed listing: reachable
                return []
        raise self._unreachable(last, "(start one with `sglang-oscar serve`)")

    def server_identity(self, attempts: int = 3) -> tuple[dict[str, Any] | None, str | None]:
        """``(identity, failure)``: what the server answers with as SGLang reports it at
        ``GET /server_info`` (the keys of :data:`IDENTITY_KEYS`, and under ``"oscar"`` an int2
        server's settings, :data:`OSCAR_STATE_KEY`), ``(None, None)`` for a server
        without that route (not SGLang), or ``(None, reason)`` when the route could not be read
        after ``attempts`` tries (connection errors, timeouts, 5xx; one second apart, doubling).
        An eval folder records it, so answers of another server are not mixed into it."""
        import httpx

        root = self.base_url[: -len("/v1")]
        failure = None
        for attempt in range(attempts):
            try:
                with httpx.Client(trust_env=not is_loopback_url(root), timeout=self._models_timeout) as http:
                    resp = http.get(root + "/server_info")
            except httpx.HTTPError as exc:
                failure = _describe(exc)
            else:
                if resp.status_code < 500:
                    try:
                        info = resp.json() if resp.status_code == 200 else None
                    except ValueError:
                        info = None
                    if not isinstance(info, dict) or "kv_cache_dtype" not in info:
                        return None, None  # no such route, or not SGLang's: nothing to identify it by
                    identity = {k: info.get(k) for k in IDENTITY_KEYS}
                    states = info.get("internal_states")
                    oscar = states[0].get(OSCAR_STATE_KEY) if states and isinstance(states[0], dict) else None
                    if oscar is not None:
                        identity["oscar"] = oscar
                    return identity, None
                failure = f"HTTP {resp.status_code}"
            if attempt + 1 < attempts:
                time.sleep(2.0**attempt)
        return None, f"GET {root}/server_info failed: {failure}"

    def check_model(self) -> None:
        """Raise :class:`EvalError` when the server lists models and ``model`` is not one of
        them (a wrong ``--model`` would otherwise be rejected sample by sample)."""
        served = self.served_models()
        if served and self.model not in served:
            raise EvalError(
                f"the server at {self.base_url} serves {', '.join(served)}, not {self.model!r}; "
                "pass the served name with --model"
            )

    # ------------------------------------------------------------------ requests
    def chat(self, messages: list[dict[str, str]], params: SamplingParams) -> Completion:
        """Ask one chat completion. Returns a :class:`Completion` with status ``ok``,
        ``rejected`` (a 4xx other than 408/409/429: not retried) or ``error`` (read timeout,
        or retries exhausted on 5xx/malformed answers). Raises :class:`ServerUnreachable` when
        the connection still fails after all retries."""
        o = self._openai
        extra_body: dict[str, Any] = {}
        if params.top_k is not None:
            extra_body["top_k"] = params.top_k
        last: Exception | None = None
        unreachable = False
        t0 = time.monotonic()
        for attempt in self._attempts():
            try:
                resp = self._client.chat.completions.create(
                    model=self.model,
                    messages=messages,
                    max_tokens=params.max_tokens,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    extra_body=extra_body or None,
                )
                comp = _to_completion(resp)
                comp.attempts = attempt + 1
                comp.elapsed_s = time.monotonic() - t0
                return comp
            except o.APITimeoutError:
                # The server is alive but the generation outlived --request-timeout:
                # re-submitting would double its load, so the sample is recorded as failed
                # (asked again on the next run) instead.
                return Completion(
                    status="error",
                    error=f"no answer within the request timeout ({self.request_timeout:g} s)",
                    attempts=attempt + 1,
                    elapsed_s=time.monotonic() - t0,
                )
            except o.APIConnectionError as exc:
                last, unreachable = exc, True
            except o.APIStatusError as exc:
                code = exc.status_code
                if code in (408, 409, 429) or code >= 500:
                    last, unreachable = exc, False
                else:
                    return Completion(
                        status="rejected",
                        error=f"HTTP {code}: {_status_message(exc)}",
                        attempts=attempt + 1,
                        elapsed_s=time.monotonic() - t0,
                    )
            except (MalformedResponse, o.APIResponseValidationError, ValueError, KeyError,
                    TypeError, AttributeError) as exc:
                last, unreachable = exc, False
        if unreachable:
            raise self._unreachable(
                last, "finished samples are kept, re-run the same command to resume"
            )
        return Completion(
            status="error",
            error=_describe(last),
            attempts=self.retries + 1,
            elapsed_s=time.monotonic() - t0,
        )


def _to_completion(resp: Any) -> Completion:
    choices = getattr(resp, "choices", None)
    if not choices:
        raise MalformedResponse("the response has no choices")
    choice = choices[0]
    msg = getattr(choice, "message", None)
    if msg is None:
        raise MalformedResponse("the first choice has no message")
    content = msg.content if isinstance(msg.content, str) else ("" if msg.content is None else None)
    if content is None:
        raise MalformedResponse(f"message content is not text: {msg.content!r}")
    reasoning = getattr(msg, "reasoning_content", None)
    if reasoning is None:
        extra = getattr(msg, "model_extra", None) or {}
        reasoning = extra.get("reasoning_content") or extra.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        reasoning = str(reasoning)
    return Completion(
        status="ok",
        content=content,
        reasoning=reasoning,
        finish_reason=getattr(choice, "finish_reason", None),
        usage=_usage_dict(getattr(resp, "usage", None)),
    )


def _status_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
        if body.get("message"):
            return str(body["message"])[:300]
    return str(getattr(exc, "message", exc))[:300]


def _describe(exc: Exception | None) -> str:
    if exc is None:
        return "stopped"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def is_loopback_url(url: str) -> bool:
    """True when ``url``'s host is this machine's loopback (``localhost``, 127.0.0.0/8,
    ``::1``): such requests must bypass any configured HTTP proxy."""
    host = (urllib.parse.urlsplit(url).hostname or "").strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def normalize_base_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/v1`` (SGLang's OpenAI routes). Raises
    :class:`EvalError` for a URL that is not http(s)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise EvalError(f"--base-url must start with http:// or https://, got {url!r}")
    if not url.endswith("/v1"):
        url += "/v1"
    return url

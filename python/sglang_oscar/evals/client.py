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
* other 4xx answers (400 context length, 404 unknown model, 422 ...) are *rejections*: not
  retried, returned as such, never scored as an answer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from sglang_oscar.evals.errors import EvalError, ServerUnreachable

DEFAULT_REQUEST_TIMEOUT_S = 6 * 3600.0
DEFAULT_RETRIES = 6
DEFAULT_BACKOFF_S = 2.0
MAX_BACKOFF_S = 120.0


@dataclass
class SamplingParams:
    max_tokens: int = 32768
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int | None = None

    def as_dict(self) -> dict[str, Any]:
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
    extra: dict[str, Any] = field(default_factory=dict)


class MalformedResponse(Exception):
    pass


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
        sleep: Callable[[float], None] = time.sleep,
    ):
        import httpx
        import openai

        self._openai = openai
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.retries = max(0, int(retries))
        self.request_timeout = float(request_timeout)
        self.backoff = float(backoff)
        self._sleep = sleep
        self._stop = threading.Event()
        timeout = httpx.Timeout(
            connect=connect_timeout, read=request_timeout, write=30.0, pool=30.0
        )
        self._client = openai.OpenAI(
            base_url=self.base_url,
            api_key=api_key or "EMPTY",
            timeout=timeout,
            max_retries=0,
        )

    def stop(self) -> None:
        """Make pending back-off sleeps end early (used when a run aborts)."""
        self._stop.set()

    def _wait(self, attempt: int) -> None:
        delay = min(MAX_BACKOFF_S, self.backoff * (2**attempt))
        if delay > 0:
            self._stop.wait(delay)

    # ------------------------------------------------------------------ preflight
    def served_models(self) -> list[str]:
        """Model ids listed by ``GET /models``; retried like a request, raising
        :class:`ServerUnreachable` when the server cannot be reached at all."""
        o = self._openai
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                page = self._client.models.list()
                return [m.id for m in page.data]
            except (o.APIConnectionError, o.InternalServerError, o.RateLimitError) as exc:
                last = exc
            except o.APIStatusError:
                return []  # reachable, but no /models endpoint
            except Exception as exc:  # malformed listing: reachable
                last = exc
                return []
            if attempt < self.retries:
                self._wait(attempt)
        raise ServerUnreachable(
            f"cannot reach the server at {self.base_url} after {self.retries + 1} attempts "
            f"({_describe(last)}); is it running? (start one with `sglang-oscar serve`)"
        )

    def check_model(self) -> None:
        served = self.served_models()
        if served and self.model not in served:
            raise EvalError(
                f"the server at {self.base_url} serves {', '.join(served)}, not {self.model!r}; "
                "pass the served name with --model"
            )

    # ------------------------------------------------------------------ requests
    def chat(self, messages: list[dict[str, str]], params: SamplingParams) -> Completion:
        o = self._openai
        extra_body: dict[str, Any] = {}
        if params.top_k is not None:
            extra_body["top_k"] = params.top_k
        last: Exception | None = None
        unreachable = False
        t0 = time.monotonic()
        for attempt in range(self.retries + 1):
            if self._stop.is_set():
                break
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
            if attempt < self.retries:
                self._wait(attempt)
        if unreachable:
            raise ServerUnreachable(
                f"cannot reach the server at {self.base_url} after {self.retries + 1} attempts "
                f"({_describe(last)}); is it running? finished samples are kept, re-run the "
                "same command to resume"
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


def normalize_base_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/v1`` (SGLang's OpenAI routes)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise EvalError(f"--base-url must start with http:// or https://, got {url!r}")
    if not url.endswith("/v1"):
        url += "/v1"
    return url

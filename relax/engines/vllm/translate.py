"""Relax's engine contract (SGLang 0.5's) to vLLM 0.32's routes and back: pure functions, no I/O.

What each side says is in ``tests/vllm/CONTRACT.md`` (vLLM, read from its source and checked against the real
server) and ``../shared/SGLANG-CONTRACT.md``. The differences that matter here:

* vLLM's token route silently drops sampling keys it does not know (SGLang's ``max_new_tokens`` among them), so
  every SGLang key is renamed or refused by name here, never passed through;
* vLLM streams deltas and puts the weight-version spans on the last chunk only; Relax keeps the newest chunk
  of a stream as the prefix to continue after a crash, so the front folds deltas into SGLang's cumulative chunks
  and labels the tokens of an unfinished stream with the version the front set last (labels change only while
  the engine is paused, so that label is the one vLLM will report; the last chunk carries vLLM's own spans);
* vLLM's request ids gain a ``generate-tokens-`` prefix, which its abort route needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from relax.weights.pause_mode import PauseMode

#: vLLM's token route names a request ``generate-tokens-<request_id>``; its abort route takes that name.
VLLM_REQUEST_PREFIX = "generate-tokens-"
#: SGLang's default when a request gives no ``max_new_tokens`` (vLLM would fill the whole context instead).
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128

#: SGLang sampling keys and their vLLM names. Anything else is refused: vLLM would drop it without a word.
SAMPLING_KEYS: Mapping[str, str] = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "n": "n",
    "sampling_seed": "seed",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stream_interval": "stream_interval",
}
#: The request keys of SGLang's ``/generate`` the front serves.
REQUEST_KEYS = frozenset({"input_ids", "sampling_params", "rid", "stream", "return_logprob"})

#: SGLang pause mode -> vLLM ``/pause`` query. ``keep`` with the cache cleared preempts the frozen requests,
#: which recompute on resume with the new weights (SGLang's ``retract``); without, their KV stays (``in_place``).
PAUSE_QUERIES: Mapping[PauseMode, Mapping[str, str]] = {
    PauseMode.ABORT: {"mode": "abort"},
    PauseMode.RETRACT: {"mode": "keep", "clear_cache": "true"},
    PauseMode.IN_PLACE: {"mode": "keep", "clear_cache": "false"},
}


class RequestRefused(ValueError):
    """A request the front cannot serve as asked; the message names the field and what to send instead."""


@dataclass(frozen=True)
class GenerateCall:
    """A ``/generate`` body, checked, as the front sends it to vLLM and reads the answer back."""

    rid: str
    prompt_tokens: int
    n: int
    stream: bool
    return_logprob: bool
    vllm_body: dict[str, Any]


def generate_call(body: Any, new_rid: Callable[[], str]) -> GenerateCall:
    """Check an SGLang ``/generate`` body and build vLLM's; raises :class:`RequestRefused`."""
    if not isinstance(body, dict):
        raise RequestRefused("the body must be a JSON object with input_ids and sampling_params")
    unknown = sorted(set(body) - REQUEST_KEYS)
    if "text" in unknown:
        raise RequestRefused("text: the vLLM front takes input_ids only (token ids of the prompt)")
    if unknown:
        raise RequestRefused(f"{', '.join(unknown)}: not served by the vLLM front "
                             f"(it serves {', '.join(sorted(REQUEST_KEYS))})")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                       for t in ids):
        raise RequestRefused("input_ids: a non-empty list of non-negative token ids (one prompt; batches are "
                             "not served by the vLLM front)")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise RequestRefused("sampling_params must be a JSON object")
    params = vllm_sampling(sampling)
    return_logprob = _flag(body, "return_logprob")
    stream = _flag(body, "stream")
    n = params.get("n", 1)
    if stream and n != 1:
        raise RequestRefused(f"sampling_params.n={n} with stream: the vLLM front streams one sample a request; "
                             "send n requests")
    rid = body.get("rid")
    if rid is None:
        rid = new_rid()
    elif not isinstance(rid, str) or not rid:
        raise RequestRefused("rid must be a non-empty string")
    params["detokenize"] = True  # the rollout's rewards read the text
    if return_logprob:
        params["logprobs"] = 0  # the sampled token's log-probability only
    vllm_body = {"token_ids": ids, "sampling_params": params, "request_id": rid, "stream": stream,
                 "output_mode": "text"}
    return GenerateCall(rid=rid, prompt_tokens=len(ids), n=n, stream=stream, return_logprob=return_logprob,
                        vllm_body=vllm_body)


def vllm_sampling(sampling: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's sampling params under vLLM's names, SGLang's default length included."""
    unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
    if unknown:
        raise RequestRefused(f"sampling_params: {', '.join(unknown)} not supported by the vLLM front "
                             f"(supported: {', '.join(sorted(SAMPLING_KEYS))})")
    params = {SAMPLING_KEYS[k]: v for k, v in sampling.items() if v is not None}
    params.setdefault("max_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
    return params


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise RequestRefused(f"{key} must be true or false, not {value!r}")
    return value


def finish_reason(reason: str | None, stop_reason: int | str | None, token_ids: list[int]) -> dict[str, Any] | None:
    """vLLM's ``finish_reason``/``stop_reason`` in SGLang's form (None while a stream runs)."""
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": len(token_ids)}
    if reason == "abort":
        return {"type": "abort", "message": "aborted by the engine"}
    # "stop" (EOS: stop_reason None, the EOS is the last token; or a stop token or string) and "repetition"
    matched = stop_reason if stop_reason is not None else (token_ids[-1] if token_ids else None)
    return {"type": "stop", "matched": matched}


def _logprobs(choice: Mapping[str, Any]) -> list[float]:
    content = (choice.get("logprobs") or {}).get("content") or []
    return [float(entry["logprob"]) for entry in content]


@dataclass
class Output:
    """One sample's output so far, in SGLang's cumulative form."""

    rid: str
    prompt_tokens: int
    return_logprob: bool
    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)
    finish: dict[str, Any] | None = None

    def add(self, choice: Mapping[str, Any], version_now: str) -> None:
        """Fold one vLLM choice (a delta of a stream, or a whole answer) into the output."""
        new = [int(t) for t in choice.get("token_ids") or []]
        if new:
            start = len(self.ids)
            if self.spans and self.spans[-1]["version"] == version_now:
                self.spans[-1]["end"] = start + len(new)
            else:
                self.spans.append({"version": version_now, "start": start, "end": start + len(new)})
        self.ids += new
        self.text += choice.get("text") or ""
        self.logprobs += _logprobs(choice)
        if choice.get("finish_reason") is not None:
            self.finish = finish_reason(choice["finish_reason"], choice.get("stop_reason"), self.ids)
            if choice.get("weight_versions") is not None:  # vLLM's own spans of the whole output win
                self.spans = [dict(span) for span in choice["weight_versions"]]

    def answer(self, version_now: str) -> dict[str, Any]:
        """SGLang's ``/generate`` answer (or stream chunk) for the output so far."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.ids),
            "cached_tokens": 0,
            "weight_version": self.spans[-1]["version"] if self.spans else version_now,
            "weight_versions": [dict(span) for span in self.spans],
        }
        if self.return_logprob and len(self.logprobs) == len(self.ids):
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(self.logprobs, self.ids, strict=True)]
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}


def sample_rids(call: GenerateCall) -> list[str]:
    """Each sample's id: the request's own for one sample, ``<rid>-<i>`` for more (as the built-in engine)."""
    return [call.rid] if call.n == 1 else [f"{call.rid}-{i}" for i in range(call.n)]


def pause_query(body: Any) -> dict[str, str]:
    """The vLLM ``/pause`` query for an SGLang ``/pause_generation`` body (mode ``abort`` when none is given)."""
    mode = body.get("mode", PauseMode.ABORT.value) if isinstance(body, dict) else PauseMode.ABORT.value
    try:
        return dict(PAUSE_QUERIES[PauseMode(mode)])
    except (ValueError, KeyError):
        modes = ", ".join(m.value for m in PAUSE_QUERIES)
        raise RequestRefused(f"mode {mode!r}: the vLLM front pauses with one of {modes}") from None


def abort_body(body: Any) -> dict[str, list[str]] | None:
    """vLLM's ``/abort_requests`` body for SGLang's ``/abort_request`` (None: nothing to abort).

    vLLM aborts *everything* for an empty list, so an empty rid without ``abort_all`` must not reach it.
    """
    if not isinstance(body, dict):
        raise RequestRefused("the body must be a JSON object with rid or abort_all")
    if body.get("abort_all") is True:
        return {"request_ids": []}
    rid = body.get("rid") or ""
    if not isinstance(rid, str):
        raise RequestRefused("rid must be a string")
    return {"request_ids": [VLLM_REQUEST_PREFIX + rid]} if rid else None


def version_body(body: Any) -> str:
    """The label of an ``/update_weight_version`` body (``new_version``, as SGLang and vLLM name it)."""
    version = body.get("new_version") if isinstance(body, dict) else None
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)
    if not isinstance(version, str) or not version:
        raise RequestRefused("new_version: a non-empty string (the weights' version label)")
    return version


__all__ = ["PAUSE_QUERIES", "SAMPLING_KEYS", "VLLM_REQUEST_PREFIX", "GenerateCall", "Output", "RequestRefused",
           "abort_body", "finish_reason", "generate_call", "pause_query", "sample_rids", "version_body",
           "vllm_sampling"]

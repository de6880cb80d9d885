"""Requests `ee-transformers serve` checks before decoding (tools/serve.py): the OpenAI fields transformers converts
without checking, the exit and draft settings of a request's `generation_config`, and a prompt's length against the
paged cache (`request_error`, `length_error` -> `RequestRefused`, HTTP 400 naming the field). Importable from
`ee_transformers.tools.serve` as before.
"""

import json
import math

from ee_transformers.generation_early_exit import EXIT_ARGUMENTS, resolve_exit_settings
from ee_transformers.speculative_early_exit import DRAFT_SOURCES, MAX_BATCH_FIELD, OUR_FIELDS, SCHEDULES
from ee_transformers.tools.serve_cache import CachePlan

DRAFT_ARGUMENTS = (
    *DRAFT_SOURCES,
    MAX_BATCH_FIELD,
    *OUR_FIELDS,
    "max_matching_ngram_size",
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
)
LENGTH_FIELDS = {  # per endpoint: the field of the prompt, the fields that set the completion length
    "/v1/completions": ("prompt", ("max_tokens",)),
    "/v1/chat/completions": ("messages", ("max_completion_tokens", "max_tokens")),
    "/v1/responses": ("input", ("max_output_tokens",)),
}


# ---------------------------------------------------------------------------------------------------------------------
# requests checked before decoding
# ---------------------------------------------------------------------------------------------------------------------
class RequestRefused(Exception):
    """A request that cannot be served as asked: HTTP 400 naming `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param, self.message = param, message

    def body(self) -> bytes:
        error = {"message": self.message, "type": "invalid_request_error", "param": self.param, "code": None}
        return json.dumps({"error": error}).encode()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _check_sampling(values: dict, prefix: str = "") -> None:
    """The OpenAI fields transformers converts without checking (a bad one answers 500 there, or empty text)."""

    def refuse(name, allowed):
        raise RequestRefused(f"{prefix}{name}", f"`{prefix}{name}` must be {allowed}, got {values[name]!r}.")

    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens"):
        if values.get(name) is not None and not (_is_int(values[name]) and values[name] >= 1):
            refuse(name, "an integer >= 1")
    if values.get("temperature") is not None and not (_is_number(values["temperature"]) and values["temperature"] >= 0):
        refuse("temperature", "a number >= 0")
    if values.get("top_p") is not None and not (_is_number(values["top_p"]) and 0 < values["top_p"] <= 1):
        refuse("top_p", "a number in (0, 1]")
    penalty = values.get("frequency_penalty")
    if penalty is not None and not (_is_number(penalty) and penalty > -1):
        refuse("frequency_penalty", "a number > -1 (transformers decodes with repetition_penalty = 1 + it)")
    if values.get("seed") is not None and not _is_int(values["seed"]):
        refuse("seed", "an integer")
    if values.get("stream") is not None and not isinstance(values["stream"], bool):
        refuse("stream", "true or false")
    stop = values.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        refuse("stop", "a string or a list of strings")


def _check_drafts(given: dict, model_config) -> None:
    """Draft settings of a sequential request's `generation_config` (`generate` decodes with them)."""

    def refuse(name, allowed):
        raise RequestRefused(
            f"generation_config.{name}", f"`{name}` in `generation_config` must be {allowed}, got {given[name]!r}."
        )

    for name in ("prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens", MAX_BATCH_FIELD):
        if given.get(name) is not None and not (_is_int(given[name]) and given[name] >= 1):
            refuse(name, "an integer >= 1")
    exits = [e + 1 for e in (getattr(model_config, "exit_layers", None) or [])]
    if given.get("assistant_early_exit") is not None and given["assistant_early_exit"] not in exits:
        refuse("assistant_early_exit", f"the number of layers that draft, ending at an exit: one of {exits}")
    schedule = given.get("num_assistant_tokens_schedule")
    if schedule is not None and schedule not in SCHEDULES:
        refuse("num_assistant_tokens_schedule", f"one of {list(SCHEDULES)}")
    threshold = given.get("assistant_confidence_threshold")
    if threshold is not None and not (_is_number(threshold) and 0 <= threshold <= 1):
        refuse("assistant_confidence_threshold", "a number in [0, 1]")
    lookup = given.get("prompt_lookup_num_tokens")
    stored = getattr(model_config, "draft_vocab_size", None) or 0
    vocab = given.get("assistant_vocab_size")
    if vocab is not None and not (_is_int(vocab) and 1 <= vocab <= stored and given.get("assistant_early_exit")):
        refuse(
            "assistant_vocab_size",
            f"an integer in [1, {stored}] (the stored draft vocabulary) with assistant_early_exit",
        )
    width = given.get("speculative_verify_width")
    if width is not None and not (_is_int(width) and width >= 1 and lookup):
        refuse("speculative_verify_width", "an integer >= 1 with prompt_lookup_num_tokens")
    table = given.get("speculative_table_drafts")
    if table not in (None, False) and not (
        table is True and lookup and getattr(model_config, "draft_table_size", None)
    ):
        refuse("speculative_table_drafts", "true or false; true needs prompt_lookup_num_tokens and a stored table")


def request_error(body, model_config, continuous_batching: bool) -> RequestRefused | None:
    """Why a generation request cannot be served as asked (None: it can), before it is tokenized."""
    if not isinstance(body, dict):
        return None  # not an object: transformers' handler answers it (422)
    try:
        _check_sampling(body)
        if continuous_batching and body.get("stop"):
            raise RequestRefused(
                "stop",
                "`stop` with --continuous-batching: transformers' continuous batching stops a request at EOS or "
                "`max_tokens` only (its requests carry no stop strings), so the strings would be ignored. Leave "
                "`stop` out, or serve without --continuous-batching.",
            )
        raw = body.get("generation_config")
        if raw is None:
            return None
        try:
            given = json.loads(raw) if isinstance(raw, str) else dict(raw)
            if not isinstance(given, dict):
                raise TypeError(f"it holds a {type(given).__name__}")
        except (TypeError, ValueError) as error:
            raise RequestRefused("generation_config", f"`generation_config` is not a JSON object: {error}") from None
        _check_sampling(given, "generation_config.")
        if continuous_batching and given.get("stop_strings"):
            raise RequestRefused(
                "generation_config.stop_strings",
                "`stop_strings` with --continuous-batching: transformers' continuous batching stops a request at EOS "
                "or `max_tokens` only, so the strings would be ignored. Leave them out, or serve without "
                "--continuous-batching.",
            )
        exits = sorted(k for k in given if k in EXIT_ARGUMENTS)
        drafts = sorted(k for k in given if k in DRAFT_ARGUMENTS)
        if continuous_batching and (exits or drafts):
            raise RequestRefused(
                f"generation_config.{(exits + drafts)[0]}",
                f"{exits + drafts} in a request: with --continuous-batching, transformers runs one batching manager "
                "for the whole server, so exit and draft settings are the server's (the folder's stored ones, or "
                "--exit-settings). Leave them out, or serve without --continuous-batching for per-request settings.",
            )
        _check_drafts(given, model_config)
        if exits:
            try:
                resolve_exit_settings(model_config, {name: given.get(name) for name in EXIT_ARGUMENTS})
            except ValueError as error:
                named = next((n for n in exits if f"`{n}" in str(error)), exits[0])
                raise RequestRefused(f"generation_config.{named}", str(error)) from None
    except RequestRefused as refused:
        return refused
    return None


def exit_settings_error(body: dict, model_config, continuous_batching: bool) -> str | None:
    """The message of `request_error` (None: the request can be served)."""
    refused = request_error(body, model_config, continuous_batching)
    return None if refused is None else refused.message


def length_error(
    prompt_tokens: int, new_tokens: int | None, plan: CachePlan | None, path: str
) -> RequestRefused | None:
    """A prompt that, with the tokens it asks for, does not fit the model's length or the paged cache."""
    limit = plan.max_length if plan is not None else None
    if limit is None:
        return None
    prompt_field, fields = LENGTH_FIELDS.get(path, LENGTH_FIELDS["/v1/completions"])
    why = f"the model's maximum length {plan.model_max_length}" if limit == plan.model_max_length else "the paged cache"
    if prompt_tokens >= limit:
        return RequestRefused(
            prompt_field,
            f"the prompt has {prompt_tokens} tokens; a request may hold {limit} tokens ({why}), prompt and "
            "completion together.",
        )
    if new_tokens is not None and prompt_tokens + new_tokens > limit:
        return RequestRefused(
            fields[0],
            f"the prompt has {prompt_tokens} tokens and `{'` / `'.join(fields)}` asks for {new_tokens} more; a "
            f"request may hold {limit} tokens ({why}): ask for at most {limit - prompt_tokens}.",
        )
    return None

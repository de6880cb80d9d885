"""`ee-transformers serve FOLDER [transformers serve options]`: transformers' own OpenAI-compatible server
(`transformers serve`, with or without `--continuous-batching`) on an early-exit folder.

What this adds to transformers' server, and nothing else:

- **the classes resolvable.** transformers' model manager loads `getattr(transformers, config.architectures[0])`, so
  plain `transformers serve --trust-remote-code FOLDER` stops at start-up with `AttributeError: module transformers has
  no attribute EarlyExitLlamaForCausalLM` (the folder's `auto_map` is not read there; no file in the folder can fix
  that). This command puts this package's classes on the `transformers` module first.
- **a paged cache sized from the model, not from free memory.** With `--continuous-batching` and no size given,
  transformers fills 60% of the machine's free memory with paged-cache blocks (the test suite's tiny folder held
  7.1 GB). Here the cache holds `--cb-max-requests` (32) requests of `--max-length` tokens (default: the model's
  maximum length), at most 1 GiB of K/V; `--cb-memory BYTES` (the blocks that many bytes of K/V hold) or
  `--cb-num-blocks` size it instead, `--cb-block-size` sets the tokens per block; steps hold at most 1024 tokens
  (`--cb-max-batch-tokens`). The size is passed to transformers as its own `--cb-num-blocks` and printed at start-up
  in one line (blocks, block size, bytes of K/V); `--cb-max-memory-percent` alone keeps transformers' free-memory
  sizing.
- **requests checked before decoding.** `max_tokens` (and `max_completion_tokens`, `max_output_tokens`),
  `temperature`, `top_p`, `frequency_penalty`, `seed`, `stream`, `stop` and the exit and draft settings of the
  request's `generation_config` (a JSON string, transformers' field) are validated when the request arrives, and a
  prompt that with its `max_tokens` does not fit the model's length or the paged cache is refused once it is
  tokenized: each answers HTTP 400 naming the field (OpenAI's error body, `param` set), where transformers' server
  answers 500 with a traceback, or 200 with empty text for a negative `max_tokens`. With `--continuous-batching`,
  transformers builds one batching manager for the whole server, so the exit and draft settings are the server's; a
  request that sets any answers 400 saying so, instead of being decoded with other settings than it asked for. For
  the same reason a batched request whose sampling settings (`temperature`, `top_p`, ...) differ from the first
  batched request's answers 400 (transformers samples every request with the first one's), and so does `stop`
  (transformers' continuous batching stops at EOS and `max_tokens` only).
- **disconnects free their request.** A streaming client that goes away is cancelled by transformers; a
  non-streaming one is cancelled here (its request id is known, the batching manager is told), so its paged-cache
  blocks return at the next step. `GET /v1/ee/cache` reports the paged cache (blocks, free blocks, requests in
  flight): `{"started": false}` until the first continuous-batching request builds it.
- **a lean model and server-wide settings.** `--exit-max-layer E` loads decoder layers 0..E only (HELIOS): tokens
  exit by layer E. `--exit-settings JSON` sets the server's exit settings (as `model.set_exit_defaults`) over the
  folder's stored ones, and turns its stored draft settings off (they would take precedence).

Sequential serving (no `--continuous-batching`) runs `model.generate`, so per-request settings work there. With
`--continuous-batching`, exits run inside transformers' continuous batching (`paged_early_exit.py`).

The hooks wrap transformers' server as 5.19 to 5.24 have it (`server_seams_missing`: the same there); on a release
without those seams the command refuses in one line naming them.

The paged cache's size is tools/serve_cache.py's, the checks of a request tools/serve_requests.py's; their names stay
importable from here.
"""

import argparse
import asyncio
import contextvars
import inspect
import json
import sys
import uuid

import transformers

from ee_transformers.compat import require_transformers
from ee_transformers.convert import read_config
from ee_transformers.generation_early_exit import EXIT_ARGUMENTS, resolve_exit_settings
from ee_transformers.modeling_early_exit import FAMILIES
from ee_transformers.speculative_early_exit import DRAFT_SOURCES, MAX_BATCH_FIELD
from ee_transformers.tools.arguments import ArgumentParser, InputError
from ee_transformers.tools.serve_cache import (  # the paged cache's size; importable from here as before
    DEFAULT_CB_MEMORY,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_REQUESTS,
    CachePlan,
    kv_bytes_per_token,  # noqa: F401 (importable from here as before)
    model_max_length,
    parse_bytes,
    plan_paged_cache,
    served_dtype,
)
from ee_transformers.tools.serve_requests import (  # requests checked before decoding; importable from here as before
    DRAFT_ARGUMENTS,  # noqa: F401 (importable from here as before)
    LENGTH_FIELDS,
    RequestRefused,
    exit_settings_error,  # noqa: F401 (importable from here as before)
    length_error,
    request_error,
)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
CACHE_ENDPOINT = "/v1/ee/cache"
# the request being served (endpoint, whether it set its completion length), for the length check
_REQUEST = contextvars.ContextVar("ee_request", default=("/v1/completions", True))


# ---------------------------------------------------------------------------------------------------------------------
# the server's seams
# ---------------------------------------------------------------------------------------------------------------------
class ServerHooks:
    """What this command adds to transformers' app: the request check (ASGI middleware), the length check (around
    the generation managers), cancellation of non-streaming requests whose client left, `GET /v1/ee/cache`."""

    def __init__(self, model_config, continuous_batching: bool, plan: CachePlan | None):
        self.model_config, self.continuous_batching, self.plan = model_config, continuous_batching, plan
        self.generation_state = None  # transformers' GenerationState, once the app is built
        self.sampling = None  # the batching manager's sampling settings: the first batched request's

    def check_sampling(self, gen_config) -> None:
        """transformers' continuous batching decodes every request with the sampling settings of the first one
        (`CBGenerateManager.init_cb`; only `max_tokens` and EOS are per request): a request that asks for others
        answers 400 instead of being decoded with settings it did not ask for."""
        asked = sampling_settings(gen_config)
        if self.sampling is None:
            self.sampling = asked
        differs = [n for n in {**self.sampling, **asked} if asked.get(n) != self.sampling.get(n)]
        if differs:
            raise RequestRefused(
                "temperature" if "do_sample" in differs else differs[0],
                f"with --continuous-batching, transformers decodes every request with the sampling settings of the "
                f"server's first request ({self.sampling}); this one asks for {asked}. Send those settings, or serve "
                "without --continuous-batching for per-request sampling.",
            )

    def cb_manager(self):
        """transformers' `ContinuousBatchingManager` of this server (None before the first batched request)."""
        holder = getattr(self.generation_state, "_cb_manager", None)
        return getattr(holder, "_cb", None)

    def cache_state(self) -> dict:
        manager = self.cb_manager()
        processor = getattr(manager, "batch_processor", None)
        if processor is None:
            return {"started": False}
        cache, scheduler = processor.cache, processor.scheduler
        total = cache.num_sectors * cache.bytes_per_sector
        free = int(cache.compute_free_capacity(relative=False))
        return {
            "started": True,
            "num_blocks": cache.num_blocks,
            "free_blocks": cache.num_blocks * free // total,
            "kv_bytes": total,
            "free_kv_bytes": free,
            "cached_blocks": sum(len(a.ledger.cached_blocks) for a in cache.cache_allocators.values()),
            "active_requests": len(scheduler.active_requests),
            "waiting_requests": len(scheduler.waiting_requests),
        }


class RequestCheck:
    """ASGI middleware: a POST to a generation endpoint that `request_error` refuses answers 400 before it reaches
    transformers' handler; every other request passes untouched (its body replayed as it came). A non-streaming
    request whose client disconnects is cancelled in the batching manager (a streaming one transformers cancels)."""

    def __init__(self, app, hooks: ServerHooks):
        self.app, self.hooks = app, hooks

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == CACHE_ENDPOINT:
            return await _send_json(send, 200, json.dumps(self.hooks.cache_state()).encode())
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ENDPOINTS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            parsed = json.loads(body or b"{}")
        except ValueError:
            parsed = None  # not JSON: transformers' handler answers it
        refused = request_error(parsed, self.hooks.model_config, self.hooks.continuous_batching)
        if refused is not None:
            return await _send_json(send, 400, refused.body())
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode() or uuid.uuid4().hex
        if b"x-request-id" not in headers:  # transformers names the batching request after it
            scope = {**scope, "headers": [*scope["headers"], (b"x-request-id", request_id.encode())]}
        parsed = parsed if isinstance(parsed, dict) else {}
        fields = LENGTH_FIELDS[scope["path"]][1]
        gc = parsed.get("generation_config")
        length_given = any(parsed.get(f) is not None for f in fields) or (
            isinstance(gc, str) and '"max_new_tokens"' in gc
        )
        _REQUEST.set((scope["path"], length_given))
        messages, replayed, left = asyncio.Queue(), [False], asyncio.Event()

        async def pump():  # the client's messages after the body (a disconnect, when it leaves)
            while True:
                message = await receive()
                await messages.put(message)
                if message["type"] == "http.disconnect":
                    left.set()
                    return

        async def replay():
            if not replayed[0]:
                replayed[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await messages.get()

        pumping = asyncio.create_task(pump())
        serving = asyncio.create_task(self.app(scope, replay, send))
        try:
            if parsed.get("stream") is True:  # transformers cancels a stream whose client left
                return await serving
            leaving = asyncio.create_task(left.wait())
            done, _ = await asyncio.wait({serving, leaving}, return_when=asyncio.FIRST_COMPLETED)
            if serving in done:
                leaving.cancel()
                return serving.result()
            manager = self.hooks.cb_manager()
            if manager is not None:
                manager.cancel_request(request_id)
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        finally:
            pumping.cancel()


async def _send_json(send, status: int, payload: bytes):
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": payload})


def sampling_settings(gen_config) -> dict:
    """What continuous batching samples with, as a request's `GenerationConfig` sets it (greedy: nothing else)."""
    settings = {"do_sample": bool(gen_config.do_sample), "repetition_penalty": gen_config.repetition_penalty}
    if settings["do_sample"]:
        settings.update({n: getattr(gen_config, n, None) for n in ("temperature", "top_p", "top_k", "min_p")})
    return settings


def _length_checked(method, hooks: ServerHooks, batched: bool = False):
    """A generation manager's `generate_streaming` / `generate_non_streaming` that first refuses a prompt that does
    not fit (`length_error`), with transformers' own tokenization of the request; a request that did not set its
    completion length gets at most what fits (transformers' default is 1024 tokens)."""

    def check(inputs, gen_config):
        if batched:
            hooks.check_sampling(gen_config)
        ids = inputs["input_ids"]
        prompt = len(ids) if isinstance(ids, list) else int(ids.shape[-1])
        path, length_given = _REQUEST.get()
        limit = hooks.plan.max_length if hooks.plan is not None else None
        if not length_given and limit is not None and prompt < limit and gen_config.max_new_tokens is not None:
            gen_config.max_new_tokens = min(gen_config.max_new_tokens, limit - prompt)
        refused = length_error(prompt, gen_config.max_new_tokens, hooks.plan, path)
        if refused is not None:
            raise refused

    if asyncio.iscoroutinefunction(method):

        async def checked(self, model, processor, inputs, gen_config, *args, **kwargs):
            check(inputs, gen_config)
            return await method(self, model, processor, inputs, gen_config, *args, **kwargs)

    else:

        def checked(self, model, processor, inputs, gen_config, *args, **kwargs):
            check(inputs, gen_config)
            return method(self, model, processor, inputs, gen_config, *args, **kwargs)

    checked.__wrapped__ = method
    return checked


def server_seams_missing() -> list[str]:
    """What `install_hooks` and `ServerHooks` wrap or read in transformers' server that the installed release lacks:
    the app factory `build_server(..., generation_state=...)`, both generation managers' `generate_streaming` /
    `generate_non_streaming`, and where the server keeps its batching manager (`GenerationState._cb_manager`,
    `CBGenerateManager._cb`)."""
    from transformers.cli.serving import server, utils  # noqa: PLC0415

    missing = []
    build = getattr(server, "build_server", None)
    build = getattr(build, "__wrapped__", build)
    if build is None or "generation_state" not in inspect.signature(build).parameters:
        missing.append("cli.serving.server.build_server(generation_state=...)")
    for name in ("GenerateManager", "CBGenerateManager"):
        cls = getattr(utils, name, None)
        missing += [f"cli.serving.utils.{name}.{m}" for m in ("generate_streaming", "generate_non_streaming")
                    if not hasattr(cls, m)]  # fmt: skip
    for name, attribute in (("GenerationState", "_cb_manager"), ("CBGenerateManager", "_cb")):
        init = vars(getattr(utils, name, object)).get("__init__")  # where the attribute is set
        if init is None or f"self.{attribute}" not in inspect.getsource(init):
            missing.append(f"cli.serving.utils.{name}.{attribute}")
    return missing


def install_hooks(hooks: ServerHooks) -> None:
    """Wraps transformers' app factory (`build_server`, the one seam its server offers) so the app it returns checks
    requests first, answers `RequestRefused` with 400 and `GET /v1/ee/cache`, and its generation managers check
    prompt lengths."""
    from fastapi.responses import Response  # noqa: PLC0415
    from transformers.cli.serving import server, utils  # noqa: PLC0415

    build = getattr(server.build_server, "__wrapped__", server.build_server)

    async def refused(_request, error: RequestRefused):
        return Response(error.body(), status_code=400, media_type="application/json")

    def build_server(*args, **kwargs):
        app = build(*args, **kwargs)
        hooks.generation_state = kwargs.get("generation_state")
        app.add_exception_handler(RequestRefused, refused)
        app.add_middleware(RequestCheck, hooks=hooks)
        return app

    build_server.__wrapped__ = build
    server.build_server = build_server
    for cls in (utils.GenerateManager, utils.CBGenerateManager):
        for name in ("generate_streaming", "generate_non_streaming"):
            method = getattr(getattr(cls, name), "__wrapped__", getattr(cls, name))
            setattr(cls, name, _length_checked(method, hooks, batched=cls is utils.CBGenerateManager))


# ---------------------------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------------------------
class FolderLoader:
    """What transformers' model manager calls for a class: `from_pretrained`, here with `exit_max_layer` and
    server-wide exit settings applied, and without the model's own copy of the tokenizer: the server holds its own
    (transformers' processor), and a second one is resident memory for nothing (about 300 MB for Gemma's 262k
    vocabulary)."""

    def __init__(self, model_class, exit_max_layer: int | None = None, exit_settings: dict | None = None):
        self.model_class, self.exit_max_layer, self.exit_settings = model_class, exit_max_layer, exit_settings or {}

    def from_pretrained(self, *args, **kwargs):
        if self.exit_max_layer is not None:
            kwargs["exit_max_layer"] = self.exit_max_layer
        model = self.model_class.from_pretrained(*args, **kwargs)
        model.tokenizer = None
        if self.exit_settings:  # the server's confident exits: stored draft settings would take precedence
            model.set_exit_defaults(**self.exit_settings)
            for name in (*DRAFT_SOURCES, MAX_BATCH_FIELD):
                setattr(model.generation_config, name, None)
        return model


def register_classes(exit_max_layer: int | None = None, exit_settings: dict | None = None) -> list[str]:
    """Puts this package's causal-LM classes on the `transformers` module (what `transformers serve` resolves)."""
    names = []
    for cls in FAMILIES.values():
        setattr(transformers, cls.__name__, FolderLoader(cls, exit_max_layer, exit_settings))
        names.append(cls.__name__)
    return names


def _positive(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
        return value

    return parse


def _size(text):
    try:
        return parse_bytes(text)
    except InputError as error:  # argparse names the flag itself
        raise argparse.ArgumentTypeError(str(error).removeprefix("--cb-memory ")) from None


def add_cache_arguments(parser) -> None:
    """The paged cache's flags (transformers' `--cb-*` names where it has them)."""
    group = parser.add_argument_group("paged cache (with --continuous-batching)")
    group.add_argument("--cb-block-size", type=_positive("--cb-block-size"), help="tokens per block (default 256)")
    group.add_argument("--cb-num-blocks", type=_positive("--cb-num-blocks"), help="blocks of the paged cache")
    group.add_argument("--cb-memory", type=_size, help="bytes of K/V, e.g. 512MiB (default: see --cb-max-requests)")
    group.add_argument(
        "--cb-max-requests",
        type=_positive("--cb-max-requests"),
        default=None,
        help=f"with no size given, the cache holds this many requests of --max-length tokens, at most "
        f"{DEFAULT_CB_MEMORY // 2**20} MiB (default {DEFAULT_MAX_REQUESTS})",
    )
    group.add_argument(
        "--max-length", type=_positive("--max-length"), help="most tokens per request (default: the model's)"
    )
    group.add_argument(
        "--cb-max-batch-tokens",
        type=_positive("--cb-max-batch-tokens"),
        help=f"most tokens per step (default {DEFAULT_MAX_BATCH_TOKENS}; transformers' 8192 keeps a larger mask)",
    )
    group.add_argument("--cb-max-memory-percent", type=float, help="alone: transformers' sizing from free memory")


def main(argv=None):
    parser = ArgumentParser(
        prog="ee-transformers serve",
        description="Serve an early-exit folder with transformers' own OpenAI-compatible server (transformers serve).",
        epilog="Every other option goes to `transformers serve` (see `transformers serve --help`), e.g. "
        "--continuous-batching, --port, --host.",
    )
    parser.add_argument("folder", help="an early-exit folder (trust_remote_code is on)")
    parser.add_argument("--exit-max-layer", type=int, help="lean model: load decoder layers 0..E only (HELIOS)")
    parser.add_argument(
        "--exit-settings",
        type=json.loads,
        default=None,
        help="the server's exit settings as JSON, over the stored ones, e.g. '{\"exit_threshold\": 0.9}'",
    )
    add_cache_arguments(parser)
    try:
        args, rest = parser.parse_known_args(argv)
        serve(args.folder, rest, args.exit_max_layer, args.exit_settings, cache=args)
    except ValueError as error:  # one line and exit code 2, as every subcommand
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(error).split())}\n")
    return 0


CACHE_FLAGS = ("cb_block_size", "cb_num_blocks", "cb_memory", "cb_max_requests", "max_length", "cb_max_batch_tokens")


def cache_flags(plan: CachePlan, cache) -> list[str]:
    """transformers serve's own flags for the plan."""
    flags = []
    if plan.num_blocks is not None:
        flags += ["--cb-num-blocks", str(plan.num_blocks)]
    if getattr(cache, "cb_block_size", None) is not None:  # transformers' default page size otherwise (no warning)
        flags += ["--cb-block-size", str(plan.block_size)]
    flags += ["--cb-max-batch-tokens", str(plan.max_batch_tokens)]
    if getattr(cache, "cb_max_memory_percent", None) is not None:
        flags += ["--cb-max-memory-percent", str(cache.cb_max_memory_percent)]
    return flags


def serve(
    folder: str,
    transformers_args: list,
    exit_max_layer: int | None = None,
    exit_settings: dict | None = None,
    cache=None,
):
    """Runs `transformers serve FOLDER --trust-remote-code *transformers_args` with this package's classes; `cache`
    holds the paged cache's flags (`add_cache_arguments`)."""
    try:
        from transformers.cli.transformers import app  # noqa: PLC0415
    except ImportError as error:
        raise InputError(
            f"serving needs transformers' server: pip install 'ee-transformers[serving]' ({error})"
        ) from error
    try:
        require_transformers("`ee-transformers serve`", server_seams_missing())
    except ImportError as error:  # one line, as every other refusal of the command
        raise InputError(str(error)) from None
    if not read_config(folder, "folder").get("exit_layers"):
        raise InputError(f"`folder` {str(folder)!r} is not an early-exit folder (its config has no `exit_layers`).")
    model_config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    if exit_settings:
        unknown = sorted(set(exit_settings) - set(EXIT_ARGUMENTS))
        if unknown:
            raise InputError(f"--exit-settings: {unknown} are not exit settings; allowed: {sorted(EXIT_ARGUMENTS)}")
        resolve_exit_settings(model_config, {name: exit_settings.get(name) for name in EXIT_ARGUMENTS})
    continuous = "--continuous-batching" in transformers_args
    given = [n for n in (*CACHE_FLAGS, "cb_max_memory_percent") if getattr(cache, n, None) is not None]
    given = [n for n in given if n != "max_length"]  # sequential serving holds it too
    plan = None
    if continuous:
        dtype_flag = next(
            (transformers_args[i + 1] for i, a in enumerate(transformers_args[:-1]) if a == "--dtype"), None
        )
        plan = plan_paged_cache(
            model_config,
            served_dtype(model_config, dtype_flag),
            exit_max_layer,
            block_size=getattr(cache, "cb_block_size", None),
            num_blocks=getattr(cache, "cb_num_blocks", None),
            memory=getattr(cache, "cb_memory", None),
            max_requests=getattr(cache, "cb_max_requests", None),
            max_length=getattr(cache, "max_length", None),
            memory_percent=getattr(cache, "cb_max_memory_percent", None),
            max_batch_tokens=getattr(cache, "cb_max_batch_tokens", None),
        )
        transformers_args = [*transformers_args, *cache_flags(plan, cache)]
        print(plan.line(), file=sys.stderr, flush=True)
    elif given:
        raise InputError(
            f"{['--' + n.replace('_', '-') for n in given]} size the paged cache: add --continuous-batching."
        )
    register_classes(exit_max_layer, exit_settings)
    if plan is None:  # sequential: the model's length is the limit
        longest = getattr(cache, "max_length", None) or model_max_length(model_config)
        plan = CachePlan(1, None, 0, longest, "sequential")
    install_hooks(ServerHooks(model_config, continuous, plan))
    app(["serve", folder, "--trust-remote-code", *transformers_args], prog_name="ee-transformers serve")

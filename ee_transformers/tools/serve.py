"""`ee-transformers serve FOLDER [transformers serve options]`: transformers' own OpenAI-compatible server
(`transformers serve`, with or without `--continuous-batching`) on an early-exit folder.

Three things this adds to transformers' server, and nothing else:

- **the classes resolvable.** transformers' model manager loads `getattr(transformers, config.architectures[0])`, so
  plain `transformers serve --trust-remote-code FOLDER` stops at start-up with `AttributeError: module transformers has
  no attribute EarlyExitLlamaForCausalLM` (the folder's `auto_map` is not read there; no file in the folder can fix
  that). This command puts this package's classes on the `transformers` module first.
- **exit settings checked before decoding.** A request's `generation_config` (a JSON string, transformers' field) may
  carry exit settings (`exit_threshold`, `exit_policy`, `early_exit`, ...). They are validated against the folder's
  config when the request arrives: an invalid one answers HTTP 400 naming the setting, where transformers' server
  answers 500. With `--continuous-batching`, transformers builds one batching manager for the whole server, so the
  exit settings are the folder's stored ones; a request that sets any answers 400 saying so, instead of being
  decoded with other settings than it asked for.
- **a lean model and server-wide settings.** `--exit-max-layer E` loads decoder layers 0..E only (HELIOS): tokens
  exit by layer E. `--exit-settings JSON` sets the server's exit settings (as `model.set_exit_defaults`) over the
  folder's stored ones, and turns its stored draft settings off (they would take precedence).

Sequential serving (no `--continuous-batching`) runs `model.generate`, so per-request settings work there. With
`--continuous-batching`, exits run inside transformers' continuous batching (`paged_early_exit.py`).
"""

import json

import transformers

from ee_transformers.convert import read_config
from ee_transformers.generation_early_exit import EXIT_ARGUMENTS, resolve_exit_settings
from ee_transformers.modeling_early_exit import FAMILIES
from ee_transformers.speculative_early_exit import DRAFT_SOURCES, MAX_BATCH_FIELD
from ee_transformers.tools.arguments import ArgumentParser, InputError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


class FolderLoader:
    """What transformers' model manager calls for a class: `from_pretrained`, here with `exit_max_layer` and
    server-wide exit settings applied."""

    def __init__(self, model_class, exit_max_layer: int | None = None, exit_settings: dict | None = None):
        self.model_class, self.exit_max_layer, self.exit_settings = model_class, exit_max_layer, exit_settings or {}

    def from_pretrained(self, *args, **kwargs):
        if self.exit_max_layer is not None:
            kwargs["exit_max_layer"] = self.exit_max_layer
        model = self.model_class.from_pretrained(*args, **kwargs)
        if self.exit_settings:  # the server's confident exits: stored draft settings would take precedence
            model.set_exit_defaults(**self.exit_settings)
            for name in (*DRAFT_SOURCES, MAX_BATCH_FIELD):
                setattr(model.generation_config, name, None)
        return model


def register_classes(exit_max_layer: int | None = None, exit_settings: dict | None = None) -> list[str]:
    """Puts this package's causal-LM classes on the `transformers` module (what `transformers serve` resolves)."""
    names = []
    for cls in FAMILIES.values():
        plain = exit_max_layer is None and not exit_settings
        setattr(transformers, cls.__name__, cls if plain else FolderLoader(cls, exit_max_layer, exit_settings))
        names.append(cls.__name__)
    return names


def exit_settings_error(body: dict, model_config, continuous_batching: bool) -> str | None:
    """Why a request's exit settings cannot be served (None: they can)."""
    raw = body.get("generation_config")
    if raw is None:
        return None
    try:
        given = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except (TypeError, ValueError) as error:
        return f"`generation_config` is not a JSON object: {error}"
    exits = {k: v for k, v in given.items() if k in EXIT_ARGUMENTS}
    if not exits:
        return None
    if continuous_batching:
        return (
            f"{sorted(exits)} in a request: with --continuous-batching, transformers runs one batching manager for the "
            "whole server, so exit settings are the server's (the folder's stored ones, or --exit-settings). Leave them out, or "
            "serve without --continuous-batching for per-request settings."
        )
    try:
        resolve_exit_settings(model_config, {name: exits.get(name) for name in EXIT_ARGUMENTS})
    except ValueError as error:
        return str(error)
    return None


class ExitSettingsCheck:
    """ASGI middleware: a POST to a generation endpoint whose exit settings cannot be served answers 400 before it
    reaches transformers' handler; every other request passes untouched (its body replayed as it came)."""

    def __init__(self, app, model_config, continuous_batching: bool):
        self.app, self.model_config, self.continuous_batching = app, model_config, continuous_batching

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ENDPOINTS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            error = exit_settings_error(json.loads(body or b"{}"), self.model_config, self.continuous_batching)
        except ValueError:
            error = None  # not JSON: transformers' handler answers it
        if error is not None:
            payload = json.dumps({"error": {"message": error, "type": "invalid_request_error"}}).encode()
            await send(
                {"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]}
            )
            return await send({"type": "http.response.body", "body": payload})

        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


def install_exit_check(model_config, continuous_batching: bool) -> None:
    """Wraps transformers' app factory (`build_server`, the one seam its server offers) so the app it returns checks
    exit settings first."""
    from transformers.cli.serving import server  # noqa: PLC0415

    build = getattr(server.build_server, "__wrapped__", server.build_server)

    def build_server(*args, **kwargs):
        app = build(*args, **kwargs)
        app.add_middleware(ExitSettingsCheck, model_config=model_config, continuous_batching=continuous_batching)
        return app

    build_server.__wrapped__ = build
    server.build_server = build_server


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
    args, rest = parser.parse_known_args(argv)
    try:
        serve(args.folder, rest, args.exit_max_layer, args.exit_settings)
    except ValueError as error:  # one line and exit code 2, as every subcommand
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(error).split())}\n")
    return 0


def serve(folder: str, transformers_args: list, exit_max_layer: int | None = None, exit_settings: dict | None = None):
    """Runs `transformers serve FOLDER --trust-remote-code *transformers_args` with this package's classes."""
    try:
        from transformers.cli.transformers import app  # noqa: PLC0415
    except ImportError as error:
        raise InputError(
            f"serving needs transformers' server: pip install 'ee-transformers[serving]' ({error})"
        ) from error
    if not read_config(folder, "folder").get("exit_layers"):
        raise InputError(f"`folder` {str(folder)!r} is not an early-exit folder (its config has no `exit_layers`).")
    model_config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    if exit_settings:
        unknown = sorted(set(exit_settings) - set(EXIT_ARGUMENTS))
        if unknown:
            raise InputError(f"--exit-settings: {unknown} are not exit settings; allowed: {sorted(EXIT_ARGUMENTS)}")
        resolve_exit_settings(model_config, {name: exit_settings.get(name) for name in EXIT_ARGUMENTS})
    register_classes(exit_max_layer, exit_settings)
    install_exit_check(model_config, "--continuous-batching" in transformers_args)
    app(["serve", folder, "--trust-remote-code", *transformers_args], prog_name="ee-transformers serve")

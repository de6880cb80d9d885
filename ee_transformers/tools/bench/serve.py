"""`ee-transformers bench-serve`: transformers' own server under load from the `openai` client, early-exit folders
against plain `transformers serve` of the base model, sequential and continuous batching, in one run.

Each server is a child process on 127.0.0.1 (killed by its PID when its rows are done):

* plain: `transformers serve BASE` (the family's own class, no exits);
* stored: `ee-transformers serve FOLDER` with the folder's stored settings (what a user of the folder gets);
* exits: the same with `--exit-settings JSON` (given confident-exit settings; lossy);
* lean: the same with `--exit-max-layer E` (HELIOS: layers above E are not loaded, every token exits by E).

For each server, each mode (`sequential`: transformers' one inference thread; `continuous-batching`) and each number
of concurrent clients C, `requests` greedy completions (held-out prompts, `new_tokens` each, EOS off) are sent from C
threads. A row reports tokens/s (generated tokens over the wall time of the whole level), p50 / p95 request latency,
the server's resident memory (RSS after the level) and how many answers equal plain sequential serving's text.

    ee-transformers bench-serve --model runs/smollm2-135m-ee --base ~/.cache/ee-transformers/smollm2-135m-instruct

Python API: `ServeBenchConfig`, `run_serve_bench`, `format_serve`, `main`.
"""

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ee_transformers.convert import read_config
from ee_transformers.tools.arguments import (
    ArgumentParser,
    InputError,
    add_config_arguments,
    check_fields,
    config_from_args,
    run_command,
)

__all__ = ["ServeBenchConfig", "format_serve", "main", "run_serve_bench"]

SERVERS = ("plain", "stored", "exits", "lean")
MODES = ("sequential", "continuous-batching")


@dataclass
class ServeBenchConfig:
    """Settings of one `bench-serve` run; `__post_init__` raises `ValueError` naming a bad field."""

    clients: list[int] = field(default_factory=lambda: [1, 4, 16], metadata={"help": "concurrent clients", "min": 1})
    requests: int = field(
        default=16, metadata={"help": "requests per level (at least the number of clients)", "min": 1}
    )
    new_tokens: int = field(default=64, metadata={"help": "greedy tokens per request", "min": 1})
    num_prompts: int = field(default=16, metadata={"help": "held-out prompts, cycled", "min": 1})
    prompt_tokens: int = field(default=64, metadata={"help": "tokens per prompt", "min": 1})
    servers: list[str] = field(
        default_factory=lambda: ["plain", "stored", "exits", "lean"],
        metadata={"help": "servers measured", "choices": SERVERS},
    )
    modes: list[str] = field(default_factory=lambda: list(MODES), metadata={"help": "serving modes", "choices": MODES})
    exit_settings: str | None = field(
        default=None, metadata={"help": "JSON exit settings of the `exits` server (it is skipped without them)"}
    )
    exit_max_layer: int | None = field(
        default=None, metadata={"help": "the lean server's exit_max_layer (it is skipped without one)", "min": 0}
    )
    threads: int = field(default=2, metadata={"help": "torch threads of each server (OMP_NUM_THREADS)", "min": 1})
    cb_block_size: int = field(default=64, metadata={"help": "continuous batching's page size in tokens", "min": 4})
    seed: int = field(default=0, metadata={"help": "seed of the prompts"})

    def __post_init__(self):
        check_fields(self)
        if self.exit_settings is not None:
            try:
                json.loads(self.exit_settings)
            except ValueError as error:
                raise ValueError(
                    f"`exit_settings` must be a JSON object, got {self.exit_settings!r} ({error})"
                ) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server as a child process on 127.0.0.1; `stop()` kills it by its PID."""

    def __init__(self, argv: list, threads: int, log_path: Path):
        self.port, self.log_path = _free_port(), log_path
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        argv = [*argv, "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--log-level", "warning"]
        self.proc = subprocess.Popen(argv, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited at start-up (log: {log_path}):\n{log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not answer /health in 300 s (log: {log_path})")

    def rss(self) -> int:
        import psutil  # noqa: PLC0415 (transformers[serving] brings it)

        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(self) -> str:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        return self.log_path.read_text()


def _server_argv(kind: str, model: str, base: str, config: ServeBenchConfig, mode: str) -> list:
    cli = [sys.executable, "-m", "ee_transformers.tools.cli", "serve", model]
    argv = {
        "plain": [sys.executable, "-m", "transformers.cli.transformers", "serve", base],
        "stored": cli,
        "exits": [*cli, "--exit-settings", config.exit_settings or "{}"],
        "lean": [*cli, "--exit-max-layer", str(config.exit_max_layer)],
    }[kind]
    if mode == "continuous-batching":
        tokens = max(config.clients) * (config.prompt_tokens + config.new_tokens + 16)
        blocks = 2 * (tokens // config.cb_block_size + max(config.clients))
        argv += ["--continuous-batching", "--cb-block-size", str(config.cb_block_size), "--cb-num-blocks", str(blocks)]
    return argv


def _complete(client, model: str, prompt: str, new_tokens: int):
    start = time.perf_counter()
    out = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=new_tokens,
        temperature=0,
        extra_body={"generation_config": json.dumps({"eos_token_id": -1, "max_new_tokens": new_tokens})},  # EOS off
    )
    return time.perf_counter() - start, out.choices[0].text, out.usage.completion_tokens


def _level(server, model, prompts, clients, config, bar):
    """`config.requests` requests from `clients` threads: wall time, latencies, texts, generated tokens."""
    import openai  # noqa: PLC0415

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", timeout=1800)
    n = max(config.requests, clients)

    def one(i):
        result = _complete(client, model, prompts[i % len(prompts)], config.new_tokens)
        bar.update(1)
        return result

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.perf_counter() - start
    return wall, [r[0] for r in results], [r[1] for r in results], sum(r[2] for r in results)


def run_serve_bench(model: str, base: str, config: ServeBenchConfig, out: Path | None = None, log=None) -> dict:
    """Every (server, mode, clients) row of the run; see the module docstring."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from ee_transformers.tools.bench.loading import heldout_prompts  # noqa: PLC0415

    log = log or (lambda line: print(line, flush=True))
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = heldout_prompts(tokenizer, num_prompts=config.num_prompts, window=config.prompt_tokens, seed=config.seed)
    prompts = [tokenizer.decode(p["ids"]) for p in ids]
    servers = [s for s in config.servers if not (s == "exits" and config.exit_settings is None)]
    servers = [s for s in servers if not (s == "lean" and config.exit_max_layer is None)]
    skipped = sorted(set(config.servers) - set(servers))
    if skipped:
        log(f"skipped (no --exit-settings / --exit-max-layer given): {skipped}")
    logs = Path(out) if out is not None else Path.cwd()
    logs.mkdir(parents=True, exist_ok=True)
    total = len(servers) * len(config.modes) * sum(max(config.requests, c) for c in config.clients)
    rows, reference = [], None
    with tqdm(total=total, desc="bench-serve", unit="request") as bar:
        for kind in servers:
            for mode in config.modes:
                served = base if kind == "plain" else model
                argv = _server_argv(kind, model, base, config, mode)
                server = ServerProcess(argv, config.threads, logs / f"server-{kind}-{mode}.log")
                try:
                    _complete(openai_client(server), served, prompts[0], 4)  # warm-up (loads the model, first batch)
                    for clients in config.clients:
                        wall, latencies, texts, tokens = _level(server, served, prompts, clients, config, bar)
                        if reference is None:
                            reference = texts  # plain, sequential, the first level: the text every row is held to
                        rows.append(_row(kind, mode, clients, wall, latencies, texts, tokens, reference, server.rss()))
                        log(format_serve([rows[-1]], header=len(rows) == 1))
                        if out is not None:
                            _write(logs, model, base, config, rows)
                except Exception as error:  # a server that fails is a row that says so; the others still run
                    rows.append({"server": kind, "mode": mode, "error": f"{type(error).__name__}: {error}"})
                    log(f"| {kind} | {mode} | failed: {rows[-1]['error'][:200]} (log: {server.log_path}) |")
                finally:
                    server_log = server.stop()
                if "Traceback" in server_log:
                    log(f"note: the {kind} {mode} server logged a traceback: see {server.log_path}")
    if out is not None:
        _write(logs, model, base, config, rows)
    return {"model": model, "base": base, "config": asdict(config), "rows": rows}


def _write(folder, model, base, config, rows):
    """serve.json and serve.md as they stand (written after every row, so a run cut short keeps its rows)."""
    (folder / "serve.json").write_text(
        json.dumps({"model": model, "base": base, "config": asdict(config), "rows": rows}, indent=2)
    )
    (folder / "serve.md").write_text(format_serve(rows) + "\n")


def openai_client(server):
    import openai  # noqa: PLC0415

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", timeout=1800)


def _row(kind, mode, clients, wall, latencies, texts, tokens, reference, rss):
    latencies = sorted(latencies)
    p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
    same = sum(a == reference[i % len(reference)] for i, a in enumerate(texts))
    return {
        "server": kind,
        "mode": mode,
        "clients": clients,
        "requests": len(texts),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "p50_s": round(statistics.median(latencies), 3),
        "p95_s": round(p95, 3),
        "rss_mb": round(rss / 2**20, 1),
        "same_text": same,
    }


def format_serve(rows, header=True) -> str:
    lines = []
    if header:
        lines += [
            "| server | mode | clients | requests | tokens/s | p50 s | p95 s | RSS MB | same text as plain |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['server']} | {r['mode']} | failed: {r['error'][:120]} | | | | | | |")
            continue
        lines.append(
            f"| {r['server']} | {r['mode']} | {r['clients']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
            f"{r['p50_s']:.2f} | {r['p95_s']:.2f} | {r['rss_mb']:.0f} | {r['same_text']}/{r['requests']} |"
        )
    return "\n".join(lines)


def _run(args):
    config = config_from_args(ServeBenchConfig, args)
    if not read_config(args.model, "--model").get("exit_layers"):
        raise InputError(f"`--model` {args.model!r} is not an early-exit folder (its config has no `exit_layers`).")
    read_config(args.base, "--base")
    run_serve_bench(args.model, args.base, config, out=Path(args.out) if args.out else None)


def main(argv=None):
    parser = ArgumentParser(
        prog="ee-transformers bench-serve",
        description="transformers serve under load from the openai client: early-exit folders against plain serving "
        "of the base model, sequential and continuous batching, in one run.",
    )
    parser.add_argument("--model", required=True, help="an early-exit folder")
    parser.add_argument("--base", required=True, help="the plain checkpoint folder it was converted from")
    parser.add_argument("--out", default=None, help="folder for serve.json, serve.md and the servers' logs")
    add_config_arguments(parser, ServeBenchConfig)
    return run_command(parser, _run, argv)

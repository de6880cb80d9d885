"""`ee-transformers bench-serve`: transformers' own server under load from the `openai` client, early-exit folders
against plain `transformers serve --continuous-batching` of the base model, in one run on one machine.

Each server is a child process on 127.0.0.1 (killed by its PID when its rows are done):

* plain: `transformers serve BASE` (the family's own class, no exits);
* stored: `ee-transformers serve FOLDER` with the folder's stored settings (what a user of the folder gets);
* exits: the same with `--exit-settings JSON` (given confident-exit settings; lossy);
* lean: the same with `--exit-max-layer E` (HELIOS: layers above E are not loaded, every token exits by E).

The engine choice: the `vllm-*` servers are `vllm serve` (the package's vLLM plugin, `ee_transformers/vllm/`), run
by `vllm_python` (an environment with vLLM: `scripts/setup.sh --vllm`), in vLLM's default compiled mode and, with
`vllm_modes` `eager`, with `--enforce-eager` too:

* vllm-plain: `vllm serve BASE`;
* vllm-off: `vllm serve FOLDER` with exits and drafts off (`--override-generation-config '{"early_exit": false,
  "prompt_lookup_num_tokens": 0}'`);
* vllm-stored: `vllm serve FOLDER` with the folder's stored (calibrated) settings: its exits, or its lossless mode
  (our proposer, which the plugin turns on for a stored `prompt_lookup_num_tokens`);
* vllm-ngram: `vllm serve BASE` with vLLM's own prompt lookup (`ngram`, 4 drafts, n-grams of 2 to 4);
* vllm-drafts: `vllm serve FOLDER` with the package's drafter as vLLM's proposer (`ee_transformers/vllm/proposer.py`;
  the folder's stored `prompt_lookup_num_tokens` drafts at most, else 4), exits off;
* vllm-forced-25 / -50 / -100: `vllm serve FOLDER` with 25% / 50% / every decode step forced to the exit nearest half
  depth (`ee_forced_profile`, benchmark only), so realised against ideal measures the engine, not the heads; `ideal`
  is the package's cost model (`measure.costs`, measured on the folder in this process) for that profile.

A vLLM row's `x plain` is over vllm-plain at the same mode, workload and clients, and its text is compared with
vllm-plain's: vllm-off must answer it (the run fails otherwise).

Every server gets the same paged cache (`--cb-block-size`, `--cb-num-blocks`: room for the longest request of the run
from every client at once, twice over) and the same `--cb-max-batch-tokens`, so their resident memory compares at one
cache size. For each server, mode
(`continuous-batching`; `sequential`: transformers' one inference thread) and number of concurrent clients C, each
workload runs:

* `prompts`: `requests` greedy completions of held-out prompts (`prompt_tokens` each, `new_tokens` new, EOS off)
  from C threads;
* `chat`: C conversations of `turns` turns, each turn sending the whole conversation so far (its earlier user turns
  and the model's answers) plus a held-out passage to repeat and explain;
* `edits`: C documents (held-out passages), each edited `turns` times: every turn sends the conversation so far and
  asks for the whole document back with one more word replaced.

Every level (workload and clients) sends passages of its own, none that an earlier level sent: a server that
keeps a history of its answers (the drafts' history index) would otherwise draft the answers it already gave.
Prompts come from `prompt_domain`: by default the Python manual's held-out tail. The main job fits heads and table on
Austen novels and the manual's first half; `table_from` serves a copy of the folder whose draft table is rebuilt from
other text (`--table-from austen` with Python prompts: drafts meet a domain the table was not built from).

A row reports tokens/s (generated tokens over the wall time of the level), p50 / p95 request latency, the server's
resident memory (RSS after the level) and how many answers equal plain's answer to the same request (its prompt, or
its conversation and turn). Every greedy request of a lossless server (plain, stored) must answer plain's text: the
run fails (exit code 1) if one does not.

    ee-transformers bench-serve --model runs/smollm2-135m-ee --base ~/.cache/ee-transformers/smollm2-135m-instruct

Python API: `ServeBenchConfig`, `run_serve_bench`, `format_serve`, `main`.
"""

import json
import math
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

VLLM_FORCED = {"vllm-forced-25": 0.25, "vllm-forced-50": 0.5, "vllm-forced-100": 1.0}  # share at half depth
VLLM_DRAFTS = {  # lossless drafts in vLLM: its own prompt lookup on the base, the package's proposer on the folder
    "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "vllm-drafts": {"method": "custom_class", "model": "ee_transformers.vllm.proposer.EarlyExitProposer"},
}
VLLM_SERVERS = ("vllm-plain", "vllm-off", "vllm-stored", *VLLM_FORCED, *VLLM_DRAFTS)
SERVERS = ("plain", "stored", "exits", "lean", *VLLM_SERVERS)
LOSSLESS = ("plain", "stored", "vllm-plain", "vllm-off", *VLLM_DRAFTS)
MODES = ("sequential", "continuous-batching")
VLLM_MODES = ("compiled", "eager")
WORKLOADS = ("prompts", "chat", "edits")
DOMAINS = ("python", "austen", "both")


@dataclass
class ServeBenchConfig:
    """Settings of one `bench-serve` run; `__post_init__` raises `ValueError` naming a bad field."""

    clients: list[int] = field(
        default_factory=lambda: [1, 4, 16, 32], metadata={"help": "concurrent clients", "min": 1}
    )
    workloads: list[str] = field(
        default_factory=lambda: ["prompts", "chat"],
        metadata={"help": "what the clients send (see the module docstring)", "choices": WORKLOADS},
    )
    requests: int = field(
        default=32, metadata={"help": "requests per level of `prompts` (at least the number of clients)", "min": 1}
    )
    turns: int = field(default=4, metadata={"help": "turns of each `chat` conversation / `edits` document", "min": 1})
    new_tokens: int = field(default=64, metadata={"help": "greedy tokens per request", "min": 1})
    num_prompts: int | None = field(
        default=None,
        metadata={
            "help": "distinct held-out passages drawn (default: one for every passage the run sends, so no level "
            "sends text an earlier level sent, whose answers a server with a history index would remember; fewer "
            "are cycled)",
            "min": 1,
        },
    )
    prompt_tokens: int = field(default=64, metadata={"help": "tokens per prompt (per user turn)", "min": 1})
    prompt_domain: str = field(
        default="python",
        metadata={
            "help": "held-out text of the prompts: python (the Python manual's tail, not what heads and tables are "
            "fitted on), austen (the held-out novel), both (alternating)",
            "choices": DOMAINS,
        },
    )
    servers: list[str] = field(
        default_factory=lambda: ["plain", "stored"], metadata={"help": "servers measured", "choices": SERVERS}
    )
    modes: list[str] = field(
        default_factory=lambda: ["continuous-batching"], metadata={"help": "serving modes", "choices": MODES}
    )
    exit_settings: str | None = field(
        default=None, metadata={"help": "JSON exit settings of the `exits` server (it is skipped without them)"}
    )
    exit_max_layer: int | None = field(
        default=None, metadata={"help": "the lean server's exit_max_layer (it is skipped without one)", "min": 0}
    )
    vllm_modes: list[str] = field(
        default_factory=lambda: ["compiled"],
        metadata={
            "help": "vLLM servers' modes: compiled (vLLM's default) and eager (--enforce-eager)",
            "choices": VLLM_MODES,
        },
    )
    vllm_python: str | None = field(
        default=None,
        metadata={"help": "the Python of an environment with vLLM, for vllm-* servers (default: this one)"},
    )
    vllm_kv_cache_gib: int = field(
        default=2, metadata={"help": "vLLM servers' KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)", "min": 1}
    )
    threads: int = field(default=2, metadata={"help": "torch threads of each server (OMP_NUM_THREADS)", "min": 1})
    cb_block_size: int = field(default=64, metadata={"help": "continuous batching's page size in tokens", "min": 4})
    cb_max_batch_tokens: int = field(
        default=1024, metadata={"help": "continuous batching's most tokens per step (every server)", "min": 1}
    )
    check_text: bool = field(
        default=True, metadata={"help": "fail the run when a lossless server answers other text than plain"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the prompts"})
    table_from: str | None = field(
        default=None,
        metadata={
            "help": "serve a copy of the folder (in --out) whose draft table is rebuilt from this text: 'training', "
            "'austen', 'python' or a text file (default: the folder's own table)"
        },
    )

    def __post_init__(self):
        check_fields(self)
        if self.exit_settings is not None:
            try:
                json.loads(self.exit_settings)
            except ValueError as error:
                raise ValueError(
                    f"`exit_settings` must be a JSON object, got {self.exit_settings!r} ({error})"
                ) from None

    def longest_request(self) -> int:
        """Tokens of the longest request of the run (a conversation's last turn holds every earlier one)."""
        turns = 1 if set(self.workloads) == {"prompts"} else self.turns
        return turns * (2 * self.prompt_tokens + self.new_tokens + 48)  # passage, instruction, answer, template


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server as a child process on 127.0.0.1, in a process group of its own; `stop()` kills the group."""

    def __init__(self, argv: list, threads: int, log_path: Path, env: dict | None = None, vllm: bool = False):
        self.port, self.log_path = _free_port(), log_path
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}
        where = ["--host", "127.0.0.1", "--port", str(self.port)]
        argv = [
            *argv,
            *where,
            *(["--uvicorn-log-level", "warning"] if vllm else ["--device", "cpu", "--log-level", "warning"]),
        ]
        # its own process group: vLLM's engine and worker are child processes, which a kill of the server alone
        # leaves running (each holding its K/V cache and spinning its threads on the next server's cores)
        self.proc = subprocess.Popen(
            argv, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.time() + 900  # vLLM compiles its model at start-up
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited at start-up (log: {log_path}):\n{log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not answer /health in 900 s (log: {log_path})")

    def rss(self) -> int:
        import psutil  # noqa: PLC0415 (transformers[serving] brings it)

        process = psutil.Process(self.proc.pid)  # vLLM's engine and worker are child processes: count the tree
        return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])

    def stop(self) -> str:
        """Kills the server; its log, with this machine's paths made portable (also in the file)."""
        os.killpg(self.proc.pid, signal.SIGKILL)  # the server and every process it started
        self.proc.wait(timeout=60)
        text = portable(self.log_path.read_text())
        self.log_path.write_text(text)
        return text


def portable(text: str) -> str:
    """`text` without this machine's paths, as results are kept: the working folder's prefix dropped, the home
    folder written `~`."""
    return text.replace(os.getcwd() + os.sep, "").replace(str(Path.home()), "~")


def _server_argv(kind: str, model: str, base: str, config: ServeBenchConfig, mode: str) -> list:
    cli = [sys.executable, "-m", "ee_transformers.tools.cli", "serve", model]
    argv = {
        "plain": [sys.executable, "-m", "transformers.cli.transformers", "serve", base],
        "stored": cli,
        "exits": [*cli, "--exit-settings", config.exit_settings or "{}"],
        "lean": [*cli, "--exit-max-layer", str(config.exit_max_layer)],
    }[kind]
    if mode == "continuous-batching":  # one cache size for every server: its longest request from every client, x2
        per_request = math.ceil(config.longest_request() / config.cb_block_size) + 1
        blocks = 2 * max(config.clients) * per_request
        argv += ["--continuous-batching", "--cb-block-size", str(config.cb_block_size), "--cb-num-blocks", str(blocks)]
        argv += ["--cb-max-batch-tokens", str(config.cb_max_batch_tokens)]
    return argv


def _vllm_argv(kind: str, model: str, base: str, config: ServeBenchConfig, mode: str) -> list:
    """`vllm serve` of the base (vllm-plain) or of the folder, fp32, greedy defaults from the request."""
    served = base if kind in ("vllm-plain", "vllm-ngram") else model
    python = config.vllm_python or sys.executable
    # `vllm serve`'s server; vllm-cpu 0.32.0's `vllm` command fails before it reads its arguments (it asks for the
    # version of a distribution named `vllm`), so its module entry point is run instead
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", served, "--dtype", "float32"]
    argv += ["--max-model-len", str(config.longest_request() + 64), "--served-model-name", served]
    override = {"vllm-off": {"early_exit": False, "prompt_lookup_num_tokens": 0}}.get(kind)
    if kind in VLLM_FORCED:  # no stored lossless mode either: it would turn the proposer on and the exits off
        shares = {"0.5": VLLM_FORCED[kind], "1.0": 1.0 - VLLM_FORCED[kind]}
        override = {"ee_forced_profile": shares, "prompt_lookup_num_tokens": 0}
    if override is not None:
        argv += ["--override-generation-config", json.dumps(override)]
    if kind in VLLM_DRAFTS:
        spec = dict(VLLM_DRAFTS[kind])
        spec.setdefault("num_speculative_tokens", _stored_lookup(model) or 4)
        argv += ["--speculative-config", json.dumps(spec)]
    if mode == "eager":
        argv.append("--enforce-eager")
    return argv


def _stored_lookup(model: str) -> int | None:
    """The folder's stored `prompt_lookup_num_tokens` (its lossless mode), None without one."""
    path = Path(model) / "generation_config.json"
    return json.loads(path.read_text()).get("prompt_lookup_num_tokens") if path.exists() else None


def forced_ideal(model: str, clients: list[int]) -> dict:
    """{(server, clients): ideal speed-up} of the forced vLLM rows under the package's cost model (`measure.costs`,
    timed here on the folder at decode shape): a step at the exit nearest half depth against a full one."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from ee_transformers.measure.costs import full_step_cost, measure_costs, step_cost  # noqa: PLC0415
    from ee_transformers.measure.forced import forced_profile  # noqa: PLC0415

    folder = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    half = [
        layer
        for layer in forced_profile({0.5: 1.0, 1.0: 0.0}, folder).layers
        if layer < folder.config.num_hidden_layers - 1
    ][0]
    costs = measure_costs(folder, batch_size=max(clients))
    out = {}
    for c in clients:
        full, early = full_step_cost(costs, c), step_cost(costs, [half] * c, [half], "forced")
        for kind, share in VLLM_FORCED.items():
            out[kind, c] = full / (share * early + (1 - share) * full)
    return out


EOS_OFF = "eos_token_id"


def _generation_config(new_tokens: int) -> dict:
    """Greedy, EOS off, exactly `new_tokens` (transformers' `generation_config` field, a JSON string)."""
    return {"generation_config": json.dumps({EOS_OFF: -1, "max_new_tokens": new_tokens, "do_sample": False})}


def passages_sent(workload: str, clients: int, config: ServeBenchConfig) -> int:
    """Passages one level of `clients` sends: a prompt each, a passage per chat turn, a document per client."""
    return {"prompts": max(config.requests, clients), "chat": clients * config.turns, "edits": clients}[workload]


class Workload:
    """What C clients send at one level: `sessions(C)` lists each client's requests, run in order (a conversation's
    turn k waits for turn k-1's answer); a request is `(key, build)` where `build(answers)` makes the request's body
    from that client's earlier answers, and `key` names it the same way on every server."""

    def __init__(self, name: str, passages: list[str], config: ServeBenchConfig, chat: bool):
        self.name, self.passages, self.config, self.chat = name, passages, config, chat

    def sessions(self, clients: int) -> list[list[tuple]]:
        if self.name == "prompts":
            n = max(self.config.requests, clients)
            per_client = [[] for _ in range(clients)]
            for i in range(n):
                k = i % len(self.passages)
                per_client[i % clients].append((f"prompt {k}", lambda answers, k=k: self._completion(self.passages[k])))
            return per_client
        return [
            [
                (f"{self.name} {c} turn {t}", lambda answers, c=c, t=t: self._turn(c, t, answers))
                for t in range(self.config.turns)
            ]
            for c in range(clients)
        ]

    def _completion(self, prompt: str) -> dict:
        return {"prompt": prompt}

    def _user_turn(self, c: int, t: int) -> str:
        p = self.passages
        if self.name == "chat":
            return f"{p[(c * self.config.turns + t) % len(p)]}\n\nRepeat the text above, then say what it explains."
        document = p[c % len(p)]
        words = [w for w in document.split() if w.isalpha() and len(w) > 3] or ["the"]
        edit = f"'{words[(7 * t) % len(words)]}' replaced by '{words[(7 * t) % len(words)].upper()}'"
        if t == 0:
            return f"Here is a document:\n\n{document}\n\nWrite the whole document again with {edit}."
        return f"Now write the whole document again with {edit} as well."

    def _turn(self, c: int, t: int, answers: list[str]) -> dict:
        messages = []
        for k in range(t + 1):
            messages.append({"role": "user", "content": self._user_turn(c, k)})
            if k < t:
                messages.append({"role": "assistant", "content": answers[k]})
        if self.chat:
            return {"messages": messages}
        transcript = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)  # no chat template
        return {"prompt": transcript + "Assistant:"}


def _send(client, model: str, body: dict, new_tokens: int, vllm: bool = False):
    start = time.perf_counter()
    extra = {"ignore_eos": True} if vllm else _generation_config(new_tokens)  # EOS off, exactly new_tokens
    if "messages" in body:
        out = client.chat.completions.create(
            model=model,
            messages=body["messages"],
            max_tokens=new_tokens,
            temperature=0,
            extra_body=extra,
        )
        text = out.choices[0].message.content or ""
    else:
        out = client.completions.create(
            model=model,
            prompt=body["prompt"],
            max_tokens=new_tokens,
            temperature=0,
            extra_body=extra,
        )
        text = out.choices[0].text
    return time.perf_counter() - start, text, out.usage.completion_tokens


def _complete(client, model: str, prompt: str, new_tokens: int, vllm: bool = False):
    return _send(client, model, {"prompt": prompt}, new_tokens, vllm)


def _level(server, model, workload: Workload, clients, config, bar, vllm=False):
    """Every session of the level from `clients` threads: wall time, latencies, {key: text}, generated tokens."""
    client = openai_client(server)

    def run(session):
        answers, results = [], []
        for key, build in session:
            latency, text, tokens = _send(client, model, build(answers), config.new_tokens, vllm)
            answers.append(text)
            results.append((key, latency, text, tokens))
            bar.update(1)
        return results

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = [r for rs in pool.map(run, workload.sessions(clients)) for r in rs]
    wall = time.perf_counter() - start
    return wall, results


def _held_out(tokenizer, config: ServeBenchConfig, count: int) -> list[str]:
    """`count` held-out passages of `prompt_tokens` tokens from `prompt_domain`."""
    from ee_transformers.tools.bench.loading import default_text_files, heldout_prompts  # noqa: PLC0415

    files = default_text_files()
    domains = ["python", "austen"] if config.prompt_domain == "both" else [config.prompt_domain]
    texts = {}
    for domain in domains:
        path, (lo, hi) = files[domain]
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        texts[domain] = text[int(lo * len(text)) : int(hi * len(text))]
    ids = heldout_prompts(tokenizer, num_prompts=count, window=config.prompt_tokens, seed=config.seed, texts=texts)
    return [tokenizer.decode(p["ids"]) for p in ids]


def level_workloads(config: ServeBenchConfig, passages: list[str], chat: bool) -> dict:
    """{(workload, clients): its `Workload`}, each level over the next passages in order (cycled when there are
    fewer passages than the run sends)."""
    levels, start = {}, 0
    for name in config.workloads:
        for c in config.clients:
            n = passages_sent(name, c, config)
            levels[name, c] = Workload(name, [passages[(start + i) % len(passages)] for i in range(n)], config, chat)
            start += n
    return levels


def text_mismatches(rows, lossless=LOSSLESS) -> list[str]:
    """The rows of `lossless` servers that failed or answered another text than plain's to some request."""
    return [
        f"{r['server']} {r['mode']}: {r['error'][:200]}"
        if "error" in r
        else f"{r['server']} {r['mode']} {r['workload']} {r['clients']} clients: {r['same_text']}/{r['requests']}"
        for r in rows
        if r["server"] in lossless and ("error" in r or r["same_text"] < r["requests"])
    ]


def stores_exits(folder) -> bool:
    """Whether the folder's stored settings decode with confident exits (then its `stored` server is lossy)."""
    import transformers  # noqa: PLC0415

    from ee_transformers.generation_early_exit import EXIT_ARGUMENTS, resolve_exit_settings  # noqa: PLC0415

    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    stored = transformers.GenerationConfig.from_pretrained(folder).to_dict()
    return resolve_exit_settings(config, {name: stored.get(name) for name in EXIT_ARGUMENTS}) is not None


def run_serve_bench(
    model: str, base: str, config: ServeBenchConfig, out: Path | None = None, log=None, lossless=LOSSLESS
) -> dict:
    """Every (server, mode, workload, clients) row of the run; see the module docstring. The report's `mismatches`
    lists the rows of `lossless` servers whose text differs from plain's (`text_mismatches`)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    log = log or (lambda line: print(line, flush=True))
    tokenizer = AutoTokenizer.from_pretrained(base)
    chat = bool(getattr(tokenizer, "chat_template", None))
    # every (workload, clients) level its own passages, so a later level never sends what an earlier one did (a
    # server keeping a history index would draft the answers it gave them); the last passage warms each server up
    sends = sum(passages_sent(name, c, config) for name in config.workloads for c in config.clients)
    drawn = _held_out(tokenizer, config, config.num_prompts or sends + 1)
    warm_up, passages = drawn[-1], drawn[:-1] if len(drawn) > 1 else drawn
    if len(passages) < sends:
        log(f"note: {len(passages)} passages for {sends} sends: later levels repeat earlier levels' text")
    levels = level_workloads(config, passages, chat)
    workloads = config.workloads
    servers = [s for s in config.servers if not (s == "exits" and config.exit_settings is None)]
    servers = [s for s in servers if not (s == "lean" and config.exit_max_layer is None)]
    skipped = sorted(set(config.servers) - set(servers))
    if skipped:
        log(f"skipped (no --exit-settings / --exit-max-layer given): {skipped}")
    logs = Path(out) if out is not None else Path.cwd()
    logs.mkdir(parents=True, exist_ok=True)
    per_level = [sum(len(s) for s in w.sessions(c)) for (_, c), w in levels.items()]
    servers.sort(key=lambda kind: kind not in ("plain", "vllm-plain"))  # each engine's text reference first
    runs = [(kind, mode) for kind in servers for mode in (config.vllm_modes if kind in VLLM_SERVERS else config.modes)]
    total = len(runs) * sum(per_level)
    ideal = forced_ideal(model, config.clients) if any(k in VLLM_FORCED for k in servers) else {}
    rows, references = [], {"transformers": {}, "vllm": {}}  # {engine: {(workload, clients, key): plain's answer}}
    with tqdm(total=total, desc="bench-serve", unit="request") as bar:
        for kind, mode in runs:
            vllm = kind in VLLM_SERVERS
            reference = references["vllm" if vllm else "transformers"]
            served = base if kind in ("plain", "vllm-plain", "vllm-ngram") else model
            if vllm:
                env = {"VLLM_CPU_KVCACHE_SPACE": str(config.vllm_kv_cache_gib), "VLLM_LOGGING_LEVEL": "WARNING"}
                argv = _vllm_argv(kind, model, base, config, mode)
                server = ServerProcess(argv, config.threads, logs / f"server-{kind}-{mode}.log", env, vllm=True)
            else:
                argv = _server_argv(kind, model, base, config, mode)
                server = ServerProcess(argv, config.threads, logs / f"server-{kind}-{mode}.log")
            try:
                _complete(openai_client(server), served, warm_up, 4, vllm)  # warm-up (loads, first batch)
                for name in workloads:
                    for clients in config.clients:
                        level = levels[name, clients]
                        wall, results = _level(server, served, level, clients, config, bar, vllm)
                        for key, _, text, _ in results:
                            reference.setdefault((name, clients, key), text)
                        row = _row(kind, mode, name, clients, wall, results, reference, server.rss())
                        if (kind, clients) in ideal:
                            row["ideal"] = round(ideal[kind, clients], 3)
                        rows.append(row)
                        log(format_serve([row], header=len(rows) == 1, all_rows=rows))
                        if out is not None:
                            _write(logs, model, base, config, rows)
            except Exception as error:  # a server that fails is a row that says so; the others still run
                rows.append({"server": kind, "mode": mode, "error": f"{type(error).__name__}: {error}"})
                log(f"| {kind} | {mode} | failed: {rows[-1]['error'][:200]} (log: {server.log_path}) |")
            finally:
                server_log = server.stop()
            if "Traceback" in server_log:
                log(f"note: the {kind} {mode} server logged a traceback: see {server.log_path}")
    mismatches = text_mismatches(rows, lossless)
    if out is not None:
        _write(logs, model, base, config, rows)
    return {"model": model, "base": base, "config": asdict(config), "rows": rows, "mismatches": mismatches}


def _write(folder, model, base, config, rows):
    """serve.json and serve.md as they stand (written after every row, so a run cut short keeps its rows)."""
    (folder / "serve.json").write_text(
        portable(json.dumps({"model": model, "base": base, "config": asdict(config), "rows": rows}, indent=2))
    )
    (folder / "serve.md").write_text(format_serve(rows) + "\n")


def openai_client(server):
    import openai  # noqa: PLC0415

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", timeout=1800)


def _row(kind, mode, workload, clients, wall, results, reference, rss):
    latencies = sorted(r[1] for r in results)
    p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
    tokens = sum(r[3] for r in results)
    return {
        "server": kind,
        "mode": mode,
        "workload": workload,
        "clients": clients,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "p50_s": round(statistics.median(latencies), 3),
        "p95_s": round(p95, 3),
        "rss_mb": round(rss / 2**20, 1),
        "same_text": sum(text == reference[(workload, clients, key)] for key, _, text, _ in results),
    }


def format_serve(rows, header=True, all_rows=None) -> str:
    """Markdown rows; `x plain` is tokens/s over its engine's plain server (plain, vllm-plain) at the same mode,
    workload and clients (of `all_rows`), `RSS x plain` the same for resident memory; the forced vLLM rows add
    `realised / ideal`: their tokens/s over vllm-off's, over the cost model's ideal."""
    done = [r for r in (all_rows or rows) if "error" not in r]
    by_server = {(r["server"], r["mode"], r["workload"], r["clients"]): r for r in done}
    lines = []
    if header:
        lines += [
            "| server | mode | workload | clients | requests | tokens/s | x plain | realised / ideal | p50 s | p95 s "
            "| RSS MB | RSS x plain | same text as plain |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['server']} | {r['mode']} | failed: {r['error'][:120]} | | | | | | | | | | |")
            continue
        level = (r["mode"], r["workload"], r["clients"])
        base = by_server.get(("vllm-plain" if r["server"] in VLLM_SERVERS else "plain", *level))
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        memory = f"{r['rss_mb'] / base['rss_mb']:.2f}x" if base else "-"
        off = by_server.get(("vllm-off", *level))
        realised = "-"
        if "ideal" in r and off:
            realised = f"{r['tokens_per_s'] / off['tokens_per_s']:.2f} / {r['ideal']:.2f}"
        lines.append(
            f"| {r['server']} | {r['mode']} | {r['workload']} | {r['clients']} | {r['requests']} | "
            f"{r['tokens_per_s']:.1f} | {speed} | {realised} | {r['p50_s']:.2f} | {r['p95_s']:.2f} | "
            f"{r['rss_mb']:.0f} | {memory} | {r['same_text']}/{r['requests']} |"
        )
    return "\n".join(lines)


def folder_with_table(model: str, source: str, out: Path) -> str:
    """A copy of the early-exit folder `model` whose draft table is rebuilt from `source` (`store_table_from`),
    written to `out/model-table-<source name>`; returns its path."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from ee_transformers.convert import from_base  # noqa: PLC0415
    from ee_transformers.tools.bench.lossless import store_table_from  # noqa: PLC0415
    from ee_transformers.utils.outputs import OutputFolder  # noqa: PLC0415

    target = OutputFolder(Path(out) / f"model-table-{Path(source).stem}", overwrite=True, argument="--table-from")
    model_ = from_base(model).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    entries, tokens = store_table_from(model_, tokenizer, source)
    print(f"bench-serve: draft table from {source}: {entries} entries from {tokens} tokens, in {target.path}")
    with target.writing("bench-serve --table-from") as folder:
        model_.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(target.path)


def _run(args):
    config = config_from_args(ServeBenchConfig, args)
    if not read_config(args.model, "--model").get("exit_layers"):
        raise InputError(f"`--model` {args.model!r} is not an early-exit folder (its config has no `exit_layers`).")
    read_config(args.base, "--base")
    if config.table_from and not args.out:
        raise InputError("`--table-from` writes a copy of the folder: pass `--out` too.")
    model = folder_with_table(args.model, config.table_from, Path(args.out)) if config.table_from else args.model
    lossless = LOSSLESS
    if stores_exits(model):
        lossless = tuple(kind for kind in LOSSLESS if kind != "stored")
        print("bench-serve: the folder stores confident exits, so its `stored` server is lossy: text not checked")
    report = run_serve_bench(model, args.base, config, out=Path(args.out) if args.out else None, lossless=lossless)
    if config.check_text and report["mismatches"]:
        print("bench-serve: lossless servers answered other text than plain (or failed):", file=sys.stderr)
        for line in report["mismatches"]:
            print(f"  {line}", file=sys.stderr)
        return 1
    return None


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

"""Every bad input of issue 13, for every command: exit code 2 (1 for a failed download step), one line on stderr that
names the argument or file, no traceback, and nothing changed on disk. The commands run in this process through
`ee-transformers`'s own entry point; the folders they are given are copies of small fixtures."""

import hashlib
import os
import shutil
import struct
import zlib

import pytest

import ee_transformers as eet
from ee_transformers.tools import assets, cli
from ee_transformers.tools.bench import cli as bench_cli
from ee_transformers.training.fit_exit_heads import FitConfig, fit_exit_heads, save_model_folder
from ee_transformers.training.tiny import save_tiny_base, tiny_texts, write_texts


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """A plain tiny Llama, an early-exit folder built from it, a checkpoint of a short fit, and text."""
    root = tmp_path_factory.mktemp("templates")
    save_tiny_base(root / "base")
    model = eet.from_base(root / "base", exit_layers=[1, 2])
    save_model_folder(model, root / "ee")
    write_texts(root / "text", tiny_texts(n_docs=4))
    from ee_transformers.training.data import load_blocks
    from ee_transformers.training.tiny import tiny_tokenizer

    train = load_blocks(sorted(str(p) for p in (root / "text").iterdir()), tiny_tokenizer(), 16).train
    fit_exit_heads(
        eet.from_base(root / "base", exit_layers=[1, 2]),
        train,
        None,
        FitConfig(steps=1, batch_size=2, checkpoint_every=1, progress=False),
        checkpoint_dir=root / "checkpoints",
    )
    return root


@pytest.fixture
def world(templates, tmp_path):
    for name in ("base", "ee", "text", "checkpoints"):
        shutil.copytree(templates / name, tmp_path / name)
    (tmp_path / "a-file").write_text("a user's file")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "README.md").write_text("the user's readme")
    (tmp_path / "full" / "model-00001-of-00002.safetensors").write_text("another model's shard")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "binary.txt").write_bytes(b"\x80\x81\x82\xff")
    return tmp_path


def folder_with_config(text):
    def make(w):
        shutil.copytree(w / "base", w / "bad")
        (w / "bad" / "config.json").write_text(text)
        return str(w / "bad")

    return make


def no_weights(w):
    shutil.copytree(w / "base", w / "bad")
    (w / "bad" / "model.safetensors").unlink()
    return str(w / "bad")


def corrupt_weights(w):
    shutil.copytree(w / "base", w / "bad")
    weights = w / "bad" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    return str(w / "bad")


def damaged_checkpoint(name, keep):
    def make(w):
        (step,) = (w / "checkpoints").iterdir()
        data = (step / name).read_bytes()
        (step / name).write_bytes(data[: keep(len(data))])
        return str(step)

    return make


def texts(w):
    return sorted(str(p) for p in (w / "text").iterdir())


def fit_argv(w, model=None, out=None, data=None):
    return [
        "fit",
        "--model",
        model or str(w / "base"),
        "--exit-layers",
        "1,2",
        "--data",
        *(data or texts(w)),
        "--block-size",
        "16",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--no-progress",
        "--out",
        out or str(w / "new"),
    ]


def calibrate_argv(w, model=None):
    return [
        "calibrate",
        model or str(w / "ee"),
        "--data",
        *texts(w),
        "--block-size",
        "16",
        "--verify-prompts",
        "0",
        "--costs",
        '{"head_cost": 0, "backfill_cost": 0}',
    ]


def bench_argv(w, model=None, batch_sizes="1", out=None):
    return [
        "bench",
        "--model",
        model or str(w / "ee"),
        "--quick",
        "--batch-sizes",
        batch_sizes,
        "--no-sweep",
        "--no-forced",
        "--no-profile",
        "--out",
        out or str(w / "bench-out"),
    ]


OFFLINE = "offline"  # a marker: the default prompts cannot be fetched

CASES = {
    # ---- convert
    "convert: base does not exist": (
        lambda w: ["convert", str(w / "nowhere"), str(w / "new"), "--exit-layers", "1"],
        2,
        "`base` '{w}/nowhere' does not exist",
    ),
    "convert: config.json is not a JSON object": (
        lambda w: ["convert", folder_with_config("[1, 2]")(w), str(w / "new"), "--exit-layers", "1"],
        2,
        "config.json must hold a JSON object, not a JSON list",
    ),
    "convert: config.json is malformed": (
        lambda w: ["convert", folder_with_config('{"model_type": ')(w), str(w / "new"), "--exit-layers", "1"],
        2,
        "{w}/bad/config.json is not valid JSON",
    ),
    "convert: missing weights": (
        lambda w: ["convert", no_weights(w), str(w / "new"), "--exit-layers", "1"],
        2,
        "`base` '{w}/bad' holds no weights",
    ),
    "convert: corrupt weights": (
        lambda w: ["convert", corrupt_weights(w), str(w / "new"), "--exit-layers", "1"],
        2,
        "the weights model.safetensors cannot be read",
    ),
    "convert: output is a file": (
        lambda w: ["convert", str(w / "base"), str(w / "a-file"), "--exit-layers", "1"],
        2,
        "`out` '{w}/a-file' is a file, not a folder",
    ),
    "convert: output holds a user's files": (
        lambda w: ["convert", str(w / "base"), str(w / "full"), "--exit-layers", "1"],
        2,
        "`out` '{w}/full' already exists and is not empty: pass `--overwrite`",
    ),
    "convert: --overwrite a folder no command wrote": (
        lambda w: ["convert", str(w / "base"), str(w / "full"), "--exit-layers", "1", "--overwrite"],
        2,
        "was not written by an ee-transformers command",
    ),
    "convert: --exit-layers ,": (
        lambda w: ["convert", str(w / "base"), str(w / "new"), "--exit-layers", ","],
        2,
        "`--exit-layers` names no layer",
    ),
    "convert: --exit-layers 1,x": (
        lambda w: ["convert", str(w / "base"), str(w / "new"), "--exit-layers", "1,x"],
        2,
        "argument --exit-layers: must be comma-separated int values",
    ),
    "convert: --exit-layers out of range": (
        lambda w: ["convert", str(w / "base"), str(w / "new"), "--exit-layers", "1,9"],
        2,
        "out of range",
    ),
    # ---- fit
    "fit: config.json is not a JSON object": (
        lambda w: fit_argv(w, model=folder_with_config('"llama"')(w)),
        2,
        "config.json must hold a JSON object, not a JSON str",
    ),
    "fit: --checkpoint-dir is a file": (
        lambda w: fit_argv(w) + ["--checkpoint-dir", str(w / "a-file")],
        2,
        "`--checkpoint-dir` '{w}/a-file' is a file",
    ),
    "fit: truncated checkpoint state": (
        lambda w: fit_argv(w) + ["--resume", damaged_checkpoint("state.json", lambda n: n // 2)(w)],
        2,
        "state.json: not a readable checkpoint state",
    ),
    "fit: truncated checkpoint tensors": (
        lambda w: fit_argv(w) + ["--resume", damaged_checkpoint("trainable.safetensors", lambda n: n - 10)(w)],
        2,
        "trainable.safetensors: the checkpoint is damaged",
    ),
    "fit: --batch-size 0": (
        lambda w: fit_argv(w) + ["--batch-size", "0"],
        2,
        "`--batch-size` must be an integer >= 1, got 0",
    ),
    "fit: --out is a file": (lambda w: fit_argv(w, out=str(w / "a-file")), 2, "`--out` '{w}/a-file' is a file"),
    "fit: --data matches nothing": (
        lambda w: fit_argv(w, data=[str(w / "no-such*.txt")]),
        2,
        "`--data` pattern '{w}/no-such*.txt' matches no file",
    ),
    # ---- calibrate
    "calibrate: --out holds a user's files": (
        lambda w: calibrate_argv(w) + ["--out", str(w / "full")],
        2,
        "`--out` '{w}/full' already exists and is not empty",
    ),
    "calibrate: --out is a file": (
        lambda w: calibrate_argv(w) + ["--out", str(w / "a-file")],
        2,
        "`--out` '{w}/a-file' is a file, not a folder",
    ),
    "calibrate: --costs {}": (
        lambda w: calibrate_argv(w)[:-2] + ["--costs", "{}"],
        2,
        "`--costs` must give `head_cost` as a number >= 0",
    ),
    "calibrate: --costs is not JSON": (
        lambda w: calibrate_argv(w)[:-2] + ["--costs", "cheap"],
        2,
        "`--costs` is not valid JSON",
    ),
    "calibrate: --batch-size 0": (
        lambda w: calibrate_argv(w) + ["--batch-size", "0"],
        2,
        "`--batch-size` must be an integer >= 1, got 0",
    ),
    "calibrate: --decode-batch-size 0": (
        lambda w: calibrate_argv(w) + ["--decode-batch-size", "0"],
        2,
        "`--decode-batch-size` must be an integer >= 1, got 0",
    ),
    "calibrate: --verify-new-tokens -1": (
        lambda w: calibrate_argv(w) + ["--verify-new-tokens", "-1"],
        2,
        "`--verify-new-tokens` must be an integer >= 1, got -1",
    ),
    "calibrate: --block-size beyond the positions": (
        lambda w: calibrate_argv(w) + ["--block-size", "4096"],
        2,
        "`--block-size`=4096 is beyond the model's positions",
    ),
    "calibrate: config.json is not a JSON object": (
        lambda w: calibrate_argv(w, folder_with_config("null")(w)),
        2,
        "config.json must hold a JSON object, not a JSON NoneType",
    ),
    "calibrate: a folder without exits": (lambda w: calibrate_argv(w, str(w / "base")), 2, "has no exit heads"),
    # ---- bench
    # ---- profile and the benchmarks of the other modes
    "profile: folder does not exist": (
        lambda w: ["profile", str(w / "nowhere"), "--data", str(w / "nowhere.txt")],
        2,
        "`path` '{w}/nowhere' does not exist",
    ),
    "bench-lean: --context too short": (
        lambda w: ["bench-lean", "--model", str(w / "ee"), "--memory-budget", "1G", "--context", "10"],
        2,
        "`--context` must exceed `--prompt-tokens` by at least 2",
    ),
    "bench-speculative: --model does not exist": (
        lambda w: ["bench-speculative", "--model", str(w / "nowhere")],
        2,
        "`--model` '{w}/nowhere' does not exist",
    ),
    "bench-lossless: --model does not exist": (
        lambda w: ["bench-lossless", "--model", str(w / "nowhere")],
        2,
        "`--model` '{w}/nowhere' does not exist",
    ),
    "bench-lossless: --lookup 4": (
        lambda w: ["bench-lossless", "--model", str(w / "ee"), "--lookup", "4"],
        2,
        "`--lookup` takes N:G pairs (or N:G:W triples) of positive integers, e.g. 10:2, got '4'",
    ),
    "calibrate: --lossless --lookup-tokens 0": (
        lambda w: calibrate_argv(w) + ["--lossless", "--lookup-tokens", "0"],
        2,
        "`--lookup-tokens` must be a non-empty list, each element an integer >= 1",
    ),
    "serve: not an early-exit folder": (
        lambda w: ["serve", str(w / "base")],
        2,
        "`folder` '{w}/base' is not an early-exit folder",
    ),
    "serve: --exit-settings names no exit setting": (
        lambda w: ["serve", str(w / "ee"), "--exit-settings", '{"exit_speed": 2}'],
        2,
        "--exit-settings: ['exit_speed'] are not exit settings",
    ),
    "bench-serve: --model does not exist": (
        lambda w: ["bench-serve", "--model", str(w / "nowhere"), "--base", str(w / "base")],
        2,
        "`--model` '{w}/nowhere' does not exist",
    ),
    "bench-serve: --servers fast": (
        lambda w: ["bench-serve", "--model", str(w / "ee"), "--base", str(w / "base"), "--servers", "fast"],
        2,
        "`--servers`",
    ),
    "bench-pool: --interval 0": (
        lambda w: ["bench-pool", "--interval", "0", "--out", str(w / "pool-out")],
        2,
        "`--interval` must be an integer >= 1, got 0",
    ),
    "bench: default prompts offline": (
        lambda w: bench_argv(w, str(w / "base")) + ["--exit-layers", "1,2"],
        2,
        "`--prompts-from` not given, and the default held-out text cannot be fetched",
    ),
    "bench: --prompts-from missing": (
        lambda w: bench_argv(w) + ["--prompts-from", str(w / "nope.txt")],
        2,
        "`--prompts-from` pattern '{w}/nope.txt' matches no file",
    ),
    "bench: --prompts-from empty": (
        lambda w: bench_argv(w) + ["--prompts-from", str(w / "empty.txt")],
        2,
        "every file is empty",
    ),
    "bench: --prompts-from binary": (
        lambda w: bench_argv(w) + ["--prompts-from", str(w / "binary.txt")],
        2,
        "binary.txt: not UTF-8 text",
    ),
    "bench: --new-tokens -1": (
        lambda w: bench_argv(w) + ["--new-tokens", "-1"],
        2,
        "`--new-tokens` must be an integer >= 1, got -1",
    ),
    "bench: --batch-sizes 0": (
        lambda w: bench_argv(w, batch_sizes="0"),
        2,
        "`--batch-sizes` must be a non-empty list, each element an integer >= 1",
    ),
    "bench: --out is a file": (
        lambda w: bench_argv(w, out=str(w / "a-file")),
        2,
        "`--out` '{w}/a-file' is a file, not a folder",
    ),
    "bench: --out holds a user's files": (
        lambda w: bench_argv(w, out=str(w / "full")),
        2,
        "`--out` '{w}/full' already exists and is not empty",
    ),
    "bench: config.json is not a JSON object": (
        lambda w: bench_argv(w, folder_with_config("3")(w)),
        2,
        "config.json must hold a JSON object, not a JSON int",
    ),
    # ---- fetch-assets
    "fetch-assets: --cache-dir is a file": (
        lambda w: ["fetch-assets", "--cache-dir", str(w / "a-file")],
        2,
        "`--cache-dir` '{w}/a-file' is a file, not a folder",
    ),
    "fetch-assets: corrupt R data": (
        lambda w: ["fetch-assets", "--text-only", "--cache-dir", str(w / "cache")],
        1,
        "cannot be read: R serialization has a vector of length -5",
    ),
    # ---- demo
    "demo: --out is a file": (lambda w: ["demo", "--out", str(w / "a-file")], 2, "`--out` '{w}/a-file' is a file"),
    "demo: --out holds a user's files": (
        lambda w: ["demo", "--out", str(w / "full")],
        2,
        "`--out` '{w}/full' already exists and is not empty",
    ),
}


def snapshot(root):
    """{path: "dir" or (sha256, mtime)} of everything under root (a folder's own mtime moves with any temporary)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(folder, name), root)] = "dir"
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return found


@pytest.fixture
def offline_and_fake_downloads(monkeypatch, tmp_path):
    """No network in this test: the default prompts cannot be fetched, the demo must not get as far as fetching, and
    the R data of the Austen package is corrupt (its real layout and hash check kept)."""

    def no_network(*args, **kwargs):
        raise RuntimeError("apt-get download r-cran-janeaustenr failed: offline")

    monkeypatch.setattr(bench_cli, "default_text_files", no_network)
    monkeypatch.setattr(assets, "fetch_model", lambda *a, **k: pytest.fail("the demo fetched before checking --out"))
    deb = tmp_path / "r-cran-janeaustenr_1.0.0-1_all.deb"
    deb.write_bytes(b"a stand-in package")
    monkeypatch.setattr(assets.text, "_apt_download", lambda package, dest, version=None: deb)
    monkeypatch.setattr(assets.text, "AUSTEN_DEB_SHA256", hashlib.sha256(deb.read_bytes()).hexdigest())

    def extract(deb, dest):  # a well-formed block whose serialization holds a vector of length -5
        payload = b"X\n" + struct.pack(">iiiii", 2, 0, 0, 16, -5)
        rdb = dest / assets.AUSTEN_RDB
        rdb.parent.mkdir(parents=True)
        rdb.write_bytes(struct.pack(">I", len(payload)) + zlib.compress(payload))
        return dest

    monkeypatch.setattr(assets.text, "_deb_extract", extract)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_changes_nothing(case, world, capsys, offline_and_fake_downloads):
    make_argv, code, message = CASES[case]
    argv = make_argv(world)
    (world / "cache").mkdir(exist_ok=True)
    before = snapshot(world)
    capsys.readouterr()
    try:
        got = cli.main(argv)
    except SystemExit as exit_:
        got = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert got == code, f"exit code {got}, stderr:\n{err}"
    assert len(lines) == 1 and lines[0].startswith(f"ee-transformers {argv[0]}: error: "), f"stderr:\n{err}"
    assert message.format(w=world) in lines[0], lines[0]
    assert "Traceback" not in err
    assert snapshot(world) == before, "a refused command changed something on disk"


def test_the_table_covers_every_command():
    commands = {case.split(":")[0] for case in CASES}
    assert commands == set(cli.SUBCOMMANDS), commands ^ set(cli.SUBCOMMANDS)

"""`ee-transformers serve` under load from a real client: the `openai` package against transformers' own server on
127.0.0.1 (a child process, killed by its PID), with and without `--continuous-batching`."""

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import numbered_tokenizer, served_folders

import ee_transformers as eet
from ee_transformers.tools.bench.serve import ServerProcess, openai_client
from ee_transformers.tools.serve import exit_settings_error

openai = pytest.importorskip("openai")  # transformers[serving], in the package's `serving` / `all` extras

CB_FLAGS = ["--continuous-batching", "--cb-num-blocks", "64", "--cb-block-size", "16", "--cb-max-batch-tokens", "64"]
PROMPTS = ["w5 w6 w7", "w12 w13", "w20 w21 w22 w23", "w40 w41 w42", "w60 w61", "w70 w71 w72 w73 w74", "w9", "w30 w31"]
NEW = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return served_folders(tmp_path_factory.mktemp("serve"))[1]


def expected_text(folder, prompt, chat=False, **kwargs):
    """In-process `generate` on the folder: the text a greedy request must get."""
    model = eet.EarlyExitLlamaForCausalLM.from_pretrained(folder).eval()
    tok = numbered_tokenizer()
    if chat:
        ids = torch.tensor([tok(f"{prompt} ")["input_ids"]])
    else:
        ids = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=-1, **kwargs)
    return words(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def words(text):
    return " ".join(text.split())


def start(folder, flags, log_path):
    """`ee-transformers serve FOLDER` as a child process (killed by its PID in `stop()`), with an openai client."""
    argv = [sys.executable, "-m", "ee_transformers.tools.cli", "serve", str(folder), *flags]
    server = ServerProcess(argv, threads=1, log_path=log_path)
    server.client = openai_client(server)
    return server


def ask(client, folder, i):
    """Request `i`: even ones are streaming chat, odd ones non-streaming completions; returns (prompt, chat, text)."""
    prompt, chat = PROMPTS[i % len(PROMPTS)], i % 2 == 0
    if chat:
        stream = client.chat.completions.create(
            model=str(folder),
            messages=[{"role": "user", "content": prompt}],
            max_tokens=NEW,
            temperature=0,
            stream=True,
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    else:
        text = (
            client.completions.create(model=str(folder), prompt=prompt, max_tokens=NEW, temperature=0).choices[0].text
        )
    return prompt, chat, words(text)


@pytest.mark.parametrize("flags", [[], CB_FLAGS], ids=["sequential", "continuous-batching"])
def test_concurrent_requests_from_the_openai_client(folder, flags, tmp_path):
    server = start(folder, flags, tmp_path / "server.log")
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(lambda i: ask(server.client, folder, i), range(len(PROMPTS))))
        bad = server.client.completions  # an invalid exit setting: 400 naming it, not 500
        with pytest.raises(openai.BadRequestError, match="exit_policy"):
            bad.create(
                model=str(folder),
                prompt="w5",
                max_tokens=2,
                extra_body={"generation_config": json.dumps({"exit_policy": "sideways"})},
            )
        with pytest.raises(openai.BadRequestError, match="256 tokens"):  # longer than the model's positions
            bad.create(model=str(folder), prompt=" ".join(["w5"] * 300), max_tokens=2)
        answered = ask(server.client, folder, 1)  # the server still serves after a refused request
    finally:
        log = server.stop()
    assert len(answers) == len(PROMPTS)
    for prompt, chat, text in answers + [answered]:
        assert text == expected_text(folder, prompt, chat), (prompt, chat, text)
    full_depth = [expected_text(folder, p, False, early_exit=False) for p in PROMPTS]
    assert full_depth != [expected_text(folder, p) for p in PROMPTS]  # the answers really are early-exit text
    assert "Traceback" not in log, log[-4000:]


def test_per_request_exit_settings_in_sequential_serving(folder, tmp_path):
    server = start(folder, [], tmp_path / "server.log")
    try:
        gc = json.dumps({"early_exit": False, "max_new_tokens": NEW, "eos_token_id": -1, "do_sample": False})
        out = server.client.completions.create(
            model=str(folder), prompt=PROMPTS[0], max_tokens=NEW, extra_body={"generation_config": gc}
        )
    finally:
        log = server.stop()
    assert words(out.choices[0].text) == expected_text(folder, PROMPTS[0], early_exit=False)
    assert "Traceback" not in log


def test_exit_settings_error_names_the_setting(folder):
    config = eet.EarlyExitLlamaForCausalLM.config_class.from_pretrained(folder)
    body = lambda **gc: {"generation_config": json.dumps(gc)}  # noqa: E731
    assert exit_settings_error({}, config, False) is None
    assert exit_settings_error(body(max_new_tokens=3), config, True) is None
    assert exit_settings_error(body(exit_threshold=0.5, exit_criterion="max_prob"), config, False) is None
    assert "exit_check_layers" in exit_settings_error(body(exit_check_layers=[7]), config, False)
    assert "continuous-batching" in exit_settings_error(body(exit_threshold=0.5), config, True)
    assert "JSON" in exit_settings_error({"generation_config": "{"}, config, False)


def test_the_served_model_holds_no_second_tokenizer(folder, monkeypatch):
    """The server loads its own tokenizer; the model it resolves drops the one a folder's model loads with it."""
    import transformers

    from ee_transformers.tools.serve import register_classes

    assert eet.EarlyExitLlamaForCausalLM.from_pretrained(folder).tokenizer is not None  # the folder has one
    for cls in eet.FAMILIES.values():  # put back after the test
        monkeypatch.setattr(transformers, cls.__name__, cls, raising=False)
    register_classes()
    model = transformers.EarlyExitLlamaForCausalLM.from_pretrained(folder)
    assert isinstance(model, eet.EarlyExitLlamaForCausalLM) and model.tokenizer is None

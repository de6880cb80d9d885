"""Helpers that several test modules use: plain functions, classes and settings (fixtures live in conftest.py)."""

import ast
from pathlib import Path

import pytest
import torch
from conftest import LayerCalls, padded_batch
from transformers.generation.streamers import BaseStreamer

import ee_transformers as eet
from ee_transformers.compat import STATIC_LAYERS_CROP

NEVER = dict(exit_criterion="max_prob", exit_threshold=1.0)  # a softmax of a tiny random model never reaches 1
ALWAYS = dict(exit_criterion="max_prob", exit_threshold=0.0)  # every row exits at the first checked exit


# what a lossless mode (it crops rejected drafts) answers for a static cache on a transformers whose static layers
# cannot be cropped (before 5.24): the tests of those modes assert it there instead of decoding
STATIC_REFUSAL = (
    r"needs a cache whose rejected slots can be cropped; StaticCache cannot be "
    r"\(static cache layers can be cropped from transformers 5\.24 on; installed: \S+\): leave `cache_implementation` out"
)


def static_cache_refused(cache_implementation) -> bool:
    """Whether the lossless modes refuse `cache_implementation` on the installed transformers (`STATIC_REFUSAL`)."""
    return cache_implementation == "static" and not STATIC_LAYERS_CROP


def ee_model(base_dirs, family="llama", exit_layers=(0, 1, 2), perturb=True):
    model = eet.from_base(base_dirs[family][0], exit_layers=list(exit_layers)).eval()
    if perturb:  # heads that differ from the final norm, so a wrong head would show
        torch.manual_seed(7)
        with torch.no_grad():
            for head in model.exit_heads:
                head.norm.weight.mul_(torch.rand_like(head.norm.weight) + 0.5)
                if getattr(head.norm, "bias", None) is not None:
                    head.norm.bias.add_(torch.rand_like(head.norm.bias) - 0.5)
    return model


def model_with(base_dirs, family="llama", seed=7, **exit_defaults):
    """An early-exit model (exits after 0, 1, 2) with its own stored exit settings and heads perturbed by `seed`."""
    model = ee_model(base_dirs, family, perturb=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        for head in model.exit_heads:
            head.norm.weight.mul_(torch.rand_like(head.norm.weight) + 0.5)
    if exit_defaults:
        model.set_exit_defaults(**exit_defaults)
    return model


def scripted_heads(model, per_exit):
    """Replaces exit-head logits: per_exit[i](rows) -> logits (n, V) for exit i. Returns the patched model."""
    vocab = model.config.vocab_size

    def logits_from_hidden(index, hidden):
        return per_exit[index](hidden.shape[0], vocab, hidden)

    model.exit_logits_from_hidden = logits_from_hidden
    return model


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


def numbered_tokenizer():
    """A word-level tokenizer over the tiny models' 99 ids whose words name them: `<pad>` 0, `<s>` 1, `w2`..`w97`, `</s>` 98."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, 98)}, "</s>": 98}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def served_folders(root):
    """A tiny Llama base folder and its early-exit folder, both with a tokenizer and a chat template, under `root`;
    the early-exit folder's stored exits (every token at layer 0) give text that full depth does not."""
    from conftest import make_base

    tok = numbered_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    make_base("llama").save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    model = eet.from_base(root / "base", exit_layers=[0, 1, 2]).eval()
    model.set_exit_defaults(exit_criterion="max_prob", exit_threshold=0.0, exit_check_layers=[0])
    model.generation_config.update(eos_token_id=-1, do_sample=False)
    model.save_pretrained(root / "ee")
    tok.save_pretrained(root / "ee")
    return root / "base", root / "ee"


def refused_before_decoding(model, match, **kwargs):
    """`model.generate(**kwargs)` on a padded batch of 2 raises a `ValueError` matching `match` before any decoder
    layer runs."""
    ids, mask = padded_batch(batch=2)
    counter = LayerCalls(model)
    try:
        with pytest.raises(ValueError, match=match):
            model.generate(ids, attention_mask=mask, max_new_tokens=6, **kwargs)
    finally:
        counter.remove()
    assert counter.calls == [0] * model.config.num_hidden_layers


def models_per_family(base_dirs, prepare=None):
    """`get(family)` -> (early-exit model with exits after layers 0, 1, 2, its base), each built once (for a
    module-scoped `models` fixture); `prepare(model, base)` adds what the module's tests need (a draft vocabulary, a
    table)."""
    cache = {}

    def get(family):
        if family not in cache:
            folder, base = base_dirs[family]
            model = eet.from_base(folder, exit_layers=[0, 1, 2]).eval()
            if prepare is not None:
                prepare(model, base)
            cache[family] = (model, base)
        return cache[family]

    return get


def sliding_window(base) -> bool:
    """Whether the base model's layers attend through a sliding window."""
    return bool(getattr(base.config, "sliding_window", None) and getattr(base.config, "use_sliding_window", True))


# --- the import graph, read with `ast` (tests/test_import_graph.py, tests/test_layout.py) ----------------------------
def package_modules(root: Path, package: str = "ee_transformers") -> dict[str, Path]:
    """{dotted module name: file} of every module of `package` under `root` (a package is its `__init__.py`)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(name: str, path: Path, modules) -> list[tuple[str, int, int]]:
    """(imported name, relative level, line) for every import in the file, top level or not; a `from X import y`
    names `X.y` where that is a module, else `X`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, 0, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append((target if target in modules else base, node.level, node.lineno))
    return found


def import_graph(root: Path, package: str = "ee_transformers") -> dict[str, set[str]]:
    """{module: the modules of `package` it imports}."""
    modules = package_modules(root, package)
    return {
        name: {target for target, _, _ in imports_of(name, path, modules) if target in modules and target != name}
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected group of modules."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while v not in group:
                group.add(stack.pop())
            on_stack.difference_update(group)
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph, group):
    start = min(group)
    paths, seen = [[start]], {start}
    while paths:  # breadth first: the shortest way from `start` back to itself inside the group
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & group):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")

"""Exit profiles: where do tokens exit under a model's exit settings, and how deep must a lean model be?

Teacher-forced and batched: every text is cut into windows, each window runs once at full depth (so every position
sees exact context), and each real position decides at the first checked exit whose criterion holds, as a token
decoded alone would (the row policy's decision; the batch policy can only decide later). The result is the histogram
of deciding layers, the share of tokens that needs each depth, and `recommend(coverage)`: the shallowest exit that
covers the target share of decisions (else the last layer), the `exit_max_layer` to load a lean model with.

    profile = eet.profile_exits(model, tokenizer, texts)       # writes exit_profile.json / .png next to the model
    profile = eet.profile_exits(model, tokenizer, texts, ProfileConfig(window=128), write=False)  # = window=128
    lean = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                exit_max_layer=profile.recommend(coverage=0.95))

The command `ee-transformers profile` (`ee_transformers.tools.profile`) runs this on text files.
"""

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ee_transformers.generation_early_exit import (
    EXIT_FIELDS,
    StepState,
    first_confident_exit,
    merged_exit_values,
    resolve_exit_settings,
)
from ee_transformers.lean_early_exit import is_lean
from ee_transformers.utils.arguments import check_fields
from ee_transformers.utils.plotting import pyplot, pyplot_or_skip

__all__ = [
    "ExitProfile",
    "PROFILE_FILE",
    "ProfileConfig",
    "decide_positions",
    "lean_agreement",
    "plot_profile",
    "profile_exits",
]

PROFILE_FILE = "exit_profile.json"


@dataclass
class ExitProfile:
    """Deciding layers of `num_tokens` teacher-forced tokens.

    histogram: {decided layer: tokens} (`num_layers - 1` = full depth); exit_layers: the model's exits; settings: the
    exit settings profiled (JSON-friendly); agreement: {depth: share of tokens a lean model with `exit_max_layer=depth`
    predicts as plain full depth does} (teacher-forced: decisions deeper than `depth` become greedy exits there; at
    the last layer it is the early-exit model's own agreement).
    """

    num_layers: int
    exit_layers: list
    histogram: dict
    settings: dict = field(default_factory=dict)
    agreement: dict = field(default_factory=dict)
    texts: int = 0
    window: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.histogram.values())

    @property
    def depths(self) -> list[int]:
        """The depths a lean model can stop at: every exit, then the last layer."""
        return list(self.exit_layers) + [self.num_layers - 1]

    @property
    def rates(self) -> dict:
        """{depth: share of tokens that need exactly that depth (decided there)}."""
        return {d: self.histogram.get(d, 0) / self.num_tokens for d in self.depths}

    @property
    def coverage(self) -> dict:
        """{depth: share of tokens decided at or before it}: what a lean model with `exit_max_layer=depth` decides
        without a greedy exit."""
        out, total = {}, 0
        for d in self.depths:
            total += self.histogram.get(d, 0)
            out[d] = total / self.num_tokens
        return out

    def recommend(self, coverage: float = 0.95) -> int:
        """The shallowest exit whose coverage reaches `coverage`, else the last layer (load everything)."""
        if isinstance(coverage, bool) or not isinstance(coverage, (int, float)) or not 0 < coverage <= 1:
            raise ValueError(
                f"`coverage` must be a share of tokens: allowed values are 0 < coverage <= 1, got {coverage!r}."
            )
        return next((d for d, share in self.coverage.items() if share >= coverage - 1e-12), self.num_layers - 1)

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "exit_layers": list(self.exit_layers),
            "num_tokens": self.num_tokens,
            "texts": self.texts,
            "window": self.window,
            "settings": self.settings,
            "histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "rates": {str(k): v for k, v in self.rates.items()},
            "coverage": {str(k): v for k, v in self.coverage.items()},
            "agreement": {str(k): v for k, v in self.agreement.items()},
            "recommend": {str(c): self.recommend(c) for c in (0.8, 0.9, 0.95, 0.99)},
        }

    @classmethod
    def from_dict(cls, data: dict) -> "ExitProfile":
        return cls(
            num_layers=data["num_layers"],
            exit_layers=list(data["exit_layers"]),
            histogram={int(k): v for k, v in data["histogram"].items()},
            settings=data.get("settings", {}),
            agreement={int(k): v for k, v in data.get("agreement", {}).items()},
            texts=data.get("texts", 0),
            window=data.get("window", 0),
        )

    @classmethod
    def load(cls, path) -> "ExitProfile":
        """From `exit_profile.json`, or a folder holding it."""
        path = Path(path)
        return cls.from_dict(json.loads((path / PROFILE_FILE if path.is_dir() else path).read_text()))

    def __str__(self):
        rows = ", ".join(
            f"{d}: {100 * r:.1f}%" + (f" (agreement {self.agreement[d]:.3f})" if d in self.agreement else "")
            for d, r in self.rates.items()
        )
        return (
            f"{self.num_tokens} tokens from {self.texts} texts; decided at {{{rows}}}; recommended exit_max_layer "
            f"{self.recommend(0.95)} (95% coverage), {self.recommend(0.9)} (90%)"
        )


def _json_settings(settings) -> dict:
    return {
        "criterion": settings.criterion.name,
        "thresholds": {str(k): v for k, v in settings.thresholds.items()},
        "patience": settings.patience,
    }


def _windows(tokenizer, texts, window):
    """Token windows of at most `window` tokens (a long text gives several; a short one its own)."""
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), window):
            if len(ids[start : start + window]) >= 2:
                yield ids[start : start + window]


@torch.no_grad()
def decide_positions(model, settings, hidden_states, chunk=1024) -> torch.Tensor:
    """Deciding layer of every position `(N,)`, from `hidden_states` (the model's output_hidden_states, each entry
    flattened to `(N, D)`), with the decoding loop's own exit rule (`first_confident_exit`), one token at a time."""
    num_layers, n = model.config.num_hidden_layers, hidden_states[0].shape[0]
    decided = torch.full((n,), num_layers - 1, dtype=torch.long, device=hidden_states[0].device)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        state = StepState(settings, stop - start, decided.device, None)
        at_exit = {j: (hidden_states[j + 1][start:stop], hidden_states[j][start:stop]) for j in settings.check_layers}
        decided[start:stop] = first_confident_exit(model, settings, at_exit, state, num_layers)
    return decided


@torch.no_grad()
def lean_agreement(model, hidden_states, decided, chunk=512) -> dict:
    """{depth: positions whose token a lean model stopping at `depth` predicts as plain full depth does}: a position
    decided at or below `depth` takes its deciding head's argmax, a deeper one the greedy exit's at `depth`."""
    last, exits = model.config.num_hidden_layers - 1, list(model.config.exit_layers)
    depths = exits + [last]
    column = torch.full((last + 1,), -1, dtype=torch.long, device=decided.device)
    column[depths] = torch.arange(len(depths), device=decided.device)
    agree = dict.fromkeys(depths, 0)
    for start in range(0, decided.numel(), chunk):
        rows = slice(start, start + chunk)
        full = model.family.head_logits(model, hidden_states[-1][rows]).argmax(-1)  # the last entry is after the norm
        argmax = torch.stack(
            [model.exit_logits_from_hidden(i, hidden_states[e + 1][rows]).argmax(-1) for i, e in enumerate(exits)]
            + [full],
            dim=1,
        )  # (n, depths)
        for d in depths:
            used = column[decided[rows].clamp(max=d)]
            agree[d] += int((argmax.gather(1, used[:, None]).squeeze(1) == full).sum())
    return agree


@dataclass
class ProfileConfig:
    """Settings of one exit profile (`profile_exits`; `ee-transformers profile`'s flags are generated from it);
    `__post_init__` raises `ValueError` naming a bad field. The exit settings profiled are the model's stored ones,
    or those given beside the config (`exit_criterion=...`)."""

    batch_size: int = field(default=8, metadata={"help": "teacher-forced windows per forward", "min": 1})
    window: int = field(default=256, metadata={"help": "tokens per teacher-forced window", "min": 1})
    max_tokens: int | None = field(
        default=None,
        metadata={"help": "profile the first windows that hold at least this many tokens (default: all)", "min": 1},
    )
    progress: bool = field(default=True, metadata={"help": "show a progress bar over the batches"})

    def __post_init__(self):
        check_fields(self)


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ProfileConfig))


def _profiled_settings(model, exit_settings):
    """The exit settings to profile, decided per token (row policy): `exit_settings` over the model's stored ones."""
    unknown = sorted(set(exit_settings) - set(EXIT_FIELDS))
    if unknown:
        raise ValueError(
            f"Unknown exit setting(s) {unknown}: allowed names are {list(EXIT_FIELDS)} (and the profile's settings "
            f"{list(_CONFIG_FIELDS)})."
        )
    if is_lean(model):
        raise ValueError(
            f"`model` holds decoder layers 0..{model.exit_max_layer} only; profile the fully loaded model "
            f"(`model.set_exit_max_layer({model.config.num_hidden_layers - 1})`)."
        )
    settings = resolve_exit_settings(model.config, merged_exit_values(model, None, dict(exit_settings)))
    if settings is None:
        raise ValueError(
            "No exit settings to profile: pass `exit_criterion` and `exit_threshold`, or store them in "
            "`model.generation_config` (calibration does)."
        )
    return dataclasses.replace(settings, policy="row")  # each token decides for itself


def _profiled_windows(tokenizer, texts, config: ProfileConfig) -> list:
    """The windows profiled: every one, or the first that hold at least `config.max_tokens` tokens."""
    windows, total = [], 0
    for ids in _windows(tokenizer, texts, config.window):
        if config.max_tokens is not None and total >= config.max_tokens:
            break
        windows.append(ids)
        total += len(ids)
    if not windows:
        raise ValueError("`texts` hold no window of at least 2 tokens to profile.")
    return windows


def _right_padded(rows, pad):
    """`(n, longest)` ids and mask of token lists, right-padded: positions stay 0..len-1, pads after every token."""
    ids = torch.full((len(rows), max(map(len, rows))), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids, mask


@torch.no_grad()
def _decide_windows(model, settings, windows, config: ProfileConfig, pad):
    """Each window's positions decided, batch by batch: (tokens per deciding layer `(L,)`, {depth: positions a lean
    model stopping there predicts as full depth does})."""
    counts = torch.zeros(model.config.num_hidden_layers, dtype=torch.long)
    agree = {}
    batches = range(0, len(windows), config.batch_size)
    if config.progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="profiling exits", unit="batch")
    for b in batches:
        ids, mask = _right_padded(windows[b : b + config.batch_size], pad)
        out = model(
            ids.to(model.device), attention_mask=mask.to(model.device), output_hidden_states=True, logits_to_keep=1
        )
        valid = mask.bool().flatten().to(model.device)
        hidden = [h.flatten(0, 1)[valid] for h in out.hidden_states]
        decided = decide_positions(model, settings, hidden)
        counts += torch.bincount(decided.cpu(), minlength=len(counts))
        for d, n in lean_agreement(model, hidden, decided).items():
            agree[d] = agree.get(d, 0) + n
    return counts, agree


@torch.no_grad()
def profile_exits(model, tokenizer, texts, config: ProfileConfig | None = None, out_dir=None, write=True, **kwargs):
    """Profiles the model's stored exit settings (or the given `exit_criterion=...`, ...) over `texts`, teacher-forced.

    config: a `ProfileConfig` (`window`: tokens per teacher-forced window; `max_tokens`: profile only the first
    windows that hold at least that many tokens; `batch_size`; `progress`); its fields may also be given as keywords
    (`window=128`), over `config`. The other keywords are exit settings. Writes `exit_profile.json` and
    `exit_profile.png` to `out_dir` (default: the folder the model was loaded from, when it is a local folder) unless
    `write=False`. The model must hold every layer (a lean model cannot tell what its shed layers would decide).
    """
    overrides = {name: kwargs.pop(name) for name in _CONFIG_FIELDS if name in kwargs}
    config = dataclasses.replace(config or ProfileConfig(), **overrides)
    settings = _profiled_settings(model, kwargs)
    texts = [texts] if isinstance(texts, str) else texts
    windows = _profiled_windows(tokenizer, texts, config)
    counts, agree = _decide_windows(model, settings, windows, config, tokenizer.pad_token_id or 0)
    total = int(counts.sum())
    profile = ExitProfile(
        num_layers=model.config.num_hidden_layers,
        exit_layers=list(model.config.exit_layers),
        histogram={j: int(c) for j, c in enumerate(counts.tolist()) if c},
        settings=_json_settings(settings),
        agreement={d: n / total for d, n in agree.items()},
        texts=len(texts),
        window=config.window,
    )
    if write:
        if out_dir is not None:
            write_profile(profile, out_dir)
        elif os.path.isdir(getattr(model, "name_or_path", None) or ""):  # next to the model
            write_profile(profile, model.name_or_path)
    return profile


def write_profile(profile: ExitProfile, folder) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PROFILE_FILE).write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    if pyplot_or_skip("exit_profile.png") is not None:  # the plot is an extra; the JSON is the profile
        plot_profile(profile, folder / "exit_profile.png")
    return folder / PROFILE_FILE


def plot_profile(profile: ExitProfile, path):
    """Share of tokens decided per depth (bars) and the coverage of a lean model stopping there (line).

    Needs matplotlib (`pip install 'ee-transformers[bench]'`)."""
    plt = pyplot()

    depths = profile.depths
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(range(len(depths)), [profile.rates[d] for d in depths], color="C0", label="decided here")
    ax.plot(
        range(len(depths)),
        [profile.coverage[d] for d in depths],
        "o-",
        color="C1",
        label="coverage with exit_max_layer here",
    )
    if profile.agreement:
        ax.plot(
            range(len(depths)),
            [profile.agreement[d] for d in depths],
            "s--",
            color="C2",
            label="agreement with full depth (teacher-forced)",
        )
    ax.axhline(0.95, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(depths)), [str(d) for d in depths])
    ax.set_xlabel("decoder layer (exits, then the last layer)")
    ax.set_ylabel("share of tokens")
    ax.set_ylim(0, 1.02)
    ax.set_title(
        f"{profile.num_tokens} tokens, {profile.settings.get('criterion', '?')}; recommended "
        f"exit_max_layer {profile.recommend(0.95)} at 95%",
        fontsize=9,
    )
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path

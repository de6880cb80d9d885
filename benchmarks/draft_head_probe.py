"""What first-draft acceptance does an EAGLE-style draft head on SmolLM2-135M-Instruct's final hidden state reach,
fitted on a CPU in minutes, on held-out text of its own domain and of the other one? (probe)

    python benchmarks/draft_head_probe.py [--train-domain austen|python] [--train-tokens 65536] [--fit-seconds 240]
        [--variants w1,w16] [--shortlist 8192] [--shortlist-from frequency|low-ids] [--plain-head] [--eval-prompts 24]
        [--eval-every SECONDS] [--threads 2] [--out FILE]

Features: the last decoder layer's output BEFORE the final norm, over 256-token blocks of the training text (the
five Austen training novels, or the Python manual's region 0-0.7), cached under /tmp. The teacher's distribution on
the shortlist is recomputed exactly from those states (frozen final norm + the LM head's shortlist rows), so no
logits are cached. Head at entry t: concat(h_t, embedding(x_{t+1})) (each RMS-normed first unless --plain-head,
see DraftHead) -> Linear(2d, d) -> one pre-norm block (causal
attention with rotary over the last `window` entries, SwiGLU MLP of the backbone's width) -> RMSNorm (started from the
model's final norm) -> the shared frozen LM head's shortlist rows: it predicts h_{t+1} and x_{t+2}. Loss: KL(teacher
|| head) on the shortlist + 0.2 smooth-L1(head state, h_{t+1}), on entries 1..254 of each block (entry 0 is the
attention-sink state, which evaluation windows never reach). Evaluation: greedy continuations (48 tokens, full
depth, min_new_tokens=48) of held-out prompts (Python manual 0.8-0.88, second half of Sense and Sensibility), then
K=4 chained drafts from every position t whose drafts are all generated tokens (t = 63 .. 106: 44 per prompt).
"""

import argparse
import hashlib
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ee_transformers.tools import assets
from ee_transformers.tools.assets.text import text_slice
from ee_transformers.tools.bench.loading import HELDOUT_REGIONS, heldout_prompts
from ee_transformers.training.data import frequent_tokens

BLOCK, PROMPT, NEW, K, BATCH = 256, 64, 48, 4, 8
BUCKETS = (0.0, 0.2, 0.4, 0.6, 0.8)


def final_states(model, ids):
    """(B, L, d): the last decoder layer's output, before the final norm. In transformers 5.24 `hidden_states[-1]`
    is NOT that: `capture_outputs` (utils/output_capturing.py, tie_last_hidden_states) replaces it with
    `last_hidden_state`, which is after `model.model.norm`; so the norm's input is taken with a hook."""
    seen = []
    hook = model.model.norm.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    try:
        model.model(input_ids=ids)  # the backbone only: the full LM head is not needed here
    finally:
        hook.remove()
    return seen[0]


def training_blocks(domain, count, tokenizer):
    """`count` blocks of BLOCK tokens starting (at a word) at evenly spaced points of the training text."""
    if domain == "austen":  # the five training novels, as the main job fits on them
        source = "\n\n".join(assets.training_texts()[:-1])
    else:
        source = text_slice(assets.fetch_text(progress=False)["python"][0], (0.0, 0.7), 10**10)
    chunk, blocks = 8 * BLOCK, []  # characters: comfortably more than BLOCK tokens
    step = max((len(source) - chunk) // count, 1)
    for k in range(count):
        piece = source[k * step : k * step + chunk]
        ids = tokenizer(piece[piece.find(" ") + 1 :], add_special_tokens=False)["input_ids"][:BLOCK]
        if len(ids) == BLOCK:
            blocks.append(ids)
    return torch.tensor(blocks)


@torch.no_grad()
def features(model, tokenizer, args):
    """(ids (N, BLOCK), states (N, BLOCK, d), seconds spent; 0 when read from the /tmp cache)."""
    key = json.dumps([args.model, args.train_domain, args.train_tokens, BLOCK, transformers.__version__])
    path = Path(
        f"/tmp/draft-head-probe-{args.train_domain}-{args.train_tokens}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.pt"
    )
    if path.exists():
        data = torch.load(path)
        print(f"features: read {tuple(data['states'].shape)} from {path}", flush=True)
        return data["ids"], data["states"], 0.0
    started = time.perf_counter()
    ids = training_blocks(args.train_domain, max(args.train_tokens // BLOCK, BATCH), tokenizer)
    states = torch.cat([final_states(model, ids[b : b + BATCH]) for b in range(0, len(ids), BATCH)])
    torch.save({"ids": ids, "states": states}, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    seconds = time.perf_counter() - started
    print(f"features: {ids.numel()} tokens ({len(ids)} blocks) in {seconds:.1f} s -> {path}", flush=True)
    return ids, states, seconds


def window_mask(q_pos, k_pos, window):
    """(1, 1, Lq, Lk) bool: a query attends to keys at most `window` - 1 entries before it, and to itself."""
    gap = q_pos[:, None] - k_pos[None, :]
    return ((gap >= 0) & (gap < window))[None, None]


class DraftHead(nn.Module):
    """`mean_state` None: the head exactly as specified. Else (the default) two additions that speed up a short fit:
    RMSNorms on both inputs before the fuse (as EAGLE-3 does: h_t has RMS ~40 with dimensions up to ~600, the
    embeddings RMS 0.14) and the fuse's bias started at the mean training state (so the head starts near the
    unigram-like logits of the mean state, not random ones)."""

    def __init__(self, model, shortlist, window, mean_state=None):
        super().__init__()
        cfg, d = model.config, model.config.hidden_size
        self.window, self.heads = window, cfg.num_attention_heads
        self.register_buffer("emb", model.get_input_embeddings().weight.detach(), persistent=False)  # shared, frozen
        self.register_buffer("lm", model.lm_head.weight.detach()[shortlist].clone(), persistent=False)
        self.rotary = model.model.rotary_emb
        self.fuse = nn.Linear(2 * d, d)
        self.norm1, self.norm2, self.norm = (nn.RMSNorm(d, eps=cfg.rms_norm_eps) for _ in range(3))
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.in_norms = None if mean_state is None else nn.ModuleList(nn.RMSNorm(d, eps=1e-5) for _ in range(2))
        with torch.no_grad():
            self.norm.weight.copy_(model.model.norm.weight)
            if mean_state is not None:
                self.fuse.bias.copy_(mean_state)

    def forward(self, states, tokens, positions, mask, past=None):
        """Entries (B, L, d) + (B, L) at `positions` (L,) -> predicted next states (B, L, d), this call's keys/values."""
        emb = F.embedding(tokens, self.emb)
        if self.in_norms is not None:
            states, emb = self.in_norms[0](states), self.in_norms[1](emb)
        x = self.fuse(torch.cat([states, emb], -1))
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary_pos_emb(q, k, *self.rotary(x, positions[None]))
        kv = (k, v)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up), kv

    def logits(self, x):
        return self.norm(x) @ self.lm.T


def fit(head, model, ids, states, seconds, lr, checkpoint=None, every=0.0):
    """AdamW, cosine over the wall-clock budget (10 warm-up steps); returns steps, start/end loss and a log, and
    `checkpoint(step, seconds)`'s answer every `every` seconds of fitting (its own time not counted)."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    pos = torch.arange(1, BLOCK - 1)  # entries 1..254: entry 0 holds the attention-sink state (RMS ~200, not ~40)
    mask, gen = window_mask(pos, pos, head.window), torch.Generator().manual_seed(0)
    log, started, last_print, step, recent = [], time.perf_counter(), 0.0, 0, []
    curve, next_check = [], every
    while (elapsed := time.perf_counter() - started) < seconds:
        if checkpoint is not None and every and elapsed >= next_check:
            paused = time.perf_counter()
            curve.append({"s": round(elapsed, 1), "step": step, **checkpoint()})
            print(f"  {elapsed:6.1f} s  step {step:5d}  checkpoint {curve[-1]}", flush=True)
            started += time.perf_counter() - paused
            next_check += every
            head.train()
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * elapsed / seconds))
        pick = torch.randint(len(ids), (BATCH,), generator=gen)
        h, x = states[pick], ids[pick]
        with torch.no_grad():
            teacher = F.log_softmax(model.model.norm(h[:, 2:]) @ head.lm.T, -1).flatten(0, 1)
        out, _ = head(h[:, 1:-1], x[:, 2:], pos, mask)
        kl = F.kl_div(
            F.log_softmax(head.logits(out), -1).flatten(0, 1), teacher, log_target=True, reduction="batchmean"
        )
        reg = F.smooth_l1_loss(out, h[:, 2:])
        loss = kl + 0.2 * reg
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        recent.append((kl.item(), reg.item()))
        if step == 1 or time.perf_counter() - started - last_print >= 30 or time.perf_counter() - started >= seconds:
            last_print = time.perf_counter() - started
            kl_m, reg_m = (statistics.fmean(v) for v in zip(*recent))
            log.append({"s": round(last_print, 1), "step": step, "kl": round(kl_m, 4), "smooth_l1": round(reg_m, 4)})
            print(f"  {last_print:6.1f} s  step {step:5d}  kl {kl_m:.4f}  smooth-l1 {reg_m:.4f}", flush=True)
            recent = []
    seconds = round(time.perf_counter() - started, 1)
    return {"steps": step, "seconds": seconds, "loss_start": log[0], "loss_end": log[-1], "log": log, "curve": curve}


def eval_prompts(tokenizer, count):
    """{domain: [ids]}: 2/3 of `count` from the Python manual's held-out region, the rest from Sense and
    Sensibility's (the benchmark's `HELDOUT_REGIONS`), through the benchmark's own prompt helper."""
    text = assets.fetch_text(progress=False)
    novel = next(p for p in text["austen"] if Path(p).stem == assets.AUSTEN_HELDOUT)
    n_python = max(1, round(count * 2 / 3)) if count > 1 else 1
    out = {}
    for domain, path, n in (("python", text["python"][0], n_python), ("austen", novel, count - n_python)):
        if n > 0:
            texts = {domain: text_slice(path, HELDOUT_REGIONS[domain], 10**10)}
            out[domain] = [p["ids"] for p in heldout_prompts(tokenizer, num_prompts=n, window=PROMPT, texts=texts)]
    return out


@torch.no_grad()
def greedy_runs(model, prompts):
    """{domain: (sequences (R, PROMPT + NEW), real states (R, PROMPT + NEW, d), teacher agreement)}."""
    runs = {}
    for domain, rows in prompts.items():
        ids = torch.tensor(rows)
        seq = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
        )
        h = torch.cat([final_states(model, seq[b : b + BATCH]) for b in range(0, len(seq), BATCH)])
        # check: one teacher-forced pass reproduces the greedy tokens (the features are the right states)
        same = (model.lm_head(model.model.norm(h[:, PROMPT - 1 : -1])).argmax(-1) == seq[:, PROMPT:]).float().mean()
        runs[domain] = (seq, h, same.item())
    return runs


@torch.no_grad()
def evaluate(head, shortlist, runs):
    """Per domain: acceptance at depth 1..K, tokens per round, first-draft acceptance by confidence, coverage."""
    report, w = {}, head.window
    for domain, (seq, h, agree) in runs.items():
        starts = torch.arange(PROMPT - 1, PROMPT + NEW - 1 - K)  # drafts x_{t+2}..x_{t+1+K}, all generated
        rows = torch.arange(len(seq))[:, None]
        win = starts[None, :, None] + torch.arange(-w + 1, 1)  # real entries t-w+1..t
        states = h[rows[..., None], win].flatten(0, 1)  # (R * T, w, d)
        tokens = seq[rows[..., None], win + 1].flatten(0, 1)
        target = seq[rows[..., None], starts[None, :, None] + 2 + torch.arange(K)].flatten(0, 1)  # (R * T, K)
        drafts, conf = [], None
        for _ in range(K):
            pos = torch.arange(states.shape[1])
            out, _ = head(states, tokens, pos, window_mask(pos, pos, w))
            probs = F.softmax(head.logits(out[:, -1]), -1)
            conf = probs.max(-1).values if conf is None else conf
            drafts.append(shortlist[probs.argmax(-1)])
            states, tokens = torch.cat([states, out[:, -1:]], 1), torch.cat([tokens, drafts[-1][:, None]], 1)
        ok = (torch.stack(drafts, 1) == target).long().cumprod(1).bool()  # drafts 1..j all right
        accept = ok.float().mean(0).tolist()
        buckets = {}
        for lo, hi in zip(BUCKETS, BUCKETS[1:] + (1.01,)):
            inside = (conf >= lo) & (conf < hi)
            name = f"[{lo:.1f},{min(hi, 1.0):.1f}{']' if hi > 1 else ')'}"
            buckets[name] = {
                "n": int(inside.sum()),
                "accept": ok[inside, 0].float().mean().item() if inside.any() else None,
            }
        report[domain] = {
            "accept_by_depth": [round(a, 4) for a in accept],
            "tokens_per_round": round(1 + sum(accept), 4),
            "first_draft_by_confidence": buckets,
            "positions": len(target),
            "shortlist_coverage": torch.isin(seq[:, PROMPT:], shortlist).float().mean().item(),
            "teacher_agreement": agree,
        }
    return report


@torch.no_grad()
def head_call_ms(head, d, calls=50):
    """Median ms of one draft step at batch 1: one new entry over a cache of `window` - 1 entries, logits, argmax."""
    past, w = None, head.window
    if w > 1:
        pos = torch.arange(w - 1)
        _, past = head(torch.randn(1, w - 1, d), torch.zeros(1, w - 1, dtype=torch.long), pos, window_mask(pos, pos, w))
    state, token, at = torch.randn(1, 1, d), torch.zeros(1, 1, dtype=torch.long), torch.tensor([w - 1])
    mask = window_mask(at, torch.arange(w), w)
    times = []
    for i in range(calls + 5):
        started = time.perf_counter()
        out, _ = head(state, token, at, mask, past)
        head.logits(out[:, -1]).argmax(-1)
        if i >= 5:
            times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(assets.default_cache_dir() / assets.MODEL_DIRNAME))
    parser.add_argument("--train-domain", choices=["austen", "python"], default="austen")
    parser.add_argument("--train-tokens", type=int, default=65536)
    parser.add_argument("--shortlist", type=int, default=8192)
    parser.add_argument("--shortlist-from", choices=["frequency", "low-ids"], default="frequency")
    parser.add_argument("--fit-seconds", type=float, default=240.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--variants", default="w1,w16", help="comma-separated w<window>, one head each")
    parser.add_argument("--eval-prompts", type=int, default=24, help="2/3 Python manual, 1/3 Sense and Sensibility")
    parser.add_argument("--plain-head", action="store_true", help="no input norms, default fuse init (DraftHead)")
    parser.add_argument("--eval-every", type=float, default=0.0, help="seconds of fitting between two evaluations")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="draft-head-probe.json")
    args = parser.parse_args()
    windows = [int(v.strip().removeprefix("w")) for v in args.variants.split(",")]
    if not all(1 <= w <= PROMPT for w in windows):
        parser.error(f"--variants: windows must lie in 1..{PROMPT}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval().requires_grad_(False)
    ids, states, feature_s = features(model, tokenizer, args)
    vocab = model.config.vocab_size
    if args.shortlist_from == "frequency":  # most frequent in the fitted blocks; ties and unseen ids: lowest id first
        shortlist = frequent_tokens(ids, args.shortlist, vocab)
    else:
        shortlist = torch.arange(min(args.shortlist, vocab))
    started = time.perf_counter()
    runs = greedy_runs(model, eval_prompts(tokenizer, args.eval_prompts))
    print(
        f"greedy runs: {sum(len(r[0]) for r in runs.values())} prompts x {NEW} tokens in "
        f"{time.perf_counter() - started:.1f} s",
        flush=True,
    )
    result = {
        "settings": vars(args)
        | {"model": args.model.replace(str(Path.home()), "~", 1), "out": Path(args.out).name}  # no machine's paths
        | {"windows": windows, "block": BLOCK, "prompt": PROMPT, "new": NEW, "K": K},
        "hidden_state": "last decoder layer output, before the final norm (input of model.model.norm)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "feature_seconds": round(feature_s, 1),
        "train_tokens_used": ids.numel(),
        "variants": {},
    }
    for w in windows:
        print(f"fitting w{w} for {args.fit_seconds:.0f} s", flush=True)
        torch.manual_seed(0)
        head = DraftHead(model, shortlist, w, None if args.plain_head else states[:, 1:].mean((0, 1)))
        start = evaluate(head.eval(), shortlist, runs)  # the untrained head, for comparison
        print(f"  untrained w{w}: " + ", ".join(f"{d} acc@1 {e['accept_by_depth'][0]:.3f}" for d, e in start.items()))

        def checkpoint(head=head):  # first-draft acceptance per domain, the fit so far
            return {d: e["accept_by_depth"][0] for d, e in evaluate(head.eval(), shortlist, runs).items()}

        fitted = fit(head.train(), model, ids, states, args.fit_seconds, args.lr, checkpoint, args.eval_every)
        head.eval()
        result["variants"][f"w{w}"] = {
            "eval_at_start": start,
            "params": sum(p.numel() for p in head.parameters()),
            "fit": fitted,
            "eval": evaluate(head, shortlist, runs),
            "head_call_ms": round(head_call_ms(head, model.config.hidden_size), 3),
        }
    print(f"\ntrained on {args.train_domain}, {ids.numel()} tokens; shortlist {args.shortlist} ({args.shortlist_from})")
    print("| head | domain | fitted on | acc@1 | acc@2 | acc@3 | acc@4 | tok/round | coverage | teacher | ms/call |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, v in result["variants"].items():
        for domain, e in v["eval"].items():
            acc = " | ".join(f"{a:.3f}" for a in e["accept_by_depth"])
            fitted_on = "yes (held out)" if domain == args.train_domain else "no"
            print(
                f"| {name} | {domain} | {fitted_on} | {acc} | {e['tokens_per_round']:.3f} | "
                f"{e['shortlist_coverage']:.3f} | {e['teacher_agreement']:.3f} | {v['head_call_ms']:.2f} |"
            )
    for name, v in result["variants"].items():
        for domain, e in v["eval"].items():
            cells = [
                f"{b} {c['accept']:.2f} (n={c['n']})" if c["n"] else f"{b} - (n=0)"
                for b, c in e["first_draft_by_confidence"].items()
            ]
            print(f"{name} {domain} first draft by confidence: " + "; ".join(cells))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

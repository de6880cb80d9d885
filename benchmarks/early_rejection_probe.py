"""Does early rejection of copied drafts pay? Counted on the model's own greedy text, costed from this machine's
layer times (BENCHMARKS.md section 5, "Early rejection").

    python benchmarks/early_rejection_probe.py --folder runs/smollm2-135m-ee [--prompts 16]

Early rejection: a round's fed tokens (the row's last token and its copied drafts) run layers 0..E, exit head E
(top-8192 draft vocabulary) checks each draft, and the drafts are cut at the first one the exit head disagrees with at
confidence >= tau; only the kept prefix runs layers E+1..L-1 and the final head. Lossless still (the full model
verifies what is kept), but a wrong cut throws away a draft the full model would have kept.

Replayed exactly on the full-depth greedy continuations (64 tokens) of held-out prompts: drafts as the folder's
stored setting makes them (own context, N=2, 3-gram, then the stored table), the exit head's teacher-forced
predictions on that text (exact wherever the drafts before it were right; a cut after the full model's first
rejection is not counted, which can only understate the saving). Costs: per-layer times of one forward of w positions
after a 64-token prefix (forward hooks, median of 10), at batch 1 and 8, plus the draft head at w rows per checked
round. Prints the predicted time of the decode rounds against the same rounds without rejection.
"""

import argparse
import statistics
import time

import torch
from table_drafts_probe import own_drafts  # the row's own context, as `context_drafts` drafts it (beside this file)
from transformers import AutoModelForCausalLM, AutoTokenizer

from ee_transformers.compat import cache_of
from ee_transformers.draft_table import table_drafts
from ee_transformers.measure.timing import greedy_generation_config, without_eos
from ee_transformers.speculative_early_exit import draft_vocab_head
from ee_transformers.tools.bench.loading import heldout_prompts, make_batches

N = 2


def stored_table_drafts(model):
    """Drafts from the folder's stored table, by the runtime's own lookup (`draft_table.table_drafts`), for one row."""
    keys, following, v = model.draft_table_keys, model.draft_table_next, model.config.vocab_size

    def drafts(text, n):
        tokens = torch.tensor([text])
        out, count = table_drafts(keys, following, tokens, torch.tensor([len(text)]), torch.tensor([n]), v)
        return out[0, : int(count[0])].tolist()

    return drafts


@torch.no_grad()
def layer_costs(model, ids, rows, exit_layer, widths=(1, 2, 3)):
    """{w: (ms of layers 0..E, ms of layers E+1..L-1, ms of the rest: embedding, norm, LM head)}, batch `rows`."""
    layers = model.model.layers
    stamps = []
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, j=j: stamps.append((j, time.perf_counter())))
        for j, layer in enumerate(layers)
    ]
    hooks.append(layers[-1].register_forward_hook(lambda m, a, o: stamps.append((len(layers), time.perf_counter()))))
    out = {}
    try:
        for w in widths:
            parts = []
            for _ in range(12):
                cache = cache_of(model(ids[:rows, :64], use_cache=True, output_exit_logits=False))
                stamps.clear()
                start = time.perf_counter()
                model(ids[:rows, 64 : 64 + w], cache=cache, use_cache=True)
                total = time.perf_counter() - start
                t = dict(stamps)
                lower, upper = t[exit_layer + 1] - t[0], t[len(layers)] - t[exit_layer + 1]
                parts.append((lower, upper, total - lower - upper))
            out[w] = tuple(1000 * statistics.median(p[i] for p in parts[2:]) for i in range(3))
    finally:
        for h in hooks:
            h.remove()
    return out


@torch.no_grad()
def head_cost(head, rows, hidden):
    x = torch.randn(rows, hidden)
    times = []
    for _ in range(23):
        start = time.perf_counter()
        head(x)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[3:])


def replay(seq, predictions, confidence, table, tau, prompt=64):
    """[(fed width, width above the exit)] of one row's rounds; tau None: no rejection."""
    text, target, done, rounds = list(seq[: prompt + 1]), seq[prompt + 1 :], 0, []
    while done < len(target):
        d = own_drafts(text, N) or table(text, N)
        d = d[: len(target) - done - 1]
        kept = 0
        while kept < len(d) and d[kept] == target[done + kept]:
            kept += 1
        cut = len(d)
        if tau is not None:
            for i in range(min(kept, len(d) - 1) + 1 if d else 0):  # exact while the drafts before i were right
                at = len(text) - 1 + i  # the fed token before draft i
                if predictions[at] != d[i] and confidence[at] >= tau:
                    cut = i
                    break
        step = min(kept, cut) + 1
        rounds.append((len(d) + 1, cut + 1))
        text += target[done : done + step]
        done += step
    return rounds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default="runs/smollm2-135m-ee")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.folder, trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    prompts = heldout_prompts(tokenizer, num_prompts=args.prompts, window=64)
    seqs = []
    with without_eos(model, model), torch.no_grad():
        config = greedy_generation_config(model, 64, clear_exit_settings=True)
        for ids, mask, _ in make_batches(prompts, 8, max_batches=len(prompts) // 8):
            out = model.generate(ids, attention_mask=mask, generation_config=config, early_exit=False)
            seqs += getattr(out, "sequences", out).tolist()
    ids = torch.tensor(seqs)
    table = stored_table_drafts(model)
    head = draft_vocab_head(model, 8192)
    vocab_ids = model.draft_token_ids[:8192]
    for e, exit_layer in enumerate(model.config.exit_layers[:2]):
        with torch.no_grad():
            logits = model(ids, output_exit_logits=True).exit_logits[e][..., vocab_ids]
        probs = logits.softmax(-1)
        confidence, best = probs.max(-1)
        predictions = vocab_ids[best]
        print(f"exit after layer {exit_layer}: teacher-forced agreement with the greedy text "
              f"{float((predictions[:, 64:-1] == ids[:, 65:]).float().mean()):.3f}")  # fmt: skip
        for batch in (1, 8):
            costs = layer_costs(model, ids, batch, exit_layer)
            check = {w: head_cost(head, batch * w, model.config.hidden_size) for w in costs}
            shown = ", ".join(f"{w}: {lo:.1f} + {up:.1f} + {rest:.1f}" for w, (lo, up, rest) in costs.items())
            print(
                f"  batch {batch}: ms per forward of w positions (layers 0..{exit_layer} + above + head etc.): {shown}"
            )
            print("  | tau | rounds | predicted decode ms | against no rejection |\n  |---|---|---|---|")
            base = None
            for tau in (None, 0.9, 0.7, 0.5, 0.0):
                rows = [
                    replay(s, predictions[r].tolist(), confidence[r].tolist(), table, tau) for r, s in enumerate(seqs)
                ]
                total = n_rounds = 0.0
                for b in range(0, len(rows), batch):
                    group = rows[b : b + batch]
                    for j in range(max(map(len, group))):
                        fed = max((g[j][0] if j < len(g) else 1) for g in group)
                        upper = max((g[j][1] if j < len(g) else 1) for g in group)
                        lo, _, _ = costs[fed]
                        _, up, rest = costs[upper]
                        total += lo + up + rest + (check[fed] if tau is not None and fed > 1 else 0.0)
                        n_rounds += 1
                base = base or total
                print(f"  | {'off' if tau is None else tau} | {int(n_rounds)} | {total:.0f} | {base / total:.3f}x |")


if __name__ == "__main__":
    main()

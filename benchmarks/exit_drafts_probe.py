"""Can better fitting make exit-head drafts pay? (BENCHMARKS.md section 5, "Exit-head drafts"; issue 20 item 4)

    python benchmarks/exit_drafts_probe.py --folder FITTED --plain ~/.cache/ee-transformers/smollm2-135m-instruct \
        [--sequences 192] [--steps 300] [--out benchmarks/results/exit-drafts-probe]

`FITTED` is an early-exit folder fitted by `ee-transformers fit` on corpus text (the Austen novels but *Sense and
Sensibility*). This script fits a second model, the same exits, head kind and steps, on the model's OWN greedy text
instead: `--sequences` prompts of 32 tokens from the same training files, each continued greedily at full depth to 256
tokens (the distribution the heads see when they draft). Both are then measured the same way: acceptance alpha, the
share of positions where an exit head's argmax equals the full model's greedy token, teacher-forced on the full-depth
greedy generations (64 new tokens) of 24 held-out prompts (12 from the second half of *Sense and Sensibility*, 12 from
the Python manual), over the full vocabulary and over the top-8192 draft vocabulary each model stores. Prints a table
and writes `probe.json` to `--out`.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

import ee_transformers as eet
from ee_transformers.tools.bench.loading import heldout_prompts, make_batches, plain_twin
from ee_transformers.training.data import load_blocks
from ee_transformers.training.fit_exit_heads import FitConfig, fit_exit_heads

PROMPT, LENGTH, NEW = 32, 256, 64


@torch.no_grad()
def greedy(model, ids, mask, new_tokens):
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out


@torch.no_grad()
def own_generations(model, train_blocks, count, batch_size=32):
    """`count` blocks of LENGTH tokens: PROMPT tokens of training text, then the model's greedy continuation."""
    starts = torch.linspace(0, len(train_blocks) - 1, count).long()
    prompts = train_blocks[starts, :PROMPT]
    blocks = []
    for b in range(0, count, batch_size):
        ids = prompts[b : b + batch_size]
        blocks.append(greedy(model, ids, torch.ones_like(ids), LENGTH - PROMPT))
        print(f"  generated {min(b + batch_size, count)}/{count}", flush=True)
    return torch.cat(blocks)


@torch.no_grad()
def acceptance(model, plain, prompts, vocab=8192):
    """{exit layer: {"all", "austen", "python", "all_top"}}: alpha teacher-forced on full-depth greedy generations."""
    hits = {}
    for ids, mask, domains in make_batches(prompts, 8, max_batches=len(prompts) // 8):
        seq = greedy(plain, ids, mask, NEW)
        full_mask = torch.cat([mask, torch.ones(seq.shape[0], NEW, dtype=mask.dtype)], 1)
        out = model(seq, attention_mask=full_mask, output_exit_logits=True)
        target = seq[:, ids.shape[1] :]  # the greedy tokens, predicted at the positions before them
        top = model.draft_token_ids[:vocab] if getattr(model, "draft_token_ids", None) is not None else None
        for layer, logits in zip(model.config.exit_layers, out.exit_logits):
            logits = logits[:, ids.shape[1] - 1 : -1].float()
            same = logits.argmax(-1) == target
            same_top = top[logits[..., top].argmax(-1)] == target if top is not None else same
            for r, domain in enumerate(domains):
                h = hits.setdefault(layer, {})
                for key, value in ((domain, same[r]), ("all", same[r]), ("all_top", same_top[r])):
                    h.setdefault(key, []).append(value.float().mean().item())
    return {layer: {k: sum(v) / len(v) for k, v in h.items()} for layer, h in hits.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True)
    parser.add_argument("--plain", required=True)
    parser.add_argument("--sequences", type=int, default=192)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/exit-drafts-probe")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.plain)
    corpus = eet.from_base(args.folder).eval()
    plain = plain_twin(corpus)  # full depth on the same weights, for the generations
    cache = os.path.expanduser(os.environ.get("EE_TRANSFORMERS_CACHE", "~/.cache/ee-transformers"))
    austen = sorted(Path(cache, "text", "austen").glob("*.txt"))
    train_files = [str(p) for p in austen if p.stem != "sense-and-sensibility"]
    splits = load_blocks(train_files, tokenizer, LENGTH, config=corpus.config)
    started = time.time()
    own = own_generations(plain, splits.train, args.sequences)
    generate_s = time.time() - started
    model = eet.from_base(args.plain, exit_layers=corpus.config.exit_layers, exit_head=corpus.config.exit_head)
    started = time.time()
    config = FitConfig(steps=args.steps, batch_size=2, progress=False)
    fit_exit_heads(model, own, splits.heldout, config)
    fit_s = time.time() - started
    # the draft vocabulary of the corpus model: counted on the same training text, so the two differ in heads only
    model.set_draft_vocab(corpus.draft_token_ids)
    model.eval()
    prompts = heldout_prompts(tokenizer, num_prompts=24, window=64)
    report = {
        "corpus-fitted": acceptance(corpus, plain, prompts),
        "own-generation-fitted": acceptance(model, plain, prompts),
        "seconds": {"generate": round(generate_s, 1), "fit": round(fit_s, 1)},
        "sequences": args.sequences,
        "steps": args.steps,
    }
    print("| heads | exit | alpha all | Austen | Python | all, top-8192 drafts |\n|---|---|---|---|---|---|")
    for name in ("corpus-fitted", "own-generation-fitted"):
        for layer, a in report[name].items():
            print(f"| {name} | {layer} | {a['all']:.3f} | {a['austen']:.3f} | {a['python']:.3f} | {a['all_top']:.3f} |")
    print(f"own generations: {generate_s:.0f} s to generate, {fit_s:.0f} s to fit")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "probe.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

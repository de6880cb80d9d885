"""Paired A/B of the gate with and without feeding a round at its cheapest trusted width (BENCHMARKS.md 5g):
plain generate, the old rule and the new one per batch, interleaved, identical output asserted.

    python benchmarks/gate_widths_ab.py BATCH_SIZE DOMAIN TABLE_FROM [REPS]
"""
import sys, time, torch, statistics
import ee_transformers.speculative_early_exit as spec
from transformers import AutoTokenizer
from ee_transformers.measure.loading import load_models, make_batches
from ee_transformers.tools.assets.text import text_slice
from ee_transformers.tools.bench.loading import default_text_files, heldout_prompts
from ee_transformers.tools.bench.lossless import store_table_from
torch.set_num_threads(2)
M = __import__("os").path.expanduser("~/.cache/ee-transformers/smollm2-135m-instruct")
bs, domain, table_from = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ee, plain = load_models(M, exit_layers=[0])
tok = AutoTokenizer.from_pretrained(M)
table = table_from != "none"
if table: store_table_from(ee, tok, table_from)
path, region = default_text_files()[domain]
prompts = heldout_prompts(tok, num_prompts=16, window=64, seed=0, texts={domain: text_slice(path, region, 10**9)})
batches = make_batches(prompts, bs, max_batches=16 // bs)
new_fresh, new_cheap = spec.plan_padded_fresh, spec.cheapest_width
def use(new):
    spec.plan_padded_fresh = new_fresh if new else (lambda p, pa, c, g, most_fed=0: new_fresh(p, pa, c, g))
    spec.cheapest_width = new_cheap if new else (lambda cost, least, most=0, known=None: least)
kw = dict(max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
T = {"plain": 0.0, "old": 0.0, "new": 0.0}
with torch.inference_mode():
  for rep in range(int(sys.argv[4]) if len(sys.argv) > 4 else 1):
    for i, (ids, mask, _) in enumerate(batches):
        ref = None
        order = ["plain", "old", "new"] if (i + rep) % 2 == 0 else ["new", "old", "plain"]
        res = {}
        for name in order:
            if name != "plain": ee.drafter.history.clear() if hasattr(ee.drafter.history, "clear") else None
            if name != "plain": use(name == "new")
            t = time.perf_counter()
            if name == "plain":
                out = plain.generate(ids, attention_mask=mask, **kw)
            else:
                out = ee.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=4, max_matching_ngram_size=3,
                                  speculative_table_drafts=table, speculative_history_tokens=0, **kw)
            res[name] = time.perf_counter() - t
            T[name] += res[name]
            ref = out if ref is None else ref
            assert torch.equal(out, ref), name
        print(i, {k: round(res["plain"] / v, 3) for k, v in res.items() if k != "plain"}, flush=True)
print("sum", {k: round(T["plain"] / v, 3) for k, v in T.items() if k != "plain"}, {k: round(v, 1) for k, v in T.items()})
for g, ws in ee.drafter.costs.samples.items():
    print(g, {w: round(sorted(v)[len(v)//2]*1000, 1) for w, v in sorted(ws.items())})

"""Cost-aware calibration: which exits to check, and at which thresholds, for a greedy-agreement target.

    ee-transformers calibrate my-ee-model --data heldout/*.txt --criterion max_prob --target-agreement 0.95
    ee-transformers calibrate my-ee-model --data heldout/*.txt --lossless

The command line of `ee_transformers.training.calibrate` (and, with `--lossless`, of
`ee_transformers.training.calibrate_lossless`); what calibration does is described there.
"""

import json
import os
import sys

from ee_transformers.training.calibrate import (
    CalibrationConfig,
    apply_calibration,
    calibrate,
    calibration_card,
    check_costs,
)
from ee_transformers.utils.arguments import (
    ArgumentParser,
    InputError,
    add_config_arguments,
    config_from_args,
    flag_names,
    run_command,
)

# the command checks its choice by really decoding, and its speed by measuring; the Python defaults are off
CLI_DEFAULTS = {"verify_prompts": 8, "measure_speed": True, "progress": True}


def build_parser():
    p = ArgumentParser(prog="ee-transformers calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="an early-exit model folder (fitted)")
    p.add_argument("--data", nargs="+", required=True, help="held-out text / JSON lines / datasets files or globs")
    p.add_argument("--text-field", default="text", help="field holding the text in JSON lines / datasets files")
    p.add_argument(
        "--costs",
        help="JSON object with head_cost, backfill_cost (and check_cost) in decoder-layer steps, "
        "used instead of measuring them",
    )
    p.add_argument("--out", help="write the calibrated folder here (default: update the model folder in place)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out that ee-transformers wrote")
    add_config_arguments(p, CalibrationConfig, defaults=CLI_DEFAULTS)
    p.add_argument(
        "--lossless",
        action="store_true",
        help="lossless mode: choose the draft sources and counts (prompt_lookup_num_tokens, "
        "max_matching_ngram_size, assistant_early_exit) by measured speed; the flags below apply",
    )
    from ee_transformers.training.calibrate_lossless import LosslessCalibrationConfig

    add_config_arguments(p.add_argument_group("lossless mode (--lossless)"), LosslessCalibrationConfig)
    return p


def main(argv=None):
    return run_command(build_parser(), _run, argv)


def _parse_costs(text):
    try:
        costs = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"`--costs` is not valid JSON ({error.msg} at character {error.pos}).") from None
    try:
        return check_costs(costs)
    except ValueError as error:
        raise InputError(str(error).replace("`costs`", "`--costs`", 1)) from None


def _fit_card(folder) -> dict:
    """The fit's own card sections (training, notes) from the folder's fit_report.json, if it has one; the base
    model and license come from the folder's card (from_base reads them)."""
    path = os.path.join(folder, "fit_report.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            fitted = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"{path} is not readable JSON ({error}).") from None
    card = fitted.get("card") if isinstance(fitted, dict) else None
    return (
        {k: v for k, v in card.items() if k in ("training", "notes") and isinstance(v, str)}
        if isinstance(card, dict)
        else {}
    )


def _run(args):
    if args.lossless:
        return _run_lossless(args)
    import ee_transformers as eet
    from ee_transformers.convert import check_weights, read_config
    from ee_transformers.training.data import read_texts, tokenize_blocks
    from ee_transformers.training.fit_exit_heads import save_model_folder
    from ee_transformers.utils.outputs import OutputFolder

    config = config_from_args(CalibrationConfig, args, defaults=CLI_DEFAULTS)
    folder = args.model
    folder_config = read_config(folder, "model")
    check_weights(folder, "model")
    # the calibrated folder: --out, or the model folder updated in place; what is not written anew is kept
    output = OutputFolder(
        args.out or folder, overwrite=args.overwrite, carry_from=folder, argument="--out" if args.out else "model"
    )
    if not folder_config.get("exit_layers"):
        raise InputError(f"`model` {folder!r} has no exit heads: build and fit them first (ee-transformers fit).")
    try:
        config = config.for_model(folder_config.get("max_position_embeddings"))
    except ValueError as error:
        raise InputError(flag_names(str(error), CalibrationConfig)) from None
    costs = _parse_costs(args.costs) if args.costs else None
    card = _fit_card(folder)
    texts = read_texts(args.data, args.text_field)
    model = eet.from_base(folder)
    if model.tokenizer is None:
        raise InputError(f"`model` {folder!r} has no tokenizer to tokenise the calibration text.")
    blocks = tokenize_blocks(texts, model.tokenizer, config.block_size)
    report = calibrate(model, blocks, config, costs=costs)
    report["data"] = [os.path.basename(p) for p in args.data]
    apply_calibration(model, report)
    card["calibration"] = calibration_card(report)
    out = save_model_folder(model, output, model.tokenizer, card, {"calibration.json": report}, command="calibrate")
    print(f"Calibrated {out}: {report['message']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _run_lossless(args):
    import ee_transformers as eet
    from ee_transformers.convert import check_weights, read_config
    from ee_transformers.tools.bench.loading import heldout_prompts, plain_twin
    from ee_transformers.training import calibrate_lossless as lossless
    from ee_transformers.training.data import expand_paths
    from ee_transformers.training.fit_exit_heads import save_model_folder
    from ee_transformers.utils.outputs import OutputFolder

    config = config_from_args(lossless.LosslessCalibrationConfig, args)
    folder = args.model
    read_config(folder, "model")
    check_weights(folder, "model")
    output = OutputFolder(
        args.out or folder, overwrite=args.overwrite, carry_from=folder, argument="--out" if args.out else "model"
    )
    model = eet.from_base(folder).eval()
    if model.tokenizer is None:
        raise InputError(f"`model` {folder!r} has no tokenizer to tokenise the held-out prompts.")
    files = expand_paths(args.data)
    prompts = heldout_prompts(model.tokenizer, files=files, num_prompts=config.num_prompts, window=config.prompt_tokens)
    report = lossless.calibrate_lossless(model, plain_twin(model), prompts, config)
    report["data"] = [os.path.basename(p) for p in files]
    lossless.apply_lossless_calibration(model, report)
    card = _fit_card(folder)
    card["lossless calibration"] = lossless.lossless_calibration_card(report)
    extra = {"calibration_lossless.json": report}
    out = save_model_folder(model, output, model.tokenizer, card, extra, command="calibrate --lossless")
    print(f"Calibrated {out} (lossless): {report['message']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

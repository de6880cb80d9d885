"""Typed configs (`BenchConfig`, `CalibrationConfig`, `FitConfig`) and the command lines generated from them: every
field is a flag, a flag round-trips to the field, a bad value is a `ValueError` naming the field (or, on the command
line, one line naming the flag), and calibration's model-dependent defaults fit the model."""

import argparse
import dataclasses

import pytest

from ee_transformers.measure.config import BenchConfig
from ee_transformers.tools import bench
from ee_transformers.tools.bench.lean import LeanConfig
from ee_transformers.tools.bench.pool import PoolConfig
from ee_transformers.tools.bench.speculative import PYTHON_ONLY, SpeculativeConfig
from ee_transformers.training import calibrate as calibration
from ee_transformers.training.calibrate import CalibrationConfig
from ee_transformers.training.fit_exit_heads import FitConfig
from ee_transformers.utils.arguments import ArgumentParser, InputError, add_config_arguments, config_from_args


@pytest.mark.parametrize(
    "config_class, values, named, allowed",
    [
        (BenchConfig, {"batch_sizes": [1, 0]}, "batch_sizes", "each element an integer >= 1"),
        (BenchConfig, {"batch_sizes": []}, "batch_sizes", "non-empty list"),
        (BenchConfig, {"new_tokens": -1}, "new_tokens", "an integer >= 1"),
        (BenchConfig, {"repeats": True}, "repeats", "an integer >= 1"),
        (BenchConfig, {"repeats": 2.5}, "repeats", "an integer >= 1"),
        (BenchConfig, {"sweep_grid": "huge"}, "sweep_grid", "one of 'small', 'medium', 'full'"),
        (BenchConfig, {"forced_modes": ["row/deferred"]}, "forced_modes", "'batch/immediate'"),
        (BenchConfig, {"max_batches": [1, 2, 3]}, "max_batches", "one value or one per batch size"),
        (BenchConfig, {"sweep_batch_sizes": [4]}, "sweep_batch_sizes", "allowed values are [1, 8]"),
        (BenchConfig, {"sweep": "yes"}, "sweep", "true or false"),
        (CalibrationConfig, {"batch_size": 0}, "batch_size", "an integer >= 1"),
        (CalibrationConfig, {"decode_batch_size": 0}, "decode_batch_size", "an integer >= 1"),
        (CalibrationConfig, {"verify_new_tokens": -3}, "verify_new_tokens", "an integer >= 1"),
        (CalibrationConfig, {"target_agreement": 0.0}, "target_agreement", "a number > 0 and <= 1"),
        (CalibrationConfig, {"target_agreement": float("nan")}, "target_agreement", "a number > 0 and <= 1"),
        (CalibrationConfig, {"criterion": "vibes"}, "criterion", "one of 'max_prob'"),
        (CalibrationConfig, {"patience": 1}, "patience", "0 (off) or an integer >= 2"),
        (CalibrationConfig, {"kv": "deferred", "policy": "row"}, "kv", "`policy`='batch' only"),
        (CalibrationConfig, {"block_size": 1}, "block_size", "an integer >= 2"),
    ],
)
def test_a_bad_field_is_a_value_error_naming_it_and_what_is_allowed(config_class, values, named, allowed):
    with pytest.raises(ValueError) as info:
        config_class(**values)
    assert f"`{named}`" in str(info.value) and allowed in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "config_class, skip", [(BenchConfig, ()), (CalibrationConfig, ()), (FitConfig, ("progress", "merge_lora"))]
)
def test_every_field_is_a_flag_and_absent_flags_keep_the_dataclass_defaults(config_class, skip):
    parser = ArgumentParser(prog="t")
    add_config_arguments(parser, config_class, skip=skip)
    flags = {option for action in parser._actions for option in action.option_strings}
    for f in dataclasses.fields(config_class):
        if f.name not in skip:
            assert "--" + f.name.replace("_", "-") in flags, f"field {f.name} has no flag"
    assert config_from_args(config_class, parser.parse_args([])) == config_class()


def test_flags_round_trip_to_typed_fields():
    parser = ArgumentParser(prog="t")
    add_config_arguments(parser, BenchConfig)
    args = parser.parse_args(
        [
            "--batch-sizes",
            "1,4",
            "--no-sweep",
            "--sweep-grid",
            "small",
            "--main-repeats",
            "5",
            "--forced-modes",
            "row/immediate",
        ]
    )
    assert config_from_args(BenchConfig, args) == BenchConfig(
        batch_sizes=[1, 4], sweep=False, sweep_grid="small", main_repeats=5, forced_modes=["row/immediate"]
    )
    # `defaults` fill in what was not given (the way --quick works); given flags win over them
    quick = config_from_args(BenchConfig, parser.parse_args(["--new-tokens", "12"]), defaults=bench.config.QUICK)
    assert quick == BenchConfig.quick(new_tokens=12) and quick.repeats == 1


def test_a_bad_flag_value_names_the_flag():
    parser = ArgumentParser(prog="t")
    add_config_arguments(parser, CalibrationConfig)
    with pytest.raises(InputError, match=r"`--decode-batch-size` must be an integer >= 1, got 0"):
        config_from_args(CalibrationConfig, parser.parse_args(["--decode-batch-size", "0"]))


def test_parser_errors_are_one_line_with_exit_code_2(capsys):
    parser = ArgumentParser(prog="ee-transformers t")
    add_config_arguments(parser, BenchConfig)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--batch-sizes", "1,x"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ee-transformers t: error: argument --batch-sizes"), err


@pytest.mark.parametrize(
    "positions, block, prompt, new",
    [(None, 256, 32, 32), (4096, 256, 32, 32), (128, 128, 32, 32), (40, 40, 20, 20), (8, 8, 4, 4)],
)
def test_calibration_defaults_fit_the_model(positions, block, prompt, new):
    config = CalibrationConfig(verify_prompts=8).for_model(positions)
    assert (config.block_size, config.verify_prompt_length, config.verify_new_tokens) == (block, prompt, new)
    if positions:
        assert config.verify_prompt_length + config.verify_new_tokens <= positions


def test_calibration_limits_given_explicitly_are_checked_against_the_model():
    with pytest.raises(ValueError, match=r"`block_size`=300 is beyond the model's positions.*at most 128"):
        CalibrationConfig(block_size=300).for_model(128)
    with pytest.raises(ValueError, match=r"`verify_new_tokens`=120 .* at most 96"):
        CalibrationConfig(verify_prompts=2, verify_new_tokens=120).for_model(128)
    with pytest.raises(ValueError, match=r"`verify_prompt_length`=64 needs blocks longer"):
        CalibrationConfig(verify_prompts=2, verify_prompt_length=64).for_model(128, block_size=64)


@pytest.mark.parametrize(
    "costs, message",
    [
        ({}, "`head_cost` as a number >= 0"),
        ({"head_cost": 1, "backfill_cost": -1}, "`backfill_cost`"),
        ({"head_cost": "1", "backfill_cost": 0}, "`head_cost`"),
        ([1, 2], "must be an object"),
    ],
)
def test_pinned_costs_are_checked(costs, message):
    with pytest.raises(ValueError, match=message):
        calibration.check_costs(costs)
    assert calibration.check_costs({"head_cost": 1, "backfill_cost": 0.5}) == {
        "head_cost": 1,
        "backfill_cost": 0.5,
        "check_cost": 0.0,
    }


def test_boolean_flags_have_a_negative_form():
    parser = ArgumentParser(prog="t")
    add_config_arguments(parser, BenchConfig)
    actions = {a.dest: a for a in parser._actions}
    assert isinstance(actions["sweep"], argparse.BooleanOptionalAction)
    assert "--no-sweep" in actions["sweep"].option_strings


LEAN_REQUIRED = {"memory_budget": [2**30], "context": 96}  # `--memory-budget` is written by hand: it takes sizes


@pytest.mark.parametrize(
    "config_class, skip, required",
    [(LeanConfig, ("memory_budget",), LEAN_REQUIRED), (SpeculativeConfig, PYTHON_ONLY, {}), (PoolConfig, (), {})],
)
def test_the_other_benchmarks_take_configs_whose_fields_are_their_flags(config_class, skip, required):
    parser = ArgumentParser(prog="t")
    add_config_arguments(parser, config_class, skip=skip)
    flags = {option for action in parser._actions for option in action.option_strings}
    for f in dataclasses.fields(config_class):
        if f.name not in skip:
            assert "--" + f.name.replace("_", "-") in flags, f"field {f.name} has no flag"
    args = parser.parse_args(["--context", "96"] if "context" in required else [])
    assert config_from_args(config_class, args, **{k: v for k, v in required.items() if k in skip}) == config_class(
        **required
    )


def test_a_field_without_a_default_is_a_required_flag(capsys):
    parser = ArgumentParser(prog="t")
    add_config_arguments(parser, LeanConfig, skip=("memory_budget",))
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert "the following arguments are required: --context" in capsys.readouterr().err
    with pytest.raises(InputError, match=r"`--context` must exceed `--prompt-tokens` by at least 2, got 65 and 64"):
        config_from_args(LeanConfig, parser.parse_args(["--context", "65"]), memory_budget=[2**30])


def test_a_list_field_may_allow_empty_and_others_may_not():
    parser = ArgumentParser(prog="t")
    add_config_arguments(parser, SpeculativeConfig, skip=PYTHON_ONLY)
    config = config_from_args(SpeculativeConfig, parser.parse_args(["--forced", "", "--forced-exits", ""]))
    assert config.forced == [] and config.forced_exits == []
    with pytest.raises(InputError, match=r"`--ks` must be a non-empty list, each element an integer >= 1"):
        config_from_args(SpeculativeConfig, parser.parse_args(["--ks", ""]))
    with pytest.raises(ValueError, match=r"`forced` must be a list, each element a number >= 0 and <= 1"):
        SpeculativeConfig(forced=[1.5])

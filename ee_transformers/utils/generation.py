"""Generation settings as `generate()` keyword arguments: the call pattern transformers 5.24 does not warn about."""

__all__ = ["generate_kwargs"]

NOT_SETTINGS = ("transformers_version", "_from_model_config")  # bookkeeping fields of a GenerationConfig


def generate_kwargs(model, generation_config, **settings) -> dict:
    """`generation_config` and `settings` as keyword arguments of `model.generate`, for a call without
    `generation_config=`: the config's fields that are set and differ from `model.generation_config`, then `settings`
    (which win; an explicit None too, e.g. to turn a stored draft setting off).

    `model.generate(ids, **generate_kwargs(model, config, **settings))` decodes as `model.generate(ids,
    generation_config=config, **settings)` did (a field the config leaves unset comes from the stored config either
    way), without transformers 5.24's "Passing `generation_config` together with generation-related arguments is
    deprecated"."""
    stored = model.generation_config.to_dict()
    given = {
        name: value
        for name, value in generation_config.to_dict().items()
        if name not in NOT_SETTINGS and value is not None and value != stored.get(name)
    }
    return {**given, **settings}

"""What differs between the transformers releases the runtime supports (5.19 through 5.24), in one place, found by
looking at what the installed transformers has (never at its version string).

- **The KV cache's name.** transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache`
  (models, decoder layers, `create_causal_mask`, `prepare_inputs_for_generation`, `generate`'s model kwargs and output
  classes); 5.19 to 5.23 use `past_key_values`. The runtime calls the cache `cache` and passes it to transformers under
  `CACHE`; `cache_argument` makes a forward take the installed release's name.
- **Continuous batching's paged cache** travels as the keyword `cache` on every release, but before 5.24 it is an
  attention keyword (the model's `past_key_values` stays None and the attention function writes the paged cache), so
  a model or layer gets it as `cache` there too (`cache_kwargs`).
- **Static cache layers** can be cropped from 5.24 on (`StaticLayer.crop`); before, the lossless modes (which crop
  rejected drafts) refuse a static cache, naming the release (`crop_hint`).
- **transformers' own `assistant_early_exit`** (LayerSkip, which the benchmarks time beside ours) fails before 5.22:
  its draft cache never writes the layers past the exit, and cropping an unwritten layer raises
  (`layer_skip_failure`); the benchmarks leave its rows out there and say why. Ours is not affected.
- **Features that wrap transformers' internals** (drafts inside continuous batching, the server hooks of
  `ee-transformers serve`) check that what they wrap is there where the user turns them on, and otherwise raise one
  line naming the releases they were read against (`require_transformers`). Those internals are the same from 5.19
  to 5.24 (the batch processor, the request states, the IO buffers, the cache allocators, the server's app factory
  and generation managers), so both features work on every supported release.

Part of the Hub runtime: imports only torch and transformers.
"""

import dataclasses
import functools

import transformers
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg

# the cache's argument and output field in the installed transformers: "cache" (5.24) or "past_key_values" (5.19-5.23)
CACHE = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
# the supported releases (pyproject's range, scripts/setup.sh's choice): the oldest, the newest, the first one not
OLDEST, NEWEST, BELOW = "5.19", "5.24", "5.25"
SUPPORTED = f"transformers>={OLDEST},<{BELOW}"
# whether static cache layers can be cropped (5.24's `StaticLayer.crop`); 5.19-5.23's are not croppable
STATIC_LAYERS_CROP = StaticLayer.is_croppable is True


def cache_of(output):
    """The KV cache of a model output or of `generate`'s model kwargs (a dict), under the installed release's name."""
    return output.get(CACHE) if isinstance(output, dict) else getattr(output, CACHE)


def cache_kwargs(cache) -> dict:
    """`cache` as the keyword a transformers model or decoder layer of the installed release takes: its cache
    argument, except that a continuous-batching paged cache before 5.24 goes to the attention function as `cache`
    (what transformers' own batching passes there; the model's `past_key_values` stays None)."""
    if CACHE != "cache" and isinstance(cache, PagedAttentionCache):
        return {"cache": cache}
    return {CACHE: cache}


def cache_argument(forward):
    """A `forward(..., cache=None, ...)` that takes the installed release's cache argument: on 5.24 transformers' own
    deprecation of `past_key_values`; before, `past_key_values` is that release's name and arrives as `cache`."""
    if CACHE == "cache":
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def with_release_name(*args, past_key_values=None, **kwargs):
        if past_key_values is not None:
            if kwargs.get("cache") is not None:
                raise ValueError("Pass the KV cache once: `past_key_values` or `cache`, not both.")
            kwargs["cache"] = past_key_values
        return forward(*args, **kwargs)

    return with_release_name


def crop_hint(cache) -> str:
    """What to add to "this cache cannot be cropped" when the reason is the installed transformers (static layers
    before 5.24); empty otherwise."""
    if STATIC_LAYERS_CROP or not any(isinstance(layer, StaticLayer) for layer in getattr(cache, "layers", ())):
        return ""
    return (
        f" (static cache layers can be cropped from transformers {NEWEST} on; installed: {transformers.__version__}): "
        f"leave `cache_implementation` out, or install transformers>={NEWEST}"
    )


def layer_skip_failure() -> str | None:
    """Why transformers' own `assistant_early_exit` (LayerSkip) cannot run on the installed release, or None: before
    5.22 a round that must crop its draft cache raises on the layers past the exit, which that cache never writes."""
    try:
        DynamicLayer().crop(-1)  # an unwritten layer: 5.22 and later leave it as it is
    except TypeError:
        return (
            f"not run: transformers {transformers.__version__}'s `assistant_early_exit` raises when it crops its "
            "draft cache (the layers past the exit are never written; fixed in 5.22)"
        )
    return None


def require_transformers(feature: str, missing) -> None:
    """Raises `ImportError` in one line when `missing` (the internals `feature` wraps that the installed transformers
    lacks) is not empty."""
    if missing:
        raise ImportError(
            f"{feature} wraps internals of transformers {OLDEST} to {NEWEST}; transformers {transformers.__version__} "
            f"lacks {', '.join(missing)}: pip install '{SUPPORTED}'."
        )


__all__ = [
    "BELOW",
    "CACHE",
    "NEWEST",
    "OLDEST",
    "SUPPORTED",
    "STATIC_LAYERS_CROP",
    "cache_argument",
    "cache_kwargs",
    "cache_of",
    "crop_hint",
    "layer_skip_failure",
    "require_transformers",
]

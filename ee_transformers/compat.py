"""What differs between the transformers releases the runtime supports (5.19 through 5.24), in one place, found by
looking at what the installed transformers has (never at its version string).

- **The KV cache's name.** transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache`
  (models, decoder layers, `create_causal_mask`, `prepare_inputs_for_generation`, `generate`'s model kwargs and output
  classes); 5.19 to 5.23 use `past_key_values`. The runtime calls the cache `cache` and passes it to transformers under
  `CACHE`; `cache_argument` makes a forward take the installed release's name.
- **Continuous batching's paged cache** travels as the keyword `cache` on every release, but before 5.24 it is an
  attention keyword (the model's `past_key_values` stays None and the attention function writes the paged cache), so
  a model or layer gets it as `cache` there too (`cache_kwargs`).
- **Features that wrap internals of the newest release** (drafts inside continuous batching, the server hooks of
  `ee-transformers serve`) call `require_transformers` where the user turns them on: one line naming the release.

Part of the Hub runtime: imports only torch and transformers.
"""

import dataclasses
import functools

import transformers
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg

# the cache's argument and output field in the installed transformers: "cache" (5.24) or "past_key_values" (5.19-5.23)
CACHE = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
# the release whose internals the newest features wrap
NEWEST = "5.24"


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


def require_transformers(feature: str, missing) -> None:
    """Raises `ImportError` in one line when `missing` (the internals `feature` wraps that the installed transformers
    lacks) is not empty."""
    if missing:
        raise ImportError(
            f"{feature} needs transformers {NEWEST} (installed: {transformers.__version__}, which lacks "
            f"{', '.join(missing)}): pip install 'transformers>={NEWEST},<5.25'."
        )


__all__ = ["CACHE", "NEWEST", "cache_argument", "cache_kwargs", "cache_of", "require_transformers"]

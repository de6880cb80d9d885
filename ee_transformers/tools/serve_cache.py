"""The paged cache `ee-transformers serve` asks transformers for (tools/serve.py): its size from the model and the
`--cb-*` flags (`plan_paged_cache` -> `CachePlan`), and the defaults of those flags. Importable from
`ee_transformers.tools.serve` as before.
"""

import math
import re
from dataclasses import dataclass

import torch

from ee_transformers.tools.arguments import InputError

DEFAULT_MAX_REQUESTS = 32
DEFAULT_CB_MEMORY = 2**30
# transformers' default of 8192 tokens per step makes an attention mask of 8192 x (cache tokens + 8192) that the first
# step fills: 526 MiB resident for the tiny test folder's 8192-token cache. On a CPU a step of 1024 tokens costs about
# what its tokens cost, so longer prefills are split in steps of 1024.
DEFAULT_MAX_BATCH_TOKENS = 1024


# ---------------------------------------------------------------------------------------------------------------------
# the paged cache's size
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CachePlan:
    """The paged cache `ee-transformers serve` asks transformers for (`num_blocks` None: transformers sizes it from
    free memory, as `--cb-max-memory-percent` asked)."""

    block_size: int
    num_blocks: int | None
    bytes_per_token: int
    model_max_length: int | None
    how: str
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    mask_bytes_per_cell: int = 4  # the attention mask: dtype bytes x masks (2 with sliding layers)

    @property
    def kv_bytes(self) -> int | None:
        return None if self.num_blocks is None else self.num_blocks * self.block_size * self.bytes_per_token

    @property
    def max_length(self) -> int | None:
        """The most tokens (prompt + completion) one request may hold: the model's length and the cache's."""
        limits = [n for n in (self.model_max_length, self.num_blocks and self.num_blocks * self.block_size) if n]
        return min(limits) if limits else None

    @property
    def mask_bytes(self) -> int | None:
        """The attention mask transformers keeps for eager / SDPA attention: steps x (cache tokens + steps)."""
        if self.num_blocks is None:
            return None
        tokens = self.num_blocks * self.block_size
        return self.max_batch_tokens * (tokens + self.max_batch_tokens) * self.mask_bytes_per_cell

    def line(self) -> str:
        step = f"steps of at most {self.max_batch_tokens} tokens (--cb-max-batch-tokens)"
        if self.num_blocks is None:
            return f"ee-transformers serve: paged cache sized by transformers from free memory ({self.how}); {step}"
        return (
            f"ee-transformers serve: paged cache {self.num_blocks} blocks x {self.block_size} tokens "
            f"({self.num_blocks * self.block_size} tokens), K/V {self.kv_bytes / 2**20:.1f} MiB "
            f"({self.bytes_per_token} bytes/token); {self.how}; {step}, attention mask up to "
            f"{self.mask_bytes / 2**20:.1f} MiB; a request may hold {self.max_length} tokens (prompt + max_tokens)"
        )


def parse_bytes(text: str) -> int:
    """`1073741824`, `512MiB`, `1GiB`, `1.5GB`, `800M` -> bytes (K/M/G are powers of 1024, KB/MB/GB of 1000)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(i?B?)\s*", str(text), re.IGNORECASE)
    if not match:
        raise InputError(f"--cb-memory must be a size in bytes such as 1073741824, 512MiB or 1GiB, got {text!r}.")
    number, prefix, suffix = float(match.group(1)), match.group(2).upper(), match.group(3).lower()
    base = 1000 if suffix == "b" and prefix else 1024
    return int(number * base ** " KMG".index(prefix or " "))


def model_max_length(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def kv_bytes_per_token(config, layers: int, dtype: torch.dtype) -> tuple[int, str]:
    """Bytes of K/V one token holds in the paged cache (as transformers counts a block: every loaded layer full)."""
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads  # noqa: PLC0415

    heads, dims, size = find_num_key_value_heads(config), find_head_dim(config), dtype.itemsize
    return layers * 2 * heads * dims * size, f"{layers} layers x 2 x {heads} KV heads x {dims} dims x {size} bytes"


def served_dtype(config, dtype_flag: str | None) -> torch.dtype:
    name = dtype_flag if dtype_flag not in (None, "auto") else getattr(config, "dtype", None) or "float32"
    dtype = name if isinstance(name, torch.dtype) else getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"--dtype must name a torch dtype such as float32 or bfloat16, got {dtype_flag!r}.")
    return dtype


def plan_paged_cache(
    config,
    dtype: torch.dtype,
    exit_max_layer: int | None = None,
    block_size: int | None = None,
    num_blocks: int | None = None,
    memory: int | None = None,
    max_requests: int | None = None,
    max_length: int | None = None,
    memory_percent: float | None = None,
    max_batch_tokens: int | None = None,
) -> CachePlan:
    """The paged cache for `--cb-*` settings: `num_blocks` as given; else as many blocks as `memory` bytes of K/V
    hold; else `max_requests` requests of `max_length` tokens (default the model's), at most `DEFAULT_CB_MEMORY`."""
    from transformers import ContinuousBatchingConfig  # noqa: PLC0415

    sizes = [f for f, v in (("--cb-num-blocks", num_blocks), ("--cb-memory", memory)) if v is not None]
    if len(sizes) > 1 or (sizes and max_requests is not None):
        named = sizes + (["--cb-max-requests"] if max_requests is not None else [])
        raise InputError(f"{' and '.join(named)} each size the paged cache: give one of them.")
    max_requests = max_requests or DEFAULT_MAX_REQUESTS
    block_size = block_size or ContinuousBatchingConfig().page_size  # transformers' page size
    layers = config.num_hidden_layers if exit_max_layer is None else exit_max_layer + 1  # a lean model's loaded ones
    per_token, shape = kv_bytes_per_token(config, layers, dtype)
    longest = model_max_length(config)
    if max_length is not None:
        if longest is not None and max_length > longest:
            raise InputError(f"--max-length {max_length} is longer than the model's maximum length ({longest}).")
        longest = max_length
    block_bytes = block_size * per_token
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type  # noqa: PLC0415

    step = dict(
        max_batch_tokens=max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS,
        mask_bytes_per_cell=dtype.itemsize * len(group_layers_by_attn_type(config)),
    )
    if num_blocks is not None:
        how = f"{shape}; --cb-num-blocks {num_blocks}"
    elif memory is not None:
        num_blocks = memory // block_bytes
        if num_blocks < 1:
            raise InputError(f"--cb-memory {memory} bytes holds no block of {block_size} tokens ({block_bytes} bytes).")
        how = f"{shape}; the blocks of --cb-memory {memory / 2**20:.1f} MiB"
    elif memory_percent is not None:
        return CachePlan(block_size, None, per_token, longest, f"--cb-max-memory-percent {memory_percent}", **step)
    else:
        if longest is None:
            raise InputError("the model's config names no maximum length: pass --max-length (or --cb-num-blocks).")
        wanted = max_requests * math.ceil(longest / block_size)
        cap = max(1, DEFAULT_CB_MEMORY // block_bytes)
        num_blocks = min(wanted, cap)
        how = f"{shape}; sized for {max_requests} requests of {longest} tokens (--cb-max-requests, --max-length)" + (
            f", capped at {DEFAULT_CB_MEMORY / 2**20:.0f} MiB (--cb-memory sizes it instead)" if cap < wanted else ""
        )
    return CachePlan(block_size, num_blocks, per_token, longest, how, **step)

"""Exit heads: what turns an intermediate residual stream into LM-head input, and learned confidence heads.

Part of the Hub runtime: imports only torch.
"""

import torch
from torch import nn


class ExitHead(nn.Module):
    """A per-exit norm, optionally followed by a zero-initialised low-rank residual MLP.

    `forward(h)` maps the residual stream leaving an exit layer, shape `(..., hidden)`, to the input of the shared LM
    head. With the adapter's up-projection at zero the head is exactly its norm, so a fresh adapter head equals a norm
    head, which (initialised from the final norm) equals applying the model's own final norm early.
    """

    def __init__(self, norm: nn.Module, hidden_size: int, adapter_rank: int | None = None):
        super().__init__()
        self.norm = norm
        self.norm._ee_init = "final_norm"  # read by the model's _init_weights
        if adapter_rank:
            self.down = nn.Linear(hidden_size, adapter_rank, bias=False)
            self.up = nn.Linear(adapter_rank, hidden_size, bias=False)
            self.up._ee_init = "zeros"
        else:
            self.down = self.up = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden_states)
        if self.up is not None:
            x = x + self.up(nn.functional.silu(self.down(x)))
        return x


class ConfidenceHead(nn.Module):
    """CALM's meta classifier: P(this exit's argmax equals the final layer's argmax) from the exit head's output."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        self.proj._ee_init = "zeros"

    def forward(self, head_output: torch.Tensor) -> torch.Tensor:
        """`head_output`: `(..., hidden)` -> probabilities `(...)`."""
        return torch.sigmoid(self.proj(head_output).squeeze(-1).float())


__all__ = ["ExitHead", "ConfidenceHead"]

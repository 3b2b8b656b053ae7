"""Manifold-constrained hyper-connections (mHC, DeepSeek V4), equal to transformers 5.24's
`DeepseekV4HyperConnection` / `DeepseekV4HyperHead`.

The residual is `hc_mult` streams [T, n, hidden]. Before a block (attention or MLP) a
`HyperConnection` reads the streams and gives three mixes: `pre` [T, n] collapses the streams
into the block's input, `post` [T, n] spreads the block's output back over the streams, and
`comb` [T, n, n] (made doubly stochastic by Sinkhorn-Knopp) mixes the old streams into the new:
`streams = post * out + comb^T @ streams`. `HyperHead` collapses the streams once more before
the final norm. The arithmetic is float32, in HF's order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, the mean in float32 (HF's
    `DeepseekV4UnweightedRMSNorm`)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.hc_mult, self.iters, self.eps, self.norm_eps = hc_mult, iters, eps, norm_eps
        width = (2 + hc_mult) * hc_mult  # pre (n), post (n), comb (n * n)
        self.fn = nn.Parameter(torch.empty(width, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, hidden] -> (post [T, n], comb [T, n, n], the block input [T, hidden])."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())  # [T, (2 + n) n]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb_w = comb_w.view(*comb_w.shape[:-1], n, n)
        comb = torch.softmax(comb_w * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):  # Sinkhorn-Knopp: rows, then columns, sum to 1
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def mix_streams(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The streams after a block: post * out spread over them, plus comb^T @ streams."""
    dtype = streams.dtype
    spread = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)  # [T, n, hidden]
    return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams into one hidden state per token."""

    def __init__(self, hc_mult: int, hidden_size: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.empty(hc_mult))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, n, hidden] -> [T, hidden]."""
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

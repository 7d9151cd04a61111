"""Tiny checkpoints with multi-token-prediction layers, and a reference drafter built from
transformers' own modules (no cache: every draft recomputes its pairs from scratch).

transformers has no MTP model for Qwen3-Next / Qwen3.5 (their classes skip `mtp.*`), so the MTP
tensors are written here: `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
`mtp.layers.0` (transformers' `Qwen3NextDecoderLayer` / `Qwen3_5DecoderLayer` of full
attention, its feed-forward as layer 0's) and `mtp.norm`, as vLLM's Qwen3NextMTP reads them.
DeepSeek-V3's is transformers' `MtpLayer` (enorm, hnorm, eh_proj, an MoE decoder block,
shared_head.norm as its post-norm), written as `model.layers.{num_hidden_layers}.*` with the
block's tensors unnested, the way DeepSeek's checkpoints carry it.

One pair p = (the target's final hidden state at p, the token at p + 1) at RoPE position p + 1;
draft j + 1 comes from the MTP output at the last pair, and each further draft appends the pair
(that output, the draft) one position on.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn


def _causal_mask(n: int, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return mask[None, None]  # [1, 1, n, n]


class QwenMTP(nn.Module):
    """Qwen3-Next / Qwen3.5 MTP (checkpoint names under `mtp.`)."""

    def __init__(self, hf) -> None:
        super().__init__()
        cfg = copy.deepcopy(hf.config)
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
        layer_cls = type(hf.model.layers[0])
        norm_cls = type(hf.model.norm)  # the family's zero-centred RMSNorm
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm_cls(h, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps=eps)
        self.layers = nn.ModuleList([layer_cls(cfg, 0)])
        self.norm = norm_cls(h, eps=eps)
        self.hf = [hf]  # (not a submodule)

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_ids: [n], hidden: [n, H] (pairs at positions 1..n) -> outputs [n, H]."""
        hf = self.hf[0]
        e = self.pre_fc_norm_embedding(hf.model.embed_tokens(next_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))[None]
        n = x.shape[1]
        pos = torch.arange(1, n + 1)[None]
        cos_sin = hf.model.rotary_emb(x, pos)
        x = self.layers[0](x, position_embeddings=cos_sin, attention_mask=_causal_mask(n, x.dtype),
                           position_ids=pos)  # fmt: skip
        return self.norm(x[0])

    def checkpoint_tensors(self, num_hidden_layers: int) -> dict[str, torch.Tensor]:
        return {f"mtp.{k}": v.contiguous() for k, v in self.state_dict().items()}


class DeepseekMTP(nn.Module):
    """transformers' MtpLayer for DeepSeek-V3 (checkpoint names model.layers.{L}.*)."""

    def __init__(self, hf) -> None:
        super().__init__()
        from transformers.modeling_layers import MtpLayer
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        cfg = copy.deepcopy(hf.config)
        cfg.first_k_dense_replace = 0  # (as transformers' get_mtp_config: always MoE)
        self.layer = MtpLayer(cfg, m.DeepseekV3DecoderLayer, m.DeepseekV3RMSNorm, 0)
        self.hf = [hf]

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hf = self.hf[0]
        e = hf.model.embed_tokens(next_ids)[None]
        n = e.shape[1]
        pos = torch.arange(1, n + 1)[None]
        cos_sin = hf.model.rotary_emb(e, pos)
        out = self.layer(e, hidden[None], position_embeddings=cos_sin,
                         attention_mask=_causal_mask(n, e.dtype), position_ids=pos, cache=None)
        return out[0]  # fmt: skip

    def checkpoint_tensors(self, num_hidden_layers: int) -> dict[str, torch.Tensor]:
        prefix = f"model.layers.{num_hidden_layers}."
        out = {}
        for k, v in self.layer.state_dict().items():
            k = k.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
            out[prefix + k] = v.contiguous()
        hf = self.hf[0]
        # DeepSeek's checkpoints carry copies of the embedding and head in the MTP layer; the
        # MTP uses the target's (copies that differ here prove which one runs)
        out[prefix + "embed_tokens.weight"] = torch.zeros_like(hf.model.embed_tokens.weight)
        out[prefix + "shared_head.head.weight"] = torch.zeros_like(hf.lm_head.weight)
        return out


def add_mtp(folder: Path, hf, seed: int = 7) -> nn.Module:
    """Write an MTP layer of random weights into the checkpoint at `folder`; returns the
    reference module."""
    is_deepseek = "Deepseek" in type(hf).__name__
    mtp: nn.Module = DeepseekMTP(hf) if is_deepseek else QwenMTP(hf)
    mtp.float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if "norm" in name and p.dim() == 1:
                zero_centred = not is_deepseek  # Qwen3-Next norms are x_hat * (1 + w)
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (0.0 if zero_centred else 1.0))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    path = folder / "model.safetensors"
    weights = load_file(path)
    weights.update(mtp.checkpoint_tensors(hf.config.num_hidden_layers))
    save_file(weights, path, metadata={"format": "pt"})
    return mtp


@torch.no_grad()
def reference_drafts(hf, mtp: Callable, ids: list[int], k: int) -> list[int]:
    """The k MTP drafts after `ids` (prompt and output so far): pairs (h_p, ids[p + 1]) for
    p < len(ids) - 1, then one pair per draft."""
    tokens = torch.tensor(ids)
    hidden = hf.model(tokens[None]).last_hidden_state[0]  # [n, H], after the final norm
    next_ids, pairs = tokens[1:], hidden[:-1]
    drafts: list[int] = []
    for _ in range(k):
        out = mtp(next_ids, pairs)  # [n, H]
        draft = int(hf.lm_head(out[-1]).argmax())
        drafts.append(draft)
        next_ids = torch.cat([next_ids, torch.tensor([draft])])
        pairs = torch.cat([pairs, out[-1:]])
    return drafts

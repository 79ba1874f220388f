"""The fused eNTK path through a Transformer's layers (Embedding, LayerNorm, attention's and the
MLP's Linears on sequences, per-sample gradients summed over positions) equals ``torch.func``'s
vmap on a float64 reference; the LSTM, which vmap cannot batch, falls back to a per-sample loop
with one line naming the layer."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from hpcfl.entk import entk_features, num_params
from hpcfl.models import build_model, reinit_last_layer
from tests.test_entk import _assert_close

F64 = torch.float64


def _text_model(name: str, seq: int, **options: int) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(name, (1, 1, seq), 80, vocab_size=80, **options)
    reinit_last_layer(model, seed=1)
    with torch.no_grad():  # LayerNorm starts at weight 1, bias 0: move it off the identity
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(0.3 * torch.randn_like(m.weight))
                m.bias.add_(0.3 * torch.randn_like(m.bias))
    return model.to(F64)


def _codes(n: int, seq: int) -> torch.Tensor:
    x = torch.randint(0, 80, (n, seq), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    x[0, :3] = x[0, 3]  # repeated symbols: an Embedding row gathers several positions of one sample
    return x


@pytest.mark.parametrize("full", [False, True], ids=["subsampled", "full"])
def test_fused_transformer_equals_vmap(caplog: pytest.LogCaptureFixture, full: bool) -> None:
    caplog.set_level(logging.INFO, logger="hpcfl.entk")
    model = _text_model("char-transformer", 7, d_model=8, layers=2, heads=2)
    x = _codes(4, 7)
    p = num_params(model) if full else num_params(model) // 3
    fused = entk_features(model, x, p=p, seed=7, method="fused", dtype=F64)
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("hpcfl.entk")]  # no fallback
    vmap = entk_features(model, x, p=p, seed=7, method="vmap", dtype=F64)
    _assert_close(fused, vmap, f"char-transformer fused vs vmap (p={p})", rtol=1e-10)
    for name in ("embedding.weight", "positions.weight", "blocks.0.ln1.weight", "blocks.1.attn.qkv.weight"):
        assert name in dict(model.named_parameters())  # the layers this covers are in scope


def test_lstm_falls_back_to_a_loop_with_one_line_naming_the_layer(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hpcfl.entk")
    model = _text_model("char-lstm", 5, embed=3, hidden=4, layers=1)
    x = _codes(3, 5)
    got = entk_features(model, x, p=40, seed=7, method="fused", dtype=F64)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("hpcfl.entk")]
    assert len(lines) == 1 and "LSTM" in lines[0] and "per-sample loop" in lines[0], lines
    _assert_close(
        got, entk_features(model, x, p=40, seed=7, method="loop", dtype=F64), "LSTM fallback", 1e-12
    )

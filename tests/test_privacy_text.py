"""The DP per-sample step's book-keeping path through a Transformer's layers (Embedding, LayerNorm,
attention's and the MLP's Linears on sequences) equals vmap per-sample gradients on float64."""

from __future__ import annotations

import torch

from hpcfl.models import build_model
from hpcfl.privacy import ghost
from hpcfl.privacy.sgd import OPACUS_EPS, vmap_clipped_grad_sum
from hpcfl.training.sgd import cross_entropy_loss


def test_book_keeping_equals_vmap_on_the_transformer() -> None:
    torch.manual_seed(0)
    model = build_model(
        "char-transformer", (1, 1, 7), 80, vocab_size=80, d_model=8, layers=2, heads=2
    ).double()
    with torch.no_grad():  # LayerNorm off the identity
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.add_(0.3 * torch.randn_like(m.weight))
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 80, (6, 7), generator=gen, dtype=torch.uint8)
    x[0, :3] = x[0, 3]  # one sample repeats a symbol: its Embedding row sums several positions
    y = torch.randint(0, 80, (6,), generator=gen)
    P = sum(p.numel() for p in model.parameters())
    expected = torch.empty(P, dtype=torch.float64)
    _, norms = vmap_clipped_grad_sum(model, cross_entropy_loss, x, y, 1.0, expected)
    clip = float(norms.median())  # some samples clipped, some not
    _, norms = vmap_clipped_grad_sum(model, cross_entropy_loss, x, y, clip, expected)
    assert ghost.supported(model)
    out = torch.empty(P, dtype=torch.float64)
    _, ours = ghost.hooked_clipped_grad_sum(model, x, y, clip, out, OPACUS_EPS)
    torch.testing.assert_close(ours, norms, rtol=0, atol=1e-10)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


def test_an_uncovered_layer_is_named_once_and_vmap_computes_the_step(caplog) -> None:  # noqa: ANN001
    """The LSTM's parameters are outside the book-keeping path: one warning names the layer and the
    fallback, and the step is vmap's."""
    import logging

    from hpcfl.privacy import sgd

    caplog.set_level(logging.WARNING, logger="hpcfl.privacy")
    sgd._NOTED.clear()
    torch.manual_seed(0)
    model = build_model("char-lstm", (1, 1, 5), 80, vocab_size=80).double()
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 80, (3, 5), generator=gen, dtype=torch.uint8)
    y = torch.randint(0, 80, (3,), generator=gen)
    P = sum(p.numel() for p in model.parameters())
    expected, out = torch.empty(P, dtype=torch.float64), torch.empty(P, dtype=torch.float64)
    vmap_clipped_grad_sum(model, cross_entropy_loss, x, y, 0.5, expected)  # the per-sample loop
    for _ in range(2):
        sgd.clipped_grad_sum(model, cross_entropy_loss, x, y, 0.5, out)
    assert ghost.unsupported_layers(model) == ["LSTM"]
    lines = [r.getMessage() for r in caplog.records if r.name == "hpcfl.privacy"]
    assert lines == [
        "DP-SGD: the book-keeping per-sample path does not cover LSTM layers; computing per-sample "
        "gradients with a per-sample loop (vmap cannot batch recurrent layers) for the whole model "
        "(slower, same result)"
    ]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # the loop's clipped sum equals autograd's per-sample gradients clipped one by one
    reference = torch.zeros(P, dtype=torch.float64)
    for i in range(3):
        model.zero_grad()
        cross_entropy_loss(model, x[i : i + 1], y[i : i + 1]).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()])
        reference += g * min(1.0, 0.5 / (float(g.norm()) + OPACUS_EPS))
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)

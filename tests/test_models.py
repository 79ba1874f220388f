"""The model zoo: shapes, exact sizes, the classifier re-init TCT needs, and config errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpcfl.errors import ConfigError
from hpcfl.models import (
    IMAGE_MODELS,
    TEXT_MODELS,
    build_model,
    last_linear,
    reinit_last_layer,
    with_fresh_head,
)

SHAPES = [((1, 28, 28), 10), ((3, 32, 32), 10), ((3, 32, 32), 100)]
PARAMETRISED = (nn.Conv2d, nn.Linear, nn.BatchNorm2d, nn.GroupNorm)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", IMAGE_MODELS)
@pytest.mark.parametrize(("shape", "classes"), SHAPES)
def test_every_model_builds_and_gives_logits(name: str, shape: tuple[int, int, int], classes: int) -> None:
    torch.manual_seed(0)
    model = build_model(name, shape, classes)
    x = torch.randn(2, *shape)
    for mode in (True, False):  # train (BatchNorm uses batch stats) and eval
        model.train(mode)
        with torch.no_grad():
            logits, rep = model.forward_with_repr(x)
            assert logits.shape == (2, classes), f"{name} logits shape"
            assert torch.isfinite(logits).all(), f"{name} logits finite"
            assert torch.equal(model.classifier(rep), logits), f"{name} classifier(repr) == logits"
            if mode is False:
                assert torch.equal(model(x), logits), f"{name} forward == forward_with_repr"
    head = last_linear(model)
    assert head is model.classifier and head.out_features == classes


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_layers_are_hook_friendly(name: str) -> None:
    model = build_model(name, (3, 32, 32), 10, **({"batch_norm": True} if name == "vgg11" else {}))
    for mod_name, module in model.named_modules():
        if isinstance(module, nn.ReLU):
            assert not module.inplace, f"{mod_name} is an in-place ReLU"
        if any(True for _ in module.parameters(recurse=False)):
            assert isinstance(module, PARAMETRISED), f"{mod_name} is a non-standard parametrised layer"
    shared = len(list(model.named_modules(remove_duplicate=False))) - len(list(model.named_modules()))
    assert shared == 0, "a module instance is used at two places, hooks could not tell them apart"


def test_exact_parameter_counts() -> None:
    simplecnn = build_model("simplecnn", (1, 28, 28), 10)
    expected = (
        (32 * 9 + 32) + (64 * 32 * 9 + 64) + (128 * 64 * 9 + 128) + (2048 * 128 + 128) + (128 * 10 + 10)
    )
    assert n_params(simplecnn) == expected == 356_234
    assert simplecnn.fc1.in_features == 128 * 4 * 4
    assert n_params(build_model("mlp", (1, 28, 28), 10)) == 784 * 100 + 100 + 100 * 10 + 10
    # ResNet-18 with GroupNorm has the same parameters as the BN one: 11.17M on CIFAR-10
    assert n_params(build_model("resnet18", (3, 32, 32), 10, norm="gn")) == 11_173_962
    assert n_params(build_model("resnet8", (3, 32, 32), 10)) == 78_042
    assert build_model("cnn-proj", (3, 32, 32), 10).fc1.in_features == 32 * 5 * 5
    assert build_model("cnn-proj", (1, 28, 28), 10).fc1.in_features == 32 * 4 * 4
    # VGG-11 skips the pool that would shrink 28x28's 1x1 map to 0x0
    assert build_model("vgg11", (1, 28, 28), 10).fc1.in_features == 512
    assert build_model("vgg11", (3, 32, 32), 10).fc1.in_features == 512


def test_norm_and_batch_norm_options_pick_the_layers() -> None:
    def count(model: nn.Module, kind: type) -> int:
        return sum(isinstance(m, kind) for m in model.modules())

    gn = build_model("resnet18", (3, 32, 32), 10)  # default: GroupNorm with 2 groups (TCT B.2)
    assert count(gn, nn.BatchNorm2d) == 0 and count(gn, nn.GroupNorm) == 20
    assert all(m.num_groups == 2 for m in gn.modules() if isinstance(m, nn.GroupNorm))
    bn = build_model("resnet18", (3, 32, 32), 10, norm="bn")
    assert count(bn, nn.GroupNorm) == 0 and count(bn, nn.BatchNorm2d) == 20
    assert count(build_model("resnet8", (3, 32, 32), 10), nn.BatchNorm2d) == 9  # default bn
    assert count(build_model("resnet8", (3, 32, 32), 10, norm="gn"), nn.GroupNorm) == 9
    assert count(build_model("vgg11", (3, 32, 32), 10), nn.BatchNorm2d) == 0
    assert count(build_model("vgg11", (3, 32, 32), 10, batch_norm=True), nn.BatchNorm2d) == 8


def test_vgg_without_batch_norm_is_the_same_function_in_train_and_eval() -> None:
    model = build_model("vgg11", (1, 28, 28), 10)
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        train_out = model.train()(x)
        eval_out = model.eval()(x)
    assert torch.equal(train_out, eval_out)


def test_cnn_proj_gives_the_256d_projection() -> None:
    model = build_model("cnn-proj", (3, 32, 32), 10).eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        logits, rep = model.forward_with_repr(x)
        assert rep.shape == (4, 256) and logits.shape == (4, 10)
        assert torch.equal(rep, model.features(x))
        assert model.projection.out_features == 256 and model.classifier.in_features == 256


@pytest.mark.parametrize("name", ["simplecnn", "resnet8"])
def test_reinit_last_layer_depends_only_on_seed(name: str) -> None:
    torch.manual_seed(1)
    a = build_model(name, (1, 28, 28), 10)
    torch.manual_seed(2)
    b = build_model(name, (1, 28, 28), 10)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    rng = torch.get_rng_state()

    reinit_last_layer(a, seed=7)
    reinit_last_layer(b, seed=7)

    assert torch.equal(torch.get_rng_state(), rng), "global RNG state changed"
    head = {"classifier.weight", "classifier.bias"}
    for key, value in a.state_dict().items():
        if key in head:
            assert not torch.equal(value, before[key]), f"{key} was not re-initialised"
            assert torch.equal(value, b.state_dict()[key]), f"{key} depends on more than the seed"
        else:
            assert torch.equal(value, before[key]), f"{key} changed but is not the last layer"

    reinit_last_layer(b, seed=8)
    assert not torch.equal(a.classifier.weight, b.classifier.weight), "different seeds, same layer"


def test_reinit_last_layer_is_pytorchs_default_linear_init() -> None:
    model = build_model("mlp", (1, 28, 28), 10)
    weight = model.classifier.weight
    reinit_last_layer(model, seed=123)
    assert model.classifier.weight is weight, "parameter replaced instead of overwritten in place"
    torch.manual_seed(123)
    reference = nn.Linear(100, 10)  # its constructor draws the default init from the global RNG
    assert torch.equal(model.classifier.weight, reference.weight)
    assert torch.equal(model.classifier.bias, reference.bias)


@pytest.mark.parametrize("name", ["simplecnn", "resnet8", "vgg11"])
def test_with_fresh_head_is_a_seeded_one_output_copy(name: str) -> None:
    """TCT stage 2's head (issue 16): a copy whose classifier is nn.Linear(in, 1) with PyTorch's
    default init from the seed alone; the model itself, the global RNG and the parameter order stay."""
    shape = (3, 32, 32) if name == "vgg11" else (1, 28, 28)
    model = build_model(name, shape, 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    fresh = with_fresh_head(model, seed=123)
    assert torch.equal(torch.get_rng_state(), rng), "global RNG state changed"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the model changed"
    head = last_linear(fresh)
    assert head is fresh.classifier and head.out_features == 1
    assert head.in_features == model.classifier.in_features
    assert [n for n, _ in fresh.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(fresh.parameters())[-2:] == [head.weight, head.bias], "the head stays last"
    for key, value in fresh.state_dict().items():
        if not key.startswith("classifier."):
            assert torch.equal(value, before[key]), f"{key} is not the stage-1 value"
    torch.manual_seed(123)
    reference = nn.Linear(head.in_features, 1)
    assert torch.equal(head.weight, reference.weight) and torch.equal(head.bias, reference.bias)
    assert fresh(torch.randn(2, *shape)).shape == (2, 1)


def test_unknown_model_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'resnet-18' \(did you mean 'resnet18'\?\).*vgg11"):
        build_model("resnet-18", (3, 32, 32), 10)


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown option 'nrom' for model 'resnet18'.*'norm'.*valid options: norm"
    ):
        build_model("resnet18", (3, 32, 32), 10, nrom="gn")
    with pytest.raises(
        ConfigError, match=r"unknown option 'norm' for model 'vgg11'.*valid options: batch_norm"
    ):
        build_model("vgg11", (3, 32, 32), 10, norm="gn")
    with pytest.raises(ConfigError, match=r"model 'mlp'; valid options: init"):
        build_model("mlp", (1, 28, 28), 10, hidden=200)
    with pytest.raises(ConfigError, match=r"init for model 'mlp'.*default, kaiming"):
        build_model("mlp", (1, 28, 28), 10, init="xavier")
    with pytest.raises(ConfigError, match=r"unknown norm for model 'resnet8' 'ln'.*bn, gn"):
        build_model("resnet8", (3, 32, 32), 10, norm="ln")
    with pytest.raises(ConfigError, match=r"'batch_norm' of model 'vgg11' must be true or false"):
        build_model("vgg11", (3, 32, 32), 10, batch_norm="yes")


@pytest.mark.parametrize(
    ("name", "shape", "classes", "message"),
    [
        ("mlp", (28, 28), 10, "input_shape must be"),
        ("mlp", (1, 0, 28), 10, "input_shape must be"),
        ("mlp", (1, 28, 28), 0, "num_classes must be"),
        ("cnn-proj", (3, 12, 12), 10, "at least 16×16 pixels, got 12×12"),
    ],
)
def test_bad_shapes_are_config_errors(name: str, shape: tuple, classes: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_model(name, shape, classes)


def test_mlp_kaiming_init_is_he_normal_with_zero_biases() -> None:
    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), 10, init="kaiming")
    w = model.fc1.weight.detach()
    assert torch.count_nonzero(model.fc1.bias) == 0 and torch.count_nonzero(model.classifier.bias) == 0
    assert abs(float(w.std()) - (2 / 784) ** 0.5) < 0.02 * (2 / 784) ** 0.5  # 78,400 draws
    assert float(w.abs().max()) > 1 / 784**0.5  # not PyTorch's U(±1/√fan_in)


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_text_models_give_next_symbol_logits(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, (1, 1, 80), 80, vocab_size=80)
    x = torch.randint(0, 80, (3, 80), dtype=torch.uint8)
    with torch.no_grad():
        logits, rep = model.forward_with_repr(x)
        assert logits.shape == (3, 80) and torch.equal(model.classifier(rep), logits)
        assert torch.equal(model(x), logits) and torch.equal(model(x.long()), logits)
        # the last symbol reaches the prediction
        features = model.features
        y = x.clone()
        y[:, -1] = (y[:, -1] + 1) % 80
        assert not torch.equal(features(y), rep)
    assert last_linear(model) is model.classifier and model.classifier.out_features == 80


def test_text_model_parameter_counts() -> None:
    lstm = build_model("char-lstm", (1, 1, 80), 80, vocab_size=80)
    layer1 = 4 * 256 * (8 + 256) + 2 * 4 * 256  # PyTorch: two bias vectors per gate set
    layer2 = 4 * 256 * (256 + 256) + 2 * 4 * 256
    assert n_params(lstm) == 80 * 8 + layer1 + layer2 + (256 * 80 + 80) == 819_920
    tf = build_model("char-transformer", (1, 1, 80), 80, vocab_size=80)
    block = 2 * 128 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)
    assert n_params(tf) == 80 * 64 + 80 * 64 + 2 * block + 128 + (64 * 80 + 80) == 115_536
    assert n_params(build_model("char-transformer", (1, 1, 20), 80, vocab_size=80, layers=1)) == (
        80 * 64 + 20 * 64 + block + 128 + 64 * 80 + 80
    )


def test_transformer_is_causal_at_every_position() -> None:
    """Each position's hidden state depends on that position and earlier ones only."""
    torch.manual_seed(0)
    model = build_model("char-transformer", (1, 1, 12), 80, vocab_size=80).eval()
    x = torch.randint(0, 80, (2, 12))
    captured: list[torch.Tensor] = []
    model.blocks[-1].register_forward_hook(lambda m, i, o: captured.append(o))
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 5) % 80
    with torch.no_grad():
        model(x), model(y)
    assert torch.equal(captured[0][:, :7], captured[1][:, :7])
    assert not torch.equal(captured[0][:, 7:], captured[1][:, 7:])


@pytest.mark.parametrize(
    ("name", "vocab_size", "options", "fragment"),
    [
        ("char-lstm", 80, {"vocab": 64}, "vocabulary of 64 symbols does not match the dataset's 80"),
        ("char-lstm", None, {}, "reads symbol codes but the dataset holds images"),
        ("simplecnn", 80, {}, "reads images but the dataset holds text over 80 symbols"),
        ("char-transformer", 80, {"d_model": 10, "heads": 4}, "not a multiple of heads 4"),
        (
            "char-transformer",
            80,
            {"layers": 0},
            "'layers' of model 'char-transformer' must be a whole number",
        ),
    ],
)
def test_text_model_errors_are_one_line(
    name: str, vocab_size: int | None, options: dict, fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        build_model(name, (1, 1, 80), 80, vocab_size=vocab_size, **options)

import pytest
import torch

from flayer.models import (
    FastText,
    FedAvgCNN,
    MaxPool2x2,
    ModelSpec,
    ResNet18,
    build_model,
    cnn_flatten_dim,
    count_parameters,
)


@pytest.mark.parametrize("size,dim", [(28, 1024), (32, 1600), (64, 10816), (16, 64)])
def test_cnn_flatten_dim(size, dim):
    assert cnn_flatten_dim(size, size) == dim


def test_cnn_flatten_dim_rejects_tiny_inputs():
    with pytest.raises(ValueError, match="at least 16x16"):
        cnn_flatten_dim(8, 8)


def test_fedavgcnn_parameter_count_matches_pfllib():
    # PFLlib: 878,538 parameters for 3x32x32 inputs and 10 classes
    assert count_parameters(FedAvgCNN(3, 10, 1600)) == 878_538
    # 1x28x28: conv1 832 + conv2 51,264 + fc1 1024*512+512 + fc 5,130
    assert count_parameters(FedAvgCNN(1, 10, 1024)) == 832 + 51_264 + 524_800 + 5_130


def test_fedavgcnn_names_and_shapes():
    m = FedAvgCNN(1, 10, 1024)
    names = [n for n, _ in m.named_parameters()]
    assert names == ["conv1.0.weight", "conv1.0.bias", "conv2.0.weight", "conv2.0.bias",
                     "fc1.0.weight", "fc1.0.bias", "fc.weight", "fc.bias"]
    assert m(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_reshape_pool_same_forward_and_state_dict():
    torch.manual_seed(0)
    a = FedAvgCNN(1, 10, 1024)
    b = FedAvgCNN(1, 10, 1024, pool="reshape")
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 1, 28, 28)
    assert torch.equal(a(x), b(x))
    y = torch.randn(2, 3, 7, 9)
    assert torch.equal(MaxPool2x2()(y), torch.nn.functional.max_pool2d(y, 2))


def test_resnet18_torchvision_layout():
    m = ResNet18(3, 10)
    # torchvision's resnet18(num_classes=10): 11,181,642 parameters
    assert count_parameters(m) == 11_181_642
    names = [n for n, _ in m.named_parameters()]
    assert names[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert "layer1.0.conv1.weight" in names and "layer4.1.bn2.bias" in names
    assert "layer2.0.downsample.0.weight" in names and "layer2.0.downsample.1.weight" in names
    assert names[-2:] == ["fc.weight", "fc.bias"]
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert ResNet18(3, 100, stem="cifar")(torch.zeros(2, 3, 32, 32)).shape == (2, 100)


def test_fasttext_shapes_and_padding():
    m = FastText(vocab_size=50, num_classes=4, hidden_dim=8)
    tokens = torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]])
    assert m(tokens).shape == (2, 4)
    # padding does not change the mean: same text with more padding gives the same output
    longer = torch.tensor([[5, 6, 0, 0, 0, 0]])
    assert torch.allclose(m(tokens[:1]), m(longer), atol=1e-6)
    assert [n for n, _ in m.named_parameters()] == ["embedding.weight", "fc1.weight", "fc1.bias", "fc.weight", "fc.bias"]


@pytest.mark.parametrize("model_cls,expected", [
    (lambda: FedAvgCNN(), ("conv1", "conv2", "fc1", "fc")),
    (lambda: ResNet18(), ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4", "fc")),
    (lambda: FastText(10), ("embedding", "fc1", "fc")),
])
def test_models_declare_ordered_layers_covering_all_parameters(model_cls, expected):
    m = model_cls()
    assert m.layer_names == expected
    covered = {n for n, _ in m.named_parameters() if n.split(".")[0] in expected}
    assert covered == {n for n, _ in m.named_parameters()}


def test_build_model_from_spec_and_errors():
    assert isinstance(build_model(ModelSpec("cnn", 3, 32, 32, 10)), FedAvgCNN)
    assert isinstance(build_model(ModelSpec("fasttext", num_classes=4, vocab_size=100)), FastText)
    with pytest.raises(ValueError, match="unknown model"):
        ModelSpec("vgg")
    with pytest.raises(ValueError, match="vocab_size"):
        ModelSpec("fasttext")

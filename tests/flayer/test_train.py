import torch

from flayer.train import Split, batches


def _split(n):
    return Split(torch.zeros(n, 1, 4, 4, dtype=torch.uint8), torch.arange(n), torch.tensor([0.5]).view(1, -1, 1, 1),
                 torch.tensor([0.5]).view(1, -1, 1, 1))


def test_batches_cover_everything_in_order_without_shuffle():
    got = [y.tolist() for _, y in batches(_split(25), 10, torch.device("cpu"), shuffle=False)]
    assert got == [list(range(10)), list(range(10, 20)), list(range(20, 25))]


def test_drop_last_skips_only_a_trailing_partial_batch():
    g = torch.Generator().manual_seed(0)
    sizes = [y.numel() for _, y in batches(_split(25), 10, torch.device("cpu"), g, drop_last=True)]
    assert sizes == [10, 10]
    # fewer samples than one batch: keep them, or the client would never train
    sizes = [y.numel() for _, y in batches(_split(7), 10, torch.device("cpu"), g, drop_last=True)]
    assert sizes == [7]


def test_images_are_normalised():
    x, _ = next(batches(_split(3), 3, torch.device("cpu"), shuffle=False))
    assert x.dtype == torch.float32 and torch.all(x == -1.0)

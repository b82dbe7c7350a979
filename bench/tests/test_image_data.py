"""Image completion data: the IDX-gzip and JPEG+partition readers on tiny files, the task construction."""
import numpy as np
import pytest
import torch

from bench.np.data import image_files
from bench.np.data.image_files import load_celeba, load_emnist, read_idx, write_idx
from bench.np.data.images import (DATASETS, ImageCompletionSampler, image_points, load_images, max_points,
                                  pixel_coordinates)


def _emnist_files(root, split="train", n=6, size=28):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, size, size), dtype=np.uint8)
    labels = np.arange(n, dtype=np.uint8) * 9 % 47  # 0, 9, 18, 27, 36, 45
    # EMNIST stores each image transposed: write the transpose of the picture we mean.
    write_idx(root / f"emnist-balanced-{split}-images-idx3-ubyte.gz", images.transpose(0, 2, 1))
    write_idx(root / f"emnist-balanced-{split}-labels-idx1-ubyte.gz", labels)
    return images, labels


def test_idx_round_trip(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", a)
    np.testing.assert_array_equal(read_idx(tmp_path / "a.gz"), a)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04\x05")
    with pytest.raises(ValueError, match="not an unsigned-byte IDX"):
        read_idx(tmp_path / "bad")


def test_emnist_transposed_back_and_classes(tmp_path):
    images, labels = _emnist_files(tmp_path)
    got, got_labels = load_emnist(tmp_path, "train", size=28)
    assert got.shape == (6, 1, 28, 28) and got.dtype == torch.uint8
    np.testing.assert_array_equal(got[:, 0].numpy(), images)
    seen, seen_labels = load_emnist(tmp_path, "train", classes=range(10))
    assert seen.shape == (2, 1, 32, 32) and seen_labels.tolist() == [0, 9]


def test_emnist_splits_seen_unseen(tmp_path):
    _emnist_files(tmp_path, "train")
    _emnist_files(tmp_path, "test")
    assert load_images("emnist", "train", tmp_path).shape[0] == 2
    assert load_images("emnist", "seen", tmp_path).shape[0] == 2
    assert load_images("emnist", "unseen", tmp_path).shape[0] == 4


def test_missing_dataset_names_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="emnist-balanced-train-images-idx3-ubyte.gz") as err:
        load_emnist(tmp_path)
    assert str(tmp_path) in str(err.value)
    with pytest.raises(FileNotFoundError, match="list_eval_partition.txt"):
        load_celeba(tmp_path)
    with pytest.raises(ValueError, match="--data-dir"):
        load_images("celeba32", "train")


def _tiny_celeba(tmp_path):
    from PIL import Image

    (tmp_path / "img_align_celeba").mkdir()
    lines = []
    for i, part in enumerate([0, 0, 2]):
        # 20 wide, 30 tall: red band in the middle 20 rows, blue above and below (cropped away).
        a = np.zeros((30, 20, 3), dtype=np.uint8)
        a[:, :, 2] = 255
        a[5:25] = (255 * (i + 1) // 3, 0, 0)
        name = f"{i + 1:06d}.jpg"
        Image.fromarray(a).save(tmp_path / "img_align_celeba" / name, quality=100)
        lines.append(f"{name} {part}")
    (tmp_path / "list_eval_partition.txt").write_text("\n".join(lines) + "\n")


def test_celeba_center_crop_resize_and_partition(tmp_path):
    _tiny_celeba(tmp_path)
    train = load_celeba(tmp_path, "train", size=8)
    assert train.shape == (2, 3, 8, 8) and train.dtype == torch.uint8
    # Rows away from the crop edge are the red band only (the edges get bicubic/JPEG bleed).
    assert train[:, 2, 1:-1].float().max() < 30 and abs(train[1, 0, 1:-1].float().mean().item() - 170) < 15
    assert load_images("celeba64", "test", tmp_path).shape == (1, 3, 64, 64)


@pytest.mark.parametrize("size", [32, 64, 128])
def test_counts_follow_the_papers(size):
    sampler = ImageCompletionSampler(torch.zeros(2, 1, size, size))
    m = {32: 200, 64: 800, 128: 1600}[size]
    assert sampler.max_total == max_points(size, size) == m
    gen = torch.Generator().manual_seed(0)
    counts = [sampler.sample_counts(gen) for _ in range(2000)]
    nc = torch.tensor([c[0] for c in counts])
    nt = torch.tensor([c[1] for c in counts])
    assert nc.min() >= 3 and nc.max() < m - 3 and nt.min() >= 3 and (nc + nt).max() < m
    assert nc.max() > m - 30 and nc.min() < 15  # the whole range is used


def test_task_values_match_the_image():
    images = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)
    batch = ImageCompletionSampler(images).sample(4, generator=torch.Generator().manual_seed(1))
    assert batch.xc.shape[0] == 4 and batch.xc.shape[1] == batch.yc.shape[1] and batch.yt.shape[-1] == 3
    for x, y in ((batch.xc, batch.yc), (batch.xt, batch.yt)):
        assert x.min() >= -1 and x.max() <= 1 and y.min() >= -0.5 and y.max() <= 0.5
    # Each (x, y) is a real pixel of one of the images, and no target repeats a context pixel.
    _, all_y = image_points(images)
    grid = pixel_coordinates(32, 32)
    for b in range(4):
        idx = torch.cdist(batch.xc[b], grid).argmin(1)
        assert any(torch.allclose(all_y[i, idx], batch.yc[b]) for i in range(5))
        tidx = torch.cdist(batch.xt[b], grid).argmin(1)
        assert not set(idx.tolist()) & set(tidx.tolist())


def test_bad_images_raise_with_shape():
    with pytest.raises(ValueError, match=r"\[N, C, H, W\].*\(3, 32, 32\)"):
        ImageCompletionSampler(torch.zeros(3, 32, 32))


def test_digits_offline():
    pytest.importorskip("sklearn", reason="the digits image set needs scikit-learn, which the harness does not require (pip install scikit-learn)")
    train, test = load_images("digits", "train"), load_images("digits", "test")
    assert train.shape[1:] == (1, 8, 8) and train.shape[0] + test.shape[0] == 1797
    batch = ImageCompletionSampler(train).sample(3, generator=torch.Generator().manual_seed(0))
    assert batch.xc.shape[1] + batch.xt.shape[1] < 64 and set(DATASETS) >= {"digits", "emnist"}


def test_a_model_learns_to_read_image_context():
    """Control for the pipeline (coordinates, values, splits): on smooth random 8×8 images (plane waves) a
    small TNP-D learns within 500 steps to predict hidden pixels far better than the pixel marginal."""
    from attn_ext.models import build_model

    gen = torch.Generator().manual_seed(1)

    def waves(n):
        w, phase = torch.randn(n, 2, generator=gen) * 2, torch.rand(n, 1, generator=gen) * 6.28
        return (0.5 + 0.5 * torch.sin(pixel_coordinates(8, 8) @ w.T + phase.T).T).view(n, 1, 8, 8)

    torch.manual_seed(0)
    sampler, test = ImageCompletionSampler(waves(500)), waves(16)
    model = build_model("tnpd", dim_x=2, dim_y=1, d_model=64, num_layers=2)
    opt = torch.optim.Adam(model.parameters(), lr=5e-4)
    for _ in range(500):
        loss = model(sampler.sample(16, gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    batch = sampler.tasks(test, gen, num_context=40, num_target=24)
    with torch.no_grad():
        mse = ((model.eval().predict(batch.xc, batch.yc, batch.xt).mean - batch.yt) ** 2).mean()
    _, y = image_points(test)
    assert mse < 0.25 * ((y - y.mean(0)) ** 2).mean()  # digits stay near 1 (image_completion.md)


def _no_decoding(*args, **kwargs):
    raise AssertionError("decoded again although the cache is valid")


def test_celeba_decode_cache_is_reused_and_keyed(tmp_path, monkeypatch):
    _tiny_celeba(tmp_path)
    first = load_celeba(tmp_path, "train", size=8)
    cache = tmp_path / image_files.CELEBA_CACHE_DIR / "celeba-train-8.npy"
    assert cache.exists() and cache.with_suffix(".json").exists()
    decode = image_files._decode_celeba
    monkeypatch.setattr(image_files, "_decode_celeba", _no_decoding)
    again = load_celeba(tmp_path, "train", size=8)
    assert torch.equal(again, first) and again.dtype == torch.uint8
    with pytest.raises(AssertionError, match="decoded again"):  # another size is another cache
        load_celeba(tmp_path, "train", size=4)
    # A changed partition file (here: the test image moved into train) invalidates the cache.
    partition = tmp_path / "list_eval_partition.txt"
    partition.write_text(partition.read_text().replace(" 2\n", " 0\n"))
    with pytest.raises(AssertionError, match="decoded again"):
        load_celeba(tmp_path, "train", size=8)
    monkeypatch.setattr(image_files, "_decode_celeba", decode)
    assert load_celeba(tmp_path, "train", size=8).shape == (3, 3, 8, 8)


def test_celeba_cache_off_and_unwritable_dir(tmp_path, monkeypatch, capsys):
    _tiny_celeba(tmp_path)
    load_celeba(tmp_path, "train", size=8, cache=False)
    assert not (tmp_path / image_files.CELEBA_CACHE_DIR).exists()

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(image_files.Path, "mkdir", refuse)
    images = load_celeba(tmp_path, "train", size=8)
    assert images.shape == (2, 3, 8, 8)
    assert "cache not written" in capsys.readouterr().err


def test_celeba_corrupt_cache_is_rebuilt(tmp_path):
    _tiny_celeba(tmp_path)
    expected = load_celeba(tmp_path, "train", size=8)
    cache = tmp_path / image_files.CELEBA_CACHE_DIR / "celeba-train-8.npy"
    cache.write_bytes(b"not an array")
    assert torch.equal(load_celeba(tmp_path, "train", size=8), expected)

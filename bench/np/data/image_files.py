"""Readers of the published image-dataset files (nothing is downloaded): EMNIST's gzip IDX files,
CelebA's aligned JPEGs with ``list_eval_partition.txt``, and scikit-learn's bundled 8×8 digits.

Every reader returns ``uint8 [N, C, H, W]`` images (and, where the format has them, labels); the
task construction of :mod:`bench.np.data.images` scales them.
"""
from __future__ import annotations

import gzip
import json
import os
import struct
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

#: IDX type code 0x08 = unsigned byte, the only one EMNIST uses.
_IDX_UBYTE = 0x08
EMNIST_FILES = {split: (f"emnist-balanced-{split}-images-idx3-ubyte.gz", f"emnist-balanced-{split}-labels-idx1-ubyte.gz")
                for split in ("train", "test")}
CELEBA_FILES = ("img_align_celeba/*.jpg", "list_eval_partition.txt")
CELEBA_PARTITIONS = {"train": 0, "valid": 1, "test": 2}
#: Decoded CelebA arrays are cached here, inside the data directory (see load_celeba).
CELEBA_CACHE_DIR = ".attn_ext_cache"
#: Bumped whenever the decoding (crop, filter) changes, so that old caches are not reused.
_CELEBA_DECODE_VERSION = 1


def _missing(name: str, directory: Path, expected: Sequence[str]) -> FileNotFoundError:
    return FileNotFoundError(f"{name} not found in {directory}: expected the files {', '.join(expected)} "
                             "(attn_ext downloads nothing; fetch them from the dataset's site)")


def read_idx(path: Path) -> np.ndarray:
    """The array stored in a (gzip-compressed if the name ends in ``.gz``) IDX file of unsigned bytes."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError(f"{path}: not an IDX file (only {len(data)} bytes)")
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != _IDX_UBYTE:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {data[:4].hex()})")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says shape {shape} ({int(np.prod(shape))} bytes), found {body.size}")
    return body.reshape(shape)


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write ``uint8`` ``array`` as a gzip IDX file (the inverse of :func:`read_idx`; used by the tests)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, _IDX_UBYTE, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


def resize(images: Tensor, size: int) -> Tensor:
    """``uint8 [N, C, H, W]`` resized (bilinear, antialiased) to ``size × size``."""
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    out = F.interpolate(images.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8)


def load_emnist(data_dir: Path, split: str = "train", classes: Optional[Sequence[int]] = None,
                size: int = 32) -> Tuple[Tensor, Tensor]:
    """EMNIST balanced ``split`` ("train" or "test"): ``(uint8 [N, 1, size, size], labels [N])``.

    The IDX files store each 28×28 image transposed (column-major); it is transposed back, then
    resized to ``size`` (32, as the TNP/LBANP/CMANP data code). ``classes`` keeps only those labels.
    """
    if split not in EMNIST_FILES:
        raise ValueError(f"EMNIST split must be 'train' or 'test', got {split!r}")
    data_dir = Path(data_dir)
    names = EMNIST_FILES[split]
    if not all((data_dir / n).exists() for n in names):
        raise _missing("EMNIST (balanced)", data_dir, names)
    images, labels = read_idx(data_dir / names[0]), read_idx(data_dir / names[1])
    if images.ndim != 3 or labels.shape != images.shape[:1]:
        raise ValueError(f"EMNIST {split}: images {images.shape} and labels {labels.shape} do not match")
    images = torch.from_numpy(images.transpose(0, 2, 1).copy()).unsqueeze(1)
    labels = torch.from_numpy(labels.astype(np.int64))
    if classes is not None:
        keep = torch.isin(labels, torch.as_tensor(list(classes)))
        images, labels = images[keep], labels[keep]
    return resize(images, size), labels


def load_celeba(data_dir: Path, split: str = "train", size: int = 32, limit: Optional[int] = None,
                cache: bool = True) -> Tensor:
    """CelebA aligned images of ``split`` ("train", "valid", "test"), center-cropped to a square and
    resized to ``size`` with PIL: ``uint8 [N, 3, size, size]`` (the first ``limit`` if given).

    Decoding the 163k training JPEGs takes minutes, so with ``cache`` the result is written once to
    ``data_dir/.attn_ext_cache/celeba-<split>-<size>[-<limit>].npy`` and memory-mapped on later
    calls (read-only: copy before writing into it). The cache is keyed by the image list, the
    partition file's size and mtime, and the decoding version; a stale or unreadable cache is
    rebuilt, and a directory that cannot be written to only costs the cache (with a warning).
    """
    if split not in CELEBA_PARTITIONS:
        raise ValueError(f"CelebA split must be one of {', '.join(CELEBA_PARTITIONS)}, got {split!r}")
    data_dir = Path(data_dir)
    partition, image_dir = data_dir / "list_eval_partition.txt", data_dir / "img_align_celeba"
    if not partition.exists() or not image_dir.is_dir():
        raise _missing("CelebA", data_dir, CELEBA_FILES)
    wanted = CELEBA_PARTITIONS[split]
    names = []
    for line in partition.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and int(parts[1]) == wanted:
            names.append(parts[0])
    names = names[:limit] if limit is not None else names
    if not names:
        raise ValueError(f"{partition}: no image of partition {wanted} ({split})")
    cache_path = data_dir / CELEBA_CACHE_DIR / f"celeba-{split}-{size}{'' if limit is None else f'-{limit}'}.npy"
    key = {"version": _CELEBA_DECODE_VERSION, "count": len(names), "first": names[0], "last": names[-1],
           "partition_bytes": partition.stat().st_size, "partition_mtime_ns": partition.stat().st_mtime_ns}
    if cache:
        cached = _read_cache(cache_path, key, (len(names), 3, size, size))
        if cached is not None:
            return cached
    images = _decode_celeba(image_dir, partition, names, size)
    if cache:
        _write_cache(cache_path, key, images)
    return images


def _decode_celeba(image_dir: Path, partition: Path, names: Sequence[str], size: int) -> Tensor:
    from PIL import Image  # lazily: Pillow comes with matplotlib, which the core package does not need

    out = np.empty((len(names), size, size, 3), dtype=np.uint8)
    for i, name in enumerate(names):
        if i and i % 10000 == 0:  # the full training split is 163k images: minutes of decoding
            print(f"attn_ext: CelebA decoded {i:,}/{len(names):,} images ({size}x{size})", file=sys.stderr, flush=True)
        path = image_dir / name
        if not path.exists():
            raise FileNotFoundError(f"CelebA: {path} is listed in {partition} but missing")
        with Image.open(path) as img:
            img = img.convert("RGB")
            w, h = img.size
            side = min(w, h)
            left, top = (w - side) // 2, (h - side) // 2
            img = img.crop((left, top, left + side, top + side)).resize((size, size), Image.BICUBIC)
            out[i] = np.asarray(img)
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()


def _read_cache(path: Path, key: dict, shape: Tuple[int, ...]) -> Optional[Tensor]:
    """The cached images if ``path`` exists with this ``key`` and ``shape``, else None."""
    key_path = path.with_suffix(".json")
    try:
        if json.loads(key_path.read_text()) != key:
            return None
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return None
    if array.shape != shape or array.dtype != np.uint8:
        return None

    with warnings.catch_warnings():  # a read-only memory map: torch warns that it cannot be written to
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _write_cache(path: Path, key: dict, images: Tensor) -> None:
    """Write ``images`` and their ``key`` next to each other, each through a rename so that an
    interrupted write never leaves a cache that looks valid."""
    try:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, images.numpy())
        os.replace(tmp, path)
        tmp_key = path.with_name(f".{path.stem}.{os.getpid()}.json.tmp")
        tmp_key.write_text(json.dumps(key))
        os.replace(tmp_key, path.with_suffix(".json"))
    except OSError as exc:
        print(f"attn_ext: CelebA decode cache not written ({exc}); the next run decodes again", file=sys.stderr)


def load_digits(split: str = "train") -> Tuple[Tensor, Tensor]:
    """scikit-learn's bundled 8×8 digits (1797 images, shipped in its wheel): ``(uint8 [N, 1, 8, 8],
    labels [N])``; "train" is every image but each fifth, "test" each fifth (a fixed split)."""
    if split not in ("train", "test"):
        raise ValueError(f"digits split must be 'train' or 'test', got {split!r}")
    try:
        from sklearn.datasets import load_digits as sk_load_digits  # optional: only the digits set needs it
    except ImportError as exc:
        raise ImportError("the 'digits' image set needs scikit-learn: pip install scikit-learn") from exc
    bunch = sk_load_digits()
    images = torch.from_numpy(np.round(bunch.images * (255 / 16)).astype(np.uint8)).unsqueeze(1)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    test = torch.arange(len(labels)) % 5 == 0
    keep = test if split == "test" else ~test
    return images[keep], labels[keep]

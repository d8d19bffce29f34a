"""Image preprocessing (``torchkeel.data.images``): torchvision's arithmetic, computed independently;
decoding that refuses what it cannot or must not decode; ``data.preprocess`` in the data pipeline
and in the export."""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from conftest import train_tiny
from imagedata import PREPROCESS, EncodedImages, encode, image_pixels, image_run_overrides
from torchkeel.config.load import load_config
from torchkeel.data.build import transformed_datasets
from torchkeel.data.images import ImageError, ImagePreprocess, decode
from torchkeel.errors import ConfigError
from torchkeel.export import export_run


def by_hand(data: bytes, mode: str, resize, crop, mean, std) -> np.ndarray:
    """What torchvision's Resize, CenterCrop, ToTensor and Normalize compute, written out again."""
    image = Image.open(io.BytesIO(data)).convert(mode)
    w, h = image.size
    if isinstance(resize, int):
        if w <= h:
            size = (resize, int(resize * h / w))
        else:
            size = (int(resize * w / h), resize)
    else:
        size = (resize[1], resize[0])
    image = image.resize(size, Image.Resampling.BILINEAR)
    ch, cw = crop
    top, left = int(round((image.size[1] - ch) / 2.0)), int(round((image.size[0] - cw) / 2.0))
    image = image.crop((left, top, left + cw, top + ch))
    x = np.asarray(image, dtype=np.float32) / 255.0
    x = x if x.ndim == 3 else x[:, :, None]
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.transpose(x, (2, 0, 1))


@pytest.mark.parametrize("size", [(300, 200), (200, 300), (257, 257)])
@pytest.mark.parametrize("mode,fmt", [("RGB", "JPEG"), ("RGB", "PNG"), ("L", "PNG")])
def test_matches_torchvisions_arithmetic_bit_for_bit(size, mode, fmt):
    pixels = np.random.default_rng(sum(size)).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    data = encode(pixels, fmt)
    mean, std = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]) if mode == "RGB" else ([0.5], [0.25])
    preprocess = ImagePreprocess.from_spec({"mode": mode, "resize": 224, "crop": 200, "mean": mean, "std": std})
    got = preprocess.array(data)
    assert got.dtype == np.float32 and list(got.shape) == preprocess.output_shape
    np.testing.assert_array_equal(got, by_hand(data, mode, 224, (200, 200), mean, std))


def test_resize_to_height_and_width_and_the_shorter_side_rule():
    data = encode(image_pixels(0, 1, (400, 300)))
    assert ImagePreprocess.from_spec({"mode": "RGB", "resize": 256}).array(data).shape == (3, 256, 341)
    assert ImagePreprocess.from_spec({"mode": "RGB", "resize": [10, 30]}).array(data).shape == (3, 10, 30)
    got = ImagePreprocess.from_spec({"mode": "RGB", "resize": [10, 30], "crop": [10, 20]}).array(data)
    np.testing.assert_allclose(got, by_hand(data, "RGB", [10, 30], (10, 20), [0], [1]), atol=1e-6)


def test_inputs_as_bytes_pil_array_or_path_give_the_same_tensor(tmp_path):
    pixels = image_pixels(2, 3, (33, 21))
    preprocess = ImagePreprocess.from_spec(PREPROCESS)
    data = encode(pixels, "PNG")
    (tmp_path / "x.png").write_bytes(data)
    expected = preprocess.array(data)
    for form in (pixels, Image.fromarray(pixels), str(tmp_path / "x.png")):
        np.testing.assert_array_equal(np.asarray(preprocess(form)), expected)


def test_undecodable_unsupported_and_truncated_images_are_named():
    with pytest.raises(ImageError, match="not a decodable image"):
        decode(b"definitely not an image")
    ico = io.BytesIO()
    Image.new("RGB", (16, 16)).save(ico, "ICO")
    with pytest.raises(ImageError, match="ICO images are not accepted; send one of JPEG, PNG"):
        decode(ico.getvalue())
    jpeg = encode(image_pixels(0, 0, (64, 64)), "JPEG")
    with pytest.raises(ImageError, match="JPEG image cannot be decoded"):
        decode(jpeg[: len(jpeg) // 2])


def test_a_decompression_bomb_is_refused_from_its_header_before_decoding():
    bomb = io.BytesIO()
    Image.new("L", (12_000, 12_000)).save(bomb, "PNG")  # 144 Mpx, a few hundred kB
    assert len(bomb.getvalue()) < 1_000_000
    start = time.process_time()  # this process's CPU time: the same on a busy machine
    with pytest.raises(ImageError, match="12000×12000 = 144,000,000 pixels, over the limit of 40,000,000"):
        decode(bomb.getvalue())
    assert time.process_time() - start < 0.5  # nothing was decompressed (a full decode takes seconds of CPU)
    with pytest.raises(ImageError, match="over the limit of 100"):
        decode(encode(image_pixels(0, 0, (11, 10))), max_pixels=100)


def test_an_image_smaller_than_the_crop_is_refused():
    with pytest.raises(ImageError, match="10×10 after resizing, smaller than the 16×16 crop"):
        ImagePreprocess.from_spec({"mode": "RGB", "crop": 16}).array(encode(image_pixels(0, 0, (10, 10))))


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"mode": "CMYK"}, "preprocess.mode must be RGB or L"),
        ({"mode": "RGB", "mean": [0.5, 0.5]}, "preprocess.mean has 2 values; mode RGB has 3 channel"),
        ({"mode": "L", "std": [0.0]}, "preprocess.std must be positive"),
        ({"mode": "RGB", "resize": [1, 2, 3]}, r"preprocess.resize must be a positive integer or \[height, width\]"),
        ({"mode": "RGB", "crop": -4}, "preprocess.crop must be a positive integer"),
        ({"mode": "RGB", "scale": 0}, "preprocess.scale must be a positive number"),
        ({"mode": "RGB", "interpolation": "lanczos"}, "preprocess.interpolation must be one of"),
        ({"mode": "RGB", "rotate": 90}, r"preprocess has unknown key\(s\) \['rotate'\]"),
    ],
)
def test_spec_errors_name_the_key(spec, message):
    with pytest.raises(ConfigError, match=message):
        ImagePreprocess.from_spec(spec)


def test_config_validates_data_preprocess():
    with pytest.raises(ConfigError, match="data.preprocess.mean has 2 values"):
        load_config(None, ["data.preprocess.mode=RGB", "data.preprocess.mean=[0.1, 0.2]"])
    with pytest.raises(ConfigError, match="data.preprocess is set but data.preprocess.mode is null"):
        load_config(None, ["data.preprocess.crop=16"])


@given(st.binary(max_size=2048))
@settings(max_examples=300, deadline=None)
def test_random_bytes_are_decoded_or_refused_with_an_image_error(data):
    try:
        out = ImagePreprocess.from_spec({"mode": "RGB", "resize": [8, 8]}).array(data)
    except ImageError:
        return
    assert out.shape == (3, 8, 8) and np.isfinite(out).all()


def test_training_pipeline_and_export_use_the_declared_preprocess(tmp_path):
    config = load_config(
        None,
        [
            "model.target=imagedata:make_cnn",
            "data.target=imagedata:make_data",
            f"data.preprocess={json.dumps(PREPROCESS)}",
        ],
    )
    train, val = transformed_datasets(config.data)
    raw = EncodedImages(96, 0)
    x, y = train[5]
    np.testing.assert_allclose(
        x.numpy(), by_hand(raw[5][0], "RGB", 20, (16, 16), PREPROCESS["mean"], PREPROCESS["std"]), atol=1e-6
    )
    assert y == raw[5][1]

    train_tiny(tmp_path, 6, *image_run_overrides())
    meta = export_run(tmp_path / "tiny", "torchscript", tmp_path / "export")
    assert meta["preprocess"] == ImagePreprocess.from_spec(PREPROCESS).to_spec()
    assert meta["labels"] == ["red", "green", "blue"] and meta["inputs"][0]["shape"] == [-1, 3, 16, 16]
    assert meta["reference"]["layout"] == "channels" and len(meta["reference"]["features"]) == 3  # preprocessed tensors
    with pytest.raises(
        ConfigError, match=r"--preprocess makes images of shape \[1, 16, 16\], but the model takes \[3, 16, 16\]"
    ):
        export_run(
            tmp_path / "tiny",
            "torchscript",
            tmp_path / "bad",
            preprocess={**PREPROCESS, "mode": "L", "mean": [0.5], "std": [0.2]},
        )
    with pytest.raises(ConfigError, match="--labels gives 2 labels, but the model has"):
        export_run(tmp_path / "tiny", "torchscript", tmp_path / "bad", labels=["a", "b"])

"""The built-in demo: a small CNN on scikit-learn's handwritten digits (nothing downloaded)."""

from torchkeel.demo.digits import (
    DEMO_CONFIG,
    DigitsCNN,
    export_and_serve_one,
    load_digit_images,
    load_digits_split,
    run_demo,
)

__all__ = ["DEMO_CONFIG", "DigitsCNN", "export_and_serve_one", "load_digit_images", "load_digits_split", "run_demo"]

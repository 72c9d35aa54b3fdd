"""Generate the heat-diffusion data set: random smooth initial temperature and diffusivity -> field after k steps.

Solved with explicit finite differences in numpy (5-point stencil, zero Dirichlet border), written to Zarr and .npy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def smooth_fields(rng: np.random.Generator, n: int, size: int, modes: int = 6) -> np.ndarray:
    """``n`` random smooth fields of ``size x size`` in [0, 1]: low-pass filtered Gaussian noise."""
    noise = rng.standard_normal((n, size, size))
    freq = np.fft.fftfreq(size) * size
    radius = np.sqrt(freq[:, None] ** 2 + freq[None, :] ** 2)
    spectrum = np.fft.fft2(noise) * np.exp(-((radius / modes) ** 2))
    fields = np.real(np.fft.ifft2(spectrum))
    lo = fields.min(axis=(1, 2), keepdims=True)
    hi = fields.max(axis=(1, 2), keepdims=True)
    return (fields - lo) / (hi - lo + 1e-12)


def diffuse(u: np.ndarray, kappa: np.ndarray, steps: int, dt: float = 1.0) -> np.ndarray:
    """``steps`` explicit steps of ``du/dt = div(kappa grad u)`` on a unit grid, zero temperature outside the field.

    Fluxes use the mean diffusivity of neighbouring cells (conservative form); stable while ``4 dt max(kappa) <= 1``.
    """
    if 4 * dt * float(kappa.max()) > 1.0:
        raise ValueError(f"unstable: 4 * dt * max(kappa) = {4 * dt * float(kappa.max()):.3f} > 1; lower dt or kappa")
    u = u.astype(np.float64).copy()
    kp = np.pad(kappa, ((0, 0), (1, 1), (1, 1)), mode="edge")
    kx_minus = 0.5 * (kp[:, 1:-1, 1:-1] + kp[:, 1:-1, :-2])
    kx_plus = 0.5 * (kp[:, 1:-1, 1:-1] + kp[:, 1:-1, 2:])
    ky_minus = 0.5 * (kp[:, 1:-1, 1:-1] + kp[:, :-2, 1:-1])
    ky_plus = 0.5 * (kp[:, 1:-1, 1:-1] + kp[:, 2:, 1:-1])
    for _ in range(steps):
        p = np.pad(u, ((0, 0), (1, 1), (1, 1)))  # zero Dirichlet border
        c = p[:, 1:-1, 1:-1]
        flux = (
            kx_plus * (p[:, 1:-1, 2:] - c)
            - kx_minus * (c - p[:, 1:-1, :-2])
            + ky_plus * (p[:, 2:, 1:-1] - c)
            - ky_minus * (c - p[:, :-2, 1:-1])
        )
        u += dt * flux
    return u


def generate(n: int, size: int, steps: int, seed: int = 0, batch: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """``input [n, 2, size, size]`` (u0, kappa) and ``target [n, 1, size, size]`` (u after ``steps``), float32."""
    rng = np.random.default_rng(seed)
    inputs = np.empty((n, 2, size, size), np.float32)
    targets = np.empty((n, 1, size, size), np.float32)
    for start in range(0, n, batch):
        m = min(batch, n - start)
        u0 = smooth_fields(rng, m, size, modes=max(2, size // 32))
        kappa = 0.02 + 0.2 * smooth_fields(rng, m, size, modes=max(2, size // 64))
        inputs[start : start + m, 0] = u0
        inputs[start : start + m, 1] = kappa
        targets[start : start + m, 0] = diffuse(u0, kappa, steps)
    return inputs, targets


def write(out: Path, split: str, inputs: np.ndarray, targets: np.ndarray, chunk_width: int, meta: dict) -> None:
    """``out/heat_<split>.zarr`` (arrays ``input``, ``target``) and ``out/<split>_input.npy``, ``<split>_target.npy``.

    Each Zarr shard (one file) holds one sample; inside it, chunks of ``chunk_width`` columns are read
    independently, so a rank that needs a tile of columns reads only the chunks it touches.
    """
    import zarr

    out.mkdir(parents=True, exist_ok=True)
    root = zarr.open_group(str(out / f"heat_{split}.zarr"), mode="w")
    for name, data in (("input", inputs), ("target", targets)):
        chunks = (1, data.shape[1], data.shape[2], min(chunk_width, data.shape[3]))
        shards = (1, *data.shape[1:])
        array = root.create_array(
            name, shape=data.shape, dtype=data.dtype, chunks=chunks, shards=shards, compressors=None
        )
        array[...] = data
        np.save(out / f"{split}_{name}.npy", data)
    root.attrs.update(meta)
    (out / f"{split}_meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="data/heat", help="output folder (heat_train.zarr, heat_test.zarr, *.npy)")
    parser.add_argument("--samples", type=int, default=256, help="training samples")
    parser.add_argument("--test-samples", type=int, default=32, help="held-out samples (another seed)")
    parser.add_argument("--size", type=int, default=256, help="fields are size x size cells")
    parser.add_argument("--steps", type=int, default=8, help="explicit diffusion steps from input to target")
    parser.add_argument(
        "--chunk-width", type=int, default=4, help="Zarr chunk width (columns): tiles read whole chunks"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for split, n, seed in (("train", args.samples, args.seed), ("test", args.test_samples, args.seed + 1)):
        inputs, targets = generate(n, args.size, args.steps, seed)
        meta = {"samples": n, "size": args.size, "steps": args.steps, "seed": seed} | {
            "equation": "du/dt = div(kappa grad u), explicit 5-point FD, dt=1, unit grid, zero Dirichlet border",
            "input_channels": ["u0", "kappa"],
            "target_channels": ["u_after_steps"],
        }
        write(Path(args.out), split, inputs, targets, args.chunk_width, meta)
        print(f"wrote {n} samples of {args.size}x{args.size} to {args.out}/heat_{split}.zarr and {split}_*.npy")


if __name__ == "__main__":
    main()

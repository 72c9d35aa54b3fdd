"""Generate the heat-diffusion data set: random smooth initial temperature and diffusivity -> field after k steps.

2-D fields or 3-D volumes (``--spatial 3``), solved with explicit finite differences in numpy (5- or 7-point
stencil, zero Dirichlet border), written to Zarr and .npy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def smooth_fields(rng: np.random.Generator, n: int, size: int, modes: int = 6, spatial: int = 2) -> np.ndarray:
    """``n`` random smooth fields of ``size`` cells per axis (``spatial`` axes) in [0, 1]: low-pass filtered noise."""
    noise = rng.standard_normal((n, *[size] * spatial))
    freq = np.fft.fftfreq(size) * size
    grids = np.meshgrid(*[freq] * spatial, indexing="ij")
    radius = np.sqrt(sum(g**2 for g in grids))
    axes = tuple(range(1, spatial + 1))
    fields = np.real(np.fft.ifftn(np.fft.fftn(noise, axes=axes) * np.exp(-((radius / modes) ** 2)), axes=axes))
    lo = fields.min(axis=axes, keepdims=True)
    hi = fields.max(axis=axes, keepdims=True)
    return (fields - lo) / (hi - lo + 1e-12)


def diffuse(u: np.ndarray, kappa: np.ndarray, steps: int, dt: float = 1.0) -> np.ndarray:
    """``steps`` explicit steps of ``du/dt = div(kappa grad u)`` on a unit grid, zero temperature outside the field.

    ``u`` and ``kappa`` are ``[n, *space]`` (2-D or 3-D). Fluxes use the mean diffusivity of neighbouring cells
    (conservative form); stable while ``2 * spatial * dt * max(kappa) <= 1``.
    """
    spatial = u.ndim - 1
    if 2 * spatial * dt * float(kappa.max()) > 1.0:
        raise ValueError(
            f"unstable: {2 * spatial} * dt * max(kappa) = {2 * spatial * dt * float(kappa.max()):.3f} > 1; "
            "lower dt or kappa"
        )
    u = u.astype(np.float64).copy()
    inner = (slice(None), *[slice(1, -1)] * spatial)
    kp = np.pad(kappa, [(0, 0)] + [(1, 1)] * spatial, mode="edge")

    def shifted(a: np.ndarray, axis: int, by: int) -> np.ndarray:  # a[inner] moved by one cell along axis
        index = list(inner)
        index[axis] = slice(1 + by, a.shape[axis] - 1 + by)
        return a[tuple(index)]

    axes = range(spatial, 0, -1)  # the last axis first: the same sum order as the 2-D stencil always had
    k_minus = {a: 0.5 * (kp[inner] + shifted(kp, a, -1)) for a in axes}
    k_plus = {a: 0.5 * (kp[inner] + shifted(kp, a, 1)) for a in axes}
    for _ in range(steps):
        p = np.pad(u, [(0, 0)] + [(1, 1)] * spatial)  # zero Dirichlet border
        c = p[inner]
        flux = 0
        for a in axes:
            flux = flux + k_plus[a] * (shifted(p, a, 1) - c) - k_minus[a] * (c - shifted(p, a, -1))
        u += dt * flux
    return u


def generate(
    n: int, size: int, steps: int, seed: int = 0, batch: int = 32, spatial: int = 2
) -> tuple[np.ndarray, np.ndarray]:
    """``input [n, 2, *space]`` (u0, kappa) and ``target [n, 1, *space]`` (u after ``steps``), float32.

    ``space`` is ``size`` cells on each of ``spatial`` (2 or 3) axes.
    """
    rng = np.random.default_rng(seed)
    space = [size] * spatial
    inputs = np.empty((n, 2, *space), np.float32)
    targets = np.empty((n, 1, *space), np.float32)
    top = 0.2 if spatial == 2 else 0.12  # keeps 2 * spatial * max(kappa) <= 1
    for start in range(0, n, batch):
        m = min(batch, n - start)
        u0 = smooth_fields(rng, m, size, modes=max(2, size // 32), spatial=spatial)
        kappa = 0.02 + top * smooth_fields(rng, m, size, modes=max(2, size // 64), spatial=spatial)
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
        # 2-D: chunks of columns; 3-D: chunks of chunk_width x chunk_width along the last two axes (a 2-D grid)
        cut = 1 if data.ndim == 4 else 2
        chunks = (1, *data.shape[1 : data.ndim - cut], *[min(chunk_width, n) for n in data.shape[data.ndim - cut :]])
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
    parser.add_argument("--spatial", type=int, default=2, choices=(2, 3), help="2-D fields or 3-D volumes")
    args = parser.parse_args(argv)
    for split, n, seed in (("train", args.samples, args.seed), ("test", args.test_samples, args.seed + 1)):
        inputs, targets = generate(n, args.size, args.steps, seed, spatial=args.spatial)
        meta = {"samples": n, "size": args.size, "steps": args.steps, "seed": seed, "spatial": args.spatial} | {
            "equation": "du/dt = div(kappa grad u), explicit 5-point FD, dt=1, unit grid, zero Dirichlet border",
            "input_channels": ["u0", "kappa"],
            "target_channels": ["u_after_steps"],
        }
        write(Path(args.out), split, inputs, targets, args.chunk_width, meta)
        print(
            f"wrote {n} samples of {'x'.join([str(args.size)] * args.spatial)} to {args.out}/heat_{split}.zarr "
            f"and {split}_*.npy"
        )


if __name__ == "__main__":
    main()

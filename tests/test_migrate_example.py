"""docs/migrate-from-ignite.md's two scripts, run as they are: the plain ignite script trains, and its meshwise
conversion prints the same held-out accuracy and loss every epoch in one process and at dp=2 x tp=2. (The two
scripts draw their batches differently: ignite's sampler against meshwise's, so their numbers are not compared.)"""

from __future__ import annotations

import sys
from pathlib import Path

from meshwise.testing import run_command, run_script

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "migrate"


def _epochs(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("epoch ")]


def test_the_converted_ignite_script_prints_one_processs_numbers_at_dp2_tp2(tmp_path):
    for sub in "abc":
        (tmp_path / sub).mkdir()
    before = run_command([sys.executable, str(EXAMPLES / "before.py")], cwd=str(tmp_path / "a"), timeout=120).stdout
    # the conversion as `python after.py` and `meshwise run --nproc-per-node 4 --mesh dp=2,tp=2 after.py` run it
    one = run_script(EXAMPLES / "after.py", 1, cwd=tmp_path / "b")[0]
    mesh = run_script(EXAMPLES / "after.py", 4, mesh="dp=2,tp=2", cwd=tmp_path / "c", timeout=180)[0]
    assert len(_epochs(before)) == 4 and "epoch 4: val accuracy 0.8" in _epochs(before)[-1], before[-2000:]
    assert len(_epochs(one)) == 4 and _epochs(mesh) == _epochs(one), (one[-2000:], mesh[-2000:])
    assert (tmp_path / "c" / "runs" / "migrate" / "after").is_dir()

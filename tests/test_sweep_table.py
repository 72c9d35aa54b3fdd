"""docs/hf-sweep.md's table lists exactly the causal-LM families of the installed transformers (its auto
mapping), each with a verdict per mode, so a family transformers adds fails here until `make test-sweep` is re-run
and the table regenerated (tests/sweep/table.py). One process, no launch."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from sweep import families, known, table  # noqa: E402  (tests/sweep, found through tests/ on sys.path)


def test_the_table_lists_every_installed_causal_lm_family():
    documented = table.documented()
    assert documented, f"{table.DOC} has no sweep table between {table.BEGIN} and {table.END}"
    installed = set(families.causal_lm_types())
    new, gone = sorted(installed - set(documented)), sorted(set(documented) - installed)
    assert not new and not gone, (
        f"the sweep table in {table.DOC} is not the installed transformers' causal-LM families: not in it {new}, "
        f"no longer installed {gone}; run `make test-sweep`, then `make sweep-table`"
    )
    modes = table.documented_modes()
    assert modes and set(modes) <= set(table.COLUMNS), modes
    for family, verdicts in documented.items():
        assert len(verdicts) == len(modes) and all(v in table.VERDICTS for v in verdicts), (family, verdicts)
        assert "not run" not in verdicts, (family, verdicts)
        for mode, verdict in zip(modes, verdicts):  # a failure in the docs is one of the open ones
            assert verdict != "FAIL" or (family, mode) in known.KNOWN, (family, mode, "FAIL not in known.py")


def test_table_rendering_reads_back():
    results = {
        "transformers": "x",
        "torch": "y",
        "seconds": 1.0,
        "modes": {"tp": {"tp": 2}, "dp_tp": {}, "cp": {}, "pp": {}},
        "families": {
            "a": {
                "class": "ACausalLM",
                "modes": {
                    "tp": {"verdict": "equal", "diff": 1e-16},
                    "dp_tp": {"verdict": "refused", "error": "ParallelError: no | plan\nat all"},
                    "cp": {"verdict": "float32", "diff": 2e-9},
                    "pp": {"verdict": "n/a", "error": "no base_model_pp_plan"},
                },
            },
            "b": {"class": "BCausalLM", "not_built": "Skip: composite config"},
        },
    }
    text = table.render(results)
    assert text.startswith(table.BEGIN) and text.endswith(table.END)
    assert table.documented_from(results) == {
        "a": ["equal", "refused", "float32", "n/a"],
        "b": ["not built"] * 4,
    }
    assert table.counts(results)["tp"] == {"equal": 1, "not built": 1}

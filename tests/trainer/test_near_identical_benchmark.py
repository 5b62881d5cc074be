"""benchmarks/near_identical_pairs.py at toy size: groups from the shipped base, every pair
judged by pixels and by objects, and the server's rule (either one) never offering a pair of
one picture."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "near_identical_pairs.py"


def test_the_benchmark_counts_one_picture_pairs_the_pixel_rule_lets_through(monkeypatch,
                                                                           capsys):
    spec = importlib.util.spec_from_file_location("near_identical_pairs", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["near_identical_pairs.py", "--seeds", "1",
                                      "--group-size", "4", "--prompts", "12"])
    module.main()
    summary = json.loads(capsys.readouterr().out.split("SUMMARY ", 1)[1])
    assert (summary["groups"], summary["pairs"]) == (12, 12 * 6)
    rows = {row["pixel_threshold"]: row for row in summary["thresholds"]}
    assert list(rows) == list(module.THRESHOLDS)
    skipped = [row["skipped"] for row in rows.values()]
    assert skipped == sorted(skipped)  # a higher threshold skips more
    # the server's rule skips what 1% of pixels does and every one-picture pair besides
    assert summary["server_rule_skipped"] >= rows[0.01]["skipped"]
    assert summary["server_rule_skipped"] >= summary["same_picture_share"]
    assert summary["server_rule_same_picture_share_of_offered"] == 0.0
    # which the pixel rule alone does not do (deterministic: fixed seeds, the shipped base)
    assert rows[0.01]["same_picture_share_of_offered"] > 0.0

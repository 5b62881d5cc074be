"""benchmarks/text_encoders.py at toy size on the CPU: the three placements run on the same
encoders, the host-resident ones end at their host copy, and the JSON holds what the H200
table in docs/benchmarks.md reads."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_the_benchmark_times_the_three_placements_and_writes_them(tmp_path):
    bench = load_benchmark("text_encoders")
    out = tmp_path / "encoders.json"
    result = bench.main(["--tiny", "--device", "cpu", "--repeats", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["card"] == "cpu" and saved["encoder_parameters"] > 0 and saved["batch"] == 4
    for placement in ("to_and_back", "host_resident", "resident_on_gpu"):
        assert len(saved[placement]["all_s"]) == 2 and saved[placement]["median_s"] > 0
    assert saved["returned_to_host_copy"] is True
    assert saved["saved_s_per_visit"] == (saved["to_and_back"]["median_s"]
                                          - saved["host_resident"]["median_s"])

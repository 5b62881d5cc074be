"""The humans-in-the-loop benchmark scripts run and measure what they say (tiny sizes)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.shapes.world import BACKGROUND, COLORS

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import does: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_measure_flags_a_filled_canvas():
    measure = _load("hitl_simulated").measure
    prompts = ["one red square", "one red square"]
    blank = np.full((2, 32, 32, 3), BACKGROUND, np.uint8)
    filled = np.full((2, 32, 32, 3), COLORS["red"], np.uint8)
    one_object = blank.copy()
    one_object[:, 4:12, 4:12] = COLORS["red"]
    assert measure(blank, prompts, "size") == {"attr": 0.0, "count": 0.5, "foreground": 0.0,
                                                     "filled": 0.0}
    assert measure(filled, prompts, "size")["filled"] == 1.0
    row = measure(one_object, prompts, "size")
    assert row["foreground"] == round(64 / 1024, 3) and row["filled"] == 0.0 and row["count"] == 1.0
    assert row["attr"] > 0 and measure(filled, prompts, "size")["attr"] == 0.0  # a flood, no object


def test_overoptimisation_probe_runs_and_reports_the_kl():
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "hitl_overoptimisation.py"), "--device", "cpu",
         "--votes", "40", "--epochs", "1", "--ensemble", "1", "--iterations", "2", "--every", "1",
         "--kl-coefficients", "0", "10"],
        capture_output=True, text=True, timeout=600, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    trained = {(r["kl"], r["iteration"]): r for r in rows if r.get("iteration")}
    assert set(trained) == {(0.0, 1), (0.0, 2), (10.0, 1), (10.0, 2)}
    assert trained[(0.0, 2)]["kl_to_reference"] is None
    assert trained[(10.0, 2)]["kl_to_reference"] > 0
    assert all(0.0 <= r["foreground"] <= 1.0 for r in trained.values())


# 4-8 minutes beside `make test`'s other processes; up to twice that on a loaded box
@pytest.mark.timeout(1800)
def test_the_default_learner_reaches_the_accuracy_target_from_1000_noisy_votes():
    """Issue 19's target, on one preference and seed as a guard (the benchmark's table has the
    mean over seeds and preferences): the default preference learner fitted on 1,000 random
    within-prompt votes of the shipped base, 10% flipped, judges held-out pairs as the clean
    preference does at least 85% of the time (0.897 when written: 2026-12-06), and its
    probabilities beat a coin's log-loss. Its fit time is the benchmark's to report."""
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "hitl_simulated.py"), "--device", "cpu",
         "--preferences", "upper", "--budgets", "1000", "--selections", "random",
         "--iterations", "0", "--seeds", "0", "--pool-seeds", "4"],
        capture_output=True, text=True, timeout=1200, check=True,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    fitted = next(r for r in rows if r.get("votes") == 1000 and r.get("selection") == "random")
    assert fitted["clean"] >= 0.85, fitted
    assert fitted["log_loss_clean"] < 0.5, fitted  # a coin's is 0.693


def test_hitl_simulated_refuses_a_train_budget_it_never_fits():
    """The preference runs train on the model fitted at --train-budget; one that is not among
    --budgets is never fitted, and every preference run was skipped without a word."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "hitl_simulated.py"), "--device", "cpu",
         "--budgets", "20", "--iterations", "1"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr
    assert "--train-budget 1000 must be one of --budgets [20], or 0 to train count alone" \
        in done.stderr
    assert done.stdout == ""  # refused before any sampling or fitting


def test_test_size_probe_passes_a_paired_rise_and_fails_a_count_drop(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports hitl_simulated, as a script does
    paired_result = _load("hitl_test_size").paired_result
    prompts = ["one red square"] * 4
    base = np.full((4, 32, 32, 3), BACKGROUND, np.uint8)
    raised = base.copy()
    for i, top in enumerate((20, 22, 20, 22)):  # low squares, then the same squares higher up
        base[i, top:top + 8, 4:12] = COLORS["red"]
        raised[i, top - 12 - i:top - 4 - i, 4:12] = COLORS["red"]
    row = paired_result(base, raised, prompts, "upper")
    assert row["attr_moved"] > 0 and row["standard_errors"] > 2 and row["passes"], row
    assert row["count"] == row["base_count"] == 1.0
    lowered = paired_result(raised, base, prompts, "upper")
    assert lowered["attr_moved"] < 0 and not lowered["passes"], lowered
    doubled = raised.copy()
    doubled[:, 0:6, 22:28] = COLORS["red"]  # higher still, but two squares for "one"
    row = paired_result(base, doubled, prompts, "upper")
    assert row["attr_moved"] > 0 and row["count"] < row["base_count"] - 0.02
    assert not row["passes"], row


def test_active_picks_rank_pairs_by_the_margin_or_by_the_members_disagreement():
    """The acquisitions of hitl_simulated: `active` takes the pair of the smallest mean
    margin, `active-disagreement` the pair whose margin the ensemble's members dispute most,
    `active-decisive` the smallest margin outside the band of the margins voted a tie."""
    hitl = _load("hitl_simulated")
    pool = np.zeros((1, 3, 32, 32, 3), np.uint8)
    pool[..., :] = BACKGROUND
    picks = {}
    for kind, acquisition in hitl.ACQUISITIONS.items():
        # blank images are all nearly identical: kept here to compare the acquisitions alone
        campaign = hitl.Campaign("left", seed=0, tie_band=0.05, acquisition=acquisition,
                                 skip_near_identical=False)
        campaign.set_pool(pool, ["one red square"], None)
        # three members' scores of the group's three images: images 0 and 1 tie on the mean
        # (margin 0) with members that agree; 0 and 2 differ on the mean, and the members
        # dispute their order
        campaign.members = np.array([[[0.0, 0.0, 2.0]], [[0.0, 0.0, -1.0]], [[0.0, 0.0, 0.5]]])
        campaign.scores = campaign.members.mean(0)
        campaign.count[:] = 1.0  # no pair where the count reward and the model disagree
        picks[kind] = campaign._active_pick()
    # the tie-aware pick is the margin's until enough ties were voted ...
    assert picks == {"active": (0, 0, 1), "active-disagreement": (0, 0, 2),
                     "active-decisive": (0, 0, 1)}
    # ... then it passes over the pairs whose margin is inside the voted ties' band
    campaign.acquisition = "decisive"
    campaign.tie_pairs = [(0, 0, 1)] * hitl.MIN_TIES_FOR_BAND  # margin 0: the band is 0
    assert campaign._active_pick() == (0, 0, 2)
    campaign.tie_pairs = campaign.tie_pairs[1:]  # one tie too few: no band yet
    assert campaign._active_pick() == (0, 0, 1)


def test_campaigns_never_pair_nearly_identical_images_as_the_server_does():
    """As GET /api/votes/next: two images with under 1% of pixels apart are never a pair,
    though their equal scores make them the least-sure pair by the margin."""
    hitl = _load("hitl_simulated")
    pool = np.zeros((1, 3, 32, 32, 3), np.uint8)
    pool[..., :] = BACKGROUND
    pool[0, :, 4:10, 4:10] = COLORS["red"]  # the same square on all three
    pool[0, 1, 0, 0] = 0  # one pixel of 1,024 apart: nearly identical to image 0
    pool[0, 2, 20:26, 20:26] = COLORS["red"]  # a second square: clearly different
    assert hitl.near_identical_pairs(pool[0]).tolist() == [
        [True, True, False], [True, True, False], [False, False, True]]
    # the same square a pixel over: 12 of 1,024 pixels apart (over 1%), the same picture
    moved = pool[0].copy()
    moved[1] = BACKGROUND
    moved[1, 5:11, 4:10] = COLORS["red"]
    assert hitl.near_identical_pairs(moved)[0, 1]
    moved[1, 5:11, 4:10] = COLORS["blue"]  # recoloured: another picture
    assert not hitl.near_identical_pairs(moved)[0, 1]
    campaign = hitl.Campaign("left", seed=0, tie_band=0.05)
    campaign.set_pool(pool, ["one red square"], None)
    campaign.scores = np.array([[0.0, 0.0, 2.0]])  # (0, 1) has margin 0: least sure
    campaign.count[:] = 1.0
    assert campaign._active_pick() in {(0, 0, 2), (0, 1, 2)}
    campaign.collect(2, active=False)  # the only two pairs worth a vote
    assert campaign.used >= {(0, 0, 2), (0, 1, 2)} and len(campaign.votes) == 2


def test_pair_metrics_score_probabilities_against_the_clean_side():
    """Log-loss, ECE and Brier of hitl_simulated: a confident right predictor beats a constant
    0.5 (ln 2), which beats a confident wrong one; the tie-band pairs are left out."""
    hitl = _load("hitl_simulated")
    truth = np.array([True, False, True, False, True])
    decisive = np.array([True, True, True, True, False])  # the last is inside the tie band
    right = np.where(truth, 0.9, 0.1)
    right[4] = 0.0  # confidently wrong inside the tie band: must not count
    good = hitl.pair_metrics(right, truth, decisive)
    constant = hitl.pair_metrics(np.full(5, 0.5), truth, decisive)
    wrong = hitl.pair_metrics(1 - right, truth, decisive)
    assert good["clean"] == 1.0 and good["clean_all"] == 0.8 and wrong["clean"] == 0.0
    assert good["log_loss_clean"] == round(-np.log(0.9), 4)
    assert constant["log_loss_clean"] == constant["log_loss_noisy"] == round(np.log(2), 4)
    assert good["log_loss_clean"] < constant["log_loss_clean"] < wrong["log_loss_clean"]
    # against 10%-flipped votes: 0.9 (-ln 0.9) + 0.1 (-ln 0.1), worse than clean
    assert good["log_loss_noisy"] == round(-0.9 * np.log(0.9) - 0.1 * np.log(0.1), 4)
    # all right at confidence 0.9: ECE 0.1; all wrong at 0.9: 0.9; the constant is always
    # scored as picking b (p > 0.5 picks a), right half the time at confidence 0.5: 0
    assert np.isclose(good["ece_clean"], 0.1) and np.isclose(wrong["ece_clean"], 0.9)
    assert constant["ece_clean"] == 0.0
    assert good["brier_clean"] == 0.01 and constant["brier_clean"] == 0.25
    assert wrong["brier_clean"] == 0.81
    # ECE weights the bins by count: 3 pairs right at 0.95, 1 wrong at 0.65
    p = np.array([0.95, 0.05, 0.95, 0.35])
    ece = hitl.expected_calibration_error(p, np.array([True, False, True, True]))
    assert np.isclose(ece, 0.75 * 0.05 + 0.25 * 0.65)


def test_a_tiny_fit_reports_log_loss_and_calibration_on_the_held_out_pairs():
    """run_selection on hand-drawn groups (one red square at random places), `upper`, 200
    votes, a small CPU fit: the row carries the new metrics, finite and in range, and a model
    that learned the preference has a log-loss under a constant 0.5's ln 2."""
    hitl = _load("hitl_simulated")
    from trainer.rewards.preference import FitConfig

    def groups(n: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        out = np.empty((n, 8, 32, 32, 3), np.uint8)
        out[:] = BACKGROUND
        for gi in range(n):
            for i in range(8):
                top, left = rng.integers(0, 25, size=2)
                out[gi, i, top:top + 8, left:left + 8] = COLORS["red"]
        return out

    prompt = "one red square"
    test = hitl.test_pairs(groups(6, 1), [prompt] * 6, "upper", 0.05)
    rows, models, _ = hitl.run_selection(
        "random", "upper", groups(20, 0), [prompt] * 20, test, [200],
        FitConfig(epochs=10, ensemble=1, device="cpu", seed=0), 0, 0.05)
    row = rows[200]
    assert set(hitl.MEAN_KEYS) <= set(row) and "report_log_loss" in row
    for key in ("log_loss_clean", "log_loss_noisy", "ece_clean", "brier_clean", "report_log_loss"):
        assert np.isfinite(row[key]), (key, row)
    assert row["log_loss_clean"] > 0 and row["log_loss_noisy"] > 0
    assert 0.0 <= row["ece_clean"] <= 1.0 and 0.0 <= row["brier_clean"] <= 1.0
    assert row["clean"] > 0.8, row  # it learned `upper` (0.95-0.99 over fit seeds 0-2)
    assert row["log_loss_clean"] < np.log(2) - 0.1, row  # 0.17-0.26 over fit seeds 0-2
    assert row["log_loss_clean"] < row["log_loss_noisy"], row  # flipped votes cost more


def test_refits_benchmark_fits_both_ways_on_the_same_votes_and_summarises():
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "hitl_refits.py"), "--device", "cpu", "--start", "40",
         "--round-votes", "20", "--rounds", "2", "--pool-seeds", "1", "--prompts", "8",
         "--preferences", "upper", "--seeds", "0", "--epochs", "2", "--ensemble", "2",
         "--warm-start-epochs", "1"],
        capture_output=True, text=True, timeout=600, check=True, cwd=BENCHMARKS).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["round"], r["votes"]) for r in rows] == [(1, 60), (2, 80)]
    for row in rows:
        for name in ("scratch", "warm"):
            assert 0.0 <= row[name]["clean"] <= 1.0 and row[name]["seconds"] > 0
    summary = json.loads(out.split("SUMMARY ", 1)[1])
    assert summary["upper"]["speedup"] > 0
    assert summary["upper"]["warm"]["clean_last_round"] == rows[-1]["warm"]["clean"]


def test_votes_to_match_random_is_the_fewest_active_votes_reaching_randoms_largest_budget():
    """Issue 19 compares the selections by the active votes needed to reach random's accuracy
    at its largest budget (3,000); the summary had only a fixed noisy-accuracy target."""
    module = _load("hitl_simulated")
    match = module.votes_to_match_random

    def curve(points):
        return {b: {"clean": acc} for b, acc in points.items()}

    random = curve({1000: 0.86, 2000: 0.88, 3000: 0.90})
    # a wobble above then below: the first budget at or above random's 3,000-vote accuracy
    assert match(curve({1000: 0.87, 1500: 0.90, 2000: 0.89, 3000: 0.93}), random) == 1500
    assert match(curve({1000: 0.85, 2000: 0.89}), random) is None  # never gets there
    assert match(curve({3000: 0.90}), random) == 3000  # equal counts as reached

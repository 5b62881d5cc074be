"""Fixtures shared by the trainer, app and worker tests, and the markers that say what each test
needs (`make check` deselects what needs a service, a browser, subprocesses or minutes)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest


def save_tiny_clip(directory: Path) -> Path:
    """A 1-layer CLIP for 32x32 images and a character-level tokenizer, in the transformers
    format (save_pretrained) that a preference fit's `clip_path` names. Random weights."""
    import torch
    import transformers  # the clip extra, which `make setup` installs

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in string.ascii_lowercase + string.digits:  # no merges: one token per character
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.CLIPTokenizer(str(directory / "vocab.json"),
                                           str(directory / "merges.txt"))
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                             crop_size={"height": 32, "width": 32})
    transformers.CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(directory)
    torch.manual_seed(0)
    layer = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2}
    config = transformers.CLIPConfig(
        text_config={**layer, "vocab_size": len(vocab), "max_position_embeddings": 40,
                     "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config={**layer, "image_size": 32, "patch_size": 4}, projection_dim=32)
    transformers.CLIPModel(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_clip_path(tmp_path_factory) -> Path:
    return save_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory) -> Path:
    """A tiny FLUX.1-dev-like diffusers directory (tests/tiny_diffusers.py; about 0.5 MB):
    copy it under a test's MODELS_DIR, where a job's model_path must lie."""
    from tiny_diffusers import write_tiny_flux

    return write_tiny_flux(tmp_path_factory.mktemp("tiny-flux") / "flux")


# -- markers (registered in pyproject.toml), applied here so that no test file has to say them:
#   postgres    needs the local PostgreSQL: the [postgres] variant of db_url (tests/app), a
#               postgres-* backend of `stack` (tests/worker), or fresh_pg_url / pg_database
#   redis       needs the local Redis: a *-redis backend of `stack`
#   worker      everything in tests/worker: real Celery worker processes (and torchrun, docker)
#   e2e, browser  everything in tests/e2e: uvicorn, a worker and chromium under Playwright
#   subprocess  spawns Python subprocesses (a CLI round trip, a benchmark script): listed below,
#               or marked in the test file beside the subprocess it starts
#   slow        takes long: marked in the test file, or listed below (from `--durations`)
# `make check` runs -m "not slow and not postgres and not redis and not worker and not e2e and
# not subprocess"; `make test` runs them all.

PG_FIXTURES = {"fresh_pg_url", "pg_database"}

# "path::function" (every parametrization of it)
SUBPROCESS = {
    "tests/app/test_auth.py::test_cli_create_user_prints_token_once_and_stores_hash",
    "tests/app/test_jobs.py::test_the_app_imports_no_worker_code",
    "tests/app/test_migrations.py::test_cli_migrate_creates_default_sqlite",
    "tests/app/test_migrations.py::test_cli_names_the_setting_to_fix_instead_of_a_traceback",
    "tests/trainer/test_cli.py::*",
    "tests/trainer/test_library.py::test_the_app_starts_without_torch",
    "tests/trainer/test_hitl_benchmarks.py::test_overoptimisation_probe_runs_and_reports_the_kl",
    # a pool sampled from the shipped base and 1,000 votes fitted: 2-4 minutes
    "tests/trainer/test_hitl_benchmarks.py::"
    "test_the_default_learner_reaches_the_accuracy_target_from_1000_noisy_votes",
    # the script's start (torch, the shapes world) before its refusal: 7-20 s
    "tests/trainer/test_hitl_benchmarks.py::test_hitl_simulated_refuses_a_train_budget_it_never_fits",
    "tests/trainer/test_hitl_benchmarks.py::"
    "test_refits_benchmark_fits_both_ways_on_the_same_votes_and_summarises",
    "tests/trainer/test_reward_server.py::test_the_command_line_serves_and_refuses_unknown_rewards",
    "tests/trainer/test_reward_models_benchmark.py::"
    "test_server_process_serves_the_same_scores_from_its_own_process",
    # two spawned gloo processes per case (ddp, fsdp): 10-15 s each
    "tests/trainer/test_gradient_sync.py::*",
}
# measured with --durations on the 2-core box (seconds, call + setup); `make check` stays < 2 min
SLOW = {
    # a 200-step Euler reference on the base model: 97
    "tests/trainer/test_solvers.py::test_dpm_solver_8_steps_is_closer_to_the_reference_than_euler_8",
    "tests/trainer/test_training.py::test_resume_equals_an_uninterrupted_run",  # 26-44 each
    "tests/trainer/test_training.py::test_kl_penalty_keeps_the_policy_near_the_base_model",  # 20
    # a tiny CLIP saved and fitted: 25
    "tests/trainer/test_preference.py::test_clip_head_learns_from_votes_round_trips_and_trains",
    "tests/app/test_fuzz.py::*",  # schemathesis: 33 on SQLite
    # every route walked, UI mounted: 36 on SQLite (test_every_route_is_classified stays fast)
    "tests/app/test_route_access.py::test_every_route",
    "tests/app/test_route_access.py::test_stored_files_with_a_token",
    "tests/app/test_route_access.py::test_session_cookie_login_and_logout",
    # preference fits (2026-12-03, the idle 2-core box: 149 s for `make check` before these
    # three, the slowest left in it)
    "tests/trainer/test_preference.py::"
    "test_a_refit_starts_from_a_compatible_model_and_otherwise_from_scratch",  # 9 fits: 25
    "tests/trainer/test_cli_fit_preference.py::test_fit_preference_from_an_exported_votes_file",
    "tests/trainer/test_hitl_benchmarks.py::"
    "test_a_tiny_fit_reports_log_loss_and_calibration_on_the_held_out_pairs",  # 13
    # 2026-12-03 again (131 s for `make check` on the idle box before these): the three
    # trackers' shared run (its module fixture trains and resumes: 11 of setup), a fit with
    # and without smoothing (8), a run with periodic evaluation (5)
    "tests/trainer/test_tracking.py::"
    "test_tensorboard_has_each_step_once_after_a_resume_and_the_sample_grids",
    "tests/trainer/test_tracking.py::test_mlflow_resume_appends_to_the_same_run",
    "tests/trainer/test_tracking.py::"
    "test_wandb_offline_runs_share_one_id_and_hold_the_history_and_images",
    "tests/trainer/test_preference.py::"
    "test_label_smoothing_pulls_the_fitted_probabilities_towards_a_half",
    "tests/trainer/test_config_fields.py::"
    "test_eval_every_logs_evaluation_metrics_without_touching_training",
    # a served app with the UI mounted and a body streamed slowly (5), a forged upload (3)
    "tests/app/test_body_limit.py::test_a_chunked_body_is_401_without_a_token_and_413_past_the_limit",
    "tests/app/test_ui_security.py::test_a_forged_file_payload_never_reaches_the_handler",
    # ten annotators voting on a served app until every pair is judged: 6 on SQLite
    "tests/app/test_concurrent_annotators.py::"
    "test_annotators_voting_at_once_each_judge_every_pair_once",
    # 2026-12-06 (108-130 s for `make check` on the idle box before these): a run with
    # periodic evaluation stopped mid-pass (5), a reward server whose client left (4), a
    # refused upload type through the served UI (4)
    "tests/trainer/test_training.py::"
    "test_a_stop_request_ends_the_periodic_evaluation_pass_at_a_solver_step",
    "tests/trainer/test_reward_server.py::test_a_request_whose_client_left_stops_at_its_next_chunk",
    "tests/app/test_ui_security.py::test_a_file_of_a_refused_type_is_deleted_too",
    "tests/trainer/test_hitl_benchmarks.py::"
    "test_the_default_learner_reaches_the_accuracy_target_from_1000_noisy_votes",
    # 2026-12-06 later (123-134 s for `make check` before these): a FLUX evaluate job with
    # its base (5; the shapes one stays), a cross-origin request to the served UI (4), two
    # sampling jobs scored through a reward server (4 and 3)
    "tests/app/test_evaluate_base.py::"
    "test_a_flux_base_is_its_model_directory_at_the_checkpoints_resolution",
    "tests/app/test_ui_security.py::"
    "test_a_request_from_another_origin_is_refused_and_gets_no_cors_answer",
    "tests/app/test_reward_server_jobs.py::"
    "test_sampling_jobs_scored_on_a_reward_server_store_what_in_process_scoring_does",
    "tests/app/test_reward_server_jobs.py::"
    "test_a_sampling_job_cancelled_while_the_server_scores_stops_within_seconds",
}


# parametrizations `make check` leaves to `make test`: of the four tiny diffusers variants it
# keeps one per family (flux_dev, sd3); schnell and SD3.5 differ from them in a branch or two
# (no guidance embedding; qk norm and a second image attention) and cost 11 s of its time
SLOW_PARAMS = {"tests/trainer/test_real_models.py": {"flux_schnell", "sd35"}}


# The longest tests of `make test` (seconds, each parametrization, measured with --durations in
# its three pytest-xdist processes on the 2-core box, 2026-12-07): started first, so that they
# run beside the many short ones instead of after them. In the order pytest collects them they
# came last, and the suite's final 8 of its 31 minutes ran one test on one core.
LONGEST = {
    "tests/trainer/test_hitl_benchmarks.py::"
    "test_the_default_learner_reaches_the_accuracy_target_from_1000_noisy_votes": 457,
    "tests/worker/test_worker_hitl.py::test_votes_fit_active_selection_and_blended_training": 434,
    "tests/trainer/test_real_models.py::test_compiled_blocks_match_eager_and_train": 233,
    "tests/trainer/test_shapes_benchmark.py::"
    "test_the_shapes_benchmark_runs_every_method_from_one_base_and_counts_their_passes": 206,
    "tests/trainer/test_training.py::"
    "test_short_cpu_run_raises_reward_while_shuffled_control_does_not": 109,
    "tests/trainer/test_flux_ddp_scaling_benchmark.py::"
    "test_full_fine_tuning_sharded_and_compiled_trains_like_eager": 108,
    "tests/trainer/test_hitl_benchmarks.py::test_overoptimisation_probe_runs_and_reports_the_kl": 90,
    "tests/trainer/test_cli.py::test_evaluate_reports_accuracy_on_48x20": 90,
    "tests/trainer/test_preference.py::test_default_fit_learns_a_left_right_preference": 83,
    "tests/worker/test_worker_serve.py::test_serve_starts_everything_and_ctrl_c_stops_it": 77,
    "tests/trainer/test_preference.py::test_fit_learns_an_unknown_preference_and_round_trips": 74,
    "tests/trainer/test_solvers.py::"
    "test_dpm_solver_8_steps_is_closer_to_the_reference_than_euler_8": 67,
}


def _listed(table: set[str], path: str, name: str) -> bool:
    return f"{path}::{name}" in table or f"{path}::*" in table


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parent.parent
    seconds: dict[str, int] = {}  # LONGEST's figure of each item listed there, by nodeid
    for item in items:
        try:
            path = item.path.resolve().relative_to(root).as_posix()
        except ValueError:
            continue
        name = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
        seconds[item.nodeid] = LONGEST.get(f"{path}::{name}", 0)
        params = getattr(item, "callspec", None)
        values = [str(v) for v in params.params.values()] if params else []
        backend = " ".join(v for v in values if v.startswith(("sqlite", "postgres")))
        if "postgres" in backend or PG_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.postgres)
        if "redis" in backend:
            item.add_marker(pytest.mark.redis)
        if path.startswith("tests/worker/"):
            item.add_marker(pytest.mark.worker)
        elif path.startswith("tests/e2e/"):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.browser)
        if _listed(SUBPROCESS, path, name):
            item.add_marker(pytest.mark.subprocess)
        if _listed(SLOW, path, name) or SLOW_PARAMS.get(path, set()) & set(values):
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):  # a pytest-xdist process (`make check` selects none)
        # LONGEST's tests first, longest first: `make test`'s `--dist load` deals the front of
        # the list out one test per process in turn (a stable sort: the rest keep their order)
        items.sort(key=lambda item: -seconds.get(item.nodeid, 0))


def pytest_configure(config):
    """transformers and diffusers give their loggers a StreamHandler bound to the sys.stderr of
    the moment they are first imported. Imported first inside a test that captures output
    (capsys), that is the test's capture stream, closed when the test ends: each later warning
    in the process then printed "--- Logging error --- ValueError: I/O operation on closed
    file" into whichever test was capturing, and a test reading its stderr line by line failed
    (two of tests/trainer/test_cli.py, when pytest-xdist gave one process a capsys test that
    imported transformers first). Bound here, before any test: to pytest's own capture, which
    lasts the session. Not in pytest-xdist's controlling process, which runs no test (the
    import is 3-4 s that every worker waited for)."""
    if config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput"):
        return
    import diffusers.utils.logging
    import transformers.utils.logging

    transformers.utils.logging.get_logger("transformers")
    diffusers.utils.logging.get_logger("diffusers")

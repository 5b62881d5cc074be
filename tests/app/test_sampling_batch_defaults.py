"""A rollout or evaluate job of a FLUX / SD3 model that leaves batch_size at 0 ("all at once",
what the leaderboard's button and the API's default send) is given a batch size at submission:
at 512 px, 256 evaluate images or 16 prompts x G solved and decoded in one batch would not fit a
card. It takes the rollout_batch_size of its checkpoints' runs (the train job's config, as
"send to arena" does, else the run config a job-less checkpoint carries), else the model's
preset's; a batch size given is kept, and the shapes model keeps 0. The stored config says what
ran. Checkpoints are real tiny-FLUX LoRAs saved by the trainer (tests/tiny_diffusers.py)."""

from __future__ import annotations

# a real model trains on prompts it is given (the shapes prompts are the shapes model's)
FLUX = {"model": "flux", "model_path": "tiny-flux", "prompts": ["a red apple", "a blue car"],
        "finetune": "lora", "lora_rank": 4,
        "resolution": 32, "reward_weights": {"jpeg_compressibility": 1.0}, "device": "cpu"}


def _saved_checkpoint(session, models, name: str, rollout_batch_size: int,
                      job_id: int | None = None) -> int:
    """A LoRA checkpoint of an untrained run with that rollout_batch_size, recorded."""
    from app.services import storage
    from app.services.checkpoints import record_checkpoint
    from trainer import PRESETS, TrainConfig, Trainer
    from trainer.models import checkpoint_weights_file

    config = TrainConfig.from_dict({**PRESETS["tiny"], **FLUX, "rollout_batch_size":
                                    rollout_batch_size, "model_path": str(models / "tiny-flux")})
    directory = Trainer(config).save_checkpoint(storage.storage_root() / "checkpoints" / name)
    return record_checkpoint(session, job_id, 0, str(checkpoint_weights_file(directory)),
                             name=name)


def test_real_model_sampling_jobs_batch_as_their_runs_did(settings, session, models):
    from app.services import datasets, jobs
    from trainer.config import PRESETS

    dataset = datasets.import_dataset(session, filename="p.txt",
                                      data=b"a red apple\none red circle\n").dataset.id
    # checkpoints recorded without a job: their own run config says
    five = _saved_checkpoint(session, models, "five", 5)
    two = _saved_checkpoint(session, models, "two", 2)
    everything = _saved_checkpoint(session, models, "all-at-once", 0)
    # a train job's checkpoint: the job's config says (as send_to_arena reads it)
    train = jobs.create_job(session, "train", {**FLUX, "rollout_batch_size": 7}, preset="tiny")
    seven = _saved_checkpoint(session, models, "seven", 5, job_id=train.id)
    session.commit()

    def batch(kind: str, config: dict) -> int:
        if kind == "evaluate":  # flux is evaluated on prompts it is given
            config = {"prompts": ["a red apple"], **config}
        return jobs.create_job(session, kind, config).config["batch_size"]

    assert batch("evaluate", {"checkpoint_ids": [five]}) == 5
    assert batch("evaluate", {"checkpoint_ids": [seven]}) == 7
    # several runs: the smallest, which every one of them fitted
    assert batch("evaluate", {"checkpoint_ids": [five, two, seven]}) == 2
    assert batch("rollout", {"dataset_id": dataset, "checkpoint_id": five, "split": "all"}) == 5
    # no run says (it solved all at once, or the base model): the model's preset's
    preset = PRESETS["flux-lora"]["rollout_batch_size"]
    assert batch("evaluate", {"checkpoint_ids": [everything]}) == preset
    assert batch("evaluate", {"checkpoint_ids": [everything, five]}) == 5
    assert batch("rollout", {"dataset_id": dataset, "model": "flux",
                             "model_path": "tiny-flux", "split": "all"}) == preset
    # a batch size given is the user's
    assert batch("evaluate", {"checkpoint_ids": [five], "batch_size": 1}) == 1
    assert batch("evaluate", {"checkpoint_ids": [everything], "batch_size": 300}) == 300


def test_shapes_sampling_jobs_keep_all_at_once(settings, session):
    from app.services import jobs, storage
    from app.services.checkpoints import record_checkpoint
    from trainer.models import SHAPES_BASE

    storage.write_bytes("checkpoints/shapes/model.safetensors", SHAPES_BASE.read_bytes())
    shapes = record_checkpoint(session, None, 0, "checkpoints/shapes/model.safetensors",
                               name="shapes")
    session.commit()
    config = jobs.create_job(session, "evaluate", {"checkpoint_ids": [shapes]}).config
    assert config["model"] == "shapes" and config["batch_size"] == 0

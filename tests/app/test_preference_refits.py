"""Which stored preference model a fit_preference job starts from (worker.preference
newest_model): the newest, loaded, when the fit's settings allow it; otherwise, and when its
file is gone or unreadable, none (the fit starts from scratch instead of failing)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from app.db import session_scope
from app.services import preference as pref_svc
from app.services import storage
from trainer.rewards.preference import FitConfig, PreferencePair, fit_preference_model
from worker.preference import newest_model


def _record(version: int, model) -> None:
    path = storage.storage_root() / pref_svc.model_path(version)
    path.parent.mkdir(parents=True, exist_ok=True)
    if model is not None:
        model.save(path)
    else:
        path.write_bytes(b"not a safetensors file")
    with session_scope() as s:
        pref_svc.record_model(s, version=version, path=pref_svc.model_path(version), report={})


def test_a_fit_starts_from_the_newest_model_when_it_can(settings):
    config = FitConfig(epochs=1, ensemble=1, warm_start_epochs=2)
    assert newest_model(config) is None  # no model yet
    rng = np.random.default_rng(0)
    pairs = [PreferencePair(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
                            rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
                            "one red circle", "a" if i % 2 else "b", key=str(i))
             for i in range(12)]
    model = fit_preference_model(pairs, config, version=1)
    _record(1, model)
    loaded = newest_model(config)
    assert loaded is not None and loaded.report.version == 1
    assert newest_model(replace(config, seed=1)) is None  # other held-out votes
    assert newest_model(replace(config, warm_start_epochs=0)) is None  # asked for scratch
    _record(2, None)  # the newest file does not load: from scratch, not a failed fit
    assert newest_model(config) is None
    (storage.storage_root() / pref_svc.model_path(2)).unlink()
    assert newest_model(config) is None

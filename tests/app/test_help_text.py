"""Every config field has help text (the style rule: "every config field has help text and
is read somewhere"): the job kinds' pydantic configs, the server's Settings and the trainer's
preference FitConfig. No database: these read the models alone."""

from __future__ import annotations

import dataclasses

import pytest

from app.config import Settings
from app.job_kinds import KINDS
from trainer.rewards.preference import FitConfig

CONFIG_FIELDS = [(kind.name, name, info) for kind in KINDS.values() if kind.config is not None
                 for name, info in kind.config.model_fields.items()]


def test_every_non_train_kind_has_a_config_model():
    # the parametrised test below would pass on nothing if the registry lost its models
    assert {name for name, kind in KINDS.items() if kind.config is not None} >= {
        "rollout", "evaluate", "fit_preference"}


@pytest.mark.parametrize(("kind", "name", "info"), CONFIG_FIELDS,
                         ids=[f"{kind}.{name}" for kind, name, _ in CONFIG_FIELDS])
def test_job_config_field_has_a_description(kind, name, info):
    assert info.description and info.description.strip(), f"{kind} config field {name!r}"


@pytest.mark.parametrize("name", list(Settings.model_fields))
def test_setting_has_a_description_naming_its_variable(name):
    description = Settings.model_fields[name].description
    assert description and description.strip(), f"setting {name!r}"
    # the environment variable, as an operator sets it
    assert description.startswith(f"{name.upper()}:"), f"setting {name!r}: {description!r}"


@pytest.mark.parametrize("field", dataclasses.fields(FitConfig), ids=lambda f: f.name)
def test_fit_config_field_has_help(field):
    help_text = field.metadata.get("help")
    assert isinstance(help_text, str) and help_text.strip(), f"FitConfig field {field.name!r}"


def test_help_text_is_in_the_config_schema():
    # what GET /api/jobs/config-schema and the OpenAPI document show beside each field
    for kind in KINDS.values():
        if kind.config is None:
            continue
        properties = kind.config.model_json_schema()["properties"]
        for name in kind.config.model_fields:
            assert properties[name].get("description"), f"{kind.name}.{name}"

"""Every list of policies is read from the registry: a scorer registered in ``POLICIES`` (nothing else edited)
shows up in the commands' help and in the study's preset cells, under its own label."""

import pytest

from dmc_train.evaluation import study
from dmc_train.policies import POLICIES, Scorer
from launch import downstream, generate


class Oldest(Scorer):
    """Every entry scores the same, so the oldest goes first (the keep rule's tie break)."""

    name = "oldest"
    label = "Oldest first"


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(POLICIES, Oldest.name, Oldest)


def _help(parse_args, capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


@pytest.mark.parametrize("command", [generate, downstream], ids=["generate", "downstream"])
def test_the_cache_help_lists_every_registered_policy(registered, command, capsys):
    text = _help(command.parse_args, capsys)
    assert all(name in text for name in POLICIES) and "oldest" in text


def test_the_full_study_runs_every_registered_policy_under_its_label(registered):
    cells = {c.name: c for c in study.presets()["full"].cells}
    for name, scorer in POLICIES.items():
        for tag in ("1of2", "1of4"):
            assert cells[f"{name}_{tag}"].cache == name and cells[f"{name}_{tag}"].method == scorer.label
    assert cells["oldest_1of4"].method == "Oldest first"


def test_a_preset_that_names_its_policies_keeps_to_them(registered):
    policies = [c.cache for c in study.presets()["quick"].cells if c.cache in POLICIES]
    assert policies == ["h2o", "streaming_llm"]


def test_every_registered_policy_has_a_label_of_its_own():
    labels = [scorer.label for scorer in POLICIES.values()]
    assert Scorer.label not in labels and len(set(labels)) == len(labels)

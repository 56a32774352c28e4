"""FLASHINFER_EP_REQUIRE_GPU=1 turns missing-environment skips into failures."""

from __future__ import annotations

import pytest

from tests import environment_gate


def test_missing_environment_skips_by_default(monkeypatch):
    monkeypatch.delenv(environment_gate.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs a GPU"):
        environment_gate.missing("needs a GPU")


@pytest.mark.parametrize("value", ["1", "true"])
def test_missing_environment_fails_in_require_mode(monkeypatch, value):
    monkeypatch.setenv(environment_gate.REQUIRE_ENV, value)
    with pytest.raises(pytest.fail.Exception, match="needs a GPU .*REQUIRE_GPU=1"):
        environment_gate.missing("needs a GPU")


def test_collection_marks_follow_the_mode(monkeypatch):
    class Item:
        def __init__(self):
            self.markers = []

        def add_marker(self, m):
            self.markers.append(m)

        def get_closest_marker(self, name):
            return next((m.mark for m in self.markers if m.mark.name == name), None)

    monkeypatch.delenv(environment_gate.REQUIRE_ENV, raising=False)
    item = Item()
    environment_gate.mark_missing(item, "no GPU")
    assert [m.mark.name for m in item.markers] == ["skip"]
    environment_gate.fail_if_marked(item)  # nothing to fail

    monkeypatch.setenv(environment_gate.REQUIRE_ENV, "1")
    item = Item()
    environment_gate.mark_missing(item, "no GPU")
    with pytest.raises(pytest.fail.Exception, match="no GPU"):
        environment_gate.fail_if_marked(item)

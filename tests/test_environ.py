import os

import pytest

from zoo.core.environ import environ_restored


def test_variables_set_changed_or_removed_in_the_block_are_put_back_even_on_error(monkeypatch):
    monkeypatch.setenv("ZOO_T_KEPT", "before")
    monkeypatch.setenv("ZOO_T_REMOVED", "there")
    monkeypatch.delenv("ZOO_T_ADDED", raising=False)
    with pytest.raises(RuntimeError), environ_restored(["ZOO_T_KEPT", "ZOO_T_REMOVED", "ZOO_T_ADDED"]):
        os.environ["ZOO_T_KEPT"] = "changed"
        del os.environ["ZOO_T_REMOVED"]
        os.environ["ZOO_T_ADDED"] = "new"
        raise RuntimeError("the block fails")
    assert os.environ["ZOO_T_KEPT"] == "before" and os.environ["ZOO_T_REMOVED"] == "there"
    assert "ZOO_T_ADDED" not in os.environ

"""The method table (config.METHOD_TABLE): every method has one row, and what reads it finds
what the row names."""

from speculant.config import AUTO, METHOD_TABLE, METHODS, method_reading
from speculant.drafters import factory
from speculant.heads import HEAD_KINDS


def test_every_method_but_auto_has_one_row_and_a_drafter_builder():
    assert METHODS == (AUTO, *METHOD_TABLE) and AUTO not in METHOD_TABLE
    assert all(name == m.name for name, m in METHOD_TABLE.items())
    assert {m.drafter for m in METHOD_TABLE.values()} == set(factory._BUILDERS)


def test_the_rows_say_what_each_method_needs():
    needs_draft = {m.name for m in METHOD_TABLE.values() if m.needs_draft}
    reads = {m.name: m.heads for m in METHOD_TABLE.values() if m.heads is not None}
    trees = {m.name for m in METHOD_TABLE.values() if m.tree_from_heads}
    assert needs_draft == {"sd", "mcsd"} and trees == {"medusa", "hydra", "eagle"}
    assert reads == {"medusa": "medusa", "hydra": "sequential", "eagle": "eagle", "bpd": "medusa"}
    assert set(reads.values()) == {*HEAD_KINDS, "eagle"} and all(METHOD_TABLE[m].missing_heads for m in reads)
    assert [m.name for m in METHOD_TABLE.values() if not m.drafts] == ["ar"]
    assert (method_reading("medusa"), method_reading("sequential"), method_reading("eagle")) == ("medusa", "hydra",
                                                                                                 "eagle")

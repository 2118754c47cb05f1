"""Drafts that learn from use: recycled predictions (drafters.recycling) and suffix matches
(drafters.suffix) give plain decoding's greedy output, alone and in a batch; the table learns
from passes, survives a restart, ignores a damaged file, and stays bounded."""

from __future__ import annotations

import pytest
import torch

from speculant.drafters.base import NoDrafter
from speculant.drafters.recycling import RecycledTable, RecyclingDrafter
from speculant.drafters.suffix import AnswerStore, SuffixAutomaton, SuffixDrafter

from helpers import decode_to_end
from tiny import tiny_llama, tiny_model_dir

PROMPT = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, scale=4.0)


def test_automaton_finds_the_longest_earlier_suffix():
    s = SuffixAutomaton()
    for t in [1, 2, 3, 1, 2, 3, 1, 2]:
        s.extend(t)
    m = s.link[s.last]
    assert s.length[m] == 5 and s.continuation(s.earlier(m), 3) == [3, 1, 2]


@pytest.mark.parametrize("make", ["suffix", "recycle", "table"])
def test_greedy_output_is_plain_decoding(target, make):
    plain = decode_to_end(target, NoDrafter(), PROMPT, 40).generated
    store, table = AnswerStore(100), RecycledTable(64, 4)
    for _ in range(3):  # the store and the table fill from the earlier generations
        d = {"suffix": lambda: SuffixDrafter(4, store), "recycle": lambda: RecyclingDrafter(table, store, gamma=4),
             "table": lambda: RecyclingDrafter(table, False)}[make]()
        state = decode_to_end(target, d, PROMPT, 40)
        d.finish(state.context)
        assert state.generated == plain
    assert state.stats.target_calls < 40  # it drafted, and the target accepted some
    assert state.stats.verified_rows >= state.stats.target_calls


def test_table_rows_from_a_hand_built_pass():
    table = RecycledTable(10, 2)
    table.update(torch.tensor([3, 4, 3]), torch.tensor([[1, 2, 0], [5, 6, 0], [7, 8, 0]]))
    assert table.rows[3].tolist() == [7, 8] and table.rows[4].tolist() == [5, 6]
    assert table.rows[0].tolist() == [-1, -1] and table.filled == 2
    paths, tokens, scores = table.grow(3, 3)
    assert paths[0] == (0,) and tokens[0] == 7 and scores == sorted(scores, reverse=True)


def test_save_load_and_a_damaged_file(tmp_path, capsys):
    path = tmp_path / "t.pt"
    table = RecycledTable(10, 2, path)
    table.update(torch.tensor([1]), torch.tensor([[2, 3]]))
    table.save()
    again = RecycledTable.load_or_new(10, 2, path)
    assert torch.equal(again.rows, table.rows)
    path.write_bytes(b"not a table")
    empty = RecycledTable.load_or_new(10, 2, path)
    assert empty.filled == 0 and "ignoring the recycled-draft table" in capsys.readouterr().err
    assert RecycledTable.load_or_new(12, 2, tmp_path / "t2.pt").filled == 0


def test_bounded_memory():
    table = RecycledTable(1000, 8)
    for _ in range(50):
        table.update(torch.randint(0, 1000, (32,)), torch.randint(0, 1000, (32, 8)))
    assert table.rows.numel() == 8000
    store = AnswerStore(200)
    for _ in range(100):
        store.add(torch.randint(0, 50, (30,)).tolist())
    assert len(store) <= 200


@pytest.mark.parametrize("method", ["suffix", "recycle"])
def test_methods_through_the_api_alone_and_batched(tmp_path, method):
    from speculant.api import SpeculativeDecoder

    d = tiny_model_dir(tmp_path / "t")
    prompts = ["w1 w2 w3 w1 w2", "w4 w5 w4 w5 w4"]
    plain = SpeculativeDecoder(d, method="ar", dtype="float32")
    dec = SpeculativeDecoder(d, method=method, dtype="float32")
    want = [plain.generate(p, 24).token_ids for p in prompts]
    assert [dec.generate(p, 24).token_ids for p in prompts] == want
    assert [r.token_ids for r in dec.generate_batch(prompts, 24)] == want

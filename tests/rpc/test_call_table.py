"""The calls in flight by call id (rpc._call_table.CallTable): a dict of
call ids as far as its users see, whatever the order of adds and removes,
the table's growth and shrinking, and ids chosen by a hostile peer."""

from __future__ import annotations

import gc
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorwire.rpc._call_table import CallTable

_IDS = st.one_of(
    st.integers(1, 200),  # ids that come back: replaced, removed twice
    st.integers(1, 2**64 - 1),
)
_OPS = st.lists(st.tuples(st.sampled_from(["put", "pop", "get", "del"]), _IDS), max_size=400)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_any_sequence_of_operations_matches_a_dict(ops: list[tuple[str, int]]) -> None:
    table: CallTable[object] = CallTable()
    oracle: dict[int, object] = {}
    for step, (op, call_id) in enumerate(ops):
        if op == "put":
            table[call_id] = oracle[call_id] = ("waiter", step)
        elif op == "pop":
            assert table.pop(call_id, "none") == oracle.pop(call_id, "none")
        elif op == "get":
            assert table.get(call_id) == oracle.get(call_id)
            assert (call_id in table) == (call_id in oracle)
        elif call_id in oracle:
            del table[call_id]
            del oracle[call_id]
        else:
            with pytest.raises(KeyError):
                del table[call_id]
        assert len(table) == len(oracle)
    assert sorted(table.items()) == sorted(oracle.items())
    assert sorted(table.keys()) == sorted(oracle)
    assert sorted(map(repr, table.values())) == sorted(map(repr, oracle.values()))


def test_grows_and_shrinks_keeping_every_call() -> None:
    table: CallTable[int] = CallTable()
    for call_id in range(1, 10_001):
        table[call_id] = -call_id
    assert len(table) == 10_000
    assert all(table[call_id] == -call_id for call_id in range(1, 10_001))
    # Most calls end; those left are all still found after the shrinking.
    for call_id in range(1, 10_001):
        if call_id % 97:
            assert table.pop(call_id) == -call_id
    left = [call_id for call_id in range(1, 10_001) if call_id % 97 == 0]
    assert sorted(table) == left
    assert all(table.get(call_id) == -call_id for call_id in left)
    assert table.get(1) is None and 1 not in table
    table.clear()
    assert len(table) == 0 and not table and table.items() == []


def test_what_is_no_call_id_is_refused_or_absent() -> None:
    table: CallTable[str] = CallTable()
    with pytest.raises(ValueError, match="call id 0"):
        table[0] = "zero"
    with pytest.raises(OverflowError):
        table[2**64] = "too large"
    with pytest.raises(OverflowError):
        table[-1] = "negative"
    for absent in (0, -1, 2**64, "1", 1.0, None):
        assert absent not in table
        assert table.get(absent, "default") == "default"
        assert table.pop(absent, "default") == "default"
    with pytest.raises(KeyError):
        table[5]
    assert len(table) == 0


def test_hostile_call_ids_do_not_make_lookups_scan() -> None:
    """A server's call ids come from its client. Ids that all land in one
    place of a table indexed by their low or their high bits are spread by
    the table's salted hash."""
    low_bits_equal = [(n << 20) | 5 for n in range(1, 2049)]
    high_bits_equal = [(5 << 52) | n for n in range(1, 2049)]
    strided = [n * 2**40 for n in range(1, 2049)]
    for ids in (low_bits_equal, high_bits_equal, strided):
        table: CallTable[int] = CallTable()
        for call_id in ids:
            table[call_id] = call_id
        # 2048 entries: with the ids clustered, a run would be 2048 long.
        assert table.longest_run() < 40, table.longest_run()
        assert all(table[call_id] == call_id for call_id in ids)
    # The hash is keyed by each table's own salt: a peer that learns where
    # ids land in one table learns nothing of another (keys() lists the
    # ids in slot order).
    first: CallTable[int] = CallTable()
    second: CallTable[int] = CallTable()
    for call_id in range(1, 65):
        first[call_id] = second[call_id] = call_id
    assert first.keys() != second.keys()
    assert sorted(first.keys()) == sorted(second.keys())


def test_a_cycle_through_the_table_is_collected() -> None:
    """The values are visible to the garbage collector, as a dict's are: a
    waiter that holds the table (as a call holds its session) is freed."""

    class Waiter:
        table: CallTable[Waiter]

    table: CallTable[Waiter] = CallTable()
    waiter = Waiter()
    waiter.table = table
    table[7] = waiter
    gone = weakref.ref(waiter)
    del table, waiter
    gc.collect()
    assert gone() is None

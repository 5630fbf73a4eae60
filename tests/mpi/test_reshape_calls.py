"""Misused Reshape calls on some or all ranks: the same exception everywhere, no hang, no leak (one mpiexec run)."""

from __future__ import annotations

import pytest

from tests.mpirun import json_lines, run_cases

pytestmark = pytest.mark.mpi

# case -> a piece (or pieces) of the message every rank must raise (cases expecting "none" check results against
# NumPy)
MESSAGES = {
    "plan() fails on one rank (the MPI engine plans locally)": "rank 1: no memory (injected)",
    "execute() cannot allocate its result on one rank": "rank 1: no memory (injected)",
    "the conforming copy fails on one rank": "rank 1: no memory (injected)",
    "options: invalid blocking on one rank": "rank 1: blocking must be",
    "options: unknown field on one rank": "rank 1: unknown ReshapeOptions field(s) ['block']",
    "options: not options on one rank": "rank 1: options must be a ReshapeOptions or a dict",
    "options: blocking differs across ranks": "options are inconsistent across processes",
    "execute without plan() on one rank": "(which failed there: RuntimeStateError: call plan() before execute())",
    "execute after free() on one rank": ("rank 0: Reshape#", ".execute(); rank 1: Reshape#", ".free()"),
    "reset_operand after free() on one rank": ("rank 0: Reshape#", ".reset_operand(); rank 1: Reshape#", ".free()"),
    "allocate_symmetric_memory on one rank, reshape on the others":
        "rank 0: Reshape(); rank 1: allocate_symmetric_memory()",
    "execute() of different Reshape objects": "every rank must make the same collective calls, on the same objects",
    "free_symmetric_memory on one rank, execute on the others": "rank 0: free_symmetric_memory(); rank 1: Reshape#",
    "finalize on one rank, execute on the others": "finalize()",
    "execute(sync_symmetric_memory=) differs across ranks":
        ("execute() with different sync_symmetric_memory (rank 0: True; rank 1: False", "pass the same on every"),
    "execute(sync_symmetric_memory=) has no truth value on one rank":
        "rank 1: sync_symmetric_memory must be True or False (ValueError: The truth value of an array",
    "reset_operand(None) on one rank": "rank 1: reset_operand() needs an operand",
    "plan after free() on one rank": (".plan(); rank ", ".free());", "is freed on every rank"),
    "execute after the operand's shape changed in place on one rank":
        "rank 1: the operand was changed in place to shape (4, {n}) and dtype float64",
    "execute after the operand's dtype changed in place on one rank":
        "rank 1: the operand was changed in place to shape ({n}, 4) and dtype int64; the plan needs",
    "execute after the operand's strides changed in place on one rank":
        "rank 1: the operand is no longer C-contiguous, as it was when planned",
    "reset_operand to a freed symmetric array on one rank": "rank 1: the operand was freed",
    "execute after release_operand() on one rank": "rank 1: execute() cannot run after release_operand()",
    "execute after finalize()": "the runtime was finalized; create a new Reshape",
    "execute after finalize() and initialize()": "the runtime was finalized; create a new Reshape",
}


@pytest.mark.parametrize("nranks", [2, 3])
def test_misused_calls_raise_the_same_error_on_every_rank(nranks):
    result, outcomes = run_cases("bad_calls.py", nranks, timeout=180)  # hangs fail; ranks agree
    assert len(outcomes) == 45, sorted(outcomes)
    for name, outcome in outcomes.items():
        assert outcome["raised"] == outcome["expect"], (name, outcome)
        if outcome["expect"] != "none":
            assert outcome["message"].strip(), name
    for name, texts in MESSAGES.items():
        for text in texts if isinstance(texts, tuple) else (texts,):
            text = text.replace("{n}", str(4 * nranks))  # N of the program's global (N, N) array
            assert text in outcomes[name]["message"], (name, outcomes[name]["message"])
    heaps = json_lines(result, "HEAP")
    assert sorted(h["rank"] for h in heaps) == list(range(nranks))
    assert all(h["allocations"] == 0 and h["bytes"] == 0 for h in heaps), heaps

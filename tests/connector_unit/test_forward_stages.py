"""Forward capture under pipeline parallelism, without an engine: the plan and the channel.

Which stage computes which layer id (``plan_stages``), and the channel that carries a
stage's rows of each step to the writing last stage (``StageLink``, ``Pipeline.parts``):
two real processes in a real gloo group. The faults are real too: a stage that reports
it could not copy its rows, and a stage whose process is gone.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hidden_state_connector.engine.forward.stages import (
    Pipeline,
    StageLink,
    StageLinkError,
    plan_stages,
)
from hidden_state_connector.engine.forward.transfer import StepCopy

from procs import free_port, run_ranks

TWO_STAGES = [(0, 2), (2, 4)]  # a 4-layer model on two stages (vLLM's even split)


def test_each_id_goes_to_the_stage_that_computes_it() -> None:
    plan = plan_stages([0, 1, 2, 4], TWO_STAGES, 1)
    assert plan.owners == (0, 0, 0, 1) and plan.is_last
    assert plan.ids_of(0) == [0, 1, 2] and plan.columns(0) == slice(0, 3)
    assert plan.ids_of(1) == [4] and plan.columns(1) == slice(3, 4)
    assert plan.senders == [0]
    # id 3 leaves layer 2, the last stage's first layer; id 2 leaves layer 1.
    assert plan_stages([2, 3], TWO_STAGES, 0).owners == (0, 1)
    only_first = plan_stages([1, 2], TWO_STAGES, 1)
    assert only_first.senders == [0] and only_first.columns(1) == slice(0, 0)
    assert plan_stages([3, 4], TWO_STAGES, 0).senders == []  # the first stage sends nothing
    assert plan_stages([0, 4], [(0, 4)], 0).senders == []  # one stage


def _rank(rank: int, port: int, queue: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    link = StageLink([0, 1], rank, timeout_s=30)
    rows = torch.arange(3 * 5 * 4, dtype=torch.float32).view(3, 5, 4)[:, :2]  # not contiguous
    if rank == 0:  # the first stage: one step's rows, then a failure, then its process ends
        link.send(torch.tensor([7, -1, 9]), rows)
        link.send(None, None, failure="copy failed")
        queue.put((0, "sent"))
        queue.close()
        queue.join_thread()
        os._exit(0)  # gone without a goodbye, as a killed stage would be
    plan = plan_stages([0, 1, 4], TWO_STAGES, 1)
    own = StepCopy(0, torch.full((3, 1, 4), -1.0), torch.tensor([7, -1, 9]))
    failures: list[str] = []
    first = Pipeline(plan, link).parts(own, True, (4, torch.float32), failures.append)
    (cols, slots, got), (own_cols, _, _) = first
    ok = cols == slice(0, 2) and own_cols == slice(2, 3) and torch.equal(got, rows)
    ok = ok and slots.tolist() == [7, -1, 9] and failures == []
    second = Pipeline(plan, link).parts(own, True, (4, torch.float32), failures.append)
    broken = []
    for _ in range(2):  # the sender is gone: the channel is broken, now and after
        try:
            link.receive(0, 2, 4, torch.float32)
        except StageLinkError as exc:
            broken.append(str(exc))
    queue.put((1, ok, len(second), failures, broken))


def test_rows_cross_the_stages_and_a_failing_stage_fails_loudly() -> None:
    port = free_port()
    [sent, received] = run_ranks(_rank, lambda rank: (rank, port))
    assert sent == (0, "sent")
    _, ok, parts, failures, broken = received
    assert ok  # rows and slots as sent, into the sending stage's columns
    assert parts == 1  # only the writer's own rows: the first stage's failed
    assert failures == ["pipeline stage 0 could not copy this step's rows"]
    assert len(broken) == 2
    assert all("pipeline stage 0's rows channel broke" in reason for reason in broken)

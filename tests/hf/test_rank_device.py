"""Each data-parallel rank computes on its own GPU: ``ProcessGroupContext.device_index`` names it, `slide train`
builds the device there (slide_hf/setup.py ``make_device(..., index=)``), and the engine refuses a rank whose
device is another GPU than its process group's (``ProcessGroupContext.check_device``). Checked without a GPU: the GPU count is stubbed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from slide_core.collectives import SingleProcess
from slide_core.distributed import ProcessGroupContext
from slide_hf import recipe, setup
from slide_hf.errors import UserError


@pytest.mark.parametrize(
    ("local_rank", "gpus", "index"),
    [(0, 8, 0), (3, 8, 3), (7, 8, 7), (3, 1, 0), (5, 2, 1), (2, 0, 0)],
    ids=["first", "fourth", "last", "one-visible-per-rank", "two-visible", "none-visible"],
)
def test_the_rank_s_gpu_is_its_local_rank_among_the_visible_ones(monkeypatch, local_rank, gpus, index) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    group = ProcessGroupContext(local_rank, 8, local_rank, backend="nccl")
    assert group.device_index == index
    assert ProcessGroupContext(local_rank, 8, local_rank, backend="gloo").device_index == 0


def test_the_engine_refuses_a_rank_on_another_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    group = ProcessGroupContext(1, 8, 1, backend="nccl")
    group._open = True  # as if its groups were made: the check is the engine's, before any collective
    elsewhere = SimpleNamespace(torch_device=torch.device("cuda", 0), is_accelerator=True)
    with pytest.raises(ValueError) as info:
        group.check_device(elsewhere)
    assert str(info.value) == (
        "rank 1 computes on cuda:0, but its process group uses cuda:1 (its local rank's GPU); "
        "build the device with index=group.device_index"
    )
    group.check_device(SimpleNamespace(torch_device=torch.device("cuda", 1), is_accelerator=True))
    SingleProcess().check_device(elsewhere)  # one process runs on any device


class _IndexedDevice:
    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, index: int = 0, memory_limit_bytes: int | None = None) -> None:
        self.made.append({"index": index, "memory_limit_bytes": memory_limit_bytes})
        self.is_accelerator = True


class _UnindexedDevice:
    def __init__(self, memory_limit_bytes: int | None = None) -> None:
        self.is_accelerator = True


def _plugin(monkeypatch, device_class: type) -> None:
    monkeypatch.setattr(setup.plugins, "load", lambda group, name, expected=None: device_class)


def test_make_device_builds_the_plugin_on_the_rank_s_gpu(monkeypatch) -> None:
    _plugin(monkeypatch, _IndexedDevice)
    _IndexedDevice.made.clear()
    setup.make_device("cpu", 1 << 30, index=3)
    setup.make_device("cpu")
    assert _IndexedDevice.made == [
        {"index": 3, "memory_limit_bytes": 1 << 30},
        {"index": 0, "memory_limit_bytes": None},
    ]


def test_a_plugin_that_takes_no_index_is_one_line_for_a_later_rank(monkeypatch) -> None:
    _plugin(monkeypatch, _UnindexedDevice)
    setup.make_device("cpu")  # one process, or local rank 0: no index is passed
    with pytest.raises(UserError) as info:
        setup.make_device("cpu", index=2)
    assert str(info.value) == (
        "--device cpu: the cpu device plugin cannot be told which GPU to use (no index argument), which data "
        "parallel needs for local rank 2"
    )


def test_slide_train_builds_each_rank_s_device_on_its_gpu(monkeypatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(recipe, "make_device", lambda name, memory, *, index: asked.append(index))
    options = SimpleNamespace(device="cuda", gpu_memory_bytes=None)
    recipe._setup_device(options, SimpleNamespace(backend="nccl", device_index=5))
    recipe._setup_device(options, SimpleNamespace(backend="gloo", device_index=0))
    recipe._setup_device(options, SingleProcess())
    assert asked == [5, 0, 0]

"""A tiny decoder written directly against the unit interface.

It lets slide-core's engine be tested, and demonstrated, without transformers: pre-norm causal
self-attention and an MLP per block, an RMS-normed linear head with cross-entropy, optionally tied to the
embedding. Rows may be packed with several documents (position ids that restart): attention then stays
within each document. ``reference_loss`` runs the same units as one ordinary autograd graph, which is
what the engine's results are compared against.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slide_core.collectives import SingleProcess, shard_span
from slide_core.devices.cpu import CPUDevice
from slide_core.host_params import HostParameters
from slide_core.unit import ParamLayout, SlideModel, Unit, UnitRole

__all__ = [
    "PinRecordingDevice",
    "ShardedRank",
    "ToyConfig",
    "ToyModel",
    "document_mask",
    "launch_ranks",
    "load_init",
    "packed_row",
    "reference_loss",
    "toy_batches",
    "toy_init",
    "wait_ranks",
]


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 97
    hidden_size: int = 32
    num_heads: int = 4
    intermediate_size: int = 48
    num_layers: int = 3
    tie_embeddings: bool = False
    eps: float = 1e-6


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@dataclass
class ToyInputs:
    shifted_labels: torch.Tensor
    attention_mask: torch.Tensor | None = None
    """(B, 1, S, S) bool, True where a query may attend to a key; None: plain causal attention."""


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S) bool: causal attention within each document of a packed row, where a document starts
    wherever the position ids do not step by +1. Built on the ids' device, with no host read."""
    restart = torch.ones_like(position_ids, dtype=torch.bool)
    restart[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    document = restart.cumsum(-1)
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]


class ToyEmbedding(Unit):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__("embed", UnitRole.EMBEDDING, ParamLayout([("weight", (cfg.vocab_size, cfg.hidden_size))]))

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: ToyInputs) -> torch.Tensor:
        return F.embedding(x, params["weight"])


class ToyBlock(Unit):
    def __init__(self, cfg: ToyConfig, index: int) -> None:
        h, i = cfg.hidden_size, cfg.intermediate_size
        layout = ParamLayout(
            [
                ("attn_norm", (h,)),
                ("qkv", (3 * h, h)),
                ("proj", (h, h)),
                ("mlp_norm", (h,)),
                ("up", (i, h)),
                ("up_bias", (i,)),
                ("down", (h, i)),
            ]
        )
        super().__init__(f"layers.{index}", UnitRole.BLOCK, layout)
        self.cfg = cfg

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: ToyInputs) -> torch.Tensor:
        cfg = self.cfg
        batch, seq, hidden = x.shape
        heads = cfg.num_heads
        q, k, v = F.linear(_rms_norm(x, params["attn_norm"], cfg.eps), params["qkv"]).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, heads, hidden // heads).transpose(1, 2) for t in (q, k, v))
        if inputs.attention_mask is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=inputs.attention_mask)
        x = x + F.linear(attn.transpose(1, 2).reshape(batch, seq, hidden), params["proj"])
        up = F.gelu(F.linear(_rms_norm(x, params["mlp_norm"], cfg.eps), params["up"], params["up_bias"]))
        return x + F.linear(up, params["down"])


class ToyHead(Unit):
    def __init__(self, cfg: ToyConfig) -> None:
        shapes: list[tuple[str, tuple[int, ...]]] = [("norm", (cfg.hidden_size,))]
        if not cfg.tie_embeddings:
            shapes.append(("weight", (cfg.vocab_size, cfg.hidden_size)))
        super().__init__("head", UnitRole.HEAD, ParamLayout(shapes))
        if cfg.tie_embeddings:
            self.borrowed = {"weight": "weight"}
        self.cfg = cfg

    def forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor, inputs: ToyInputs) -> torch.Tensor:
        logits = F.linear(_rms_norm(x, params["norm"], self.cfg.eps), params["weight"])
        return F.cross_entropy(
            logits.flatten(0, 1).float(), inputs.shifted_labels.flatten(), ignore_index=-100, reduction="sum"
        )


class ToyModel(SlideModel):
    def __init__(self, cfg: ToyConfig) -> None:
        self.cfg = cfg
        self.embedding = ToyEmbedding(cfg)
        self.blocks = [ToyBlock(cfg, i) for i in range(cfg.num_layers)]
        self.head = ToyHead(cfg)

    def prepare_inputs(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        dtype: torch.dtype,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> ToyInputs:
        shifted = torch.full_like(labels, -100)
        shifted[:, :-1] = labels[:, 1:]
        return ToyInputs(shifted, None if position_ids is None else document_mask(position_ids))

    def init_(self, params: Mapping[str, Mapping[str, torch.Tensor]], seed: int) -> None:
        """Random init into host views (``params[unit_name][param_name]``): small normals, unit norms."""
        generator = torch.Generator().manual_seed(seed)
        for unit_params in params.values():
            for name, tensor in unit_params.items():
                if "norm" in name:
                    tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=generator))
                else:
                    tensor.copy_(0.2 * torch.randn(tensor.shape, generator=generator))


def reference_loss(
    model: ToyModel,
    params: Mapping[str, Mapping[str, torch.Tensor]],
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The summed token loss of one micro-batch as one ordinary autograd graph over ``params``."""
    inputs = model.prepare_inputs(input_ids, labels, torch.float32, position_ids=position_ids)
    x = model.embedding.forward(params[model.embedding.name], input_ids, inputs)
    for block in model.blocks:
        x = block.forward(params[block.name], x, inputs)
    head_params = dict(params[model.head.name])
    for mine, theirs in model.head.borrowed.items():
        head_params[mine] = params[model.embedding.name][theirs]
    return model.head.forward(head_params, x, inputs)


def toy_init(model: ToyModel, seed: int = 1) -> dict[str, dict[str, torch.Tensor]]:
    """Fresh random weights for ``model`` (``init[unit_name][param_name]``), as ``ToyModel.init_`` makes them."""
    init = {unit.name: {spec.name: torch.empty(spec.shape) for spec in unit.layout} for unit in model.units}
    model.init_(init, seed)
    return init


def load_init(host: HostParameters, init: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Copy ``toy_init``'s weights into the host master (in either master format)."""
    for unit in host.model.units:
        with host.editing(unit) as views:
            for name, view in views.items():
                view.copy_(init[unit.name][name])


def toy_batches(
    cfg: ToyConfig, steps: int, accum: int, *, seed: int = 0, batch: int = 2, seq: int = 12
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``steps`` optimizer steps of ``accum`` micro-batches of random ids; each micro-batch masks the first
    third of its first row (prompt-style), so token counts differ between micro-batches."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(accum):
            ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator)
            labels = ids.clone()
            labels[0, : seq // 3] = -100
            micro.append((ids, labels))
        out.append(micro)
    return out


def packed_row(documents: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row ``(input_ids, labels, position_ids)``, each (1, S), from 1-d token documents: labels
    are the tokens except -100 at every document's first token (so no document's last token learns to
    predict the next one's first), and position ids restart at 0 for every document."""
    ids = torch.cat(documents)
    labels = torch.cat([torch.cat((torch.tensor([-100]), doc[1:])) for doc in documents])
    positions = torch.cat([torch.arange(doc.numel()) for doc in documents])
    return ids[None], labels[None], positions[None]


RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun tells each process it starts (Note [One rank under torchrun] in slide_core/distributed.py)."""


def launch_ranks(
    command: Sequence[str], world_size: int, *, launched: bool = True, stdout: int = subprocess.PIPE
) -> list[subprocess.Popen[str]]:
    """Start ``command`` in ``world_size`` processes as torchrun would on this machine: each with its
    rank's variables (:data:`RANK_VARIABLES`, a free local port) and one thread for torch's CPU ops, the
    processes sharing this machine's cores. ``launched=False`` starts them without the variables (a plain
    single-process run), whatever this process's environment holds. stderr is piped as text; collect
    with :func:`wait_ranks`."""
    base = {key: value for key, value in os.environ.items() if key not in RANK_VARIABLES}
    base["OMP_NUM_THREADS"] = "1"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(world_size):
        env = dict(base)
        if launched:
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        procs.append(subprocess.Popen(list(command), env=env, stdout=stdout, stderr=subprocess.PIPE, text=True))
    return procs


def wait_ranks(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[tuple[int, str]]:
    """Each launched rank's ``(exit code, stderr)``; every rank still running after ``timeout_s`` is
    killed, so a test of several processes can fail but never hang or leave an orphan."""
    import time

    deadline = time.monotonic() + timeout_s
    finished = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            finished.append((proc.returncode, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return finished


class PinRecordingDevice(CPUDevice):
    """The CPU device, recording every host range it is asked to page-lock and to unlock (the CPU device
    itself needs neither), so tests can check what a GPU run would register."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: list[torch.Tensor] = []
        self.unpinned: list[torch.Tensor] = []

    def pin_host_range(self, tensor: torch.Tensor) -> None:
        self.pinned.append(tensor)

    def unpin_host_range(self, tensor: torch.Tensor) -> None:
        self.unpinned.append(tensor)


class ShardedRank(SingleProcess):
    """Rank ``rank`` of ``world_size`` for the shards an engine is built with, in one process: its collectives
    do nothing, so a test builds each rank's engine alone and checks what that rank holds."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size

    def span(self, numel: int) -> tuple[int, int]:
        return shard_span(numel, self.rank, self.world_size)

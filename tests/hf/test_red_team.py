"""The project's own red team: bad input of every kind, through the `slide` CLI in-process.

Every case in :data:`CASES` must end with exactly one line on stderr (no traceback), the expected exit
status, and no change to any file the user had: the whole working folder is hashed before and after, so a
half-written output, a leftover temp directory or an edited checkpoint fails the case just as a traceback
does. A run's own ``train.log``/``options.json`` and its lock file may change when a resume is refused
late; nothing else may.

The cases come in families: every numeric option of train, plan and bench with NaN, infinities, negative
and huge values; broken TOML, data, model directories (truncated, missing, ``.bin``-only, shape-mismatched,
int8, NaN weights), broken ``state.json`` fields and checkpoint files, and outputs that cannot be written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pathlib
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file

from slide_hf.cli.main import main
from slide_hf.run_files import RECORD_FILE

MAY_CHANGE = frozenset({"train.log", "options.json", ".slide.lock"})
"""A run's own log, its options as last started, and its lock: rewritten by a resume refused late."""


@dataclass(frozen=True)
class World:
    """The user's folder for one case: ``user/`` holds a model directory, a data file and a finished run
    with two checkpoints; ``tmp`` is where outputs may (and must not) appear."""

    tmp: Path

    @property
    def user(self) -> Path:
        return self.tmp / "user"

    @property
    def model(self) -> Path:
        return self.user / "model"

    @property
    def run(self) -> Path:
        return self.user / "run"

    @property
    def data(self) -> Path:
        return self.user / "data.jsonl"

    def paths(self) -> dict[str, str]:
        return {"tmp": str(self.tmp), "user": str(self.user), "model": str(self.model), "run": str(self.run)}


@dataclass(frozen=True)
class Case:
    """``argv`` with ``{tmp}``, ``{user}``, ``{model}``, ``{run}`` placeholders; ``setup`` breaks the user's
    files before they are hashed; ``during`` is a context the command runs in (a held lock, an injected
    fault); ``match`` must appear in the one stderr line."""

    name: str
    argv: tuple[str, ...]
    match: str
    code: int = 2
    setup: Callable[[World], None] | None = None
    during: Callable[[World], contextlib.AbstractContextManager] | None = field(default=None)


# ---- fixtures: one model directory and one finished run, copied into each case's folder -----------------

TINY = ("--device", "cpu", "--dtype", "float32", "--seq-len", "16", "--batch-size", "2")


@pytest.fixture(scope="module")
def originals(tmp_path_factory, torch_kernels_module) -> tuple[Path, Path]:
    """A `test-llama` directory over the byte tokenizer's vocabulary, and a 2-step run trained from it."""
    from transformers import AutoModelForCausalLM

    from slide_hf import PRESETS
    from slide_hf.tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer

    root = tmp_path_factory.mktemp("red-team")
    model = root / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(PRESETS["test-llama"](vocab_size=BYTE_VOCAB_SIZE)).save_pretrained(model)
    byte_tokenizer().save_pretrained(str(model))
    run = root / "run"
    args = ["train", "--output", str(run), "--model", str(model), *TINY, "--steps", "2", "--save-every", "1"]
    assert main(args) == 0
    return model, run


@pytest.fixture
def world(tmp_path: Path, originals: tuple[Path, Path], torch_kernels: None) -> World:
    world = World(tmp_path)
    world.user.mkdir()
    shutil.copytree(originals[0], world.model)
    shutil.copytree(originals[1], world.run)
    world.data.write_text("".join(json.dumps({"text": f"line {i} of the user's data"}) + "\n" for i in range(64)))
    return world


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` (directories too, so an empty leftover counts) and each file's hash."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.name in MAY_CHANGE:
            continue
        key = str(path.relative_to(root))
        found[key] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return found


# ---- how the cases break things -------------------------------------------------------------------------


def _weights(world: World) -> dict[str, torch.Tensor]:
    return load_file(world.model / "model.safetensors")


def _save_weights(world: World, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(world.model / "model.safetensors"), metadata={"format": "pt"})


def _edit_weight(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[World], None]:
    def setup(world: World) -> None:
        tensors = _weights(world)
        tensors["model.layers.0.mlp.down_proj.weight"] = change(tensors["model.layers.0.mlp.down_proj.weight"])
        _save_weights(world, tensors)

    return setup


def _nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0, 0] = float("nan")
    return t


def _truncate(relative: str, keep: float = 0.5) -> Callable[[World], None]:
    def setup(world: World) -> None:
        file = world.user / relative
        data = file.read_bytes()
        file.write_bytes(data[: int(len(data) * keep)])

    return setup


def _write(relative: str, content: bytes | str) -> Callable[[World], None]:
    def setup(world: World) -> None:
        file = world.user / relative
        file.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            file.write_bytes(content)
        else:
            file.write_text(content)

    return setup


def _remove(relative: str) -> Callable[[World], None]:
    def setup(world: World) -> None:
        target = world.user / relative
        shutil.rmtree(target) if target.is_dir() else target.unlink()

    return setup


def _bin_only(world: World) -> None:
    torch.save(_weights(world), world.model / "pytorch_model.bin")
    (world.model / "model.safetensors").unlink()


def _missing_shard(world: World) -> None:
    index = {"metadata": {}, "weight_map": {key: "model-00002-of-00002.safetensors" for key in _weights(world)}}
    (world.model / "model.safetensors.index.json").write_text(json.dumps(index))


def _checksum(state: dict) -> str:
    """state.json's documented checksum: SHA-256 of the canonical JSON without the checksum field."""
    body = {k: v for k, v in state.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


NEWEST = "run/checkpoints/step-00000002"
SHARD = "shard-00000-of-00001.bin"


def _state_edit(change: Callable[[dict], None], *, keep_checksum: bool = True) -> Callable[[World], None]:
    """Edit the newest checkpoint's state.json; with ``keep_checksum`` the checksum is recomputed, so only
    the field checks can catch the edit (as for a checkpoint of an older format)."""

    def setup(world: World) -> None:
        file = world.user / NEWEST / "state.json"
        state = json.loads(file.read_text())
        change(state)
        if keep_checksum:
            state["checksum"] = _checksum(state)
        file.write_text(json.dumps(state, indent=1))

    return setup


def _flip_byte(relative: str, offset: int, value: int) -> Callable[[World], None]:
    def setup(world: World) -> None:
        file = world.user / relative
        data = bytearray(file.read_bytes())
        data[offset] = value
        file.write_bytes(bytes(data))

    return setup


def _nan_master(world: World) -> None:
    """NaN in the newest checkpoint's master, with every checksum valid (a diverged run, not damage)."""
    from slide_core.checkpoint import load_checkpoint, read_state, save_checkpoint

    checkpoint = world.user / NEWEST
    state = read_state(checkpoint)
    arrays = {
        name: torch.empty(info["numel"], dtype=getattr(torch, info["dtype"])) for name, info in state["arrays"].items()
    }
    load_checkpoint(checkpoint, arrays)
    arrays["master"][3] = float("inf")
    save_checkpoint(checkpoint.parent, state["step"], arrays, state["extra"])


def _then(*setups: Callable[[World], None]) -> Callable[[World], None]:
    def setup(world: World) -> None:
        for step in setups:
            step(world)

    return setup


# ---- contexts a command runs in ----------------------------------------------------------------------


def _held_lock(world: World) -> contextlib.AbstractContextManager:
    from slide_hf.run_dir import locked

    return locked(world.run)


@contextlib.contextmanager
def _in_user_folder(world: World) -> Iterator[None]:
    previous = Path.cwd()
    os.chdir(world.user)
    try:
        yield
    finally:
        os.chdir(previous)


@contextlib.contextmanager
def _read_only_below(world: World) -> Iterator[None]:
    """Creating or writing anything under ``tmp/ro`` fails with EROFS, as on a read-only mount."""
    ro = world.tmp / "ro"
    real_mkdir, real_open = pathlib.Path.mkdir, pathlib.Path.open

    def refuse(path: Path) -> None:
        if path.absolute().is_relative_to(ro) and path.absolute() != ro:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def mkdir(self, *args, **kwargs):
        refuse(self)
        return real_mkdir(self, *args, **kwargs)

    def open_(self, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            refuse(self)
        return real_open(self, mode, *args, **kwargs)

    ro.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pathlib.Path, "mkdir", mkdir)
        patch.setattr(pathlib.Path, "open", open_)
        yield
    ro.rmdir()


@contextlib.contextmanager
def _full_disk_for_tokenizers(world: World) -> Iterator[None]:
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    def save_pretrained(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TokenizersBackend, "save_pretrained", save_pretrained)
        yield


@contextlib.contextmanager
def _bench_must_not_run(world: World) -> Iterator[None]:
    """The checks come first: a benchmark that starts would make the case exit 1, not 2."""
    import slide_hf.bench

    def run_bench(cfg):
        raise AssertionError("the benchmark ran before its options were checked")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slide_hf.bench, "run_bench", run_bench)
        yield


@contextlib.contextmanager
def _bug_in_plan(world: World) -> Iterator[None]:
    import slide_hf.cli.plan

    def broken(name):
        raise RuntimeError("an internal invariant failed\nsecond line of detail")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slide_hf.cli.plan, "_build", broken)
        yield


# ---- the table ---------------------------------------------------------------------------------------

TRAIN = ("train", "--output", "{tmp}/out", "--model", "{model}", *TINY, "--steps", "2")
RESUME = ("train", "--resume", "{run}")
EXPORT = ("export", "{run}")
PLAN = ("plan", "--model", "tiny-llama", "--gpu-memory", "24GiB", "--host-memory", "64GiB")
BENCH = ("bench", "--model", "tiny-llama", "--batch-size", "1", "--seq-len", "16", "--steps", "3", "--warmup", "1")

FLOAT_OPTIONS = (
    "--lr",
    "--weight-decay",
    "--adam-beta1",
    "--adam-beta2",
    "--adam-eps",
    "--max-grad-norm",
    "--nvme-fraction",
    "--eval-fraction",
)
INT_OPTIONS = (
    "--seq-len",
    "--batch-size",
    "--grad-accum",
    "--steps",
    "--epochs",
    "--warmup-steps",
    "--seed",
    "--save-every",
    "--keep-checkpoints",
    "--block-slots",
    "--eval-every",
    "--log-every",
)


def _numeric_cases() -> list[Case]:
    cases = []
    for flag in FLOAT_OPTIONS:
        for value in ("nan", "inf", "-inf", "-1", "1e400"):
            cases.append(Case(f"train{flag}={value}", (*TRAIN, f"{flag}={value}"), flag))
    for flag in INT_OPTIONS:
        for value in ("-1", "99999999999999999999", "nan"):
            cases.append(Case(f"train{flag}={value}", (*TRAIN, f"{flag}={value}"), flag))
    for value in ("nanGiB", "infGiB", "1e400", "-5GiB", "0", "lots"):
        cases.append(Case(f"train--gpu-memory={value}", (*TRAIN, f"--gpu-memory={value}"), "--gpu-memory"))
    for flag in ("--batch-size", "--seq-len", "--grad-accum", "--block-slots"):
        for value in ("-1", "99999999999999999999", "nan"):
            cases.append(Case(f"plan{flag}={value}", (*PLAN, f"{flag}={value}"), flag))
    for value in ("nan", "inf", "-1", "2"):
        cases.append(Case(f"plan--nvme-fraction={value}", (*PLAN, f"--nvme-fraction={value}"), "--nvme-fraction"))
    # --seq-tile: a count of tokens, auto or 0; a tile no micro-batch exceeds (TINY's 2 x 16 tokens, the
    # plan's 2048 of tiny-llama without --seq-len, the demo's 128 in `slide train` without it) would never tile
    for value in ("-1", "nan", "abc", "1.5", "99999999999999999999", "32", "4096"):
        cases.append(Case(f"train--seq-tile={value}", (*TRAIN, f"--seq-tile={value}"), "--seq-tile"))
    for value in ("-1", "nan", "abc", "2048"):
        cases.append(Case(f"plan--seq-tile={value}", (*PLAN, f"--seq-tile={value}"), "--seq-tile"))
    cases.append(
        Case("plan--seq-tile=600,--seq-len=512", (*PLAN, "--seq-len", "512", "--seq-tile", "600"), "--seq-tile")
    )
    no_seq_len = ("train", "--output", "{tmp}/out", "--model", "{model}", "--device", "cpu", "--steps", "1")
    cases.append(Case("train--seq-tile=100000,no--seq-len", (*no_seq_len, "--seq-tile", "100000"), "--seq-tile"))
    for flag in ("--gpu-memory", "--host-memory"):
        for value in ("nanGiB", "infGiB", "1e400", "-1GiB"):
            cases.append(Case(f"plan{flag}={value}", (*PLAN, f"{flag}={value}"), flag))
    bench = [
        ("--steps", "-1"),
        ("--steps", "99999999999999999999"),
        ("--steps", "nan"),
        ("--warmup", "-1"),
        ("--batch-size", "0"),
        ("--batch-size", "99999999999999999999"),
        ("--seq-len", "1"),
        ("--seq-len", "99999999999999999999"),
        ("--gpu-memory", "nan"),
        ("--gpu-memory", "inf"),
        ("--gpu-memory", "1e400"),
        ("--gpu-memory", "-1"),
        ("--gpu-memory", "0"),
        ("--resident-gib", "nan"),
        ("--resident-gib", "-1"),
        ("--block-slots", "0"),
        ("--block-slots", "65"),
        ("--max-grad-norm", "nan"),
        ("--max-grad-norm", "-1"),
        ("--nvme-fraction", "nan"),
        ("--nvme-fraction", "2"),
        ("--seq-tile", "-1"),
        ("--seq-tile", "16"),
    ]
    for flag, value in bench:
        cases.append(Case(f"bench{flag}={value}", (*BENCH, f"{flag}={value}"), flag, during=_bench_must_not_run))
    return cases


# ---- a run directory broken under `--resume`, `--overwrite` and `slide export` ---------------------------


def _link(relative: str, to: str) -> Callable[[World], None]:
    def setup(world: World) -> None:
        (world.user / relative).symlink_to(world.user / to)

    return setup


OLDER = "run/checkpoints/step-00000001"
DEEP = "[" * 100_000 + "]" * 100_000
EXPORT_TO = ("export", "{run}", "{tmp}/out")
OVERWRITE = ("train", "--output", "{run}", *TINY, "--steps", "1", "--overwrite")


CASES: list[Case] = [
    *_numeric_cases(),
    # ---- the command line itself ----
    Case("unknown command", ("fly",), "invalid choice: 'fly'"),
    Case("unknown flag", (*TRAIN, "--learning-rate", "1"), "unrecognized arguments: --learning-rate"),
    Case("flag without value", ("train", "--lr"), "argument --lr: expected one argument"),
    Case("plan without --model", ("plan",), "the following arguments are required: --model"),
    Case(
        "internal error is one line, exit 1",
        PLAN,
        "internal error: RuntimeError: an internal invariant failed",
        code=1,
        during=_bug_in_plan,
    ),
    # ---- --config TOML ----
    Case("toml missing", (*TRAIN, "--config", "{user}/none.toml"), "does not exist"),
    Case(
        "toml is a directory", (*TRAIN, "--config", "{user}/dir.toml"), "is a directory", setup=_write("dir.toml/x", "")
    ),
    Case(
        "toml not UTF-8",
        (*TRAIN, "--config", "{user}/bad.toml"),
        "not UTF-8",
        setup=_write("bad.toml", b"lr = 1\xff\xfe\n"),
    ),
    Case(
        "toml syntax", (*TRAIN, "--config", "{user}/bad.toml"), "not valid TOML", setup=_write("bad.toml", "lr = = 1")
    ),
    Case(
        "toml unknown key",
        (*TRAIN, "--config", "{user}/c.toml"),
        "unknown option 'learning_rate'",
        setup=_write("c.toml", "learning_rate = 0.1\n"),
    ),
    Case(
        "toml wrong type",
        (*TRAIN, "--config", "{user}/c.toml"),
        "steps must be int",
        setup=_write("c.toml", "steps = 2.5\n"),
    ),
    Case("toml nan", (*TRAIN, "--config", "{user}/c.toml"), "--lr must be", setup=_write("c.toml", "lr = nan\n")),
    # ---- --data ----
    Case("data missing", (*TRAIN, "--data", "{user}/none.jsonl"), "none.jsonl"),
    Case("data is a directory", (*TRAIN, "--data", "{user}/model"), "model"),
    Case(
        "data not UTF-8",
        (*TRAIN, "--data", "{user}/bad.jsonl"),
        "bad.jsonl",
        setup=_write("bad.jsonl", b'{"text": "\xff\xfe"}\n'),
    ),
    Case("data empty", (*TRAIN, "--data", "{user}/empty.jsonl"), "empty.jsonl", setup=_write("empty.jsonl", "")),
    Case(
        "data malformed line",
        (*TRAIN, "--data", "{user}/bad.jsonl"),
        "bad.jsonl",
        setup=_write("bad.jsonl", '{"text": "fine"}\n{"text": \n'),
    ),
    Case(
        "data nested 100000 deep",
        (*TRAIN, "--data", "{user}/deep.jsonl"),
        "deep.jsonl:2: JSON nested too deeply",
        setup=_write("deep.jsonl", '{"text": "fine"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"),
    ),
    Case(
        "data record over the limit",
        (*TRAIN, "--data", "{user}/big.jsonl", "--max-record-size", "1KiB"),
        "big.jsonl:1: the record is larger than the 1024 bytes record limit",
        setup=_write("big.jsonl", '{"text": "' + "x" * 2000 + '"}\n'),
    ),
    Case(
        "data in a mixture missing",
        (*TRAIN, "--data", "{user}/data.jsonl", "--data", "{user}/none.jsonl"),
        "none.jsonl",
    ),
    Case(
        "data weights without a second --data",
        (*TRAIN, "--data", "{user}/data.jsonl", "--data-weights", "3,1"),
        "--data-weights gives 2 weight(s) for 1 --data source(s)",
    ),
    Case(
        "data weights negative",
        (*TRAIN, "--data", "{user}/data.jsonl", "--data", "{user}/data.jsonl", "--data-weights", "3,-1"),
        "--data-weights must be positive finite numbers",
    ),
    Case("adam eps below fp32", (*TRAIN, "--adam-eps", "1e-300"), "--adam-eps must be a finite number in [1.17549e-38"),
    Case("weight decay past 1/lr", (*TRAIN, "--weight-decay", "1e30"), "lr * wd must be below 1"),
    Case("ranks past the cores", (*TRAIN, "--nproc-per-node", "100000"), "CPU core(s); use --nproc-per-node"),
    # ---- --model directories ----
    Case("model missing", (*TRAIN[:4], "{user}/nothing", *TRAIN[5:]), "nothing"),
    Case("weights missing", TRAIN, "no *.safetensors weights", setup=_remove("model/model.safetensors")),
    Case("weights truncated", TRAIN, "not a readable safetensors file", setup=_truncate("model/model.safetensors")),
    Case(
        "weights header only",
        TRAIN,
        "not a readable safetensors file",
        setup=_truncate("model/model.safetensors", 0.01),
    ),
    Case("weights .bin only", TRAIN, ".bin checkpoints are not supported", setup=_bin_only),
    Case(
        "weights wrong shape",
        TRAIN,
        "model.layers.0.mlp.down_proj.weight has shape [64, 95]",
        setup=_edit_weight(lambda t: t[:, :95].contiguous()),
    ),
    Case("weights int8", TRAIN, "only float checkpoints", setup=_edit_weight(lambda t: t.to(torch.int8))),
    Case("weights NaN", TRAIN, "model.layers.0.mlp.down_proj.weight holds NaN or Inf", setup=_edit_weight(_nan)),
    Case("weights index names a missing shard", TRAIN, "lists shard(s) that are missing", setup=_missing_shard),
    Case(
        "weights index not JSON",
        TRAIN,
        "not a safetensors index",
        setup=_write("model/model.safetensors.index.json", "{"),
    ),
    Case("model config truncated", TRAIN, "config.json", setup=_truncate("model/config.json")),
    Case("model config not UTF-8", TRAIN, "config.json", setup=_write("model/config.json", b"\xff\xfe{}")),
    Case("model config missing", TRAIN, "config.json", setup=_remove("model/config.json")),
    Case(
        "model type unsupported",
        TRAIN,
        "bert",
        setup=_write("model/config.json", json.dumps({"model_type": "bert", "vocab_size": 259})),
    ),
    Case("tokenizer save on a full disk", TRAIN, "No space left on device", during=_full_disk_for_tokenizers),
    # ---- --output ----
    Case("output empty string", (*TRAIN[:2], "", *TRAIN[3:]), "--output", during=_in_user_folder),
    Case("output is the current directory", (*TRAIN[:2], ".", *TRAIN[3:]), "current directory", during=_in_user_folder),
    Case("output is an ancestor", (*TRAIN[:2], "{tmp}", *TRAIN[3:]), "current directory", during=_in_user_folder),
    Case("output is a file", (*TRAIN[:2], "{user}/data.jsonl", *TRAIN[3:]), "is a file"),
    Case("output below a file", (*TRAIN[:2], "{user}/data.jsonl/run", *TRAIN[3:]), "cannot create output directory"),
    Case("output holds another run", (*TRAIN[:2], "{run}", *TRAIN[3:]), "is not empty"),
    Case("output in /proc", (*TRAIN[:2], "/proc/slide-red-team", *TRAIN[3:]), "/proc/slide-red-team"),
    Case(
        "output on a read-only mount",
        (*TRAIN[:2], "{tmp}/ro/run", *TRAIN[3:]),
        "Read-only file system",
        during=_read_only_below,
    ),
    Case(
        "output held by a live run", (*RESUME, "--steps", "3"), "is in use by another slide run (pid", during=_held_lock
    ),
    Case(
        "overwrite with a live run",
        (*TRAIN[:2], "{run}", *TRAIN[3:], "--overwrite"),
        "in use by another slide run",
        during=_held_lock,
    ),
    Case(
        "nvme dir is a file",
        (*TRAIN, "--offload-optimizer", "nvme", "--nvme-dir", "{user}/data.jsonl"),
        "is a file, not a directory",
    ),
    # ---- --resume and state.json ----
    Case("resume missing", ("train", "--resume", "{user}/none"), "no checkpoint found"),
    Case("resume without checkpoints", ("train", "--resume", "{model}"), "no checkpoint found"),
    Case(
        "state.json byte flipped (not UTF-8)",
        RESUME,
        "state.json is not UTF-8 text",
        setup=_flip_byte(f"{NEWEST}/state.json", 10, 0xFF),
    ),
    Case("state.json truncated", RESUME, "state.json is not valid JSON", setup=_truncate(f"{NEWEST}/state.json")),
    Case("state.json empty", RESUME, "state.json is not valid JSON", setup=_write(f"{NEWEST}/state.json", "")),
    Case(
        "state.json step edited",
        RESUME,
        "fails its checksum",
        setup=_state_edit(lambda s: s.update(step=9), keep_checksum=False),
    ),
    Case(
        "state.json data index edited",
        RESUME,
        "fails its checksum",
        setup=_state_edit(lambda s: s["extra"]["data"].update(index=5), keep_checksum=False),
    ),
    Case(
        "state.json negative step",
        RESUME,
        "field step must be an integer >= 0, got -4",
        setup=_state_edit(lambda s: s.update(step=-4)),
    ),
    Case(
        "state.json step a string",
        RESUME,
        "field step must be an integer >= 0",
        setup=_state_edit(lambda s: s.update(step="2")),
    ),
    Case(
        "state.json arrays missing",
        RESUME,
        "field arrays must be an object",
        setup=_state_edit(lambda s: s.pop("arrays")),
    ),
    Case(
        "state.json extra missing", RESUME, "field extra must be an object", setup=_state_edit(lambda s: s.pop("extra"))
    ),
    Case(
        "state.json crc list short",
        RESUME,
        "crc32 must list",
        setup=_state_edit(lambda s: s["shards"][0]["parts"]["master"].update(crc32=[])),
    ),
    Case(
        "state.json data index beyond the data",
        RESUME,
        "extra.data.index is 1000000000, beyond",
        setup=_state_edit(lambda s: s["extra"]["data"].update(index=10**9)),
    ),
    Case(
        "state.json data epoch negative",
        RESUME,
        "extra.data.epoch must be an integer >= 0",
        setup=_state_edit(lambda s: s["extra"]["data"].update(epoch=-1)),
    ),
    Case(
        "state.json data missing",
        RESUME,
        "extra.data must be an object",
        setup=_state_edit(lambda s: s["extra"].pop("data")),
    ),
    Case(
        "state.json rng wrong type",
        RESUME,
        "extra.rng must list",
        setup=_state_edit(lambda s: s["extra"].update(rng="0123")),
    ),
    Case(
        "state.json rng out of range",
        RESUME,
        "extra.rng must list",
        setup=_state_edit(lambda s: s["extra"]["rng"].__setitem__(0, 999)),
    ),
    Case(
        "state.json engine step negative",
        RESUME,
        "extra.engine.step",
        setup=_state_edit(lambda s: s["extra"]["engine"].update(step=-1)),
    ),
    Case(
        "state.json engine not an object",
        RESUME,
        "extra.engine must be an object",
        setup=_state_edit(lambda s: s["extra"].update(engine=[1])),
    ),
    Case(
        "state.json of another model",
        RESUME,
        "is of model 'someone-else'",
        setup=_state_edit(lambda s: s["extra"].update(model="someone-else")),
    ),
    Case(
        "checkpoint master flipped: the intact one is named",
        RESUME,
        "the newest intact one is {run}/checkpoints/step-00000001: resume from it with --resume",
        setup=_flip_byte(f"{NEWEST}/{SHARD}", 7, 0x42),
    ),
    Case("checkpoint shard missing", RESUME, f"{SHARD} is missing", setup=_remove(f"{NEWEST}/{SHARD}")),
    Case("checkpoint shard truncated", RESUME, f"{SHARD} is", setup=_truncate(f"{NEWEST}/{SHARD}")),
    Case(
        "checkpoint manifest truncated", RESUME, "state.json is not valid JSON", setup=_truncate(f"{NEWEST}/state.json")
    ),
    Case(
        "every checkpoint corrupt",
        RESUME,
        "no older intact checkpoint",
        setup=_then(_truncate(f"{NEWEST}/{SHARD}"), _truncate(f"run/checkpoints/step-00000001/{SHARD}")),
    ),
    # ---- slide export ----
    Case("export source missing", ("export", "{user}/none", "{tmp}/out"), "no checkpoint found"),
    Case("export output exists", (*EXPORT, "{user}/data.jsonl"), "already exists"),
    Case("export to /proc", (*EXPORT, "/proc/slide-red-team"), "cannot write the model to /proc/slide-red-team"),
    Case("export to a read-only mount", (*EXPORT, "{tmp}/ro/out"), "Read-only file system", during=_read_only_below),
    Case("export config corrupt", (*EXPORT, "{tmp}/out"), "config.json", setup=_truncate("run/config/config.json")),
    Case("export config missing", (*EXPORT, "{tmp}/out"), "has no config/config.json", setup=_remove("run/config")),
    Case(
        "export model type unsupported",
        (*EXPORT, "{tmp}/out"),
        "bert",
        setup=_write("run/config/config.json", json.dumps({"model_type": "bert", "vocab_size": 259})),
    ),
    Case(
        "export of a corrupt checkpoint",
        (*EXPORT, "{tmp}/out"),
        "export it with `slide export",
        setup=_flip_byte(f"{NEWEST}/{SHARD}", 7, 0x42),
    ),
    Case("export of NaN weights", (*EXPORT, "{tmp}/out"), "holds NaN or Inf values", setup=_nan_master),
    Case(
        "export state.json edited",
        (*EXPORT, "{tmp}/out"),
        "fails its checksum",
        setup=_state_edit(lambda s: s.update(step=7), keep_checksum=False),
    ),
    Case("export into a live run", (*EXPORT, "{run}/model2"), "in use by another slide run", during=_held_lock),
    Case("export --save-dtype", (*EXPORT, "{tmp}/out", "--save-dtype", "int8"), "invalid choice: 'int8'"),
    # ---- slide plan and bench outputs and models ----
    Case("plan unknown model", ("plan", "--model", "{user}/nothing"), "nothing"),
    Case("plan seq-len past the positions", (*PLAN, "--seq-len", "4096", "--check"), "exceeds the model's 2048"),
    Case(
        "bench --json in /proc",
        (*BENCH, "--json", "/proc/slide.json"),
        "cannot write --json",
        during=_bench_must_not_run,
    ),
    Case(
        "bench --json in a missing folder",
        (*BENCH, "--json", "{tmp}/no/such/r.json"),
        "No such file or directory",
        during=_bench_must_not_run,
    ),
    Case("bench --json is a directory", (*BENCH, "--json", "{user}"), "is a directory", during=_bench_must_not_run),
    Case(
        "bench --json on a read-only mount",
        (*BENCH, "--json", "{tmp}/ro/r.json"),
        "cannot write --json {tmp}/ro/r.json: Read-only file system",
        during=_read_only_below,
    ),
    Case(
        "bench --trace in /proc",
        (*BENCH, "--trace", "/proc/slide-trace"),
        "cannot write --trace",
        during=_bench_must_not_run,
    ),
    Case(
        "bench steps not above warmup",
        (*BENCH[:-4], "--steps", "2", "--warmup", "2"),
        "must exceed --warmup",
        during=_bench_must_not_run,
    ),
    # ---- run directories: a newest checkpoint without its state.json, a state.json nested too deeply, and
    # --overwrite asked to remove an input of the run or a directory whose record of slide's files is missing,
    # damaged or hostile ----
    Case(
        "resume: newest checkpoint without state.json",
        RESUME,
        "checkpoint {run}/checkpoints/step-00000002 is corrupt (state.json is missing); the newest intact one is "
        "{run}/checkpoints/step-00000001: resume from it with --resume {run}/checkpoints/step-00000001",
        setup=_remove(f"{NEWEST}/state.json"),
    ),
    Case(
        "export: newest checkpoint without state.json",
        EXPORT_TO,
        "step-00000002 is corrupt (state.json is missing); the newest intact one is {run}/checkpoints/step-00000001: "
        "export it with `slide export {run}/checkpoints/step-00000001",
        setup=_remove(f"{NEWEST}/state.json"),
    ),
    Case(
        "resume: no checkpoint has its state.json",
        RESUME,
        "step-00000002 is corrupt (state.json is missing); no older intact checkpoint of this run exists",
        setup=_then(_remove(f"{NEWEST}/state.json"), _remove(f"{OLDER}/state.json")),
    ),
    # ---- a state.json nested deeper than the JSON parser goes ----
    Case(
        "resume: state.json of 100000 nested brackets",
        RESUME,
        "state.json is not valid JSON: it nests arrays or objects too deeply",
        setup=_write(f"{NEWEST}/state.json", DEEP),
    ),
    Case(
        "export: state.json of 100000 nested brackets",
        EXPORT_TO,
        "state.json is not valid JSON: it nests arrays or objects too deeply",
        setup=_write(f"{NEWEST}/state.json", DEEP),
    ),
    Case(
        "resume a checkpoint: state.json of 100000 nested brackets",
        ("train", "--resume", "{run}/checkpoints/step-00000001"),
        "step-00000001 is corrupt (state.json is not valid JSON: it nests",
        setup=_write(f"{OLDER}/state.json", DEEP),
    ),
    # ---- --overwrite and the run's inputs ----
    Case(
        "overwrite: --model is the run's own model",
        (*OVERWRITE, "--model", "{run}/model"),
        "--model {run}/model is in {run}, whose files from an earlier run --overwrite would remove",
    ),
    Case(
        "overwrite: --model is a link to the run's model",
        (*OVERWRITE, "--model", "{user}/linked-model"),
        "--model {user}/linked-model is in {run}",
        setup=_link("linked-model", "run/model"),
    ),
    Case(
        "overwrite: --tokenizer is the run's tokenizer",
        (*OVERWRITE, "--model", "{model}", "--tokenizer", "{run}/tokenizer"),
        "--tokenizer {run}/tokenizer is in {run}",
    ),
    Case(
        "overwrite: --data is a link to a file of the run",
        (*OVERWRITE, "--data", "{user}/rows.jsonl"),
        "--data {user}/rows.jsonl is in {run}",
        setup=_link("rows.jsonl", "run/metrics.jsonl"),
    ),
    Case(
        "overwrite: --eval-data is a file of the run",
        (*OVERWRITE, "--data", "{user}/data.jsonl", "--eval-data", "{run}/metrics.jsonl"),
        "--eval-data {run}/metrics.jsonl is in {run}",
    ),
    Case(
        "overwrite: --chat-template is a file of the run",
        (*OVERWRITE, "--data", "{user}/data.jsonl", "--chat-template", "{run}/tokenizer/chat_template.jinja"),
        "--chat-template {run}/tokenizer/chat_template.jinja is in {run}",
    ),
    # ---- --overwrite and the record of slide's files ----
    Case(
        "overwrite: a run without a record of its files",
        OVERWRITE,
        "--overwrite: {run} holds a run of a slide that kept no record of the files it wrote",
        setup=_remove(f"run/{RECORD_FILE}"),
    ),
    Case(
        "overwrite: record not JSON",
        OVERWRITE,
        f"{{run}}/{RECORD_FILE}, slide's record of the files it wrote in {{run}}, is damaged",
        setup=_write(f"run/{RECORD_FILE}", "[[[" + DEEP),
    ),
    Case(
        "overwrite: record names a file outside the run",
        OVERWRITE,
        "is damaged",
        setup=_write(f"run/{RECORD_FILE}", json.dumps({"format": 1, "files": ["../data.jsonl"]})),
    ),
    Case(
        "overwrite: record names an absolute path",
        OVERWRITE,
        "is damaged",
        setup=lambda world: _write(
            f"run/{RECORD_FILE}", json.dumps({"format": 1, "files": [str(world.user / "data.jsonl")]})
        )(world),
    ),
]


def test_the_table_is_large_and_unique() -> None:
    names = [case.name for case in CASES]
    assert len(names) == len(set(names))
    assert len(CASES) >= 100


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_is_one_line_and_touches_nothing(case: Case, world: World, capsys) -> None:
    if case.setup is not None:
        case.setup(world)
    before = _snapshot(world.tmp)
    argv = [part.format(**world.paths()) for part in case.argv]
    capsys.readouterr()
    with case.during(world) if case.during is not None else contextlib.nullcontext():
        status = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == case.code, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert case.match.format(**world.paths()) in lines[0], lines[0]
    if case.code == 2:
        assert ": error: " in lines[0]
    assert _snapshot(world.tmp) == before, "a file of the user's changed, or something was left behind"

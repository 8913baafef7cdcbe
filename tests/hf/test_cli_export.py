"""`slide export`: a checkpoint of a run becomes an HF directory that transformers loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slide_hf.cli.main import main

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the CPU user's path, not the Triton interpreter


def test_export_a_mid_run_checkpoint(tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    args = ["train", "--output", str(run), "--steps", "4", "--seq-len", "32", "--dtype", "float32"]
    assert main([*args, "--save-every", "2", "--keep-checkpoints", "3"]) == 0
    out = tmp_path / "step2"
    assert main(["export", str(run / "checkpoints" / "step-00000002"), str(out)]) == 0
    assert "exported step 2" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(AutoTokenizer.from_pretrained(out)) == model.config.vocab_size
    # The newest checkpoint (step 4) equals the model the run exported at its end.
    latest = tmp_path / "latest"
    assert main(["export", str(run), str(latest), "--save-dtype", "float32"]) == 0
    final = {k: v for f in (run / "model").glob("*.safetensors") for k, v in load_file(f).items()}
    exported = {k: v for f in latest.glob("*.safetensors") for k, v in load_file(f).items()}
    assert final.keys() == exported.keys()
    assert all(torch.equal(final[k], exported[k]) for k in final)
    # Step 2 differs from step 4: the export really read the older checkpoint.
    older = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert any(not torch.equal(older[k], final[k]) for k in final)


def test_export_errors_are_one_line(tmp_path: Path, capsys) -> None:
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint found" in err[0]


TINY = ("--device", "cpu", "--dtype", "float32", "--steps", "2", "--seq-len", "16", "--batch-size", "2")


def test_a_preset_export_carries_the_byte_tokenizer_special_tokens(tmp_path: Path) -> None:
    """tiny-llama copies Llama's shape, not its tokenizer: the export must name the byte tokenizer's ids, or
    generate() stops on whichever byte the preset's ids alias."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    run = tmp_path / "run"
    assert main(["train", "--output", str(run), *TINY]) == 0
    for model_dir in (run / "model", tmp_path / "exported"):
        if model_dir.name == "exported":
            assert main(["export", str(run), str(model_dir)]) == 0
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        generation = GenerationConfig.from_pretrained(model_dir)
        ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
        assert ids == (256, 257, 258)
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == ids
        assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == ids
        assert tokenizer.decode([config.eos_token_id]) == "<|eos|>"


def test_the_input_models_generation_config_survives_train_and_export(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from slide_hf import PRESETS
    from slide_hf.tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer

    source = tmp_path / "source"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(PRESETS["test-llama"](vocab_size=BYTE_VOCAB_SIZE)).save_pretrained(source)
    byte_tokenizer().save_pretrained(str(source))
    GenerationConfig(eos_token_id=[257, 10], temperature=0.6, top_p=0.9, do_sample=True).save_pretrained(source)
    wanted = GenerationConfig.from_pretrained(source).to_dict()
    run = tmp_path / "run"
    assert main(["train", "--output", str(run), "--model", str(source), *TINY]) == 0
    assert main(["export", str(run), str(tmp_path / "exported")]) == 0
    for model_dir in (run / "model", tmp_path / "exported"):
        got = GenerationConfig.from_pretrained(model_dir).to_dict()
        assert {k: got[k] for k in ("eos_token_id", "temperature", "top_p", "do_sample")} == {
            k: wanted[k] for k in ("eos_token_id", "temperature", "top_p", "do_sample")
        }


def test_export_of_a_run_without_tokenizer_says_so(tmp_path: Path, caplog) -> None:
    import shutil

    run = tmp_path / "run"
    assert main(["train", "--output", str(run), *TINY]) == 0
    shutil.rmtree(run / "tokenizer")
    with caplog.at_level("WARNING", logger="slide.export"):
        assert main(["export", str(run), str(tmp_path / "out")]) == 0
    assert f"{run} has no tokenizer/: the export carries no tokenizer files" in caplog.text
    assert (tmp_path / "out" / "model.safetensors").is_file() and not (tmp_path / "out" / "tokenizer.json").exists()


def test_a_corrupt_newest_checkpoint_names_the_newest_intact_one(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert (
        main(["train", "--output", str(run), *TINY, "--steps", "3", "--save-every", "1", "--keep-checkpoints", "3"])
        == 0
    )
    capsys.readouterr()
    newest = run / "checkpoints" / "step-00000003"
    shard = newest / "shard-00000-of-00001.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x10
    shard.write_bytes(bytes(data))
    intact = run / "checkpoints" / "step-00000002"
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"checkpoint {newest} is corrupt (shard-00000-of-00001.bin fails its checksum in block 0" in err[0]
    assert f"the newest intact one is {intact}: resume from it with --resume {intact}" in err[0]
    shard.write_bytes(b"")  # `slide export` reads the master only: make that bad too
    out = tmp_path / "out"
    assert main(["export", str(run), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shard-00000-of-00001.bin is 0 bytes, expected" in err[0], err
    assert f"the newest intact one is {intact}: export it with `slide export {intact} {out}`" in err[0]
    assert main(["export", str(intact), str(out)]) == 0


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640)])
def test_every_exported_file_has_the_same_mode_under_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    import os
    import stat

    run = tmp_path / "run"
    assert main(["train", "--output", str(run), *TINY]) == 0
    previous = os.umask(umask)
    try:
        assert main(["export", str(run), str(tmp_path / "out")]) == 0
    finally:
        os.umask(previous)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "out").iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes and "tokenizer.json" in modes
    assert modes == dict.fromkeys(modes, mode), {name: oct(m) for name, m in modes.items()}


@pytest.fixture
def three_checkpoints(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    argv = ["train", "--output", str(run), *TINY, "--steps", "3", "--save-every", "1", "--keep-checkpoints", "3"]
    assert main(argv) == 0
    return run


def _pruned_while_read(monkeypatch, victim: Path, *, at_once: bool) -> None:
    """The live run prunes ``victim`` as the export reads it: its first file is gone at once and the rest
    follow a moment later (as rmtree goes), or the whole directory is gone before the read."""
    import shutil
    import threading

    import slide_core.checkpoint as checkpoint

    real = checkpoint.load_checkpoint

    def load(path, tensors, **options):
        if Path(path) == victim and victim.exists():
            if at_once:
                shutil.rmtree(victim)
            else:
                (victim / "shard-00000-of-00001.bin").unlink()
                threading.Timer(0.3, shutil.rmtree, (victim,)).start()
        return real(path, tensors, **options)

    monkeypatch.setattr(checkpoint, "load_checkpoint", load)


@pytest.mark.parametrize("at_once", [False, True])
def test_export_of_a_live_run_falls_back_when_the_newest_checkpoint_is_pruned(
    three_checkpoints: Path, tmp_path: Path, monkeypatch, capsys, caplog, at_once: bool
) -> None:
    from slide_hf.run_dir import _Lock

    run = three_checkpoints
    newest = run / "checkpoints" / "step-00000003"
    live = _Lock(run)
    assert live.acquire()  # a training process holds the run
    try:
        _pruned_while_read(monkeypatch, newest, at_once=at_once)
        capsys.readouterr()
        with caplog.at_level("WARNING", logger="slide.export"):
            assert main(["export", str(run), str(tmp_path / "out")]) == 0
    finally:
        live.release()
    captured = capsys.readouterr()
    assert "corrupt" not in captured.err and "exported step 2" in captured.out
    assert f"{newest} was removed while it was read" in caplog.text
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_named_checkpoint_pruned_while_read_is_one_line(three_checkpoints: Path, tmp_path: Path, monkeypatch, capsys):
    run = three_checkpoints
    newest = run / "checkpoints" / "step-00000003"
    _pruned_while_read(monkeypatch, newest, at_once=True)
    capsys.readouterr()
    assert main(["export", str(newest), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"checkpoint {newest} was removed while it was read" in err[0], err
    assert f"`slide export {run} {tmp_path / 'out'}`" in err[0]


def test_a_damaged_checkpoint_of_an_idle_run_is_still_corrupt(three_checkpoints: Path, tmp_path: Path, capsys):
    newest = three_checkpoints / "checkpoints" / "step-00000003"
    (newest / "shard-00000-of-00001.bin").unlink()
    capsys.readouterr()
    assert main(["export", str(three_checkpoints), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"checkpoint {newest} is corrupt (shard-00000-of-00001.bin is missing)" in err[0], err

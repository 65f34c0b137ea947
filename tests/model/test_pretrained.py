"""model/pretrained.py: loading a trained checkpoint folder (clear errors), the shipped checkpoint (<= 10 MB,
loads, byte tokenizer), and setup.py shipping ``checkpoints/*/*`` in a non-editable install."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from blockdiff.model import DiffusionGemma
from blockdiff.model.pretrained import CHECKPOINT_FILES, load_pretrained, shipped_checkpoint_dir
from blockdiff.model.tokenizer import ByteTokenizer
from blockdiff.model.train import dense_forward, save_checkpoint, smoke_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_CHECKPOINT_BYTES = 10_000_000  # the size rule for anything shipped in the repository


@pytest.fixture
def ckpt(tmp_path):
    folder = tmp_path / "ckpt"
    save_checkpoint(DiffusionGemma(smoke_config(), seed=1, moe_impl="loop"), str(folder), ByteTokenizer())
    return folder


def test_load_pretrained_returns_the_model_in_eval_mode_and_its_tokenizer(ckpt):
    model, tok = load_pretrained(ckpt)
    assert isinstance(tok, ByteTokenizer) and not model.training
    assert model.config == smoke_config() and model.embed_tokens.weight.dtype == torch.bfloat16  # as stored
    m32, _ = load_pretrained(ckpt, dtype=torch.float32)
    assert m32.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(m32.embed_tokens.weight, model.embed_tokens.weight.float())


def test_load_pretrained_errors_name_the_folder_and_the_problem(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist or is not a folder"):
        load_pretrained(tmp_path / "nope")
    os.remove(ckpt / "tokenizer.json")
    os.remove(ckpt / "config.json")
    with pytest.raises(FileNotFoundError, match=r"lacks config\.json, tokenizer\.json"):
        load_pretrained(ckpt)
    ByteTokenizer().save(ckpt)
    cfg = smoke_config(vocab_size=300).to_dict()
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError):  # weights [259, ...] do not fit a vocab-300 config
        load_pretrained(ckpt)


def _check_servable_checkpoint(folder: str) -> None:
    """At most 10 MB in all, the served files present, the byte tokenizer, loads through the project's loader, and
    one forward pass (prefix + canvas) gives finite logits."""
    files = sorted(os.listdir(folder))
    for f in CHECKPOINT_FILES:
        assert f in files, f
    total = sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    assert total <= MAX_CHECKPOINT_BYTES, f"{folder} holds {total} bytes > 10 MB"
    model, tok = load_pretrained(folder, dtype=torch.float32)
    assert model.config.vocab_size == tok.vocab_size and model.config.eos_token_id == tok.eos_token_id
    CL = model.config.canvas_length
    ids = torch.tensor([tok.encode("def f(x):\n    return x + 1\n")[:16] + [tok.byte_offset + 32] * CL])
    with torch.no_grad():
        logits = dense_forward(model, ids, 16)
    assert logits.shape == (1, CL, tok.vocab_size) and torch.isfinite(logits).all()


def test_servable_checkpoint_check_itself(ckpt):
    _check_servable_checkpoint(str(ckpt))
    (ckpt / "padding.bin").write_bytes(bytes(MAX_CHECKPOINT_BYTES))
    with pytest.raises(AssertionError, match="> 10 MB"):
        _check_servable_checkpoint(str(ckpt))


def test_shipped_checkpoint_if_present_is_small_and_loads():
    """The checkpoint ``blockdiff demo`` runs by default (model/checkpoints/stdlib-byte/)."""
    folder = shipped_checkpoint_dir()
    if not os.path.isdir(folder):
        pytest.skip(f"no checkpoint shipped at {folder}")
    _check_servable_checkpoint(folder)


def test_wheel_ships_checkpoint_folders(tmp_path):
    """A non-editable install (a wheel built from setup.py) carries model/checkpoints/<name>/* as package data."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(os.path.join(REPO, "setup.py"), src)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "checkpoints")
    for pkg in ("attention", "sampler", "model", "integration"):
        shutil.copytree(os.path.join(REPO, pkg), src / pkg, ignore=ignore)
    ck = src / "model" / "checkpoints" / "tiny"
    ck.mkdir(parents=True)
    for f in (*CHECKPOINT_FILES, "loss.png", "train_log.json"):
        (ck / f).write_bytes(b"x")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    (whl,) = (tmp_path / "dist").glob("blockdiff-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for f in (*CHECKPOINT_FILES, "loss.png", "train_log.json"):
        assert f"blockdiff/model/checkpoints/tiny/{f}" in names, (f, sorted(n for n in names if "model/" in n))

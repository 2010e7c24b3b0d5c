"""``checkpoint.initial_load``: a fine-tuning job starts from a Hugging Face folder, as real
``torchrun`` and ``python -m trainer`` processes.

The first launch (dp2) finds no checkpoint, imports the folder (each rank its own shards),
commits it at once as step 0 with the folder's tokenizer files, and trains. The folder is
then moved away: the next launch (one process, another layout) resumes from the root, says
that the resume wins, never reads the folder, and its final checkpoint still carries the
tokenizer files, so its export is a complete Hugging Face folder that transformers loads.
"""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
import torch

import ckpt
from ckpt.export import export
from tests.ckpt._hf_llama import MODEL_ARGS, TOKENIZER, save_tiny_llama
from tests.e2e._jobs import ROOT, base_env, trainer_argv

pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (the `test` extra of pyproject.toml)")]

ARGS = (*MODEL_ARGS, "--checkpoint.interval=100", "--checkpoint.keep_last=0",
        "--training.log_every=1")


def _run(argv: list[str]) -> str:
    out = subprocess.run(argv, cwd=ROOT, env=base_env(), capture_output=True, text=True,
                         timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    return text


def test_fine_tune_starts_from_the_folder_and_a_restart_never_reads_it(tmp_path):
    llama = save_tiny_llama(tmp_path / "hf")
    root = str(tmp_path / "run")
    text = _run(trainer_argv(*ARGS, f"--checkpoint.root={root}",
                             f"--checkpoint.initial_load={llama.folder}",
                             "--training.steps=3", nproc=2))
    assert f"imported {llama.folder}" in text and "committing it as step 0" in text, text
    assert "starting fresh" not in text
    assert [c.step for c in ckpt.CheckpointStore(root).list()] == [0, 3]
    for step in (0, 3):
        files = ckpt.list_attachments(root, step)
        assert {"config.json", "hf_export.json", *TOKENIZER} <= set(files), (step, files)
    first_loss = float(text.split("step     1 | loss ")[1].split()[0])

    (tmp_path / "hf").rename(tmp_path / "gone")  # a restart must not need it
    text = _run(trainer_argv(*ARGS, f"--checkpoint.root={root}",
                             f"--checkpoint.initial_load={llama.folder}",
                             "--training.steps=5"))
    assert "step 3" in text and "is not read: a resume wins" in text, text
    assert "imported" not in text
    for name, data in TOKENIZER.items():  # carried from step 3 to the new saves
        assert ckpt.read_attachment(root, 5, name) == data

    out = tmp_path / "tuned"
    export(root, None, str(out), format="hf")
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(out, local_files_only=True,
                                                 dtype=torch.float32)
    assert tuned.config.num_key_value_heads == 2
    assert {p.name for p in out.iterdir()} >= {"config.json", *TOKENIZER}
    # The first step trained the imported model: its loss is transformers' on that batch.
    from trainer.config import load_config
    from trainer.data import build_loader

    cfg = load_config(str(ROOT / "configs" / "tiny.toml"), list(MODEL_ARGS))
    inputs, targets = build_loader(cfg, 0, 1, cfg.training.global_batch_size).next_batch()
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "gone", local_files_only=True,
                                                    dtype=torch.float32)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(
            original(inputs).logits.flatten(0, 1), targets.flatten())
    assert abs(first_loss - float(expected)) < 1e-3, (first_loss, float(expected))


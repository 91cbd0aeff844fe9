"""A tiny Hugging Face ``Trainer`` run (a one-layer GPT-2 built from a config, synthetic token ids, CPU,
nothing downloaded) with ``EnergyCallback``, pushing to the exporter's real OTLP receiver."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from training_models import TinyLMConfig, TokenDataset, label_values, receiver, series, tiny_gpt2, total

from gpu_energy_exporter.training.hf import EnergyCallback, even_share

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
CONFIG = TinyLMConfig(vocab_size=64, seq_len=16)


def trainer_for(callback: EnergyCallback, tmp_path: Path, train: Any, **args: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    arguments = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4,
        gradient_accumulation_steps=2, num_train_epochs=2, logging_steps=1, eval_strategy="epoch",
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=3, **args,
    )
    return Trainer(model=tiny_gpt2(CONFIG), args=arguments, train_dataset=train,
                   eval_dataset=TokenDataset(4, CONFIG, seed=1), callbacks=[callback])


def test_trainer_run_is_reported(tmp_path: Path) -> None:
    with receiver() as (endpoint, store):
        callback = EnergyCallback(backend="hf-test", seq_len=CONFIG.seq_len, notes="tiny", endpoint=endpoint,
                                  export_interval=0.1)
        trainer = trainer_for(callback, tmp_path, TokenDataset(10, CONFIG))
        model = trainer.model
        trainer.train()
        state = trainer.state
        logged_losses = [h["loss"] for h in state.log_history if "loss" in h]
        eval_losses = [h["eval_loss"] for h in state.log_history if "eval_loss" in h]

        # 10 samples x 2 epochs, counted from the micro-batches on this rank (no include_num_input_tokens_seen).
        assert total(store, "training_samples_total") == 20
        assert total(store, "training_tokens_total") == 20 * CONFIG.seq_len
        assert state.global_step == 4 and total(store, "training_steps_total") == 4
        assert total(store, "training_step_duration_seconds_count") == 4
        assert state.total_flos > 0 and total(store, "training_flops_total") == pytest.approx(state.total_flos)
        assert total(store, "training_loss") == pytest.approx(logged_losses[-1], rel=1e-6)
        assert total(store, "training_validation_loss") == pytest.approx(eval_losses[-1], rel=1e-6)
        assert total(store, "training_epoch") == 2
        assert total(store, "training_run_total_steps") == 4
        assert total(store, "training_run_finished") == 1
        assert total(store, "training_learning_rate") > 0
        (info,) = series(store, "training_run_info")
        meta = dict(info)
        assert meta["model"] == "GPT2LMHeadModel" and meta["backend"] == "hf-test" and meta["notes"] == "tiny"
        assert (meta["batch_size"], meta["grad_accum"], meta["seq_len"], meta["seed"]) == ("4", "2", "16", "3")
        assert meta["precision"] == "fp32" and "precision_raw" not in meta
        assert meta["optimizer"].startswith("adamw")
        # Counted from the model at on_train_begin: GPT-2's tied input/output embedding counted once.
        assert total(store, "training_model_parameters") == sum(p.numel() for p in model.parameters())
        assert label_values(store, "training_tokens_total", "gpu_uuid") == {"none"}  # a CPU run
        assert callback.run is None and not model._forward_pre_hooks  # cleaned up after train()


class PaddedDataset(TokenDataset):
    """Every sequence ends in 4 padding positions (attention_mask 0)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = super().__getitem__(i)
        mask = torch.ones(CONFIG.seq_len, dtype=torch.int64)
        mask[-4:] = 0
        return {**item, "attention_mask": mask}


def test_trainer_token_count_is_used_when_the_trainer_counts(tmp_path: Path) -> None:
    with receiver() as (endpoint, store):
        callback = EnergyCallback(endpoint=endpoint, export_interval=30)
        trainer = trainer_for(callback, tmp_path, PaddedDataset(10, CONFIG),
                              include_num_input_tokens_seen="non_padding")
        trainer.train()
        # The Trainer's own (non-padding) count, not the shape count of 20 x 16.
        assert trainer.state.num_input_tokens_seen == 20 * 12
        assert total(store, "training_tokens_total") == 20 * 12
        assert total(store, "training_samples_total") == 20


def test_even_share_adds_up_exactly() -> None:
    for delta in (0, 1, 7, 1000, 10**12 + 3):
        for world in (1, 2, 3, 8):
            shares = [even_share(delta, rank, world) for rank in range(world)]
            assert sum(shares) == delta and max(shares) - min(shares) <= 1


def test_missing_transformers_says_what_to_install() -> None:
    script = textwrap.dedent("""
        import sys
        sys.modules["transformers"] = None
        try:
            import gpu_energy_exporter.training.hf
        except ImportError as exc:
            print("IMPORT-ERROR", exc)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60,
                          check=False)
    assert "IMPORT-ERROR" in proc.stdout, proc.stderr
    assert "pip install gpu-energy-exporter[hf]" in proc.stdout

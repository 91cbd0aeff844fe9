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
GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
CONFIG = TinyLMConfig(vocab_size=64, seq_len=16)


def trainer_for(callback: EnergyCallback, tmp_path: Path, train: Any, **args: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    settings: dict[str, Any] = {
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4,
        "gradient_accumulation_steps": 2, "num_train_epochs": 2, "logging_steps": 1, "eval_strategy": "epoch",
        "save_strategy": "no", "report_to": [], "use_cpu": True, "disable_tqdm": True, "seed": 3,
    }
    arguments = TrainingArguments(**{**settings, **args})
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


def test_run_metadata_and_export_settings_pass_through_the_callback(tmp_path: Path) -> None:
    from gpu_energy_exporter.training import ExportSettings, RunMetadata

    # The same callback by keywords and by objects.
    fields = {"model": "my-gpt2", "backend": "hf-test", "seq_len": CONFIG.seq_len, "seed": 11, "notes": "obj",
              "parameters": 12_345, "total_steps": 100, "padding": "included", "flops": "total"}
    assert EnergyCallback(**fields, gpu_uuids=[GPU_A]).metadata == RunMetadata(**fields)
    assert EnergyCallback(**fields, gpu_uuids=[GPU_A]).export == ExportSettings(gpu_uuids=[GPU_A])
    with receiver() as (endpoint, store):
        callback = EnergyCallback(metadata=RunMetadata(**fields),
                                  export=ExportSettings(endpoint=endpoint, export_interval=30, gpu_uuids=[GPU_A]))
        trainer = trainer_for(callback, tmp_path, TokenDataset(10, CONFIG))
        trainer.train()
        (info,) = series(store, "training_run_info")
        meta = dict(info)
        # Given: passed through, and over what the Trainer says (model class, seed 3, the parameter count,
        # max_steps 4); not given: read from the Trainer (batch size, gradient accumulation, precision).
        assert (meta["model"], meta["backend"], meta["seq_len"], meta["seed"], meta["notes"]) == (
            "my-gpt2", "hf-test", "16", "11", "obj")
        assert (meta["padding"], meta["flops"]) == ("included", "total")
        assert (meta["batch_size"], meta["grad_accum"], meta["precision"]) == ("4", "2", "fp32")
        assert total(store, "training_model_parameters") == 12_345
        assert total(store, "training_run_total_steps") == 100
        assert total(store, "training_global_step") == trainer.state.global_step == 4  # derived
        assert label_values(store, "training_tokens_total", "gpu_uuid") == {GPU_A}  # given, not the CPU's
        assert total(store, "training_tokens_total") == 20 * CONFIG.seq_len


def test_an_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"EnergyCallback.__init__\(\) got an unexpected keyword argument "
                                        r"'batchsize' \(did you mean 'batch_size'\?\); it takes run_id, "
                                        r"metadata, export, flops_per_token, count_batch"):
        EnergyCallback(batchsize=8)


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
    assert "pip install transformers accelerate" in proc.stdout and "'.[hf]'" in proc.stdout


# ----------------------------------------------------------------------------------------------------
# FLOPs step by step, trainable-parameter FLOPs, padding, resume


def non_embedding_parameters(model: Any) -> tuple[int, int]:
    """(N, N_trainable) by hand: every parameter but the token and position embeddings (GPT-2's output
    head is tied to the token embedding, so it goes with it)."""
    skip = {"transformer.wte.weight", "transformer.wpe.weight"}
    params = [(n, p) for n, p in model.named_parameters() if n not in skip]
    return sum(p.numel() for _, p in params), sum(p.numel() for _, p in params if p.requires_grad)


class StepProbe:
    """A second callback, after EnergyCallback: the run's totals right after each optimizer step."""

    def __init__(self, energy: EnergyCallback) -> None:
        self.energy = energy
        self.flops: list[float] = []
        self.global_steps: list[int] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.energy.run is not None
        self.flops.append(float(self.energy.run.flops))
        self.global_steps.append(getattr(self.energy.run, "global_step", -1))


def test_flops_rise_with_every_step_not_at_logging_steps(tmp_path: Path) -> None:
    with receiver() as (endpoint, store):
        callback = EnergyCallback(endpoint=endpoint, export_interval=30)
        # One log at the very end: the Trainer's total_flos moves only then.
        trainer = trainer_for(callback, tmp_path, TokenDataset(16, CONFIG), logging_steps=100,
                              gradient_accumulation_steps=1)
        probe = StepProbe(callback)
        trainer.add_callback(probe)
        n, _ = non_embedding_parameters(trainer.model)
        trainer.train()
        per_step = 4 * CONFIG.seq_len * 6 * n  # 4 samples x 16 positions x 6N
        assert len(probe.flops) == 8
        # The counter rises by one step's FLOPs at every step; with total_flos it stayed 0 until the end.
        increments = [b - a for a, b in zip([0.0, *probe.flops], probe.flops, strict=False)]
        assert increments == [pytest.approx(per_step)] * 8
        # Everything trains, so 4N + 2N_trainable = 6N, the Trainer's own count: the totals agree.
        assert total(store, "training_flops_total") == pytest.approx(trainer.state.total_flos)
        assert total(store, "training_flops_total") == pytest.approx(8 * per_step)
        (info,) = series(store, "training_run_info")
        assert dict(info)["flops"] == "trainable"


class LoRA(torch.nn.Module):
    """A low-rank adapter around a frozen GPT-2 ``Conv1D`` (weight shaped (in, out)), as LoRA does."""

    def __init__(self, base: Any, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        d_in, d_out = base.weight.shape
        self.a = torch.nn.Linear(d_in, rank, bias=False)
        self.b = torch.nn.Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


def lora_gpt2() -> Any:
    model = tiny_gpt2(CONFIG)
    for p in model.parameters():
        p.requires_grad_(False)
    block = model.transformer.h[0]
    block.attn.c_attn = LoRA(block.attn.c_attn)
    block.mlp.c_fc = LoRA(block.mlp.c_fc)
    return model


def test_lora_flops_count_trainable_weight_gradients_and_tokens_exclude_padding(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    with receiver() as (endpoint, store):
        callback = EnergyCallback(endpoint=endpoint, export_interval=30)  # defaults: trainable, excluded
        arguments = TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
            num_train_epochs=2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=True, seed=3,
        )
        model = lora_gpt2()
        trainer = Trainer(model=model, args=arguments, train_dataset=PaddedDataset(10, CONFIG), callbacks=[callback])
        trainer.train()
        n, trainable = non_embedding_parameters(model)
        assert 0 < trainable < n / 10  # a LoRA-like run: a small adapter on a frozen base

        positions = 20 * CONFIG.seq_len  # 10 samples x 2 epochs; padding is computed, so FLOPs count it
        assert total(store, "training_flops_total") == pytest.approx(positions * (4 * n + 2 * trainable))
        # What the Trainer's total_flos says (6N per position): about 1.5x the FLOPs executed.
        assert trainer.state.total_flos == pytest.approx(positions * 6 * n)
        assert trainer.state.total_flos / total(store, "training_flops_total") > 1.4
        # Tokens: the 12 non-padding positions of each 16 (the attention mask), not 16.
        assert total(store, "training_tokens_total") == 20 * 12
        assert total(store, "training_samples_total") == 20
        (info,) = series(store, "training_run_info")
        assert (dict(info)["padding"], dict(info)["flops"]) == ("excluded", "trainable")


def test_padding_included_and_total_flops_are_options(tmp_path: Path) -> None:
    from transformers import Trainer

    with receiver() as (endpoint, store):
        callback = EnergyCallback(endpoint=endpoint, export_interval=30, padding="included", flops="total")
        args = trainer_for(callback, tmp_path, PaddedDataset(10, CONFIG)).args
        trainer = Trainer(model=lora_gpt2(), args=args, train_dataset=PaddedDataset(10, CONFIG),
                          eval_dataset=TokenDataset(4, CONFIG, seed=1), callbacks=[callback])
        trainer.train()
        assert total(store, "training_tokens_total") == 20 * CONFIG.seq_len
        # flops="total" is the Trainer's convention (6N, frozen weights too): the totals agree.
        assert total(store, "training_flops_total") == pytest.approx(trainer.state.total_flos)
        (info,) = series(store, "training_run_info")
        assert (dict(info)["padding"], dict(info)["flops"]) == ("included", "total")
    with pytest.raises(ValueError, match="padding must be"):
        EnergyCallback(padding="some")
    with pytest.raises(ValueError, match="flops must be"):
        EnergyCallback(flops="all")


def test_progress_after_resume_comes_from_the_global_step(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    def arguments(**extra: Any) -> Any:
        return TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=1,
            max_steps=4, logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, seed=3, **extra)

    train = TokenDataset(16, CONFIG)
    first = Trainer(model=tiny_gpt2(CONFIG), args=arguments(save_strategy="steps", save_steps=2),
                    train_dataset=train)
    first.train()
    checkpoint = tmp_path / "checkpoint-2"
    assert checkpoint.is_dir()

    with receiver() as (endpoint, store):
        callback = EnergyCallback("resumed", endpoint=endpoint, export_interval=30)
        resumed = Trainer(model=tiny_gpt2(CONFIG), args=arguments(save_strategy="no"), train_dataset=train,
                          callbacks=[callback])
        probe = StepProbe(callback)
        resumed.add_callback(probe)
        pushed: list[tuple[float, float]] = []

        class PushAfterFirstStep(StepProbe):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if not pushed and self.energy.run is not None and self.energy.run.flush():
                    pushed.append((total(store, "training_global_step"), total(store, "training_run_total_steps")))

        resumed.add_callback(PushAfterFirstStep(callback))
        resumed.train(resume_from_checkpoint=str(checkpoint))

        # Halfway when resumed: the first step after the resume is step 3 of 4 (75%), not step 1 of 4.
        assert probe.global_steps == [3, 4]
        assert pushed == [(3, 4)]
        assert total(store, "training_global_step") == 4 and total(store, "training_run_total_steps") == 4
        # This process took two steps: the per-process counter (rates, J/step) is unchanged.
        assert total(store, "training_steps_total") == 2
        assert total(store, "training_samples_total") == 8

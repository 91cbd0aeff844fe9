"""A Lightning run of the tiny LM (CPU, no logger, no checkpoints, no progress bar) with
``EnergyCallback``, pushing to the exporter's real OTLP receiver."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from training_models import TinyLM, TinyLMConfig, label_values, receiver, series, synthetic_tokens, total

pytestmark = [
    pytest.mark.slow,
    # Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecates (not ours to fix).
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
]

REPO = Path(__file__).resolve().parent.parent
GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
CONFIG = TinyLMConfig(vocab_size=64, hidden_size=16, seq_len=16)


def fit(callback: Any) -> tuple[Any, Any]:
    """A tiny LightningModule fitted for 2 epochs of 10 samples (batches of 4, 2 per step) with ``callback``:
    returns (trainer, module)."""
    import lightning.pytorch as pl

    class LitTinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = TinyLM(CONFIG)
            self.losses: list[float] = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.lm.loss(batch["input_ids"])
            self.losses.append(float(loss.detach()))
            return loss

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            self.log("val_loss", self.lm.loss(batch["input_ids"]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    train = [{"input_ids": x} for x in synthetic_tokens(10, CONFIG)]
    val = [{"input_ids": x} for x in synthetic_tokens(4, CONFIG, seed=1)]
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
        num_sanity_val_steps=0, callbacks=[callback],
    )
    module = LitTinyLM()
    trainer.fit(module, torch.utils.data.DataLoader(train, batch_size=4),
                torch.utils.data.DataLoader(val, batch_size=4))
    return trainer, module


def test_lightning_run_is_reported() -> None:
    from gpu_energy_exporter.training.lightning import EnergyCallback

    params = sum(p.numel() for p in TinyLM(CONFIG).parameters())
    with receiver() as (endpoint, store):
        callback = EnergyCallback(backend="lightning-test", seq_len=CONFIG.seq_len, endpoint=endpoint,
                                  export_interval=0.1, flops_per_token=6 * params)
        trainer, module = fit(callback)

        # 3 batches per epoch (4, 4, 2 samples); 2 micro-batches per step: 2 steps per epoch.
        assert trainer.global_step == 4
        assert total(store, "training_steps_total") == 4
        assert total(store, "training_samples_total") == 20
        assert total(store, "training_tokens_total") == 20 * CONFIG.seq_len
        assert total(store, "training_flops_total") == 20 * CONFIG.seq_len * 6 * params
        # The callback undoes Lightning's division by accumulate_grad_batches.
        assert total(store, "training_loss") == pytest.approx(module.losses[-1], rel=1e-5)
        assert total(store, "training_validation_loss") == pytest.approx(
            float(trainer.callback_metrics["val_loss"]), rel=1e-5)
        assert total(store, "training_learning_rate") == pytest.approx(0.05)
        assert total(store, "training_epoch") == 2
        assert total(store, "training_run_total_steps") == 4
        assert total(store, "training_run_finished") == 1
        assert total(store, "training_step_duration_seconds_count") == 4
        (info,) = series(store, "training_run_info")
        meta = dict(info)
        assert (meta["model"], meta["optimizer"], meta["grad_accum"]) == ("LitTinyLM", "SGD", "2")
        assert meta["backend"] == "lightning-test" and meta["batch_size"] == "4"
        # Lightning's "32-true", normalised for the peak-FLOP/s join; the raw setting kept beside it.
        assert (meta["precision"], meta["precision_raw"]) == ("fp32", "32-true")
        assert total(store, "training_model_parameters") == params
        assert label_values(store, "training_tokens_total", "gpu_uuid") == {"none"}  # a CPU run
        assert callback.run is None


def test_run_metadata_and_export_settings_pass_through_the_callback() -> None:
    from gpu_energy_exporter.training import ExportSettings, RunMetadata
    from gpu_energy_exporter.training.lightning import EnergyCallback

    # The same callback by keywords and by objects.
    fields = {"model": "lit-tiny", "optimizer": "my-sgd", "notes": "obj", "parameters": 777, "total_steps": 40,
              "padding": "included", "flops": "total"}
    assert EnergyCallback(**fields, gpu_uuids=[GPU_A]).metadata == RunMetadata(**fields)
    assert EnergyCallback(**fields, gpu_uuids=[GPU_A]).export == ExportSettings(gpu_uuids=[GPU_A])
    non_embedding = sum(p.numel() for p in TinyLM(CONFIG).head.parameters())  # an embedding is a lookup
    with receiver() as (endpoint, store):
        callback = EnergyCallback(metadata=RunMetadata(**fields),
                                  export=ExportSettings(endpoint=endpoint, export_interval=30, gpu_uuids=[GPU_A]))
        trainer, _ = fit(callback)
        (info,) = series(store, "training_run_info")
        meta = dict(info)
        # Given: passed through, and over what the Trainer says (module and optimizer class, the parameter
        # count, the estimated 4 steps); not given: read from the Trainer (gradient accumulation, precision).
        assert (meta["model"], meta["optimizer"], meta["notes"]) == ("lit-tiny", "my-sgd", "obj")
        assert (meta["padding"], meta["flops"]) == ("included", "total")
        assert (meta["grad_accum"], meta["precision"]) == ("2", "fp32")
        assert total(store, "training_model_parameters") == 777
        assert total(store, "training_run_total_steps") == 40
        assert total(store, "training_global_step") == trainer.global_step == 4  # derived
        assert label_values(store, "training_tokens_total", "gpu_uuid") == {GPU_A}  # given, not the CPU's
        # FLOPs counted from the module in the given convention: 6 N per position.
        assert total(store, "training_flops_total") == 20 * CONFIG.seq_len * 6 * non_embedding


def test_an_unknown_keyword_is_a_type_error() -> None:
    from gpu_energy_exporter.training.lightning import EnergyCallback

    with pytest.raises(TypeError, match=r"EnergyCallback.__init__\(\) got an unexpected keyword argument "
                                        r"'val_loss' \(did you mean 'val_loss_key'\?\); it takes run_id, "
                                        r"metadata, export, flops_per_token, val_loss_key, input_key, count_batch"):
        EnergyCallback(val_loss="loss")


def test_missing_lightning_says_what_to_install() -> None:
    script = textwrap.dedent("""
        import sys
        sys.modules["lightning"] = None
        sys.modules["lightning.pytorch"] = None
        sys.modules["pytorch_lightning"] = None
        try:
            import gpu_energy_exporter.training.lightning
        except ImportError as exc:
            print("IMPORT-ERROR", exc)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60,
                          check=False)
    assert "IMPORT-ERROR" in proc.stdout, proc.stderr
    assert "pip install lightning" in proc.stdout and "'.[lightning]'" in proc.stdout

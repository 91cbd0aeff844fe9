"""A real PyTorch training loop (the tiny two-layer LM from a config, synthetic token ids, CPU) reporting
through the plain API to the exporter's OTLP receiver: what the receiver totals is what was trained.

The DataLoader forks worker processes while the run's export thread is alive, as real training scripts
do; the workers' copies of the run must stay silent or the receiver's totals would be wrong.
"""

from __future__ import annotations

import pytest
import torch
from training_models import TinyLM, TinyLMConfig, label_values, receiver, series, synthetic_tokens, total

from gpu_energy_exporter.training import count_batch, start_run
from gpu_energy_exporter.training.metadata import count_parameters

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"),
]

CONFIG = TinyLMConfig(vocab_size=64, hidden_size=16, seq_len=16)


class SlowDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Token ids served slowly enough that forked workers outlive several export intervals."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        import time

        time.sleep(0.005)
        return {"input_ids": self.ids[i]}


def test_tiny_lm_training_loop_totals_reach_the_receiver() -> None:
    torch.manual_seed(0)
    samples, batch_size, epochs, grad_accum = 22, 4, 2, 2
    model = TinyLM(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(SlowDataset(synthetic_tokens(samples, CONFIG)), batch_size=batch_size,
                                         shuffle=True, num_workers=2, multiprocessing_context="fork")
    trained_tokens = trained_samples = optimizer_steps = 0
    first_loss = last_loss = None

    with receiver() as (endpoint, store):
        with start_run(model="tiny-lm", backend="torch", optimizer="adamw", batch_size=batch_size,
                       grad_accum=grad_accum, seq_len=CONFIG.seq_len, precision="fp32", seed=0,
                       total_steps=epochs * 3, parameters=count_parameters(model), endpoint=endpoint,
                       export_interval=0.05) as run:
            for epoch in range(epochs):
                step_tokens = step_samples = 0
                for i, batch in enumerate(loader):
                    loss = model.loss(batch["input_ids"]) / grad_accum
                    loss.backward()
                    n_samples, n_tokens = count_batch(batch)
                    step_tokens += n_tokens
                    step_samples += n_samples
                    if (i + 1) % grad_accum == 0 or i + 1 == len(loader):
                        optimizer.step()
                        optimizer.zero_grad()
                        run.step(tokens=step_tokens, samples=step_samples, loss=loss * grad_accum,
                                 lr=optimizer.param_groups[0]["lr"])
                        trained_tokens += step_tokens
                        trained_samples += step_samples
                        optimizer_steps += 1
                        step_tokens = step_samples = 0
                        last_loss = float(loss.detach()) * grad_accum
                        first_loss = last_loss if first_loss is None else first_loss
                with torch.no_grad():
                    val = model.loss(synthetic_tokens(8, CONFIG, seed=1))
                run.epoch(epoch + 1, val_loss=float(val))

        assert trained_samples == samples * epochs and trained_tokens == samples * epochs * CONFIG.seq_len
        assert optimizer_steps == epochs * 3  # 6 batches per epoch, 2 per step
        assert total(store, "training_tokens_total") == trained_tokens
        assert total(store, "training_samples_total") == trained_samples
        assert total(store, "training_steps_total") == optimizer_steps
        assert total(store, "training_step_duration_seconds_count") == optimizer_steps - 1
        assert total(store, "training_loss") == pytest.approx(last_loss, rel=1e-5)
        assert total(store, "training_epoch") == epochs
        assert total(store, "training_run_finished") == 1
        assert label_values(store, "training_run_info", "model") == {"tiny-lm"}
        # The model's real parameter count: embedding 64 x 16, head 16 x 64 weights + 64 biases = 2112.
        assert sum(p.numel() for p in model.parameters()) == 2112
        assert total(store, "training_model_parameters") == 2112
        assert label_values(store, "training_tokens_total", "run_id") == {run.run_id}
        assert len(series(store, "training_tokens_total")) == 1  # one rank, one series: no stray pushers
        assert run.delivered_exports > 2 and run.dropped_exports == 0
        assert last_loss < first_loss  # it really trained


def test_count_parameters_counts_shared_and_sharded_parameters_whole() -> None:
    from gpu_energy_exporter.training.metadata import count_parameters

    model = TinyLM(CONFIG)
    assert count_parameters(model) == 2112
    tied = torch.nn.Sequential(model.embed, torch.nn.Linear(16, 64, bias=False))
    assert count_parameters(tied) == 64 * 16 + 16 * 64
    tied[1].weight = model.embed.weight  # tied (both 64 x 16): one tensor, counted once
    assert count_parameters(tied) == 64 * 16
    # DeepSpeed ZeRO-3 leaves an empty local tensor and the full size in ds_numel.
    shard = torch.nn.Linear(4, 4)
    for p in shard.parameters():
        p.data = torch.empty(0)
        p.ds_numel = 1000  # type: ignore[attr-defined]
    assert count_parameters(shard) == 2000
    assert count_parameters(None) is None


@pytest.mark.gpu
def test_tiny_lm_on_a_real_gpu_is_labelled_with_that_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs PyTorch with CUDA and a visible GPU")
    from gpu_energy_exporter.training.gpus import read_nvml_gpus

    device = torch.device("cuda:0")
    model = TinyLM(CONFIG).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = synthetic_tokens(16, CONFIG).to(device)
    with receiver() as (endpoint, store):
        with start_run(endpoint=endpoint, export_interval=0.1, device=device) as run:
            for batch in ids.split(4):
                loss = model.loss(batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                run.step(tokens=batch.numel(), samples=len(batch), loss=loss)  # a CUDA tensor: no sync
        (gpu,) = label_values(store, "training_tokens_total", "gpu_uuid")
        assert gpu.startswith("GPU-") and gpu in {g.uuid for g in read_nvml_gpus()}
        assert total(store, "training_tokens_total") == 16 * CONFIG.seq_len
        assert label_values(store, "training_run_gpu_info", "gpu_uuid") == {gpu}
        assert 0 < total(store, "training_loss") < 10



@pytest.mark.gpu
# torch warns that its synchronisation debug mode "is a prototype feature" whenever the mode is set; the test
# relies on the mode raising on a synchronising operation, not on that warning (torch 2.11,
# reference/real-gpu-h100.md).
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature:UserWarning")
def test_counting_non_padding_tokens_on_a_gpu_never_synchronises() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs PyTorch with CUDA and a visible GPU")
    from gpu_energy_exporter.training import count_tokens

    device = torch.device("cuda:0")
    ids = synthetic_tokens(16, CONFIG).to(device)
    mask = torch.ones_like(ids)
    mask[:, -5:] = 0
    with receiver() as (endpoint, store):
        run = start_run(endpoint=endpoint, export_interval=3600, device=device, padding="excluded")
        # torch raises on any operation that synchronises the host with the device.
        torch.cuda.set_sync_debug_mode("error")
        try:
            for batch, batch_mask in zip(ids.split(4), mask.split(4), strict=True):
                run.step(tokens=count_tokens({"input_ids": batch, "attention_mask": batch_mask}), samples=4)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        run.finish()
        assert total(store, "training_tokens_total") == 16 * (CONFIG.seq_len - 5)

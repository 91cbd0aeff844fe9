"""Two-process ``torch.distributed`` (gloo, CPU) training runs proving each token is counted once.

The test starts two copies of this file as worker processes (``python test_training_distributed.py
<mode>``) with the environment ``torchrun`` would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), all pushing to one OTLP receiver in the test process. Summed over ranks, the receiver's
tokens and samples must equal the true totals of the data trained on:

- ``plain``: a DDP loop with a DistributedSampler (each rank sees distinct samples) reporting each
  rank's own counts through the plain API, with a run id generated and broadcast by rank 0;
- ``hf``: a Hugging Face ``Trainer`` (accelerate sets up gloo) with ``include_num_input_tokens_seen``,
  whose token count is gathered over both ranks before the callback sees it: the callback must report
  shares, not the global count twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORLD = 2
# SAMPLES divides evenly into WORLD x BATCH: no rank pads its shard with repeated samples.
SAMPLES, EPOCHS, BATCH = 8, 2, 2


# ----------------------------------------------------------------------------------------------------
# the workers (run as scripts)


def plain_worker(endpoint: str) -> dict[str, object]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from training_models import TinyLM, TinyLMConfig, synthetic_tokens

    from gpu_energy_exporter.training import start_run

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = TinyLMConfig()
    data = synthetic_tokens(SAMPLES, config)
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM(config))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[list[int]] = []
    with start_run(model="tiny-lm", backend="ddp", endpoint=endpoint, export_interval=0.1) as run:
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for ids in loader:
                logits = model(ids[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size),
                                                         ids[:, 1:].reshape(-1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                run.step(tokens=ids.numel(), samples=len(ids), loss=loss)
                seen.append(ids[:, 0].tolist())
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "run_id": run.run_id, "tokens": run.tokens, "samples": run.samples,
            "steps": run.steps, "dropped": run.dropped_exports}


def hf_worker(endpoint: str) -> dict[str, object]:
    from training_models import TinyLMConfig, TokenDataset, tiny_gpt2
    from transformers import Trainer, TrainingArguments

    from gpu_energy_exporter.training.hf import EnergyCallback

    config = TinyLMConfig()
    callback = EnergyCallback(backend="hf-ddp", endpoint=endpoint, export_interval=0.1)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        include_num_input_tokens_seen="all", ddp_backend="gloo",
    )
    trainer = Trainer(model=tiny_gpt2(config), args=args, train_dataset=TokenDataset(SAMPLES, config),
                      callbacks=[callback])
    trainer.train()
    return {"rank": args.process_index, "world_size": args.world_size,
            "tokens_seen": trainer.state.num_input_tokens_seen, "steps": trainer.state.global_step}


# ----------------------------------------------------------------------------------------------------
# the tests


def launch(mode: str, endpoint: str) -> list[dict[str, object]]:
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "OTEL_", "GPU_ENERGY_"))}
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
            "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)]),
            "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
        })
        procs.append(subprocess.Popen([sys.executable, __file__, mode, endpoint], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return sorted(results, key=lambda r: int(r["rank"]))  # type: ignore[arg-type]


@pytest.mark.slow
def test_plain_ddp_counts_every_token_once() -> None:
    from training_models import label_values, receiver, series, total

    with receiver() as (endpoint, store):
        results = launch("plain", endpoint)
        run_ids = {r["run_id"] for r in results}
        assert len(run_ids) == 1  # generated on rank 0, broadcast to rank 1
        (run_id,) = run_ids
        seq_len = 16
        # Distinct shards: each rank trained on half the samples, every epoch.
        assert [r["samples"] for r in results] == [SAMPLES // WORLD * EPOCHS] * WORLD
        assert total(store, "training_tokens_total", run_id=run_id) == SAMPLES * EPOCHS * seq_len
        assert total(store, "training_samples_total", run_id=run_id) == SAMPLES * EPOCHS
        for rank, result in enumerate(results):
            assert total(store, "training_tokens_total", run_id=run_id, rank=str(rank)) == result["tokens"]
        assert label_values(store, "training_tokens_total", "rank") == {"0", "1"}
        assert len(series(store, "training_run_info")) == WORLD
        assert label_values(store, "training_run_info", "world_size") == {"2"}
        assert total(store, "training_run_finished", run_id=run_id) == WORLD


@pytest.mark.slow
def test_hf_trainer_ddp_reports_gathered_tokens_once() -> None:
    from training_models import label_values, receiver, total

    with receiver() as (endpoint, store):
        results = launch("hf", endpoint)
        assert [r["world_size"] for r in results] == [WORLD, WORLD]
        # The Trainer's count is global (gathered): both ranks see the whole run's tokens ...
        seen = SAMPLES * EPOCHS * 16
        assert [r["tokens_seen"] for r in results] == [seen, seen]
        # ... and the receiver must total it once, not twice.
        (run_id,) = label_values(store, "training_tokens_total", "run_id")
        assert total(store, "training_tokens_total", run_id=run_id) == seen
        assert total(store, "training_samples_total", run_id=run_id) == SAMPLES * EPOCHS
        assert label_values(store, "training_tokens_total", "rank") == {"0", "1"}
        assert total(store, "training_tokens_total", run_id=run_id, rank="0") == seen // WORLD


if __name__ == "__main__":
    mode, target = sys.argv[1], sys.argv[2]
    result = plain_worker(target) if mode == "plain" else hf_worker(target)
    print(json.dumps(result))

"""What the training-helper tests share: tiny models built from configs, synthetic token ids, and the
real OTLP receiver to push to.

Nothing here downloads anything: the models are built from configs with random weights and the data is
random token ids, so the tests run offline on a CPU in seconds. The receiver is the exporter's own
(``gpu_energy_exporter.otlp``) on an ephemeral 127.0.0.1 port; totals are read back from its store the
way ``/metrics`` exposes them (Prometheus names: ``training_tokens_total``...).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from gpu_energy_exporter.otlp.receiver import OTLPReceiver
from gpu_energy_exporter.otlp.store import TrainingStore

# Set before transformers is imported anywhere in a test process: never reach the Hub.
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ----------------------------------------------------------------------------------------------------
# the tiny language model


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = 64
    hidden_size: int = 16
    seq_len: int = 16


class TinyLM(nn.Module):
    """Two layers: an embedding and a linear head predicting the next token."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))

    def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self(input_ids[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))


def synthetic_tokens(samples: int, config: TinyLMConfig = TinyLMConfig(), seed: int = 0) -> torch.Tensor:
    """``samples`` random sequences of token ids, shape (samples, seq_len), int64."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (samples, config.seq_len), generator=gen)


class TokenDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Synthetic causal-LM examples as the Hugging Face Trainer expects them."""

    def __init__(self, samples: int, config: TinyLMConfig = TinyLMConfig(), seed: int = 0) -> None:
        self.ids = synthetic_tokens(samples, config, seed)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2(config: TinyLMConfig = TinyLMConfig()):  # noqa: ANN201 - transformers is imported lazily
    """A one-layer GPT-2 built from a config (random weights, nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=config.vocab_size, n_positions=config.seq_len, n_embd=32, n_layer=1,
                     n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


# ----------------------------------------------------------------------------------------------------
# the receiver


@contextlib.contextmanager
def receiver() -> Iterator[tuple[str, TrainingStore]]:
    """The exporter's OTLP receiver on an ephemeral loopback port: yields (base endpoint, store)."""
    store = TrainingStore()
    server = OTLPReceiver(("127.0.0.1", 0), store).start()
    host, port = server.server_address[:2]
    try:
        yield f"http://{host}:{port}", store
    finally:
        server.shutdown()


def series(store: TrainingStore, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """Every sample named ``name`` (a full Prometheus sample name) the store exposes now."""
    out: dict[frozenset[tuple[str, str]], float] = {}
    for family in store.collect():
        for sample in family.samples:
            if sample.name == name:
                out[frozenset(sample.labels.items())] = sample.value
    return out


def total(store: TrainingStore, name: str, **labels: str) -> float:
    """Sum of ``name`` over the series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for k, v in series(store, name).items() if want <= k)


def label_values(store: TrainingStore, name: str, label: str) -> set[str]:
    return {dict(k).get(label, "") for k in series(store, name)}


def closed_port() -> int:
    """A loopback port nothing listens on (bound then released): connections are refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

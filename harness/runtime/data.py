"""Synthetic training data: random token sequences with the case's batch, length and dataloader
settings (workers, prefetch, pinned memory), so memory and speed are the real input pipeline's."""

from __future__ import annotations


class SyntheticTokens:
    """A map-style dataset of fixed random token sequences (labels = inputs). A few distinct
    sequences, cycled, so a tiny model's loss visibly falls within a few steps."""

    def __init__(self, vocab: int, seq_len: int, distinct: int, length: int, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (distinct, seq_len), generator=g)
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.data[i % len(self.data)]


def loader(case, shape, vocab, on_cpu, micro_steps):
    import torch
    from torch.utils.data import DataLoader

    ds = SyntheticTokens(vocab, shape.seq_len, distinct=shape.micro_batch * 2, length=shape.micro_batch * micro_steps)
    kwargs = {}
    if case.train.dataloader_workers > 0:
        kwargs["prefetch_factor"] = case.train.prefetch_factor or 2
        kwargs["persistent_workers"] = False
    return DataLoader(
        ds,
        batch_size=shape.micro_batch,
        num_workers=case.train.dataloader_workers,
        pin_memory=case.train.pin_memory and not on_cpu and torch.cuda.is_available(),
        **kwargs,
    )


class SyntheticExamples(SyntheticTokens):
    """The same sequences as a framework trainer's dataset takes them: one example a row, with its
    attention mask and labels (a tokenized SFT example at the cutoff length, every token trained)."""

    def __getitem__(self, i):
        import torch

        row = super().__getitem__(i)
        return {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()}


def examples(shape, vocab: int) -> SyntheticExamples:
    """A trainer's training set for `shape.steps` optimizer steps of `shape.grad_accum` micro-batches: one
    sequence repeated. A trainer shuffles its dataset (and shards it over ranks), so with several distinct
    sequences each step's loss would be of another sample; with one, every step sees the same batch and a
    run of a few steps shows its loss falling whatever the order."""
    return SyntheticExamples(vocab, shape.seq_len, distinct=1,
                             length=shape.micro_batch * shape.grad_accum * shape.steps * max(1, shape.ranks))

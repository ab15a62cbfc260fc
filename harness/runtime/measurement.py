"""What one training process measures of itself: memory per phase (allocator, device, host), under an
emulated card's cap where it has one, its weights as they are held, and where its optimizer state lives."""

from __future__ import annotations

import sys


def card_room(device, context_bytes: int | None, read_free=None) -> int:
    """Device memory free for this process at its start, its own context counted as free: what an
    emulated card of that size would offer it. Less than the emulated card means another process
    holds memory on the card (harness.measure.records.CaseRun.card_shortfall). `read_free` is
    `torch.cuda.mem_get_info` unless given: (free, total) bytes of `device`."""
    if read_free is None:
        import torch

        read_free = torch.cuda.mem_get_info
    free, _ = read_free(device)
    return int(free) + (context_bytes or 0)


class Measurement:
    """The phase-by-phase figures of one process, on whichever platform it runs."""

    def __init__(self, device, emulated_card_bytes: int | None):
        import torch

        from harness.measure.trackers import (
            AcceleratorTracker,
            LiveTensorTracker,
            Sampler,
            clock_reader,
            device_memory_reader,
        )

        self.device = device
        self.on_cpu = device.type == "cpu"
        self.limit = emulated_card_bytes
        self.context_bytes = None
        self.card_free_at_start = None
        reader = device_memory_reader(device)
        if self.on_cpu:
            self.alloc = LiveTensorTracker()
        else:
            self.alloc = AcceleratorTracker(device)
            torch.zeros(1, device=device)  # create the context, so its size can be read
            if reader is not None and reader.per_process:
                self.context_bytes = max(0, (reader.read() or 0) - torch.cuda.memory_reserved(device))
            self.card_free_at_start = card_room(device, self.context_bytes)
            if emulated_card_bytes:
                # A smaller card on a bigger one: the allocator may use what the card has left
                # after this process's context (which the real card holds too).
                total = torch.cuda.get_device_properties(device).total_memory
                usable = emulated_card_bytes - (self.context_bytes or 0)
                torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, usable / total)), device)
        self.sampler = Sampler(reader, clock_reader=clock_reader(device))

    def __enter__(self):
        self.sampler.__enter__()
        if self.on_cpu:
            self.alloc.__enter__()
        return self

    def __exit__(self, *exc):
        if self.on_cpu:
            self.alloc.__exit__(*exc)
        self.sampler.__exit__(*exc)
        return False

    def check_cpu_limit(self):
        """On a CPU, an emulated card limit turns into the same kind of error a GPU raises."""
        if self.on_cpu and self.limit and self.alloc.peak_bytes() > self.limit:
            import torch

            raise torch.OutOfMemoryError(
                f"CPU out of memory (emulated card). Tried to allocate {self.alloc.peak_bytes() - self.limit} B "
                f"above the emulated card of {self.limit} B"
            )

    def reset(self):
        self.alloc.reset_peak()
        self.sampler.reset()

    def figures(self):
        from harness.measure.records import Memory

        self.sampler.sample()
        reserved = None if self.on_cpu else self.alloc.peak_reserved()
        device = self.sampler.device_peak
        if device is not None and reserved is not None and self.context_bytes is not None:
            # NVML is sampled every 20 ms and can miss a short spike; the process held at least
            # its reserved peak plus its context at that moment.
            device = max(device, reserved + self.context_bytes)
        return Memory(
            allocated=self.alloc.peak_bytes(),
            reserved=reserved,
            device=device,
            host_rss=self.sampler.host_peak,
            host_anon=self.sampler.host_anon_peak,
            resident=self.alloc.current(),
        )

    def lift_cap(self):
        """Probes measure byte deltas of ablations (checkpointing off, all logits), which may not
        fit the emulated card; they run without its cap."""
        if not self.on_cpu and self.limit:
            import torch

            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        self.limit = None

    def current(self) -> int:
        return self.alloc.current()

    def sync(self):
        if not self.on_cpu:
            import torch

            torch.cuda.synchronize(self.device)


def _logical_numel(p) -> int:
    if hasattr(p, "ds_numel"):
        return int(p.ds_numel)
    qs = getattr(p, "quant_state", None)
    if qs is not None and getattr(qs, "shape", None) is not None:
        import math

        return math.prod(qs.shape)
    return p.numel()


def local_bytes(p) -> int:
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor.numel() * p.ds_tensor.element_size()
    return p.numel() * p.element_size()


def weights(model):
    from harness.measure.records import Weights

    params = list(model.parameters())
    q_bytes = q_bf16 = 0
    found_q = False
    bnb = sys.modules.get("bitsandbytes")  # loaded by the QLoRA path only
    if bnb is not None:
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                found_q = True
                w = module.weight
                q_bytes += w.numel() * w.element_size()
                qs = getattr(w, "quant_state", None)
                if qs is not None:
                    for t in (qs.absmax, getattr(qs, "code", None)):
                        if t is not None:
                            q_bytes += t.numel() * t.element_size()
                    nested = getattr(qs, "state2", None)
                    if nested is not None:
                        q_bytes += nested.absmax.numel() * nested.absmax.element_size()
                q_bf16 += _logical_numel(w) * 2
    return Weights(
        params_total=sum(_logical_numel(p) for p in params),
        params_trainable=sum(_logical_numel(p) for p in params if p.requires_grad),
        param_bytes_local=sum(local_bytes(p) for p in params),
        quantized_linear_bytes=q_bytes if found_q else None,
        quantized_linear_bf16_bytes=q_bf16 if found_q else None,
    )


def offload(engine, on_cpu: bool):
    from harness.measure.records import Offload

    zero_opt = engine.optimizer
    inner = getattr(zero_opt, "optimizer", zero_opt)
    offloaded = bool(getattr(zero_opt, "cpu_offload", False) or getattr(zero_opt, "offload_optimizer", False))
    tensors = []
    for state in inner.state.values():
        tensors += [t for t in state.values() if hasattr(t, "numel") and t.dim() > 0]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        tensors += list(getattr(zero_opt, name, []) or [])
    device_bytes = host_bytes = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        # On a GPU the tensor's device says where it lives. On a CPU the accelerator *is* the
        # host, so the placement DeepSpeed chose (its offload flag) is what we can report.
        on_host = (t.device.type == "cpu") if not on_cpu else offloaded
        if on_host:
            host_bytes += nbytes
        else:
            device_bytes += nbytes
    return Offload(optimizer_class=type(inner).__name__, device_state_bytes=device_bytes, host_state_bytes=host_bytes)

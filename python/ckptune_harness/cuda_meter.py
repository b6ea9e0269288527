"""The CUDA side's meter: PyTorch's own caching-allocator statistics (`torch.cuda.memory_stats`
definitions), with the interface of `meter.Meter`, so one training loop measures either device.
On a GPU the bytes a user runs out of are the allocator's reserved bytes, so a step reports
both its allocated and its reserved peak."""

import torch


class CudaMeter:
    """Allocated and reserved bytes of one CUDA device, peaks reset per step."""

    path = "torch.cuda.memory_stats"

    def __init__(self, device):
        self.device = torch.device(device)

    def reset_peak(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def current(self):
        return torch.cuda.memory_allocated(self.device)

    def peak(self):
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def reserved_peak(self):
        return torch.cuda.max_memory_reserved(self.device)

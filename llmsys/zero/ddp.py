"""Data parallelism for any module: gradients all-reduced in buckets while backward still runs.

::

    model = DistributedDataParallel(my_module)      # every rank: the same module, its own batch part
    loss_fn(model(x_local), y_local).backward()     # gradients arrive averaged over the ranks
    optimizer.step()                                 # any optimizer, on my_module.parameters()

The textbook shape of PyTorch's DDP (Li et al., "PyTorch Distributed", VLDB
2020): parameters are grouped into buckets of about ``bucket_cap_mb``, in the
reverse of their registration order (roughly the order backward produces their
gradients). A hook after each gradient is accumulated marks the parameter ready;
when a bucket is complete its gradients are flattened, divided by the world size
and all-reduced asynchronously, so the communication of the last layers overlaps
the backward of the first. A callback queued on the autograd engine waits for
every bucket at the end of backward and points each ``.grad`` at its averaged
slice of the bucket (which then *is* the gradient: no second copy).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from llmsys.zero.units import size_and_rank


class Bucket:
    """Parameters whose gradients are all-reduced together, as one flat buffer."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.ready = set()  # ids of the parameters whose gradient is complete this backward
        self.buffer = None  # the flat gradients being reduced
        self.handle = None  # the asynchronous all-reduce

    def flatten_grads(self) -> torch.Tensor:
        """The bucket's gradients in one buffer."""
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    def unflatten_into_grads(self) -> None:
        offset = 0
        for p in self.params:
            p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that after ``backward`` every gradient is the mean over the ranks of ``group``.

    Rank 0's parameters and buffers are broadcast at construction, so every rank starts
    equal. ``launch_log`` records, per backward, when each bucket's all-reduce started
    (``("launch", i)``) and when backward ended (``("end", n)``): what overlap means.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group=None):
        super().__init__()
        self.world_size, _ = size_and_rank(group, "DistributedDataParallel")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.module, self.group = module, group
        source = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=source, group=group)
        params = [p for p in module.parameters() if p.requires_grad]
        self._names = {id(p): name for name, p in module.named_parameters()}
        self.buckets = _fill_buckets(params[::-1], bucket_cap_mb * 2**20)
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        for p in params:
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, p))
        self._end_queued = False
        self.launch_log = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param: nn.Parameter, _) -> None:
        if not self._end_queued:  # the first gradient of this backward
            self._end_queued = True
            self.launch_log = []
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        self.launch_log.append(("launch", self.buckets.index(bucket)))
        bucket.buffer = bucket.flatten_grads().div_(self.world_size)
        bucket.handle = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    def _end_of_backward(self) -> None:
        self.launch_log.append(("end", len(self.buckets)))
        self._end_queued = False
        for bucket in self.buckets:
            if bucket.handle is None:
                missing = [self._names[id(p)] for p in bucket.params if id(p) not in bucket.ready]
                for b in self.buckets:
                    b.ready, b.buffer, b.handle = set(), None, None
                raise RuntimeError(f"parameter {missing[0]} got no gradient in this backward: every rank must use "
                                   "every trainable parameter in each step (freeze it with requires_grad_(False), "
                                   "or remove it from the module)")
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.unflatten_into_grads()
            bucket.ready, bucket.buffer, bucket.handle = set(), None, None


def _fill_buckets(params: list[nn.Parameter], cap_bytes: float) -> list[Bucket]:
    """Consecutive parameters, a new bucket whenever the current one has reached ``cap_bytes``."""
    groups, size = [[]], 0
    for p in params:
        if groups[-1] and size >= cap_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    return [Bucket(group) for group in groups if group]

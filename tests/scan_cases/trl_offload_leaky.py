# ruff: noqa
# Stand-in for the LF004 scan rule (data file: never imported).
# Imitates trl 1.16.0 `trl/models/activation_offloading.py` (`OffloadActivations`; torchtune
# 0.6.1 `torchtune/training/_activation_offloading.py` has the same design): the pack hook
# is a closure defined in `__init__`, parks each saved tensor (or its host copy) in
# instance-wide dicts keyed by a running integer, and hands autograd only that integer.
import torch
from torch.autograd.graph import saved_tensors_hooks


class OffloadActivations(saved_tensors_hooks):
    def __init__(self, use_streams=True, min_offload_size=1024, max_fwd_stash_size=5):
        self.use_streams = use_streams
        self.min_bytes = min_offload_size
        self.tracker = {}  # id -> (tensor, offloaded?)
        self.next_id = 0
        self.fwd_stash = {}  # id -> (device tensor, event) while its copy is in flight
        self.bwd_stash = {}
        self.max_fwd_stash_size = max_fwd_stash_size
        self.copy_stream = torch.cuda.Stream()

        def new_id() -> int:
            self.next_id += 1
            return self.next_id

        def pack(activation: torch.Tensor) -> int:
            nbytes = activation.element_size() * activation.nelement()
            tensor_id = new_id()
            if nbytes < self.min_bytes or isinstance(activation, torch.nn.Parameter):
                self.tracker[tensor_id] = (activation, False)
                return tensor_id
            if not activation.is_contiguous():
                activation = activation.contiguous()
            with torch.cuda.stream(self.copy_stream):
                host = torch.empty_like(activation, pin_memory=True, device="cpu")
                host.copy_(activation, non_blocking=True)
                self.tracker[tensor_id] = (host, True)
            if self.use_streams:
                event = self.copy_stream.record_event()
                self.fwd_stash[tensor_id] = (activation, event)
            return tensor_id

        def unpack(tensor_id: int) -> torch.Tensor:
            if tensor_id not in self.tracker:
                raise ValueError(f"Untracked tensor with id {tensor_id}")
            tensor, offloaded = self.tracker.pop(tensor_id)
            if offloaded:
                tensor = tensor.to("cuda", non_blocking=True)
                self.bwd_stash[tensor_id] = tensor
            return tensor

        super().__init__(pack, unpack)

    def __enter__(self):
        # the reset TRL 1.5 added: it runs only when the next step begins
        self.tracker.clear()
        self.fwd_stash.clear()
        self.bwd_stash.clear()
        self.next_id = 0
        return super().__enter__()

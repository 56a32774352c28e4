"""Install our all2all managers on the EP group's CudaCommunicator.

Patches: `CudaCommunicator.__init__`
(vllm/distributed/device_communicators/cuda_communicator.py l.36-46; the backend
if/elif at l.202-278 ends in `ValueError("Unknown all2all backend")`).
Why not swap the class: vllm/distributed/stateless_coordinator.py l.193 asserts the
communicator class is CudaCommunicator, and GroupCoordinator.graph_capture
isinstance-checks it.
How: wrap `__init__`; for our backends call the original with use_all2all=False, then
on the EP communicator that asked for an all2all set `use_all2all=True` and
`all2all_manager=<ours>` (constructed over the group's CPU group, as vLLM does).
"""

from __future__ import annotations

import inspect

from vllm_flashinfer_ep.backends import is_ours
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.vllm.patches._util import is_marked, mark

logger = get_logger(__name__)

TARGET = "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator.__init__"


def _backend_of_current_config() -> str | None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return config.parallel_config.all2all_backend if config is not None else None


def is_applied() -> bool:
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    return is_marked(CudaCommunicator.__init__)


def apply() -> None:
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    if is_applied():
        return
    original = CudaCommunicator.__init__
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs) -> None:
        backend = _backend_of_current_config()
        if not is_ours(backend):
            original(self, *args, **kwargs)
            return
        bound = signature.bind(self, *args, **kwargs)
        wants_all2all = bool(bound.arguments.get("use_all2all", False))
        bound.arguments["use_all2all"] = False
        original(*bound.args, **bound.kwargs)
        if wants_all2all and self.is_ep_communicator:
            from vllm_flashinfer_ep.vllm.managers import MANAGERS

            tcp_store_group = bound.arguments.get("tcp_store_group")
            self.use_all2all = True
            self.all2all_manager = MANAGERS[backend](self.cpu_group, tcp_store_group)
            logger.info("Using %s all2all manager.", type(self.all2all_manager).__name__)

    CudaCommunicator.__init__ = mark(__init__, original)

"""Replacements for the worker patches (communicator init, model load, FT sentinel).

Each `make_*` takes what vLLM 0.33.0 has and returns what replaces it; the table in
`patches/__init__.py` says where it goes and why.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

from vllm_flashinfer_ep.backends import BACKENDS, LOW_LATENCY, is_ours
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime.capture import capture_phase
from vllm_flashinfer_ep.runtime.limits import round_up_ll_hidden_size

logger = get_logger(__name__)


def backend_of_current_config() -> str | None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return config.parallel_config.all2all_backend if config is not None else None


def make_communicator_init(original):
    """Our manager on the EP group; vLLM's if/elif never sees our name."""
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs) -> None:
        backend = backend_of_current_config()
        if not is_ours(backend):
            original(self, *args, **kwargs)
            return
        bound = signature.bind(self, *args, **kwargs)
        wants_all2all = bool(bound.arguments.get("use_all2all", False))
        bound.arguments["use_all2all"] = False
        original(*bound.args, **bound.kwargs)
        if wants_all2all and self.is_ep_communicator:
            from vllm_flashinfer_ep.vllm.managers import MANAGERS

            self.use_all2all = True
            self.all2all_manager = MANAGERS[backend](
                self.cpu_group, bound.arguments.get("tcp_store_group")
            )
            logger.info("Using %s all2all manager.", type(self.all2all_manager).__name__)

    return __init__


def make_prepare_finalize_selection(original):
    """A registry lookup in front of vLLM's if/elif: for our backends the manager builds
    the prepare/finalize (the shape of the factory registry of vLLM PR #50556)."""
    signature = inspect.signature(original)

    def maybe_make_prepare_finalize(moe, quant_config, *args, **kwargs):
        par = moe.moe_parallel_config
        if par.all2all_backend not in BACKENDS or not par.use_all2all_kernels:
            return original(moe, quant_config, *args, **kwargs)
        bound = signature.bind(moe, quant_config, *args, **kwargs).arguments
        manager = bound.get("all2all_manager")
        if manager is None:
            from vllm.model_executor.layers.fused_moe.all2all_utils import get_ep_all2all_manager

            manager = get_ep_all2all_manager()
        return manager.make_prepare_finalize(
            moe, quant_config, use_monolithic=bool(bound.get("use_monolithic", False))
        )

    return maybe_make_prepare_finalize


def make_batched_activation_format(original):
    def use_batched_activation_format(self) -> bool:
        if self.all2all_backend == LOW_LATENCY:
            return bool(self.use_all2all_kernels)
        return original(self)

    return use_batched_activation_format


_logged_roundups: set[tuple[int, int]] = set()


def make_hidden_size_roundup(original):
    def maybe_roundup_layer_hidden_size(hidden_size, act_dtype, moe_parallel_config):
        if not (
            moe_parallel_config.all2all_backend == LOW_LATENCY
            and moe_parallel_config.use_all2all_kernels
        ):
            return original(hidden_size, act_dtype, moe_parallel_config)
        rounded = round_up_ll_hidden_size(hidden_size)
        if rounded != hidden_size and (hidden_size, rounded) not in _logged_roundups:
            _logged_roundups.add((hidden_size, rounded))
            logger.info(
                "flashinfer_ep_low_latency: rounding MoE hidden size %d up to %d "
                "(NCCL-EP LL kernels exist for specific hidden sizes only)",
                hidden_size,
                rounded,
            )
        return rounded

    return maybe_roundup_layer_hidden_size


# The hidden dimension of each expert tensor LL pads (vLLM's layout before
# process_weights_after_loading: w13 [E, 2I, H], w2 [E, H, I], w2 bias [E, H]).
PADDED_EXPERT_DIMS = {"w13_weight": 2, "w2_weight": 1, "w2_bias": 1}


def _padded_experts(model, hidden: int) -> list[tuple]:
    """(parameter, dim) of every expert tensor wider than the checkpoint's `hidden`."""
    found = []
    for name, param in model.named_parameters():
        dim = PADDED_EXPERT_DIMS.get(name.rsplit(".", 1)[-1])
        if dim is not None and param.dim() > dim and param.shape[dim] > hidden:
            found.append((param, dim))
    return found


def make_padded_expert_load(original):
    """gpt-oss's unquantized loader copies each expert tensor whole; under LL's round-up
    the parameters are wider. Each padded one is loaded through a view of its leading
    `hidden` columns, and the padding is zeroed (vLLM creates it uninitialized). Other
    backends' loads are vLLM's own."""

    def _load_weights_other(self, *args, **kwargs):
        if getattr(self.parallel_config, "all2all_backend", None) != LOW_LATENCY:
            return original(self, *args, **kwargs)
        hidden = self.config.hidden_size
        wholes = []
        try:
            for param, dim in _padded_experts(self, hidden):
                whole = param.data
                whole.narrow(dim, hidden, whole.shape[dim] - hidden).zero_()
                wholes.append((param, whole))
                param.data = whole.narrow(dim, 0, hidden)
            return original(self, *args, **kwargs)
        finally:
            for param, whole in wholes:
                param.data = whole

    return _load_weights_other


def make_ft_backend_set(original: frozenset) -> frozenset:
    return frozenset(original | {LOW_LATENCY})


def make_gate_forward(original):
    def forward(self, x, *args, **kwargs):
        width = getattr(self, "input_size", None)
        if width is not None and x.shape[-1] > width:
            x = x[..., :width]  # the padding columns are zeros: same logits
        return original(self, x, *args, **kwargs)

    return forward


def make_graph_capture(original):
    """The engine's capture phase (runtime/capture.py) spans vLLM's graph_capture: when
    the outermost one opens, the EP ranks agree on the capture plan and pool what it adds
    (`open_capture_phase`), before any handle is created in it; inside, the pools learn
    the token counts vLLM warms up beyond the plan."""

    @contextlib.contextmanager
    def graph_capture(self, *args, **kwargs):
        with capture_phase() as outermost:
            if outermost:
                for manager in ep_managers():
                    manager.open_capture_phase()
            with original(self, *args, **kwargs) as context:
                yield context

    return graph_capture


def make_kernel_init(original):
    """An LL prepare/finalize's kernel runs the experts wing's class in place of the one
    vLLM's oracle built (experts/__init__.py), with the layer's wire decision."""

    def __init__(self, prepare_finalize, fused_experts, *args, **kwargs) -> None:
        from vllm_flashinfer_ep.vllm.prepare_finalize import (
            FlashInferEPLowLatencyPrepareAndFinalize,
        )

        if isinstance(prepare_finalize, FlashInferEPLowLatencyPrepareAndFinalize):
            from vllm_flashinfer_ep import experts

            fused_experts = experts.for_low_latency(
                fused_experts,
                fp8_wire=prepare_finalize.fp8_dispatch,
                sent_per_rank=prepare_finalize.sent_per_rank,
                options=experts.ExpertsOptions.from_env(),
            )
        original(self, prepare_finalize, fused_experts, *args, **kwargs)

    return __init__


def make_kernel_apply(original):
    """A kernel whose prepare/finalize carries a RoundSplit (LL with
    VLLM_FLASHINFER_EP_LL_ROUND_TOKENS) runs forwards above the fleet's capacity as several
    rounds (round_chunks.py); every other kernel calls vLLM's `apply` exactly as it was
    called, whatever its arguments. The prepare/finalize is read at each call: vLLM may
    swap a kernel's parts after load."""
    signature = inspect.signature(original)

    def apply(self, *args, **kwargs):
        prepare_finalize = self.prepare_finalize
        rounds = getattr(prepare_finalize, "round_split", None)
        if rounds is None:
            return original(self, *args, **kwargs)
        named = signature.bind(self, *args, **kwargs).arguments  # every argument by name
        del named[next(iter(signature.parameters))]  # the kernel itself
        return rounds.run(functools.partial(original, self), prepare_finalize, **named)

    return apply


def ep_managers() -> list:
    """This process's flashinfer_ep all2all manager (its EP group's), if any."""
    from vllm.distributed.parallel_state import get_ep_group

    try:
        group = get_ep_group()
    except AssertionError:  # no EP group in this process (a dense model, a test)
        return []
    manager = getattr(getattr(group, "device_communicator", None), "all2all_manager", None)
    return [manager] if hasattr(manager, "open_capture_phase") else []

"""Feed the MoE router the unpadded activations when the layer hidden size was rounded up.

Patches: `GateLinear.forward`
(vllm/model_executor/layers/fused_moe/router/gate_linear.py).
Why: when the all2all rounds a layer's hidden size up (patch 9, e.g. 3072 -> 4096 for
NCCL-EP low latency), vLLM 0.33.0's MoE runner zero-pads the activations *before* it
applies the router gate it holds (runner/moe_runner.py `forward` pads, `_forward_impl`
then calls `self.gate(hidden_states)`), so the gate's [experts, 3072] weight meets
4096-wide rows and the forward fails with a shape error. Measured through the engine on
an H200 with a hidden-3072 Qwen3-MoE. The padding columns are zeros, so the router
result on the first `input_size` columns is exactly the unpadded one.
How: wrap `forward`; rows wider than the gate's `input_size` are sliced back (a view).
Upstream fix: apply the gate before padding in the runner. Removal: then, or with 9.
"""

from __future__ import annotations

from vllm_flashinfer_ep.vllm.patches._util import is_marked, mark

TARGET = "vllm.model_executor.layers.fused_moe.router.gate_linear.GateLinear.forward"


def is_applied() -> bool:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    return is_marked(GateLinear.forward)


def apply() -> None:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    if is_applied():
        return
    original = GateLinear.forward

    def forward(self, x, *args, **kwargs):
        width = getattr(self, "input_size", None)
        if width is not None and x.shape[-1] > width:
            x = x[..., :width]
        return original(self, x, *args, **kwargs)

    GateLinear.forward = mark(forward, original)

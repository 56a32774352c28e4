"""Diagnosis of HT with online FP8 on the GPU test machine (not a test; device_suite.sh
step `ht-fp8-probe`).

On the H200 the world-1 HT engine with `--quantization fp8_per_tensor` stopped at its
warm-up forward with "CUDA error: invalid argument" (docs/device_vllm.md), while HT with
a 128x128 block FP8 checkpoint and the online model without EP both ran, so the package
refuses HT with online FP8 at config time. Each engine below runs in its own process and
is reported as ran / failed with the tail of its error:
  noep-online-nographs  the online model without EP in HT's mode (compiled, cudagraph
                        mode NONE) at an 8192-token budget: vLLM alone
  ht-online-eager       HT with online FP8, --enforce-eager (no torch.compile)
  ht-online             HT with online FP8 as served (compiled, graphs off)
The two HT engines lift the refusal through the harness (FLASHINFER_EP_TEST_HT_ONLINE_FP8).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from engine_models import write_tiny_model
from engine_runner import EngineRunner
from test_engine_world1 import HT, _spec
from world1_harness import HT_ONLINE_FP8_ENV

ONLINE = {"quantization": "fp8_per_tensor"}


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="ht-fp8-probe-"))
    runner = EngineRunner(work)
    model = write_tiny_model(work / "m2048", 2048)
    allow = {HT_ONLINE_FP8_ENV: "1"}
    cases = [
        ("noep-online-nographs", _spec(model, moe_backend="triton", max_num_batched_tokens=8192,
                                       compilation_config={"cudagraph_mode": "NONE"}, **ONLINE), None),
        ("ht-online-eager", _spec(model, HT, enforce_eager=True, **ONLINE), allow),
        ("ht-online", _spec(model, HT, **ONLINE), allow),
    ]
    for name, spec, env in cases:
        try:
            run = runner.run(name, spec, env=env)
            print(f"{name}: ran ({run['after_load'].get('kernels')})", flush=True)
        except Exception as exc:  # noqa: BLE001 - a diagnosis reports every outcome
            tail = "\n".join(str(exc).splitlines()[-4:])
            print(f"{name}: failed\n{tail}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

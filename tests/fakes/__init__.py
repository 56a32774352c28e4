"""Stand-ins for FlashInfer's `flashinfer.moe_ep` and helpers shared by CPU and GPU tests."""

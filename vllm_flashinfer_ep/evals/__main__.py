"""`python -m vllm_flashinfer_ep.evals gsm8k --config FILE ...`."""

import sys

from vllm_flashinfer_ep.evals.cli import main

sys.exit(main())

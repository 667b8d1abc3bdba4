"""Benchmarks of strata's Python API against its peers, in one run.

``python -m strata.bench adam``: params/s of ``strata.optim.CPUAdamW`` (fp32, bf16 and
8-bit state) against DeepSpeed's ``DeepSpeedCPUAdam`` and
``torch.optim.AdamW(fused=True)``, one tensor of 64M parameters, 2 threads, with a
STREAM-like triad as the memory limit.

``python -m strata.bench io``: GB/s of ``strata.io`` writing and reading one tensor
against DeepSpeed's DeepNVMe ``aio_handle``, same size, block size and queue depth,
both from page-locked buffers, O_DIRECT.

Implementations alternate round by round (so drift of a shared machine hits all alike);
figures are medians. A peer that cannot be imported is reported as such, never guessed.
"""

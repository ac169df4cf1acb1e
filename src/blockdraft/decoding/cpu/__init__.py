"""The decoding loop's CPU-only forwards: lean target and drafter steps.

At batch 1 on a CPU a `tiny`-sized forward is mostly dispatch, so the loop runs these
plain-tensor forwards instead of the HF modules; they are exact and switched by
`blockdraft.kernels.cpu_kernels_apply` with the packed weights and the screened head.
"""
